"""The C argmax of the sampler against torch.argmax, on its AVX-512 and scalar builds."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import sampling_ops
from tests.conftest import torch_threads

pytestmark = pytest.mark.skipif(sampling_ops._library() is None, reason="no C compiler")


@pytest.fixture(autouse=True, params=["native", "portable"])
def build(request, monkeypatch):
    """Every test runs on this CPU's build (AVX-512 where it has it) and on the scalar loop."""
    library = sampling_ops._library() if request.param == "native" else sampling_ops.load_build(("-mno-avx512f",))
    calls = []

    class Counting:
        def bg_argmax_rows(self, *args):
            calls.append(args)
            library.bg_argmax_rows(*args)

        def bg_argmax_rows_bf16(self, *args):
            calls.append(args)
            library.bg_argmax_rows_bf16(*args)

    monkeypatch.setattr(sampling_ops, "_library", lambda: Counting())
    return calls


def assert_like_torch(logits: torch.Tensor) -> None:
    assert torch.equal(sampling_ops.argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("cols", [1, 7, 16, 17, 100, 49152])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_of_every_width(build, cols, threads, dtype):
    logits = torch.randn(40, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
    with torch_threads(threads):
        assert_like_torch(logits)
    assert len(build) == 1  # the C pass ran (contiguous, on the CPU)


def test_bfloat16_rows_give_the_argmax_of_their_float32_values():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(2)).bfloat16()
    logits[0, [5, 200]] = 3.0  # a tie, in the lanes and past them
    logits[1, 299] = float("nan")
    logits[2, [17, 18]] = float("inf")
    assert torch.equal(sampling_ops.argmax_rows(logits), logits.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_give_the_first_index(dtype):
    logits = torch.zeros(6, 100)
    logits[0, [3, 19, 35, 99]] = 5.0  # in several lanes and in the tail
    logits[1, [20, 4]] = 5.0  # the later lane holds the earlier index
    logits[2, [97, 98]] = 1.0  # only in the tail
    logits[3] = float("-inf")  # every value the same
    logits[4, [8, 24]] = 0.0
    logits[4, :8] = -0.0  # -0.0 and 0.0 are equal
    logits[5, 40:] = 2.0
    assert_like_torch(logits.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_with_nan_gives_its_first_nan(dtype):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    logits[0, 30] = float("nan")
    logits[1, [2, 40]] = float("nan")
    logits[2, 49] = float("nan")  # in the tail
    logits[3, 0] = float("nan")
    logits[4, 10] = float("inf")
    assert_like_torch(logits.to(dtype))


def test_other_inputs_go_to_torch(build):
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    assert_like_torch(logits.half())
    assert_like_torch(logits.t())  # not contiguous
    with pytest.raises(IndexError):  # torch's refusal of an empty row, as torch.argmax gives it
        sampling_ops.argmax_rows(logits[:, :0])
    assert build == []


def test_no_rows_give_no_tokens():
    assert sampling_ops.argmax_rows(torch.zeros(0, 40)).shape == (0,)
