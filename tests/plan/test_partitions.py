"""Prefix-aware partitions: a group stays on one worker unless it is larger than a share."""

from __future__ import annotations

import numpy as np

from batchgen.plan.radix_tree import RadixTree
from batchgen.plan.partitions import partition, partition_orders, random_parts, request_costs

BLOCK = 4
PREFIX_TOKENS = 32  # 8 full blocks per group


def grouped_tree(group_sizes: list[int]) -> tuple[RadixTree, list[int]]:
    """Groups of rows sharing a 32-token prefix, each row with a 3-token tail of its own; the group of each row."""
    tree, group_of, token = RadixTree(BLOCK), [], 10_000
    for group, size in enumerate(group_sizes):
        prefix = [group * 100 + i for i in range(PREFIX_TOKENS)]
        for _ in range(size):
            tree.insert(len(group_of), prefix + [token, token + 1, token + 2])
            group_of.append(group)
            token += 3
    return tree, group_of


def test_groups_smaller_than_a_share_stay_whole_and_the_load_is_balanced():
    tree, group_of = grouped_tree([2, 10, 4, 6])
    costs = request_costs(tree, np.zeros(len(group_of), np.int64))
    parts = partition(tree, costs, 2)
    for group in set(group_of):
        assert len({int(parts[i]) for i, g in enumerate(group_of) if g == group}) == 1
    loads = np.bincount(parts, weights=costs, minlength=2)
    assert loads.max() / loads.sum() <= 0.52  # 32 + 3k per group of k: 62, 50, 44, 38 pack as 100 / 94
    computed = (tree.num_tokens() - tree.cached_tokens(parts)).sum()
    assert computed == tree.stats().num_computed_prompt_tokens  # every prefix still computed once


def test_a_group_larger_than_a_share_is_split_and_only_it():
    tree, group_of = grouped_tree([60, 3, 5, 2])
    costs = request_costs(tree, np.zeros(len(group_of), np.int64))
    parts = partition(tree, costs, 2)
    placed = {group: {int(parts[i]) for i, g in enumerate(group_of) if g == group} for group in set(group_of)}
    assert placed[0] == {0, 1} and all(len(placed[group]) == 1 for group in (1, 2, 3))
    computed = (tree.num_tokens() - tree.cached_tokens(parts)).sum()
    assert computed == tree.stats().num_computed_prompt_tokens + PREFIX_TOKENS  # the split prefix, once more
    random = (tree.num_tokens() - tree.cached_tokens(random_parts(len(group_of), 2))).sum()
    assert random >= tree.stats().num_computed_prompt_tokens + 3 * PREFIX_TOKENS


def test_each_partition_lists_its_rows_once_in_run_order():
    tree, group_of = grouped_tree([7, 1, 9, 4, 4])
    costs = request_costs(tree, np.full(len(group_of), 8, np.int64))
    parts = partition(tree, costs, 3)
    orders = partition_orders(tree, parts, 3)
    assert sorted(np.concatenate(orders).tolist()) == list(range(len(group_of)))
    run_position = {int(index): position for position, index in enumerate(tree.order_indices())}
    for number, order in enumerate(orders):
        assert (parts[order] == number).all()
        assert [run_position[int(i)] for i in order] == sorted(run_position[int(i)] for i in order)


def test_random_parts_are_balanced():
    assert np.bincount(random_parts(10, 3)).tolist() in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
