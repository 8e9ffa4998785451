"""The planner: a prefix tree of full KV blocks over every prompt of a job.

Each node below the root is one full block (``block_size`` tokens) identified
by its chained hash. Fixed-size blocks never need node splitting.

Invariants:
- A node at depth ``d`` stands for the first ``d`` full blocks of every request
  in its subtree; the root (depth 0) stands for the empty prefix.
- Children are told apart by hash AND token ids: a hash hit with different
  tokens is a collision and becomes a separate child.
- A request ends at the node of its last full block (the root if it has none);
  its partial tail, if any, belongs to no node.
- ``weight`` of a node = number of requests ending in its subtree.
- ``first_index`` of a node = insertion index of the first request that
  passed through it; it breaks ordering ties, so the plan is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.block_hash import ROOT_HASH, BlockHash, hash_blocks


@dataclass
class PlanStats:
    """Prompt-token totals of a plan (prefill counts assume a large enough KV pool)."""

    num_requests: int
    num_prompt_tokens: int
    num_tokens_to_prefill: int
    num_cached_tokens: int  # = num_prompt_tokens - num_tokens_to_prefill
    ideal_hit_rate: float  # = num_cached_tokens / num_prompt_tokens, 0.0 when no tokens


@dataclass
class PrefixGroup:
    """A prefix shared by ``num_requests`` requests (and by no longer common prefix of all of them)."""

    num_requests: int
    num_shared_tokens: int
    shared_token_ids: list[int]
    request_ids: list[int]  # sorted


@dataclass(eq=False)
class _Node:
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    parent: _Node | None
    depth: int
    first_index: int
    weight: int = 0
    request_ids: list[int] = field(default_factory=list)
    children: dict[BlockHash, list[_Node]] = field(default_factory=dict)

    def child(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> _Node | None:
        """The child holding exactly this block, or None (a hash alone never matches)."""
        for node in self.children.get(block_hash, ()):
            if node.token_ids == token_ids:
                return node
        return None

    def all_children(self) -> list[_Node]:
        """Every child, in no particular order."""
        return [node for same_hash in self.children.values() for node in same_hash]

    def sorted_children(self) -> list[_Node]:
        """Children, heavier subtree first, ties by first insertion."""
        return sorted(self.all_children(), key=lambda node: (-node.weight, node.first_index))


class RadixTree:
    """Block-granular prefix tree of all prompts: run order, prefill totals, shared prefixes."""

    def __init__(self, block_size: int = 16) -> None:
        assert block_size >= 1, "block_size must be >= 1"
        self.block_size = block_size
        self._root = _Node(ROOT_HASH, (), None, 0, 0)
        self._requests: dict[int, tuple[_Node, int, int]] = {}  # id -> (end node, tokens, max reused tokens)

    def insert(self, request_id: int, token_ids: list[int], block_hashes: list[BlockHash] | None = None,
               max_reused_tokens: int | None = None) -> None:
        """Add one prompt; request ids must be unique. ``block_hashes``: the prompt's chain
        (``hash_blocks(token_ids, block_size)``) when the caller has it already;
        ``max_reused_tokens``: how many leading tokens may come from the cache (default all but
        the last; fewer for a request that scores its prompt)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id} was already inserted")
        index = len(self._requests)
        node = self._root
        node.weight += 1
        size = self.block_size
        if block_hashes is None:
            block_hashes = hash_blocks(token_ids, size)
        for i, block_hash in enumerate(block_hashes):
            block = tuple(token_ids[i * size : (i + 1) * size])
            child = node.child(block_hash, block)
            if child is None:
                child = _Node(block_hash, block, node, node.depth + 1, index)
                node.children.setdefault(block_hash, []).append(child)
            child.weight += 1
            node = child
        node.request_ids.append(request_id)
        max_reused = len(token_ids) - 1 if max_reused_tokens is None else max_reused_tokens
        self._requests[request_id] = (node, len(token_ids), max(max_reused, 0))

    def order(self) -> list[int]:
        """Run order: depth-first; at each node its own requests, then children heavier first."""
        request_ids: list[int] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            request_ids.extend(node.request_ids)
            stack.extend(reversed(node.sorted_children()))
        return request_ids

    def stats(self) -> PlanStats:
        """Prefill totals when requests run in ``order()`` and no cached block is evicted.

        A request reuses the blocks of its path already computed by an earlier
        request, at most ``max_reused_tokens // block_size`` of them (``(L - 1) // block_size``
        by default). Computed blocks are
        marked walking up from each request's end node until a marked one, so
        the whole walk is linear in the number of nodes plus requests.
        """
        computed: set[_Node] = set()
        num_prompt_tokens = 0
        num_tokens_to_prefill = 0
        for request_id in self.order():
            node, num_tokens, max_reused = self._requests[request_id]
            num_reused = node.depth
            while node is not self._root and node not in computed:
                computed.add(node)
                num_reused -= 1
                node = node.parent
            num_reused = min(num_reused, max_reused // self.block_size)
            num_prompt_tokens += num_tokens
            num_tokens_to_prefill += num_tokens - num_reused * self.block_size
        num_cached_tokens = num_prompt_tokens - num_tokens_to_prefill
        hit_rate = num_cached_tokens / num_prompt_tokens if num_prompt_tokens else 0.0
        return PlanStats(len(self._requests), num_prompt_tokens, num_tokens_to_prefill, num_cached_tokens, hit_rate)

    def prefix_groups(self, max_groups: int = 10) -> list[PrefixGroup]:
        """Deepest shared prefixes, most tokens saved ((num_requests - 1) * num_shared_tokens) first.

        A node qualifies when at least two requests share it and no child is
        shared by all of them (that child would be a longer prefix of the same set).
        """
        candidates = [
            node
            for node in self._nodes()
            if node.depth > 0 and node.weight >= 2 and all(c.weight < node.weight for c in node.all_children())
        ]
        candidates.sort(key=lambda node: (-(node.weight - 1) * node.depth, node.first_index, -node.depth))
        return [self._group(node) for node in candidates[:max_groups]]

    def _group(self, node: _Node) -> PrefixGroup:
        blocks: list[tuple[int, ...]] = []
        walker = node
        while walker is not self._root:
            blocks.append(walker.token_ids)
            walker = walker.parent
        shared_token_ids = [token for block in reversed(blocks) for token in block]
        request_ids = sorted(request_id for sub in self._nodes(node) for request_id in sub.request_ids)
        return PrefixGroup(node.weight, node.depth * self.block_size, shared_token_ids, request_ids)

    def _nodes(self, top: _Node | None = None) -> list[_Node]:
        """Every node of the subtree under ``top`` (the whole tree by default), iteratively."""
        nodes: list[_Node] = []
        stack = [self._root if top is None else top]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.all_children())
        return nodes
