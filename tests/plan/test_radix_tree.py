import random

import pytest

from batchgen.plan import radix_tree
from batchgen.plan.radix_tree import PlanStats, PrefixGroup, RadixTree


def build(prompts: dict[int, list[int]], block_size: int = 16) -> RadixTree:
    tree = RadixTree(block_size=block_size)
    for request_id, token_ids in prompts.items():
        tree.insert(request_id, token_ids)
    return tree


def groups(tree: RadixTree, prompts: dict[int, list[int]], max_groups: int = 10) -> list[PrefixGroup]:
    return tree.prefix_groups(max_groups, prompts.__getitem__)


def test_shared_prefix_is_prefilled_once():
    prefix = list(range(160))  # 10 full blocks
    prompts = {i: prefix + [1000 + 5 * i + j for j in range(5)] for i in range(16)}
    tree = build(prompts)
    stats = tree.stats()
    assert stats.num_requests == 16
    assert stats.num_prompt_tokens == 16 * 165
    assert stats.num_computed_prompt_tokens == 160 + 16 * 5
    assert stats.num_cached_prompt_tokens == 16 * 165 - (160 + 16 * 5)
    assert stats.prefix_hit_rate == pytest.approx(stats.num_cached_prompt_tokens / (16 * 165))
    assert tree.order() == list(range(16))
    assert groups(tree, prompts) == [PrefixGroup(16, 160, prefix, list(range(16)))]


def test_duplicates_with_partial_tail_reuse_all_full_blocks():
    prompts = {0: list(range(40)), 1: list(range(40)), 2: list(range(40))}
    tree = build(prompts)
    assert tree.stats().num_computed_prompt_tokens == 40 + 8 + 8
    assert tree.order() == [0, 1, 2]
    assert groups(tree, prompts) == [PrefixGroup(3, 32, list(range(32)), [0, 1, 2])]


def test_block_aligned_duplicates_recompute_their_last_block():
    tree = build({0: list(range(32)), 1: list(range(32)), 2: list(range(32))})
    assert tree.stats().num_computed_prompt_tokens == 32 + 16 + 16


def test_block_aligned_prefix_of_another_runs_first():
    tree = build({0: list(range(48)), 1: list(range(32))})
    assert tree.order() == [1, 0]
    stats = tree.stats()
    assert stats.num_prompt_tokens == 80
    # 1 computes its 32 tokens, 0 reuses both blocks and computes its last 16.
    assert stats.num_computed_prompt_tokens == 32 + 16
    assert stats.num_cached_prompt_tokens == 32


def test_unaligned_prefix_of_another_shares_only_full_blocks():
    prompts = {0: list(range(48)), 1: list(range(40))}
    tree = build(prompts)
    assert tree.order() == [1, 0]
    stats = tree.stats()
    # The 8-token tail of 1 is not a full block, so 0 recomputes its third block.
    assert stats.num_computed_prompt_tokens == 40 + 16
    assert stats.num_cached_prompt_tokens == 32
    assert groups(tree, prompts) == [PrefixGroup(2, 32, list(range(32)), [0, 1])]


def test_prompts_shorter_than_a_block_share_nothing():
    prompts = {0: [1, 2, 3], 1: [1, 2, 3], 2: [5] * 15, 3: [9] * 16, 4: [9] * 16}
    tree = build(prompts)
    assert tree.order() == [0, 1, 2, 3, 4]
    stats = tree.stats()
    # A single-block prompt may reuse (16 - 1) // 16 = 0 blocks.
    assert stats.num_computed_prompt_tokens == 3 + 3 + 15 + 16 + 16
    assert stats.num_cached_prompt_tokens == 0
    assert stats.prefix_hit_rate == 0.0
    assert groups(tree, prompts) == [PrefixGroup(2, 16, [9] * 16, [3, 4])]


def test_order_groups_siblings_heavier_subtree_first():
    p, q = [1, 1, 1, 1], [2, 2, 2, 2]
    prompts = {0: q + [10], 1: p + [11], 2: q + [12], 3: p + [13], 4: p + [5, 5, 5, 5, 14]}
    tree = build(prompts, block_size=4)
    assert tree.order() == [1, 3, 4, 0, 2]


def test_order_ties_follow_first_insertion_not_request_id():
    r, s = [3] * 4, [4] * 4
    tree = build({10: r + [1], 5: s + [1], 11: r + [2], 6: s + [2]}, block_size=4)
    assert tree.order() == [10, 11, 5, 6]


def test_order_is_depth_first_with_heavier_child_first_inside_a_subtree():
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    prompts = {0: a + b, 1: a + c + [0], 2: a + c + [1], 3: a, 4: b}
    tree = build(prompts, block_size=4)
    # Under a: 3 ends there, then c (2 requests) before b (1 request); the b root branch last.
    assert tree.order() == [3, 1, 2, 0, 4]


def test_nodes_are_told_apart_by_chain_hash_alone(monkeypatch):
    """The plan trusts the 64-bit chain hash (the engine's cache compares tokens on every hit)."""
    def colliding_hashes(token_ids, block_size):
        return [7] * (len(token_ids) // block_size)

    monkeypatch.setattr(radix_tree, "hash_blocks", colliding_hashes)
    prompts = {0: [1] * 16 + [9], 1: [2] * 16 + [9], 2: [1] * 16 + [3]}
    tree = build(prompts)
    assert tree.order() == [0, 1, 2]
    assert tree.stats().num_computed_prompt_tokens == 17 + 1 + 1


def test_prefix_groups_report_deepest_shared_prefixes_by_tokens_saved():
    p = [1, 2, 3, 4]
    p3 = p + [5, 6, 7, 8] + [9, 9, 9, 9]
    prompts = {0: p3 + [10] * 4 + [1], 1: p3 + [11] * 4, 2: p + [12] * 4, 3: [20] * 8, 4: [1, 2]}
    tree = build(prompts, block_size=4)
    # p3 saves (2 - 1) * 12 = 12 tokens, p saves (3 - 1) * 4 = 8; the middle block of p3 is
    # shared by the same two requests as p3 and is not reported.
    assert groups(tree, prompts) == [PrefixGroup(2, 12, p3, [0, 1]), PrefixGroup(3, 4, p, [0, 1, 2])]
    assert groups(tree, prompts, max_groups=1) == [PrefixGroup(2, 12, p3, [0, 1])]


def test_empty_tree():
    tree = RadixTree(block_size=16)
    assert tree.order() == []
    assert tree.stats() == PlanStats(num_requests=0)
    assert tree.prefix_groups() == []


def test_empty_prompt_counts_no_tokens():
    tree = build({0: [], 1: list(range(20))})
    assert tree.order() == [0, 1]
    assert tree.stats() == PlanStats(num_prompt_tokens=20, num_computed_prompt_tokens=20, num_requests=2)


def test_duplicate_request_id_is_rejected():
    tree = build({0: [1, 2, 3]})
    tree.insert(0, [4, 5])
    with pytest.raises(ValueError, match="request id 0 was inserted more than once"):
        tree.order()


def test_deep_prompt_has_no_recursion_limit():
    long_prompt = [i % 1000 for i in range(50_000)]  # 3125 full blocks
    prompts = {0: long_prompt + [7] * 18, 1: long_prompt, 2: [1] * 20}
    tree = build(prompts)
    assert tree.order() == [1, 0, 2]
    # 1 computes everything; 0 reuses all 3125 blocks and computes its extra block + 2-token tail.
    assert tree.stats().num_computed_prompt_tokens == 50_000 + 18 + 20
    [group] = groups(tree, prompts)
    assert (group.num_requests, group.num_shared_tokens, group.request_ids) == (2, 50_000, [0, 1])
    assert group.shared_token_ids == long_prompt


def reference_plan(prompts: dict[int, list[int]], block_size: int) -> tuple[list[int], int]:
    """Run order and prefill total of a plain nested-dict trie: depth-first, own requests first,
    children heavier first, ties by first insertion."""
    root: dict = {"children": {}, "ends": [], "weight": 0, "first": 0}
    for position, (request_id, tokens) in enumerate(prompts.items()):
        node = root
        node["weight"] += 1
        for start in range(0, len(tokens) // block_size * block_size, block_size):
            block = tuple(tokens[start : start + block_size])
            node = node["children"].setdefault(block, {"children": {}, "ends": [], "weight": 0, "first": position})
            node["weight"] += 1
        node["ends"].append(request_id)
    order, stack = [], [root]
    while stack:
        node = stack.pop()
        order.extend(node["ends"])
        children = sorted(node["children"].values(), key=lambda child: (-child["weight"], child["first"]))
        stack.extend(reversed(children))
    return order, reference_prefill(prompts, order, block_size)


def reference_prefill(prompts: dict[int, list[int]], order: list[int], block_size: int) -> int:
    """Tokens to prefill when `order`'s requests run one after another, each reusing the full
    blocks of its prefix an earlier one computed (all but the last token)."""
    computed, prefill = set(), 0
    for request_id in order:
        tokens = prompts[request_id]
        blocks = [tuple(tokens[: end]) for end in range(block_size, len(tokens) + 1, block_size)]
        reused = 0
        while reused < len(blocks) and blocks[reused] in computed:
            reused += 1
        computed.update(blocks)
        prefill += len(tokens) - min(reused, (len(tokens) - 1) // block_size if tokens else 0) * block_size
    return prefill


@pytest.mark.parametrize("seed", range(20))
def test_order_and_prefill_equal_a_plain_trie_on_random_prompts(seed, monkeypatch):
    monkeypatch.setattr(radix_tree, "CHUNK_ROWS", 7)  # several array chunks
    rng = random.Random(seed)
    stems = [[rng.randrange(3) for _ in range(rng.randrange(0, 13))] for _ in range(4)]
    prompts = {}
    for request_id in rng.sample(range(1000), 60):
        prompts[request_id] = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(0, 9))]
    tree = build(prompts, block_size=4)
    order, prefill = reference_plan(prompts, 4)
    assert tree.order() == order
    assert tree.stats().num_computed_prompt_tokens == prefill
    # partitions run apart, each in the order restricted to it, with a cache of its own
    ids = list(prompts)
    parts = [rng.randrange(3) for _ in ids]
    cached = tree.cached_tokens(parts)
    for part in range(3):
        members = {request_id for request_id, p in zip(ids, parts) if p == part}
        expected = reference_prefill(prompts, [i for i in order if i in members], 4)
        assert sum(len(prompts[i]) - cached[ids.index(i)] for i in members) == expected
