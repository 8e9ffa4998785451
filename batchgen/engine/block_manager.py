"""The KV block pool: allocation, prefix caching by chained block hash, LRU eviction.

A block holds `block_size` token slots in every layer's K/V cache. Slot `s` of a sequence's
token at position `p` is `block_table[p // block_size] * block_size + p % block_size`.

Invariants:
- `ref_count` of a block = number of running sequences whose block table holds it.
- A block is in exactly one of: referenced (ref_count > 0), `_evictable` (ref_count 0, has a
  hash, still reusable), `_free_block_ids` (ref_count 0, no hash).
- `_hash_to_block` maps a full block's chained hash to the block holding it. A registered block
  whose K/V is not written yet is *pending* (`is_computed` False): another sequence that needs
  it waits instead of computing it again. Pending blocks are always referenced.
- A cache hit compares token ids too (a 64-bit hash can collide).
- Eviction takes the least recently freed evictable block; a sequence's blocks are freed
  deepest first, so its deepest blocks are evicted first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from batchgen.engine.block_hash import BlockHash, extend_block_hashes
from batchgen.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    is_computed: bool = False


@dataclass(slots=True)
class PrefixMatch:
    """Result of looking a waiting sequence up in the cache.

    `block_ids`: computed cached blocks it can reuse, in order. `is_blocked`: the next block it
    needs is being computed by another sequence right now, so it should wait.
    """

    block_ids: list[int]
    is_blocked: bool


class BlockManager:
    """Fixed pool of `num_blocks` KV blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # ---- counters -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never used, or cached but unreferenced)."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    # ---- prefix lookup ----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Computed cached blocks `seq` can reuse (at most `seq.num_reusable_tokens // block_size`)."""
        if not self.enable_prefix_caching:
            return PrefixMatch([], False)
        max_blocks = seq.num_reusable_tokens // self.block_size
        hashes = self._hashes(seq, max_blocks)
        block_ids: list[int] = []
        for index in range(max_blocks):
            block = self._lookup(hashes[index], self._block_tokens(seq, index))
            if block is None:
                break
            if not block.is_computed:
                return PrefixMatch(block_ids, True)
            block_ids.append(block.block_id)
        return PrefixMatch(block_ids, False)

    def _lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> Block | None:
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids else None

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(seq.token_ids[start : start + self.block_size])

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """`seq.block_hashes`, extended to cover at least its first `num_blocks` full blocks
        (the list may be longer; callers index only what they need)."""
        return extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, num_blocks)

    # ---- allocation protocol: can_allocate / allocate / can_append / append / free -----------
    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its block table covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, match: PrefixMatch, num_tokens: int) -> None:
        """Give a waiting `seq` the matched cached blocks plus fresh ones up to `num_tokens` tokens."""
        assert not seq.block_table
        for block_id in match.block_ids:
            self._reference(block_id)
        seq.block_table = list(match.block_ids)
        seq.num_computed_tokens = len(match.block_ids) * self.block_size
        self.append(seq, num_tokens)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table with fresh blocks to cover `num_tokens` tokens.

        Fresh blocks that will hold full blocks of `seq`'s current tokens (within the reuse cap)
        are registered as pending, so sequences sharing them wait instead of computing them again.
        """
        start = len(seq.block_table)
        for _ in range(self.num_blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_free_block())
        max_blocks = (len(seq) - 1) // self.block_size
        if self.enable_prefix_caching and start < min(len(seq.block_table), max_blocks):
            hashes = self._hashes(seq, max_blocks)
            for index in range(start, min(len(seq.block_table), max_blocks)):
                self._register(seq.block_table[index], hashes[index], self._block_tokens(seq, index))

    def mark_computed(self, seq: Sequence) -> None:
        """Record that `seq.num_computed_tokens` tokens are written: full blocks become reusable."""
        num_full = seq.num_computed_tokens // self.block_size
        for index in range(seq.num_marked_blocks, num_full):
            block = self.blocks[seq.block_table[index]]
            if block.is_computed:
                continue
            block.is_computed = True
            if block.block_hash is None and self.enable_prefix_caching:
                block_hash = self._hashes(seq, index + 1)[index]
                if block_hash not in self._hash_to_block:
                    self._register(block.block_id, block_hash, self._block_tokens(seq, index))
        seq.num_marked_blocks = num_full

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share `parent`'s blocks with `child`; a partial last block is copied, not shared.

        Returns the (source, destination) block copy the next step must make, if any; the
        caller checks first that a free block exists when the last block is partial.
        """
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self._reference(block_id)
        if len(parent) % self.block_size and child.block_table:
            shared_id = child.block_table[-1]
            self.blocks[shared_id].ref_count -= 1
            copy_id = self._take_free_block()
            child.block_table[-1] = copy_id
            return shared_id, copy_id
        return None

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, deepest first; computed hashed blocks stay reusable."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is not None and not block.is_computed:
                self._unregister(block)
            if block.block_hash is not None:
                self._evictable[block_id] = None
            else:
                block.is_computed = False
                self._free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_marked_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (each becomes free), or, while a sequence holds blocks,
        change nothing and return False."""
        if self.num_used_blocks:
            return False
        for block_id in self._evictable:
            self._unregister(self.blocks[block_id])
            self._free_block_ids.append(block_id)
        self._evictable.clear()
        return True

    # ---- internals -------------------------------------------------------------------------
    def _reference(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0 and block_id in self._evictable:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if self._free_block_ids:
            block_id = self._free_block_ids.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._unregister(self.blocks[block_id])
            self.num_evictions += 1
        block = self.blocks[block_id]
        block.ref_count = 1
        block.is_computed = False
        return block_id

    def _register(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        if block_hash in self._hash_to_block:
            return
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = block_hash, token_ids
        self._hash_to_block[block_hash] = block_id

    def _unregister(self, block: Block) -> None:
        if self._hash_to_block.get(block.block_hash) == block.block_id:
            del self._hash_to_block[block.block_hash]
        block.block_hash, block.token_ids, block.is_computed = None, None, False
