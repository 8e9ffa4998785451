import pytest
import torch

from batchgen.kernels import cpu_attention, window_bands
from batchgen.kernels.attention import make_backend
from batchgen.kernels.attention_kernel import AttentionVariant, PagedSeqs
from tests.kernels.paged_inputs import make_inputs, reference_prefill

# chunks: a whole prompt of several bands, a short one with cached context, a single token, one
# with cached context whose first rows' windows start at 0 and later ones' do not, a short one
# after a long context; windows from one position to longer than every chunk
CONTEXT_LENS = [600, 40, 1, 333, 700]
QUERY_LENS = [600, 17, 1, 300, 5]


def prefill_inputs(dtype, num_heads=4, num_kv_heads=1, head_dim=64):
    q, k_cache, v_cache, block_tables, context_lens = make_inputs(CONTEXT_LENS, num_heads, num_kv_heads, head_dim,
                                                                  dtype, seed=3)
    q = torch.randn((sum(QUERY_LENS), num_heads, head_dim), generator=torch.Generator().manual_seed(4)).to(dtype)
    starts = torch.tensor([sum(QUERY_LENS[:s]) for s in range(len(QUERY_LENS))], dtype=torch.int32)
    seqs = PagedSeqs(block_tables, context_lens, query_starts=starts,
                     query_lens=torch.tensor(QUERY_LENS, dtype=torch.int32))
    return q, k_cache, v_cache, seqs


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [1, 5, 65, 70, 256, 300, 601])
def test_matches_reference(monkeypatch, dtype, atol, window):
    monkeypatch.setattr(window_bands, "BAND_ROWS", 256)  # chunks of several bands
    q, k_cache, v_cache, seqs = prefill_inputs(dtype)
    out = torch.full_like(q, float("nan"))
    variant = AttentionVariant(window=window)
    assert window_bands.paged_prefill_attention(q, k_cache, v_cache, seqs, 0.125, out, variant)
    expected = reference_prefill(q, k_cache, v_cache, seqs.block_tables, seqs.context_lens, QUERY_LENS, 0.125,
                                 variant)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("variant", [AttentionVariant(), AttentionVariant(window=8, softcap=2.0),
                                     AttentionVariant(window=8, sinks=torch.zeros(4))])
def test_declines_what_it_does_not_compute(variant):
    q, k_cache, v_cache, seqs = prefill_inputs(torch.float32)
    out = torch.full_like(q, float("nan"))
    assert not window_bands.paged_prefill_attention(q, k_cache, v_cache, seqs, 0.125, out, variant)
    assert out.isnan().all()


@pytest.mark.skipif(not cpu_attention.is_available(), reason="the C attention kernels are not built here")
def test_windowed_prefill_takes_bands_where_flash_outruns_the_c_kernel():
    backend = make_backend("auto", torch.device("cpu"), torch.bfloat16, 256)
    flash_first = not cpu_attention.prefill_is_preferred(torch.bfloat16)
    assert (backend.variant_prefills[0] is window_bands.paged_prefill_attention) == flash_first
    assert backend.variant_prefills[-1] is cpu_attention.paged_prefill_attention  # soft-caps and sinks
