from batchgen.engine import block_hash as block_hash_module
from batchgen.engine.block_hash import hash_blocks
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.sequence import Sequence
from batchgen.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_seq(token_ids: list[int]) -> Sequence:
    return Sequence(0, token_ids, SamplingParams(max_tokens=8), arrival_time=0.0)


def admit(manager: BlockManager, seq: Sequence) -> list[int]:
    """Match, allocate the whole sequence and return the cached block ids it reused."""
    match = manager.match_prefix(seq)
    assert not match.is_blocked
    manager.allocate(seq, match, len(seq))
    return match.block_ids


def compute(manager: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = len(seq)
    manager.mark_computed(seq)


def admit_computed(manager: BlockManager, token_ids: list[int]) -> Sequence:
    """A sequence of `token_ids` admitted whole and computed."""
    seq = make_seq(token_ids)
    admit(manager, seq)
    compute(manager, seq)
    return seq


def test_fresh_pool_hands_out_ids_in_order():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    first, second = make_seq(list(range(10))), make_seq(list(range(100, 105)))
    assert admit(manager, first) == []
    assert admit(manager, second) == []
    assert first.block_table == [0, 1, 2]
    assert second.block_table == [3, 4]
    assert first.num_computed_tokens == 0
    assert [block.ref_count for block in manager.blocks] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert (manager.num_free_blocks, manager.num_used_blocks) == (3, 5)


def test_counters_follow_allocate_compute_free():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    seq = make_seq(list(range(10)))  # 2 full blocks + 2 tokens
    assert (manager.num_free_blocks, manager.num_used_blocks, manager.num_cached_blocks) == (8, 0, 0)
    admit(manager, seq)
    # Full prompt blocks within the reuse cap, (10 - 1) // 4 = 2, are registered as pending.
    assert (manager.num_free_blocks, manager.num_used_blocks, manager.num_cached_blocks) == (5, 3, 2)
    compute(manager, seq)
    assert manager.num_cached_blocks == 2
    manager.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert [block.ref_count for block in manager.blocks[:3]] == [0, 0, 0]
    assert (manager.num_free_blocks, manager.num_used_blocks, manager.num_cached_blocks) == (8, 0, 2)


def test_second_sequence_with_same_prefix_reuses_block_ids():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefix = list(range(8))
    first = admit_computed(manager, prefix + [50, 51])
    second = make_seq(prefix + [60, 61, 62])
    match = manager.match_prefix(second)
    assert match.block_ids == [0, 1]
    assert not match.is_blocked
    manager.allocate(second, match, len(second))
    assert second.block_table == [0, 1, 3]
    assert second.num_computed_tokens == 8
    assert [block.ref_count for block in manager.blocks[:4]] == [2, 2, 1, 1]
    manager.free(first)
    assert [block.ref_count for block in manager.blocks[:4]] == [1, 1, 0, 1]
    assert manager.num_used_blocks == 3


def test_block_aligned_cached_prompt_reuses_all_but_last_block():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(12))  # exactly 3 blocks
    first = make_seq(prompt)
    admit(manager, first)
    compute(manager, first)
    assert manager.num_cached_blocks == 3
    second = make_seq(prompt)
    match = manager.match_prefix(second)
    assert match.block_ids == [0, 1]  # (12 - 1) // 4 = 2
    manager.allocate(second, match, len(second))
    assert second.block_table == [0, 1, 3]
    assert second.num_computed_tokens == 8


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(block_hash_module, "_hash_bytes", lambda parent_hash, block: 42)
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_seq([1, 2, 3, 4, 5])
    admit(manager, first)
    compute(manager, first)
    assert manager.blocks[0].block_hash == 42
    second = make_seq([9, 9, 9, 9, 5])  # different tokens, same (colliding) hash
    match = manager.match_prefix(second)
    assert match.block_ids == [] and not match.is_blocked
    manager.allocate(second, match, len(second))
    assert second.block_table == [2, 3]
    assert second.num_computed_tokens == 0
    same = make_seq([1, 2, 3, 4, 6])
    assert manager.match_prefix(same).block_ids == [0]


def test_pending_block_blocks_a_second_sequence_until_computed():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefix = list(range(8))
    first = make_seq(prefix + [50])
    admit(manager, first)
    second = make_seq(prefix + [60])
    match = manager.match_prefix(second)
    assert match.is_blocked and match.block_ids == []
    first.num_computed_tokens = 4
    manager.mark_computed(first)
    match = manager.match_prefix(second)
    assert match.is_blocked and match.block_ids == [0]
    first.num_computed_tokens = 9
    manager.mark_computed(first)
    match = manager.match_prefix(second)
    assert not match.is_blocked and match.block_ids == [0, 1]


def test_freeing_an_uncomputed_pending_block_unregisters_it():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefix = list(range(8))
    first = make_seq(prefix + [50])
    admit(manager, first)
    first.num_computed_tokens = 4
    manager.mark_computed(first)
    manager.free(first)
    assert manager.num_cached_blocks == 1
    assert manager.blocks[1].block_hash is None
    assert manager.num_free_blocks == 8
    second = make_seq(prefix + [60])
    match = manager.match_prefix(second)
    assert match.block_ids == [0] and not match.is_blocked
    manager.allocate(second, match, len(second))
    # Block 0 comes back from the cache; the fresh ones come from the never-hashed free list.
    assert second.block_table == [0, 3, 4]
    assert manager.blocks[3].block_hash == hash_blocks(second.token_ids, BLOCK_SIZE)[1]


def test_lru_evicts_deepest_block_of_earliest_freed_sequence_first():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    first = make_seq(list(range(9)))  # blocks 0, 1 (full) + 2 (partial)
    second = make_seq(list(range(100, 109)))  # blocks 3, 4 (full) + 5 (partial)
    for seq in (first, second):
        admit(manager, seq)
        compute(manager, seq)
    assert manager.num_free_blocks == 0
    manager.free(first)
    manager.free(second)
    assert manager.num_cached_blocks == 4
    assert (manager.num_free_blocks, manager.num_evictions) == (6, 0)
    fresh = make_seq(list(range(200, 224)))  # 6 blocks, no hits
    admit(manager, fresh)
    # Unhashed partial blocks first, then evictions: first's deepest, first's root, second's.
    assert fresh.block_table == [2, 5, 1, 0, 4, 3]
    assert manager.num_evictions == 4
    assert manager.num_cached_blocks == 5  # fresh's own pending blocks, (24 - 1) // 4 = 5
    assert manager.match_prefix(make_seq(list(range(9)))).block_ids == []


def test_partial_eviction_keeps_the_cached_root():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_seq(list(range(9)))
    admit(manager, first)
    compute(manager, first)
    manager.free(first)
    taker = make_seq([300, 301, 302])  # one fresh block: free list first (block 3), then evict
    admit(manager, taker)
    assert taker.block_table == [3]
    other = make_seq([400, 401, 402])
    admit(manager, other)
    assert other.block_table == [2]
    last = make_seq([500, 501, 502])
    admit(manager, last)
    assert last.block_table == [1]
    assert manager.num_evictions == 1
    assert manager.match_prefix(make_seq(list(range(9)))).block_ids == [0]


def test_fork_shares_full_blocks_and_copies_partial_last_block():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent = make_seq(list(range(10)))
    admit(manager, parent)
    compute(manager, parent)
    child = parent.fork(1, None)
    assert manager.fork(parent, child) == (2, 3)
    assert parent.block_table == [0, 1, 2]
    assert child.block_table == [0, 1, 3]
    assert [block.ref_count for block in manager.blocks[:4]] == [2, 2, 1, 1]
    manager.free(child)
    assert [block.ref_count for block in manager.blocks[:4]] == [1, 1, 1, 0]
    manager.free(parent)
    assert manager.num_used_blocks == 0


def test_fork_of_block_aligned_sequence_shares_every_block():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent = make_seq(list(range(8)))
    admit(manager, parent)
    compute(manager, parent)
    child = parent.fork(1, None)
    assert manager.fork(parent, child) is None
    assert child.block_table == [0, 1]
    assert [block.ref_count for block in manager.blocks[:2]] == [2, 2]


def test_decode_filled_blocks_are_registered_and_reused():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    seq = make_seq([1, 2, 3, 4, 5, 6])
    admit(manager, seq)
    compute(manager, seq)
    assert manager.num_cached_blocks == 1
    for token in (7, 8, 9):  # decode: the second block fills up with output tokens
        seq.token_ids.append(token)
        manager.append(seq, len(seq))
        compute(manager, seq)
    assert seq.block_table == [0, 1, 2]
    assert manager.num_cached_blocks == 2
    assert manager.blocks[1].block_hash == hash_blocks(seq.token_ids, BLOCK_SIZE)[1]
    later = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 100])
    assert manager.match_prefix(later).block_ids == [0, 1]


def test_prefix_caching_disabled_never_hits():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    prompt = list(range(9))
    first = make_seq(prompt)
    admit(manager, first)
    compute(manager, first)
    assert manager.num_cached_blocks == 0
    second = make_seq(prompt)
    match = manager.match_prefix(second)
    assert match.block_ids == [] and not match.is_blocked
    manager.allocate(second, match, len(second))
    assert second.block_table == [3, 4, 5]
    manager.free(first)
    assert manager.match_prefix(make_seq(prompt)).block_ids == []


def test_reset_prefix_cache_frees_cached_blocks_and_refuses_while_blocks_are_held():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefix = list(range(8))
    first = admit_computed(manager, prefix + [50, 51])
    assert not manager.reset_prefix_cache()  # first holds its blocks
    assert manager.num_cached_blocks == 2
    manager.free(first)
    assert manager.reset_prefix_cache()
    assert (manager.num_free_blocks, manager.num_used_blocks, manager.num_cached_blocks) == (8, 0, 0)
    assert admit(manager, make_seq(prefix + [60, 61, 62])) == []  # nothing left to reuse
