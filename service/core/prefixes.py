"""The prefixes that the sequences of a micro-batch share: a forest whose nodes are computed once.

Sequences whose first `min_tokens` tokens are equal form a tree (a radix tree over their token
ids): a node is a run of positions [start, end) that every sequence below it holds, and each
sequence is the path of nodes from a root to the node holding its last token. A token's hidden
state depends on the tokens before it only, so a node computed once, its queries attending to its
ancestors' keys and then causally to its own, gives each of its sequences what it would alone.
A sequence that shares nothing is a tree of one node.

Sequences that give MoE routes (routing replay; jobs.GivenRoutes) share a position only where
their routes there are equal too: both uncovered, or both covered with the same expert ids in the
same order. Identical prompt tokens that the rollout routed differently are computed apart.

A sequence whose first tokens the prefix cache holds (prefix_cache.py) computes from its `floor`
on: its root node starts there, and it shares nodes only with sequences that read the same cached
blocks (the same floor and `root`, the cached prefix's last block); the prefix tokens are neither
computed nor counted, and the engine reads their keys and values from its pool.

Prefixes are compared on token ids and routes, never on a hash alone (a fingerprint of a position's
routes orders the sequences, so that those sharing a prefix sit together; equality is then checked
on the ids). Torch-free: the batcher counts what a micro-batch computes with `Grouper`, and the
engine packs the `Forest` of the micro-batch it gets.
"""

from __future__ import annotations

import bisect
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from service.core.jobs import GivenRoutes, IntArray


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
    [start, end) holds p). A root may start past 0: its sequences' first tokens come from the
    prefix cache."""

    nodes: tuple[Node, ...]
    paths: tuple[tuple[int, ...], ...]

    @property
    def computed_tokens(self) -> int:
        return sum(node.length for node in self.nodes)

    @property
    def cached(self) -> bool:
        """Whether some sequence's first tokens come from the prefix cache (a root starts past 0)."""
        return any(node.parent == -1 and node.start > 0 for node in self.nodes)

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


def alone(lengths: Sequence[int], floors: Sequence[int] | None = None) -> Forest:
    """Every sequence a tree of one node: nothing shared; `floors`: where each one's computing starts
    (its first tokens cached; None: 0)."""
    starts = floors if floors is not None else [0] * len(lengths)
    nodes = tuple(
        Node(i, start, length, -1) for i, (length, start) in enumerate(zip(lengths, starts, strict=True))
    )
    return Forest(nodes, tuple((i,) for i in range(len(lengths))))


def common_prefix(a: IntArray, b: IntArray) -> int:
    """How many leading tokens a and b have in common."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    first = int(differ.argmax())  # a boolean argmax stops at the first True
    return first if differ[first] else n


def _key(tokens: IntArray) -> bytes:
    # lexicographic order on these bytes keeps every set of sequences with a common prefix contiguous
    return np.ascontiguousarray(tokens, dtype=np.int64).tobytes()


# odd 64-bit multipliers of a position's route fingerprint, one per 8-byte word of its ids; fixed
_MULTIPLIERS = np.random.default_rng(0x5EED).integers(1, 1 << 63, size=4096, dtype=np.uint64) | np.uint64(1)


def _fingerprints(routes: GivenRoutes, length: int) -> npt.NDArray[np.uint64]:
    """[length] per position: 0 where not covered; else an odd fingerprint of its expert ids' bytes
    (layers x k ids, read as 8-byte words: 48 words a position for Qwen3-30B-A3B's uint8 routes, one
    multiply-add each; normalise gives every sequence's routes in one dtype)."""
    out = np.zeros(length, dtype=np.uint64)
    experts = routes.experts
    count = int(experts.shape[0])
    if not count:
        return out
    raw = np.ascontiguousarray(experts).reshape(count, -1).view(np.uint8)  # [P, bytes]
    if raw.shape[1] % 8:
        raw = np.concatenate([raw, np.zeros((count, -raw.shape[1] % 8), dtype=np.uint8)], axis=1)
    words = raw.view(np.uint64)  # [P, bytes / 8]
    if words.shape[1] > _MULTIPLIERS.shape[0]:
        raise ValueError(f"routes of {raw.shape[1]} bytes a position: at most {8 * _MULTIPLIERS.shape[0]}")
    out[routes.start : routes.end] = (words @ _MULTIPLIERS[: words.shape[1]]) | np.uint64(1)  # mod 2^64
    return out


def _routed_key(tokens: IntArray, routes: GivenRoutes | None) -> bytes:
    """The key of a sequence whose positions compare on (token, routes): pairs of 8-byte words."""
    pairs = np.zeros((tokens.shape[0], 2), dtype=np.uint64)
    pairs[:, 0] = np.asarray(tokens, dtype=np.int64).view(np.uint64)
    if routes is not None:
        pairs[:, 1] = _fingerprints(routes, tokens.shape[0])
    return pairs.tobytes()


def routes_agree(a: GivenRoutes | None, b: GivenRoutes | None, n: int) -> int:
    """How many leading positions of 0 .. n-1 two sequences' routes treat alike: both uncovered, or
    both covered with equal ids (compared, not hashed)."""

    def covered(r: GivenRoutes | None) -> tuple[int, int]:
        lo, hi = (r.start, min(r.end, n)) if r is not None else (n, n)
        return (lo, hi) if lo < hi else (n, n)

    (sa, ea), (sb, eb) = covered(a), covered(b)
    first = n
    if sa != sb:
        first = min(sa, sb)
    elif ea != eb:
        first = min(ea, eb)
    lo, hi = max(sa, sb), min(ea, eb, first)
    if lo < hi:
        assert a is not None
        assert b is not None
        ids_a = a.experts[lo - a.start : hi - a.start]
        ids_b = b.experts[lo - b.start : hi - b.start]
        differ = np.flatnonzero((ids_a != ids_b).reshape(hi - lo, -1).any(axis=1))
        if differ.size:
            first = lo + int(differ[0])
    return first


def common_routed_prefix(
    a: IntArray, b: IntArray, routes_a: GivenRoutes | None, routes_b: GivenRoutes | None
) -> int:
    """How many leading positions a and b have in common: equal tokens and equal routes."""
    n = common_prefix(a, b)
    if routes_a is None and routes_b is None:
        return n
    return routes_agree(routes_a, routes_b, n)


def _group(floor: int, root: int) -> bytes:
    """The bytes that keep sequences reading different cached prefixes apart."""
    return struct.pack("<qq", floor, root)


def share(
    tokens: Sequence[IntArray],
    min_tokens: int,
    routes: Sequence[GivenRoutes | None] | None = None,
    floors: Sequence[int] | None = None,
    roots: Sequence[int] | None = None,
) -> Forest:
    """The forest of `tokens` (one [L_i] array per sequence): sequences share a root when their first
    `min_tokens` tokens are equal, and below it every prefix they have in common. `routes`: each
    sequence's given MoE routes (None: none gives any); a position is then shared only where the
    routes are equal too. `floors` and `roots`: where each sequence's computing starts and the cached
    block it reads last (prefix_cache.Hit; None: nothing cached): sequences share only with those of
    the same pair, and nodes are cut at the floor. Nodes follow the sequences' order (each
    sequence's new nodes after those of the sequences before it)."""
    if routes is not None and all(r is None for r in routes):
        routes = None
    keys = [_key(t) if routes is None else _routed_key(t, routes[i]) for i, t in enumerate(tokens)]
    width = 8 if routes is None else 16  # key bytes a position
    groups = [b""] * len(tokens)
    if floors is not None:
        assert roots is not None
        groups = [_group(f, r) for f, r in zip(floors, roots, strict=True)]
    clusters: dict[bytes, list[int]] = {}
    for i, t in enumerate(tokens):
        if t.shape[0] >= min_tokens:
            clusters.setdefault(groups[i] + keys[i][: width * min_tokens], []).append(i)
    built: list[Node] = []
    last: list[int] = [-1] * len(tokens)  # each sequence's deepest node
    grouped: set[int] = set()
    for members in clusters.values():
        if len(members) > 1:
            _radix_tree(tokens, members, built, last, keys, routes)
            grouped.update(members)
    for i, t in enumerate(tokens):
        if i not in grouped:
            built.append(Node(i, 0, int(t.shape[0]), -1))
            last[i] = len(built) - 1
    if floors is not None:
        _cut(built, floors)
    return _in_sequence_order(built, last)


def _cut(built: list[Node], floors: Sequence[int]) -> None:
    """Each node from its owner's floor on (a node's sequences share one floor): a node ending by it
    goes (its children become roots), one across it starts there. A sequence's last node ends at its
    last token, past its floor, so every path keeps a node."""
    gone = [node.end <= floors[node.owner] for node in built]
    for i, node in enumerate(built):
        if gone[i]:
            continue
        parent = -1 if node.parent == -1 or gone[node.parent] else node.parent
        built[i] = Node(node.owner, max(node.start, floors[node.owner]), node.end, parent)


def _radix_tree(  # noqa: PLR0917
    tokens: Sequence[IntArray],
    members: list[int],
    out: list[Node],
    last: list[int],
    keys: list[bytes],
    routes: Sequence[GivenRoutes | None] | None,
) -> None:
    """Append the radix tree of `members` (which share at least their first position) to `out`."""
    order = sorted(members, key=keys.__getitem__)
    if routes is None:
        lcp = [common_prefix(tokens[a], tokens[b]) for a, b in itertools.pairwise(order)]
    else:
        lcp = [
            common_routed_prefix(tokens[a], tokens[b], routes[a], routes[b])
            for a, b in itertools.pairwise(order)
        ]
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
    with a sequence already in: equal tokens and, where given, equal routes; past its `floor`, the
    tokens the prefix cache serves it, sharing only with sequences of the same floor and `root`); the
    costs of the sequences added sum to `share(...)`'s computed_tokens (with routes, unless two
    positions' route fingerprints collide: then the cost may be more, never less)."""

    min_tokens: int
    _clusters: dict[bytes, tuple[list[bytes], list[tuple[IntArray, GivenRoutes | None]]]] = field(
        default_factory=dict
    )
    _last: tuple[IntArray, GivenRoutes | None, bytes] | None = None  # the last key computed

    def cost(
        self, tokens: IntArray, routes: GivenRoutes | None = None, floor: int = 0, root: int = -1
    ) -> int:
        return int(tokens.shape[0]) - max(floor, self._shared(tokens, routes, _group(floor, root)))

    def add(
        self, tokens: IntArray, routes: GivenRoutes | None = None, floor: int = 0, root: int = -1
    ) -> None:
        if tokens.shape[0] < self.min_tokens:
            return
        key = self._key(tokens, routes)
        cluster = _group(floor, root) + key[: 16 * self.min_tokens]
        keys, entries = self._clusters.setdefault(cluster, ([], []))
        at = bisect.bisect_left(keys, key)
        keys.insert(at, key)
        entries.insert(at, (tokens, routes))

    def _key(self, tokens: IntArray, routes: GivenRoutes | None) -> bytes:
        """_routed_key, computed once for a sequence whose `cost` is asked and which is then added."""
        last = self._last
        if last is not None and last[0] is tokens and last[1] is routes:
            return last[2]
        key = _routed_key(tokens, routes)
        self._last = (tokens, routes, key)
        return key

    def _shared(self, tokens: IntArray, routes: GivenRoutes | None, group: bytes) -> int:
        if tokens.shape[0] < self.min_tokens:
            return 0
        key = self._key(tokens, routes)
        cluster = self._clusters.get(group + key[: 16 * self.min_tokens])
        if cluster is None:
            return 0
        keys, entries = cluster
        at = bisect.bisect_left(keys, key)
        # in lexicographic order, the longest common prefix with a set is with a neighbour
        return max(
            common_routed_prefix(tokens, entries[j][0], routes, entries[j][1])
            for j in (at - 1, at)
            if 0 <= j < len(entries)
        )
