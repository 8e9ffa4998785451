"""Chained block hashes: the identity of a full KV block.

``hash(block i) = xxh64(hash(block i-1) as 8 little-endian bytes
+ token ids as int32 little-endian bytes, seed=HASH_SEED)`` with
``hash(block -1) = ROOT_HASH``.

Invariants:
- Only full blocks (exactly ``block_size`` tokens) have a hash.
- The hash depends on every token before the block, so equal hashes mean equal
  prefixes (up to a 64-bit collision, which callers rule out by comparing
  token ids on every hit).
- Hashes are 64-bit ints, identical in every process and on every run (no
  Python ``hash()`` randomisation involved).
- A prompt's chain is computed once, by the planner; the engine hands it to the
  prompt's sequence, whose block manager extends it as generated tokens fill blocks.
"""

import struct
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", int)

ROOT_HASH = BlockHash(0x626174636867656E)  # b"batchgen"
HASH_SEED = 0


def hash_block(parent_hash: BlockHash, token_ids: list[int]) -> BlockHash:
    """Hash one full block given the hash of the block before it."""
    data = struct.pack(f"<Q{len(token_ids)}i", parent_hash, *token_ids)
    return BlockHash(xxhash.xxh64_intdigest(data, seed=HASH_SEED))


def hash_blocks(token_ids: list[int], block_size: int, parent_hash: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes
