"""The prefixes that the sequences of a micro-batch share: a forest whose nodes are computed once.

Sequences whose first `min_tokens` tokens are equal form a tree (a radix tree over their token
ids): a node is a run of positions [start, end) that every sequence below it holds, and each
sequence is the path of nodes from a root to the node holding its last token. A token's hidden
state depends on the tokens before it only, so a node computed once, its queries attending to its
ancestors' keys and then causally to its own, gives each of its sequences what it would alone.
A sequence that shares nothing is a tree of one node.

Prefixes are compared on token ids, never on a hash alone. Torch-free: the batcher counts what a
micro-batch computes with `Grouper`, and the engine packs the `Forest` of the micro-batch it gets.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from service.jobs import IntArray


@dataclass(frozen=True, slots=True)
class Node:
    """Positions [start, end) of the sequences below it, whose tokens `owner` (one of them) holds."""

    owner: int  # index of a sequence in the micro-batch
    start: int
    end: int
    parent: int  # index of the parent node; -1: a root

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Forest:
    """The nodes of a micro-batch's sequences, every parent before its children, and each sequence's
    path: its nodes from the root down (position p of the sequence is in the path's node whose
    [start, end) holds p)."""

    nodes: tuple[Node, ...]
    paths: tuple[tuple[int, ...], ...]

    @property
    def computed_tokens(self) -> int:
        return sum(node.length for node in self.nodes)

    @property
    def shared(self) -> bool:
        """Whether some node serves more than one sequence."""
        return any(len(path) > 1 for path in self.paths) or len(self.nodes) < len(self.paths)

    def shares(self) -> list[float]:
        """Per sequence, its part of the computed tokens: each node's split evenly among the sequences
        through it (they sum to computed_tokens)."""
        users = [0] * len(self.nodes)
        for path in self.paths:
            for node in path:
                users[node] += 1
        return [sum(self.nodes[n].length / users[n] for n in path) for path in self.paths]


def alone(lengths: Sequence[int]) -> Forest:
    """Every sequence a tree of one node: nothing shared."""
    nodes = tuple(Node(i, 0, length, -1) for i, length in enumerate(lengths))
    return Forest(nodes, tuple((i,) for i in range(len(lengths))))


def common_prefix(a: IntArray, b: IntArray) -> int:
    """How many leading tokens a and b have in common."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _key(tokens: IntArray) -> bytes:
    # lexicographic order on these bytes keeps every set of sequences with a common prefix contiguous
    return np.ascontiguousarray(tokens, dtype=np.int64).tobytes()


def share(tokens: Sequence[IntArray], min_tokens: int) -> Forest:
    """The forest of `tokens` (one [L_i] array per sequence): sequences share a root when their first
    `min_tokens` tokens are equal, and below it every prefix they have in common. Nodes follow the
    sequences' order (each sequence's new nodes after those of the sequences before it)."""
    clusters: dict[bytes, list[int]] = {}
    for i, t in enumerate(tokens):
        if t.shape[0] >= min_tokens:
            clusters.setdefault(_key(t[:min_tokens]), []).append(i)
    built: list[Node] = []
    last: list[int] = [-1] * len(tokens)  # each sequence's deepest node
    grouped: set[int] = set()
    for members in clusters.values():
        if len(members) > 1:
            _radix_tree(tokens, members, built, last)
            grouped.update(members)
    for i, t in enumerate(tokens):
        if i not in grouped:
            built.append(Node(i, 0, int(t.shape[0]), -1))
            last[i] = len(built) - 1
    return _in_sequence_order(built, last)


def _radix_tree(tokens: Sequence[IntArray], members: list[int], out: list[Node], last: list[int]) -> None:
    """Append the radix tree of `members` (which share at least their first token) to `out`."""
    order = sorted(members, key=lambda i: _key(tokens[i]))
    lcp = [common_prefix(tokens[a], tokens[b]) for a, b in itertools.pairwise(order)]
    stack = [(0, len(order), 0, -1)]  # ranges of `order`: [lo, hi), depth covered, parent node
    while stack:
        lo, hi, depth, parent = stack.pop()
        if hi - lo == 1:
            i = order[lo]
            if tokens[i].shape[0] > depth:
                out.append(Node(i, depth, int(tokens[i].shape[0]), parent))
                last[i] = len(out) - 1
            else:  # the sequence ends where its parent does
                last[i] = parent
            continue
        shared = min(lcp[lo : hi - 1])  # every sequence of the range holds [depth, shared)
        node = parent
        if shared > depth:
            out.append(Node(order[lo], depth, shared, parent))
            node = len(out) - 1
        start = lo
        for k in range(lo, hi - 1):
            if lcp[k] == shared:  # sequences k and k + 1 part at `shared`
                stack.append((start, k + 1, shared, node))
                start = k + 1
        stack.append((start, hi, shared, node))


def _in_sequence_order(built: list[Node], last: list[int]) -> Forest:
    """Renumber `built` so that nodes come in the order of the sequences whose paths first reach them."""
    paths_built = []
    for deepest in last:
        path = []
        at = deepest
        while at != -1:
            path.append(at)
            at = built[at].parent
        paths_built.append(path[::-1])
    number: dict[int, int] = {}
    for path in paths_built:
        for n in path:
            number.setdefault(n, len(number))
    nodes = [Node(0, 0, 0, -1)] * len(number)
    for old, new in number.items():
        node = built[old]
        parent = number[node.parent] if node.parent != -1 else -1
        nodes[new] = Node(node.owner, node.start, node.end, parent)
    return Forest(tuple(nodes), tuple(tuple(number[n] for n in path) for path in paths_built))


@dataclass(slots=True)
class Grouper:
    """The tokens a growing micro-batch computes, one sequence at a time: `cost` of a sequence is
    what `add`ing it adds (its tokens past the longest prefix it shares, of at least `min_tokens`,
    with a sequence already in); the costs of the sequences added sum to `share(...)`'s
    computed_tokens."""

    min_tokens: int
    _clusters: dict[bytes, tuple[list[bytes], list[IntArray]]] = field(default_factory=dict)

    def cost(self, tokens: IntArray) -> int:
        return int(tokens.shape[0]) - self._shared(tokens)

    def add(self, tokens: IntArray) -> None:
        if tokens.shape[0] < self.min_tokens:
            return
        keys, arrays = self._clusters.setdefault(_key(tokens[: self.min_tokens]), ([], []))
        key = _key(tokens)
        at = bisect.bisect_left(keys, key)
        keys.insert(at, key)
        arrays.insert(at, tokens)

    def _shared(self, tokens: IntArray) -> int:
        if tokens.shape[0] < self.min_tokens:
            return 0
        cluster = self._clusters.get(_key(tokens[: self.min_tokens]))
        if cluster is None:
            return 0
        keys, arrays = cluster
        at = bisect.bisect_left(keys, _key(tokens))
        # in lexicographic order, the longest common prefix with a set is with a neighbour
        return max(common_prefix(tokens, arrays[j]) for j in (at - 1, at) if 0 <= j < len(arrays))
