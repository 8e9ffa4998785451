"""Prefix-aware partitions of a plan: rows that share a prefix go to the same worker.

A group is a subtree of the plan's radix tree: the requests sharing a chain of leading blocks,
contiguous in run order. Starting from the root, a group whose cost is more than one worker's
share (the total cost over the number of partitions) is split into its own requests (those whose
chain ends at its node) and its child groups, until every group fits a share or is one
request. The groups are then packed into the partitions costliest first, each into the partition
with the least cost so far.

A request's cost is the work it adds where its group runs together: the prompt tokens the
prefix cache does not serve plus the tokens it generates.

Invariants:
- Every request is in exactly one partition.
- A group is split across partitions only when its cost exceeds one share.
- Inside a partition, requests run in the plan's order restricted to it (`partition_orders`),
  so a group's shared prefix is computed once there.
"""

from __future__ import annotations

import heapq

import numpy as np

from batchgen.plan.radix_tree import RadixTree


def request_costs(tree: RadixTree, num_generated_tokens: np.ndarray) -> np.ndarray:
    """Each request's cost (by insertion index), given the tokens it generates at most."""
    return tree.num_tokens() - tree.cached_tokens() + num_generated_tokens


def partition(tree: RadixTree, costs: np.ndarray, num_parts: int) -> np.ndarray:
    """The partition (0 .. num_parts - 1) of each request, by insertion index; see the module docstring."""
    order = tree.order_indices()
    cumulative = np.concatenate([[0], np.cumsum(costs[order])])
    share = cumulative[-1] / num_parts
    groups: list[tuple[int, int]] = []  # ranges of run-order positions
    pending = [(0, len(order), 0)]  # (start, end, depth): a range sharing its first `depth` blocks
    while pending:
        start, end, depth = pending.pop()
        if cumulative[end] - cumulative[start] <= share or end - start == 1:
            groups.append((start, end))
            continue
        hashes, has_block = tree.block_hashes_at(depth, order[start:end])
        is_new = np.r_[True, (hashes[1:] != hashes[:-1]) | ~has_block[1:] | ~has_block[:-1]]
        bounds = [*(start + np.flatnonzero(is_new)).tolist(), end]
        pending += [(low, high, depth + 1) for low, high in zip(bounds[:-1], bounds[1:])]
    parts = np.empty(len(order), np.int64)
    loads = [(0.0, part) for part in range(num_parts)]
    for start, end in sorted(groups, key=lambda group: (cumulative[group[0]] - cumulative[group[1]], group[0])):
        load, part = heapq.heappop(loads)
        parts[order[start:end]] = part
        heapq.heappush(loads, (load + cumulative[end] - cumulative[start], part))
    return parts


def partition_orders(tree: RadixTree, parts: np.ndarray, num_parts: int) -> list[np.ndarray]:
    """Each partition's requests (insertion indices) in run order."""
    order = tree.order_indices()
    in_order = parts[order]
    return [order[in_order == part] for part in range(num_parts)]


def random_parts(num_requests: int, num_parts: int, seed: int = 0) -> np.ndarray:
    """Balanced random partitions (what placement blind to prefixes gives), for comparison."""
    return np.random.default_rng(seed).permutation(num_requests) % num_parts
