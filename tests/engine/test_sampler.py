import math

import pytest
import torch

from batchgen.engine import sampler
from batchgen.engine.sampler import SamplingRow, TokenMasks, make_generator, sample
from batchgen.sampling_params import SamplingParams

EOS = 0


def make_row(token_ids=(7,), num_output_tokens=0, sample_index=0, **kwargs) -> SamplingRow:
    params = SamplingParams(**kwargs)
    generator = None if params.seed is None else make_generator(params.seed, sample_index)
    return SamplingRow(params, list(token_ids), num_output_tokens, generator)


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def draw_support(logits_row: torch.Tensor, num_draws: int = 2000, **kwargs) -> set[int]:
    """Tokens drawn by ``num_draws`` unseeded rows sharing the same logits."""
    torch.manual_seed(0)
    rows = [make_row(**kwargs) for _ in range(num_draws)]
    return set(sample(logits_row.expand(num_draws, -1), rows, [EOS]))


def test_all_greedy_batch_is_argmax():
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    rows = [make_row(temperature=0.0) for _ in range(5)]
    assert sample(logits, rows, [EOS]) == logits.argmax(dim=-1).tolist()


def test_greedy_accepts_half_precision_logits():
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    rows = [make_row(temperature=0.0) for _ in range(3)]
    assert sample(logits, rows, [EOS]) == logits.float().argmax(dim=-1).tolist()


def test_top_k_one_equals_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    sampled = [make_row(temperature=1.3, top_k=1, seed=i) for i in range(3)] + [
        make_row(temperature=0.9, top_k=1) for _ in range(3)
    ]
    greedy = [make_row(temperature=0.0) for _ in range(6)]
    assert sample(logits, sampled, [EOS]) == sample(logits, greedy, [EOS])


def test_tiny_top_p_samples_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    rows = [make_row(temperature=2.0, top_p=1e-6, seed=i) for i in range(2)] + [make_row(top_p=1e-6) for _ in range(2)]
    assert sample(logits, rows, [EOS]) == logits.float().argmax(dim=-1).tolist()


def test_greedy_rows_never_consume_randomness():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    rows = [make_row(temperature=0.0, seed=5), make_row(top_k=1)]
    generator_state = rows[0].generator.getstate()
    global_state = torch.get_rng_state()
    sample(logits, rows, [EOS])
    assert rows[0].generator.getstate() == generator_state
    assert torch.equal(torch.get_rng_state(), global_state)


def test_seeded_rows_do_not_touch_the_global_generator():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(4))
    rows = [make_row(seed=1), make_row(seed=2, top_p=0.9)]
    global_state = torch.get_rng_state()
    sample(logits, rows, [EOS])
    assert torch.equal(torch.get_rng_state(), global_state)


def test_callers_logits_are_not_modified():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    original = logits.clone()
    rows = [
        make_row(token_ids=[1, 2, 3], min_tokens=4, stop_token_ids=[5], repetition_penalty=1.5, temperature=0.0),
        make_row(token_ids=[4], repetition_penalty=0.5, top_k=4, top_p=0.5, min_p=0.1),
        make_row(seed=3),
    ]
    sample(logits, rows, [EOS])
    assert torch.equal(logits, original)


def test_seeded_row_is_reproducible_whatever_the_batch():
    vocab_size, num_steps = 40, 25
    steps = [torch.randn(vocab_size, generator=torch.Generator().manual_seed(100 + s)) for s in range(num_steps)]

    def run(batch_size: int, position: int) -> list[int]:
        target = make_row(seed=1234, sample_index=2, temperature=0.8, top_p=0.9)
        others = [
            make_row(seed=99, top_k=5),
            make_row(temperature=1.5),
            make_row(temperature=0.0),
            make_row(min_p=0.2, repetition_penalty=1.3),
        ][: batch_size - 1]
        rows = others[:position] + [target] + others[position:]
        tokens = []
        for logits_row in steps:
            batch = torch.randn(batch_size, vocab_size)
            batch[position] = logits_row
            tokens.append(sample(batch, rows, [EOS])[position])
        return tokens

    alone = run(batch_size=1, position=0)
    assert run(batch_size=5, position=0) == alone
    assert run(batch_size=5, position=3) == alone
    assert run(batch_size=3, position=1) == alone
    assert len(set(alone)) > 5


def test_make_generator_seeds_with_seed_plus_sample_index():
    a, b, c = make_generator(10, 3), make_generator(13, 0), make_generator(10, 0)
    draws = [[generator.random() for _ in range(8)] for generator in (a, b, c)]
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_different_seeds_give_different_draws():
    logits = torch.zeros(1, 50)
    sequences = []
    for seed in (1, 2):
        row = make_row(seed=seed)
        sequences.append([sample(logits, [row], [EOS])[0] for _ in range(300)])
    num_equal = sum(a == b for a, b in zip(*sequences))
    # Independent uniform draws over 50 tokens agree about 6 times in 300.
    assert num_equal < 25
    assert len(set(sequences[0])) > 30


def test_top_k_restricts_support():
    logits = torch.randn(30, generator=torch.Generator().manual_seed(6))
    best = set(logits.topk(3).indices.tolist())
    assert draw_support(logits * 0.1, top_k=3) <= best
    assert draw_support(logits * 0.01, top_k=3) == best


@pytest.mark.parametrize("top_p, expected", [(0.4, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_set_reaching_top_p(top_p, expected):
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    assert draw_support(logits, top_p=top_p) == expected


def test_top_k_and_top_p_combine():
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    # top_k=3 renormalises to [0.44, 0.33, 0.22]; top_p=0.7 then keeps the first two.
    assert draw_support(logits, top_k=3, top_p=0.7) == {0, 1}


@pytest.mark.parametrize("min_p, expected", [(0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p_drops_tokens_below_fraction_of_best(min_p, expected):
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    assert draw_support(logits, min_p=min_p) == expected


def test_repetition_penalty_changes_argmax():
    logits = torch.tensor([[2.0, 1.8, -1.0, -3.0], [-0.5, -0.6, -4.0, -5.0], [2.0, 1.8, -1.0, -3.0]])
    rows = [
        make_row(token_ids=[0, 3], temperature=0.0, repetition_penalty=1.5),  # 2.0 / 1.5 < 1.8
        make_row(token_ids=[2, 2, 0, 3, 3], temperature=0.0, repetition_penalty=2.0),  # -0.5 * 2 < -0.6
        make_row(token_ids=[0], temperature=0.0),
    ]
    assert sample(logits, rows, [EOS]) == [1, 1, 0]


def test_repetition_penalty_below_one_favours_seen_tokens():
    logits = torch.tensor([[2.0, 1.8, -1.0]])
    rows = [make_row(token_ids=[1], temperature=0.0, repetition_penalty=0.5)]
    assert sample(logits, rows, [EOS]) == [1]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[5.0, 4.0, 0.0, 3.0]]).expand(3, -1)
    rows = [
        make_row(num_output_tokens=1, min_tokens=2, stop_token_ids=[1], temperature=0.0),
        make_row(num_output_tokens=2, min_tokens=2, stop_token_ids=[1], temperature=0.0),
        make_row(num_output_tokens=0, min_tokens=2, temperature=0.0),
    ]
    assert sample(logits, rows, [EOS]) == [3, 0, 1]


def test_min_tokens_masks_every_eos_id_when_sampling():
    logits = torch.tensor([3.0, 3.0, 3.0, 0.0, 0.0])
    assert draw_support(logits, min_tokens=1, stop_token_ids=[2]) == {1, 3, 4}
    torch.manual_seed(0)
    rows = [make_row(min_tokens=1, stop_token_ids=[2]) for _ in range(500)]
    assert set(sample(logits.expand(500, -1), rows, [0, 1, 99])) == {3, 4}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_distribution_matches_softmax(temperature):
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2, 0.8, -1.0, 0.3])
    num_draws = 20000
    rows = [make_row(temperature=temperature) for _ in range(num_draws)]
    tokens = sample(logits.expand(num_draws, -1), rows, [99])
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
    # 0.999 quantile of chi-square with 7 degrees of freedom is 24.3.
    assert chi_square(counts, (logits / temperature).softmax(-1)) < 24.3


def test_seeded_distribution_matches_softmax():
    logits = torch.tensor([[0.7, 0.0, -0.7, 0.3]])
    row = make_row(seed=2024)
    tokens = [sample(logits, [row], [99])[0] for _ in range(2000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float()
    # 0.999 quantile of chi-square with 3 degrees of freedom is 16.3.
    assert chi_square(counts, logits[0].softmax(-1)) < 16.3


def test_rows_with_nan_or_infinite_logits_still_give_a_token_of_the_vocabulary():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(8))
    logits[0, 7] = float("nan")
    logits[1] = float("nan")
    logits[2, [3, 9]] = float("inf")
    logits[3] = -math.inf
    logits[3, 12] = 0.0
    rows = [make_row(seed=i) for i in range(4)]
    tokens = sample(logits, rows, [EOS])
    assert all(0 <= token < 50 for token in tokens)
    assert tokens[3] == 12


def test_mixed_batch_keeps_row_order():
    logits = torch.full((3, 10), -math.inf)
    logits[0, 4] = 0.0
    logits[1, 7] = 0.0
    logits[2, 2] = 0.0
    rows = [make_row(seed=1), make_row(temperature=0.0), make_row(top_p=0.5)]
    assert sample(logits, rows, [EOS]) == [4, 7, 2]


def test_rows_must_match_logits():
    with pytest.raises(ValueError, match="num_rows=1"):
        sample(torch.zeros(2, 4), [make_row()], [EOS])


def test_a_batch_past_one_chunk_samples_each_row_as_alone(monkeypatch):
    monkeypatch.setattr(sampler, "CHUNK_BYTES", 3 * 4 * 16)  # chunks of 3 rows of 16 logits
    logits = torch.randn(8, 16, generator=torch.Generator().manual_seed(6))
    kinds = [dict(seed=10 + i) if i % 3 else dict(temperature=0.0) for i in range(8)]
    allowed = {4: [2, 3], 7: [5, 9, 11]}  # a greedy row and a sampled row, in different chunks

    def bitmask(row: int) -> torch.Tensor:
        return torch.tensor([[sum(1 << t for t in allowed[row])]], dtype=torch.int32)

    masks = TokenMasks(list(allowed), torch.cat([bitmask(row) for row in allowed]))
    batch = sample(logits, [make_row(**kind) for kind in kinds], [EOS], masks)
    alone = [sample(logits[i : i + 1], [make_row(**kinds[i])], [EOS],
                    TokenMasks([0], bitmask(i)) if i in allowed else None)[0] for i in range(8)]
    assert batch == alone
    assert batch[4] in allowed[4] and batch[7] in allowed[7]
