"""The planner: a prefix tree of full KV blocks over every prompt of a job, held as arrays.

A node at depth ``d`` (``d`` >= 1) is a prefix of ``d`` full blocks, identified by the chained
hash of its last block (``block_hash``): a chain hash stands for every token before it. The
tree keeps per request only its id, token count, reuse cap and hash chain (about half a byte
per prompt token), so a million prompts plan in a few hundred MB.

Invariants:
- A request's path is its chain: the node at depth ``d`` is its ``d``-th block hash; it ends at
  the node of its last full block (the root if it has none).
- ``weight`` of a node = number of requests whose path passes through it.
- ``first index`` of a node = insertion index of the first request through it; it breaks
  ordering ties, so the plan is deterministic.
- Nodes are told apart by their 64-bit chain hash alone. A collision could only misorder or
  miscount the plan; the engine's block manager compares token ids on every cache hit, so
  outputs never depend on it.
- Every query works depth by depth on the requests still sharing a node with another request
  (a request alone in its node has nothing left to order or share), so the cost follows the
  shared prefixes, not the prompt lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from batchgen.engine.block_hash import BlockHash, hash_blocks
from batchgen.engine.request import reuse_cap
from batchgen.engine.stats import TokenCounts

CHUNK_ROWS = 8192  # inserted requests buffered in Python lists before becoming arrays


@dataclass
class PlanStats(TokenCounts):
    """A plan's requests and prompt-token counters (see `TokenCounts`: the computed and cached
    counts assume a KV pool large enough to hold each shared prefix while its group runs)."""

    num_requests: int = 0


@dataclass
class PrefixGroup:
    """A prefix shared by ``num_requests`` requests (and by no longer common prefix of all of them)."""

    num_requests: int
    num_shared_tokens: int
    shared_token_ids: list[int]
    request_ids: list[int]  # sorted


@dataclass
class _Chunk:
    """The chains of inserted requests ``first_row ..``: request ``first_row + i`` has the hashes
    ``hashes[starts[i] : starts[i] + lengths[i]]``."""

    first_row: int
    starts: np.ndarray
    hashes: np.ndarray


@dataclass
class _Level:
    """The requests that reach depth ``depth`` inside a shared node (ascending insertion index),
    their node there (``nodes[inverse]``), and the node's weight and first index."""

    depth: int
    rows: np.ndarray
    nodes: np.ndarray
    inverse: np.ndarray
    weights: np.ndarray  # per node
    first_rows: np.ndarray  # per node


class RadixTree:
    """Block-granular prefix tree of all prompts: run order, prefill totals, shared prefixes."""

    def __init__(self, block_size: int = 16) -> None:
        assert block_size >= 1, "block_size must be >= 1"
        self.block_size = block_size
        self._chunks: list[_Chunk] = []
        self._columns: dict[str, list[np.ndarray]] = {"ids": [], "tokens": [], "caps": [], "lengths": []}
        self._pending: dict[str, list[int]] = {"ids": [], "tokens": [], "caps": [], "lengths": [], "hashes": []}
        self._num_rows = 0
        self._arrays: dict[str, np.ndarray] | None = None
        self._order: np.ndarray | None = None

    def insert(self, request_id: int, token_ids: Sequence[int], block_hashes: list[BlockHash] | None = None,
               max_reused_tokens: int | None = None) -> None:
        """Add one prompt; request ids must be unique (ValueError at the first query otherwise).
        ``block_hashes``: the prompt's chain (``hash_blocks(token_ids, block_size)``) when the
        caller has it already; ``max_reused_tokens``: how many leading tokens may come from the
        cache (default: `reuse_cap` of a request that scores nothing)."""
        if block_hashes is None:
            block_hashes = hash_blocks(list(token_ids), self.block_size)
        max_reused = reuse_cap(len(token_ids), None) if max_reused_tokens is None else max_reused_tokens
        pending = self._pending
        pending["ids"].append(request_id)
        pending["tokens"].append(len(token_ids))
        pending["caps"].append(max(max_reused, 0) // self.block_size)
        pending["lengths"].append(len(block_hashes))
        pending["hashes"].extend(block_hashes)
        self._num_rows += 1
        self._arrays = self._order = None
        if len(pending["ids"]) >= CHUNK_ROWS:
            self._flush()

    def _flush(self) -> None:
        pending = self._pending
        if not pending["ids"]:
            return
        lengths = np.array(pending["lengths"], np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self._chunks.append(_Chunk(self._num_rows - len(lengths), starts, np.array(pending["hashes"], np.uint64)))
        for name in self._columns:
            self._columns[name].append(np.array(pending[name], np.int64))
        self._pending = {name: [] for name in pending}

    def _arrays_of(self) -> dict[str, np.ndarray]:
        """ids, tokens, caps (reusable blocks), lengths (chain lengths) per inserted request."""
        if self._arrays is None:
            self._flush()
            self._arrays = {name: np.concatenate(parts) if parts else np.zeros(0, np.int64)
                            for name, parts in self._columns.items()}
            self._columns = {name: [array] for name, array in self._arrays.items()}
            values, counts = np.unique(self._arrays["ids"], return_counts=True)
            if (counts > 1).any():
                raise ValueError(f"request id {int(values[counts > 1][0])} was inserted more than once")
        return self._arrays

    def _hashes_at(self, depth: int, rows: np.ndarray) -> np.ndarray:
        """The depth-``depth`` chain hash of each of ``rows`` (ascending; each has that many blocks)."""
        out = np.empty(len(rows), np.uint64)
        bounds = np.searchsorted(rows, [chunk.first_row for chunk in self._chunks] + [self._num_rows])
        for chunk, low, high in zip(self._chunks, bounds[:-1], bounds[1:]):
            local = rows[low:high] - chunk.first_row
            out[low:high] = chunk.hashes[chunk.starts[local] + depth]
        return out

    def _levels(self) -> Iterator[_Level]:
        """Depth by depth, the requests inside a node shared with another request at the depth
        above (every request at depth 0), with their nodes at this depth."""
        lengths = self._arrays_of()["lengths"]
        rows = np.flatnonzero(lengths > 0)
        depth = 0
        while rows.size:
            nodes, first, inverse, weights = np.unique(self._hashes_at(depth, rows), return_index=True,
                                                       return_inverse=True, return_counts=True)
            level = _Level(depth, rows, nodes, inverse, weights, rows[first])
            yield level
            keep = (weights[inverse] >= 2) & (lengths[rows] > depth + 1)
            rows = rows[keep]
            depth += 1

    def order(self) -> list[int]:
        """Request ids in run order (see `order_indices`)."""
        return self._arrays_of()["ids"][self.order_indices()].tolist()

    def order_indices(self) -> np.ndarray:
        """Insertion indices in run order: depth-first; at each node its own requests first (by insertion), then its
        children, heavier subtree first, ties by first insertion.

        Each request holds ``start``: the first position of its current group (the requests
        with the same path so far) in the final order. A level splits every group into its
        ended requests (which keep the start) and its child nodes, placed after them in child order.
        """
        if self._order is not None:
            return self._order
        num_rows = len(self._arrays_of()["ids"])
        start = np.zeros(num_rows, np.int64)
        group_size = np.full(num_rows, num_rows, np.int64)  # of each request's current group
        for level in self._levels():
            rows = level.rows
            child_key = (num_rows - level.weights) * num_rows + level.first_rows  # heavier, then first
            sort = np.lexsort((child_key[level.inverse], start[rows]))
            group_starts, node_keys = start[rows][sort], child_key[level.inverse][sort]
            position = np.arange(len(rows))
            new_group = np.r_[True, group_starts[1:] != group_starts[:-1]]
            new_node = new_group | np.r_[True, node_keys[1:] != node_keys[:-1]]
            group_first = np.maximum.accumulate(np.where(new_group, position, 0))
            node_first = np.maximum.accumulate(np.where(new_node, position, 0))
            group_ids = np.cumsum(new_group) - 1
            num_ended = group_size[rows][sort] - np.bincount(group_ids)[group_ids]
            sorted_rows = rows[sort]
            start[sorted_rows] = group_starts + num_ended + node_first - group_first
            group_size[sorted_rows] = level.weights[level.inverse][sort]
        self._order = np.argsort(start, kind="stable")
        return self._order

    def stats(self) -> PlanStats:
        """Prefill totals when requests run in ``order()`` and no cached block is evicted (see `cached_tokens`)."""
        tokens = self.num_tokens()
        num_prompt_tokens, num_cached = int(tokens.sum()), int(self.cached_tokens().sum())
        return PlanStats(num_prompt_tokens=num_prompt_tokens, num_computed_prompt_tokens=num_prompt_tokens - num_cached,
                         num_cached_prompt_tokens=num_cached, num_requests=len(tokens))

    def num_tokens(self) -> np.ndarray:
        """The prompt's token count of each request, by insertion index."""
        return self._arrays_of()["tokens"]

    def cached_tokens(self, parts: np.ndarray | None = None) -> np.ndarray:
        """Per request (by insertion index), the prompt tokens the prefix cache serves when the
        requests run in ``order()`` and no cached block is evicted. With ``parts`` (a partition
        number per request) each partition runs on its own, with a cache of its own.

        A request reuses the nodes of its path that an earlier request of its partition computed,
        at most its cap (``max_reused_tokens // block_size``, ``(L - 1) // block_size`` by
        default): inside each shared node, every request but the partition's first in run order
        reuses it.
        """
        arrays = self._arrays_of()
        reused = np.zeros(len(arrays["ids"]), np.int64)
        if len(reused):
            parts = np.zeros(len(reused), np.int64) if parts is None else np.asarray(parts, np.int64)
            rank = np.empty(len(reused), np.int64)
            rank[self.order_indices()] = np.arange(len(reused))
            for level in self._levels():
                _, node_in_part = np.unique(level.inverse * (int(parts.max()) + 1) + parts[level.rows],
                                            return_inverse=True)
                first_rank = np.full(int(node_in_part.max()) + 1, len(reused), np.int64)
                np.minimum.at(first_rank, node_in_part, rank[level.rows])
                reused[level.rows] += rank[level.rows] != first_rank[node_in_part]
        return np.minimum(reused, arrays["caps"]) * self.block_size

    def block_hashes_at(self, depth: int, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the ``depth``-th chain hash of each request of ``indices``, whether it has that many
        blocks: where it does not, its hash is 0)."""
        has_block = self._arrays_of()["lengths"][indices] > depth
        hashes = np.zeros(len(indices), np.uint64)
        positions = np.flatnonzero(has_block)
        ascending = np.argsort(indices[positions], kind="stable")
        hashes[positions[ascending]] = self._hashes_at(depth, indices[positions][ascending])
        return hashes, has_block

    def prefix_groups(self, max_groups: int = 10,
                      token_ids_of: Callable[[int], Sequence[int]] | None = None) -> list[PrefixGroup]:
        """Deepest shared prefixes, most tokens saved ((num_requests - 1) * num_shared_tokens) first.

        A node qualifies when at least two requests share it and no child is shared by all of
        them (that child would be a longer prefix of the same set). ``token_ids_of(request_id)``
        gives a request's prompt tokens, for ``shared_token_ids`` (empty without it).
        """
        candidates: list[tuple[int, int, int, int]] = []  # (-tokens saved, first row, -depth, hash)
        previous: _Level | None = None
        for level in [*self._levels(), None]:
            if previous is not None:
                candidates += self._candidates(previous, level, max_groups)
            previous = level
        candidates.sort()
        return [self._group(-negative_depth, node, token_ids_of)
                for _, _, negative_depth, node in candidates[:max_groups]]

    def _candidates(self, level: _Level, below: _Level | None, max_groups: int) -> list[tuple[int, int, int, int]]:
        """The best ``max_groups`` qualifying nodes of ``level``, given the level below it."""
        is_full = np.zeros(len(level.nodes), bool)
        if below is not None:
            parent = level.inverse[np.searchsorted(level.rows, below.rows)]
            child_weight = below.weights[below.inverse]
            is_full[parent[child_weight == level.weights[parent]]] = True
        qualifies = np.flatnonzero((level.weights >= 2) & ~is_full)
        depth = level.depth + 1
        saved = (level.weights - 1) * depth * self.block_size
        best = qualifies[np.lexsort((level.first_rows[qualifies], -saved[qualifies]))[:max_groups]]
        return [(-int(saved[node]), int(level.first_rows[node]), -depth, int(level.nodes[node])) for node in best]

    def _group(self, depth: int, node: int, token_ids_of: Callable[[int], Sequence[int]] | None) -> PrefixGroup:
        arrays = self._arrays_of()
        rows = np.flatnonzero(arrays["lengths"] >= depth)
        rows = rows[self._hashes_at(depth - 1, rows) == np.uint64(node)]
        request_ids = sorted(arrays["ids"][rows].tolist())
        num_shared = depth * self.block_size
        shared = list(token_ids_of(int(arrays["ids"][rows[0]]))[:num_shared]) if token_ids_of else []
        return PrefixGroup(len(rows), num_shared, shared, request_ids)
