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

import sys
from array import array
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", int)

ROOT_HASH = BlockHash(0x626174636867656E)  # b"batchgen"
HASH_SEED = 0


def _int32_le(token_ids: list[int]) -> bytes:
    ids = array("i", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


def _hash_bytes(parent_hash: int, block: bytes) -> BlockHash:
    """The hash of a block whose token ids are `block` (int32 little-endian)."""
    return BlockHash(xxhash.xxh64_intdigest(parent_hash.to_bytes(8, "little") + block, seed=HASH_SEED))


def hash_blocks(token_ids: list[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    return extend_block_hashes([], token_ids, block_size, len(token_ids) // block_size)


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], block_size: int,
                        num_blocks: int) -> list[BlockHash]:
    """Extend ``hashes``, the chain of the first blocks of ``token_ids``, in place until it holds at
    least ``num_blocks`` hashes (each of those blocks must be full); returns it."""
    if len(hashes) >= num_blocks:
        return hashes
    first = len(hashes)
    data = _int32_le(token_ids[first * block_size : num_blocks * block_size])
    parent = hashes[-1] if hashes else ROOT_HASH
    width = 4 * block_size
    for start in range(0, len(data), width):
        parent = _hash_bytes(parent, data[start : start + width])
        hashes.append(parent)
    return hashes
