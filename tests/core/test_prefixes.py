"""The forest of shared prefixes against a brute-force count of distinct prefixes, and the batcher's
incremental count against the forest, on random groups, trees, identical and nested sequences."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest

from service.core.jobs import GivenRoutes
from service.core.prefixes import Forest, Grouper, alone, common_prefix, share


def _brute_force_tokens(seqs: list[list[Any]], min_tokens: int) -> int:
    """Tokens to compute: each distinct prefix once among sequences whose first `min_tokens` tokens
    are equal; every token of a sequence that shares them with no other."""
    heads: dict[tuple[int, ...], list[list[int]]] = {}
    for s in seqs:
        heads.setdefault(tuple(s[:min_tokens]) if len(s) >= min_tokens else (id(s), -1), []).append(s)
    total = 0
    for members in heads.values():
        if len(members) == 1:
            total += len(members[0])
        else:
            total += len({tuple(s[:k]) for s in members for k in range(1, len(s) + 1)})
    return total


def _check(forest: Forest, seqs: list[list[int]]) -> None:
    """Every sequence is its path's tokens, from 0, contiguous; parents come before children."""
    arrays = [np.asarray(s, dtype=np.int64) for s in seqs]
    for i, node in enumerate(forest.nodes):
        assert node.parent < i
        assert node.length > 0
        if node.parent != -1:
            assert forest.nodes[node.parent].end == node.start
        else:
            assert node.start == 0
    for seq, path in zip(arrays, forest.paths, strict=True):
        rebuilt = [arrays[forest.nodes[n].owner][forest.nodes[n].start : forest.nodes[n].end] for n in path]
        assert np.array_equal(np.concatenate(rebuilt), seq)
        for a, b in itertools.pairwise(path):
            assert forest.nodes[b].parent == a


def _random_tree(rng: random.Random, n: int) -> list[list[int]]:
    """Sequences built by extending random earlier ones (or their prefixes): groups, nested turns,
    duplicates, a sequence that is another's prefix, and strangers."""
    seqs: list[list[int]] = []
    for _ in range(n):
        roll = rng.random()
        if not seqs or roll < 0.2:
            seqs.append([rng.randrange(5) for _ in range(rng.randint(1, 30))])
        elif roll < 0.3:
            seqs.append(list(rng.choice(seqs)))
        else:
            base = rng.choice(seqs)
            cut = rng.randint(0, len(base))
            seqs.append(base[:cut] + [rng.randrange(5) for _ in range(rng.randint(0, 20))] or [1])
    return seqs


@pytest.mark.parametrize("seed", range(40))
def test_forest_computes_each_distinct_prefix_once(seed: int) -> None:
    rng = random.Random(seed)
    seqs = _random_tree(rng, rng.randint(1, 14))
    min_tokens = rng.choice([1, 3, 8])
    forest = share([np.asarray(s, dtype=np.int64) for s in seqs], min_tokens)
    _check(forest, seqs)
    assert forest.computed_tokens == _brute_force_tokens(seqs, min_tokens)
    assert sum(forest.shares()) == pytest.approx(forest.computed_tokens)


@pytest.mark.parametrize("seed", range(20))
def test_grouper_counts_what_the_forest_computes_in_any_order(seed: int) -> None:
    rng = random.Random(1000 + seed)
    seqs = [np.asarray(s, dtype=np.int64) for s in _random_tree(rng, rng.randint(1, 14))]
    min_tokens = rng.choice([1, 3, 8])
    rng.shuffle(seqs)
    grouper = Grouper(min_tokens)
    total = 0
    for s in seqs:
        total += grouper.cost(s)
        grouper.add(s)
    assert total == share(seqs, min_tokens).computed_tokens


def test_a_grpo_group_and_a_stranger() -> None:
    prompt = list(range(10, 74))  # 64 tokens
    group = [[*prompt, 1, 2, 3], [*prompt, 1, 2, 4, 5], [*prompt, 7]]
    stranger = list(range(50))
    forest = share([np.asarray(s, dtype=np.int64) for s in [*group, stranger]], 64)
    _check(forest, [*group, stranger])
    assert forest.shared
    # the prompt once; [1, 2] once below it; then 3 | 4, 5 | 7; the stranger whole
    assert forest.computed_tokens == 64 + 2 + 1 + 2 + 1 + 50
    assert [len(p) for p in forest.paths] == [3, 3, 2, 1]
    assert forest.shares()[3] == 50
    assert forest.shares()[2] == pytest.approx(64 / 3 + 1)


def test_below_the_minimum_nothing_is_shared() -> None:
    a, b = [1] * 10 + [2], [1] * 10 + [3]
    forest = share([np.asarray(a), np.asarray(b)], 11)
    assert not forest.shared
    assert forest == alone([11, 11])
    assert share([np.asarray(a), np.asarray(b)], 10).computed_tokens == 12


def test_identical_sequences_and_a_prefix_of_another() -> None:
    s = list(range(20))
    forest = share([np.asarray(x) for x in (s, s, s[:12])], 4)
    _check(forest, [s, s, s[:12]])
    assert forest.computed_tokens == 20
    assert forest.shared
    assert forest.paths[0] == forest.paths[1]


def test_common_prefix() -> None:
    assert common_prefix(np.asarray([1, 2, 3]), np.asarray([1, 2, 4, 5])) == 2
    assert common_prefix(np.asarray([1, 2]), np.asarray([1, 2, 4])) == 2
    assert common_prefix(np.asarray([9]), np.asarray([1])) == 0
    assert common_prefix(np.asarray([1, 2]), np.asarray([1, 2])) == 2  # equal: the whole
    assert common_prefix(np.zeros(0, dtype=np.int64), np.asarray([1])) == 0  # one empty


def _with_routes(
    rng: random.Random, seqs: list[list[int]]
) -> tuple[list[list[Any]], list[GivenRoutes | None]]:
    """Random routes over each sequence (few distinct ids, so that equal routes are common; some
    sequences without, some from a later position or ending early), and each sequence as the list
    of its positions' (token, ids or None): what the brute force compares."""
    keyed: list[list[Any]] = []
    routes: list[GivenRoutes | None] = []
    for s in seqs:
        roll = rng.random()
        if roll < 0.25:
            keyed.append([(t, None) for t in s])
            routes.append(None)
            continue
        start = 0 if roll < 0.6 else rng.randint(0, len(s))
        end = rng.randint(start, len(s))
        # an id per (position, layer, slot) drawn from the token so that equal prefixes often agree
        ids = np.asarray(
            [
                [[(s[p] + (rng.random() < 0.1)) % 3, 3 + layer] for layer in range(2)]
                for p in range(start, end)
            ],
            dtype=np.int64,
        ).reshape(end - start, 2, 2)
        given = GivenRoutes(start, ids)
        keyed.append(
            [(t, tuple(ids[p - start].ravel()) if start <= p < end else None) for p, t in enumerate(s)]
        )
        routes.append(given)
    return keyed, routes


@pytest.mark.parametrize("seed", range(30))
def test_sequences_share_a_position_only_with_equal_routes(seed: int) -> None:
    rng = random.Random(5000 + seed)
    seqs = _random_tree(rng, rng.randint(1, 14))
    keyed, routes = _with_routes(rng, seqs)
    min_tokens = rng.choice([1, 3, 8])
    arrays = [np.asarray(s, dtype=np.int64) for s in seqs]
    forest = share(arrays, min_tokens, routes)
    _check(forest, seqs)
    assert forest.computed_tokens == _brute_force_tokens(keyed, min_tokens)
    for i, path in enumerate(forest.paths):  # every node's positions routed alike for all its sequences
        for n in path:
            node = forest.nodes[n]
            assert keyed[i][node.start : node.end] == keyed[node.owner][node.start : node.end]
    order = list(range(len(seqs)))
    rng.shuffle(order)
    grouper = Grouper(min_tokens)
    total = 0
    for i in order:
        total += grouper.cost(arrays[i], routes[i])
        grouper.add(arrays[i], routes[i])
    assert total == forest.computed_tokens


def test_a_group_routed_two_ways_over_its_prompt() -> None:
    prompt = list(range(10, 30))
    seqs = [np.asarray([*prompt, 1, 2], dtype=np.int64), np.asarray([*prompt, 3], dtype=np.int64)]
    ids = np.zeros((20, 1, 2), dtype=np.int64)
    ids[:, 0, 1] = 1
    other = ids.copy()
    other[7, 0] = [1, 0]  # the same experts in another slot order: another route
    assert share(seqs, 4, [GivenRoutes(0, ids), GivenRoutes(0, ids)]).computed_tokens == 20 + 2 + 1
    split = share(seqs, 4, [GivenRoutes(0, ids), GivenRoutes(0, other)])
    assert split.computed_tokens == 7 + 15 + 14  # shared up to position 7 only
    assert share(seqs, 4, [GivenRoutes(0, ids), None]).computed_tokens == 22 + 21


def _floored(seqs: list[list[int]], rng: random.Random) -> tuple[list[int], list[int]]:
    """A floor and a root for each sequence, as the prefix cache gives them: sequences of one root hold
    the same tokens below their floor (the first sequence of each prefix of 8 tokens picks one)."""
    picked: dict[tuple[int, ...], tuple[int, int]] = {}
    floors, roots = [], []
    for s in seqs:
        head = tuple(s[:8])
        if len(s) > 8 and head not in picked:
            picked[head] = (rng.choice([0, 4, 8]), len(picked))
        floor, root = picked.get(head, (0, -1)) if len(s) > 8 else (0, -1)
        floors.append(floor if floor < len(s) else 0)
        roots.append(root if floor else -1)
    return floors, roots


@pytest.mark.parametrize("seed", range(20))
def test_a_cached_floor_cuts_the_forest_and_the_grouper_counts_past_it(seed: int) -> None:
    """Sequences whose first tokens the prefix cache serves compute from their floor on, sharing only
    with those of the same cached root: each node starts at or past its floor, every path covers its
    sequence from the floor, and the Grouper's costs sum to what the forest computes."""
    rng = random.Random(3000 + seed)
    seqs = _random_tree(rng, rng.randint(1, 14))
    floors, roots = _floored(seqs, rng)
    arrays = [np.asarray(s, dtype=np.int64) for s in seqs]
    min_tokens = rng.choice([1, 3, 4])
    forest = share(arrays, min_tokens, None, floors, roots)
    for i, path in enumerate(forest.paths):
        nodes = [forest.nodes[n] for n in path]
        assert nodes[0].start == floors[i]
        assert nodes[0].parent == -1
        rebuilt = np.concatenate([arrays[n.owner][n.start : n.end] for n in nodes])
        assert np.array_equal(rebuilt, arrays[i][floors[i] :])
    assert forest.cached == any(floors)
    grouper = Grouper(min_tokens)
    total = 0
    for s, floor, root in zip(arrays, floors, roots, strict=True):
        total += grouper.cost(s, None, floor, root)
        grouper.add(s, None, floor, root)
    assert total == forest.computed_tokens
    # apart from the cache, the same sequences share more (or as much)
    assert share(arrays, min_tokens).computed_tokens <= forest.computed_tokens + sum(floors)


def test_alone_from_a_floor() -> None:
    forest = alone([20, 30], [16, 0])
    assert [(n.start, n.end) for n in forest.nodes] == [(16, 20), (0, 30)]
    assert forest.cached
    assert forest.computed_tokens == 34
