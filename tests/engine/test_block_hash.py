import os
import struct
import subprocess
import sys

import xxhash

from batchgen.engine import block_hash
from batchgen.engine.block_hash import ROOT_HASH, extend_block_hashes, hash_blocks


def direct_hash(parent_hash: int, token_ids: list[int]) -> int:
    data = parent_hash.to_bytes(8, "little") + b"".join(struct.pack("<i", t) for t in token_ids)
    return xxhash.xxh64_intdigest(data, seed=0)


def test_a_block_hash_is_xxh64_of_its_parent_and_int32_tokens():
    token_ids = [0, 1, -1, 2**31 - 1, 70000, 5, 6, 7]
    assert hash_blocks(token_ids, 8) == [direct_hash(ROOT_HASH, token_ids)]
    assert extend_block_hashes([12345], [9] * 8 + token_ids, 8, 2) == [12345, direct_hash(12345, token_ids)]


def test_hash_blocks_is_chained_from_root():
    token_ids = list(range(100, 112))
    expected_0 = direct_hash(ROOT_HASH, token_ids[0:4])
    expected_1 = direct_hash(expected_0, token_ids[4:8])
    expected_2 = direct_hash(expected_1, token_ids[8:12])
    assert hash_blocks(token_ids, 4) == [expected_0, expected_1, expected_2]


def test_partial_trailing_block_has_no_hash():
    token_ids = list(range(10))
    hashes = hash_blocks(token_ids, 4)
    assert len(hashes) == 2
    assert hashes == hash_blocks(token_ids[:8], 4)
    assert hash_blocks(token_ids[:3], 4) == []
    assert hash_blocks([], 4) == []


def test_hash_depends_on_every_earlier_block():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_blocks([1, 2, 3, 9, 5, 6, 7, 8], 4)
    assert a[0] != b[0]
    assert a[1] != b[1]


def hash_blocks_in_subprocess(token_ids: list[int], block_size: int, python_hash_seed: str) -> str:
    """Print `hash_blocks` from a fresh interpreter (the module is loaded alone, for speed)."""
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('block_hash', {block_hash.__file__!r}); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        f"print(module.hash_blocks({token_ids!r}, {block_size}))"
    )
    env = dict(os.environ, PYTHONHASHSEED=python_hash_seed)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_hashes_are_equal_across_processes():
    token_ids = list(range(37))
    expected = str(hash_blocks(token_ids, 8))
    assert hash_blocks_in_subprocess(token_ids, 8, "12345") == expected
    assert hash_blocks_in_subprocess(token_ids, 8, "999") == expected
