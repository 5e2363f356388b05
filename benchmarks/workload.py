"""The benchmarks' workloads (fixed seeds) and their FLOP floors; no torch: shared by the GPU runs and
the CPU smoke tests. The model shapes are in shapes.py."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from service.core.jobs import SequenceJob
from service.engine.config import BATCH_TOKENS, MOE_BATCH_TOKENS
from service.engine.contract import EngineInfo, MoeShape


@dataclass(frozen=True, slots=True)
class Sample:
    prompt: list[int]
    response: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response


def workload(
    vocab: int,
    *,
    sequences: int = 64,
    prompt_range: tuple[int, int] = (256, 1024),
    response_mean: float = 250.0,
    response_clip: tuple[int, int] = (16, 1024),
    seed: int = 0,
) -> list[Sample]:
    """Prompt length uniform in prompt_range; response exponential(mean), clipped; fixed seed."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(sequences):
        p = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        r = int(np.clip(round(rng.exponential(response_mean)), *response_clip))
        tokens = rng.integers(0, vocab, size=p + r).tolist()
        samples.append(Sample(prompt=tokens[:p], response=tokens[p:]))
    return samples


def jobs(samples: list[Sample]) -> list[SequenceJob]:
    """The service's jobs: the response is the action window."""
    return [
        SequenceJob(
            tokens=np.asarray(s.tokens, dtype=np.int64),
            actions=np.arange(len(s.prompt), len(s.tokens), dtype=np.int64),
            temperature=1.0,
            return_entropy=False,
        )
        for s in samples
    ]


def floor_flops(shape: dict[str, int | bool], non_embedding_params: int, samples: list[Sample]) -> float:
    """2·params·tokens + 2·vocab·hidden·actions + causal attention (QKᵀ and PV over L²/2 pairs, over
    the shape's `attention_width`, heads · head_dim, where it is not the hidden size)."""
    hidden, layers, vocab = (
        int(shape["hidden_size"]),
        int(shape["num_hidden_layers"]),
        int(shape["vocab_size"]),
    )
    width = int(shape.get("attention_width", hidden))
    tokens = sum(len(s.tokens) for s in samples)
    actions = sum(len(s.response) for s in samples)
    attention = sum(2.0 * layers * width * len(s.tokens) ** 2 for s in samples)
    return 2.0 * non_embedding_params * tokens + 2.0 * vocab * hidden * actions + attention


# GRPO groups and multi-turn trees: sequences that share prefixes exactly (prefix sharing's workloads).


def grpo_groups(
    vocab: int,
    *,
    prompts: int = 8,
    responses: int = 8,
    prompt_range: tuple[int, int] = (256, 1024),
    response_mean: float = 250.0,
    response_clip: tuple[int, int] = (16, 1024),
    seed: int = 10,
) -> list[Sample]:
    """`prompts` groups of `responses` samples, a group's samples one after another: every sample
    of a group has its prompt's tokens exactly; responses exponential(mean), clipped; fixed seed."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(prompts):
        prompt = rng.integers(0, vocab, size=int(rng.integers(prompt_range[0], prompt_range[1] + 1))).tolist()
        for _ in range(responses):
            r = int(np.clip(round(rng.exponential(response_mean)), *response_clip))
            samples.append(Sample(prompt=prompt, response=rng.integers(0, vocab, size=r).tolist()))
    return samples


def _scaled(low: int, high: int, scale: float) -> tuple[int, int]:
    return max(1, round(low * scale)), max(1, round(high * scale))


def grpo_short(vocab: int, scale: float = 1.0) -> list[Sample]:
    """8 prompts x 8 responses: prompt U[256, 1024], response Exp(250) clipped to [16, 1024]
    (every length times `scale`: a CPU smoke test)."""
    return grpo_groups(
        vocab,
        prompt_range=_scaled(256, 1024, scale),
        response_mean=250.0 * scale,
        response_clip=_scaled(16, 1024, scale),
        seed=10,
    )


def grpo_long(vocab: int, scale: float = 1.0) -> list[Sample]:
    """8 prompts x 8 responses: prompt U[2048, 4096], response Exp(300) clipped to [16, 1024]."""
    return grpo_groups(
        vocab,
        prompt_range=_scaled(2048, 4096, scale),
        response_mean=300.0 * scale,
        response_clip=_scaled(16, 1024, scale),
        seed=11,
    )


def long_workload(vocab: int, scale: float = 1.0, seed: int = 1) -> list[Sample]:
    """8 sequences: a 1k-token prompt, a response uniform in [8k, 24k] (both times `scale`)."""
    rng = np.random.default_rng(seed)
    prompt = max(1, round(1024 * scale))
    out = []
    for _ in range(8):
        response = int(rng.integers(round(8192 * scale), round(24576 * scale) + 1))
        tokens = rng.integers(0, vocab, size=prompt + response).tolist()
        out.append(Sample(tokens[:prompt], tokens[prompt:]))
    return out


def teacher_prompts(vocab: int, tokens: int, count: int = 8, seed: int = 13) -> list[list[int]]:
    """TRL's teacher call's prompts (benchmarks.distribution): `count` random prompts of `tokens` ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, tokens).tolist() for _ in range(count)]


def teacher(vocab: int, scale: float = 1.0) -> list[Sample]:
    """The teacher call's prompts (8 x 4,096 tokens, times `scale`) as samples whose every position
    after the first is an action: what `prompt_logprobs` scores (service/http/completions/plan.py)."""
    return [Sample(prompt=p[:1], response=p[1:]) for p in teacher_prompts(vocab, max(2, round(4096 * scale)))]


def chat_header(vocab: int, scale: float = 1.0, *, header: int = 32) -> list[Sample]:
    """The standard workload (64 sequences, nothing else in common) whose every prompt starts with
    the same `header` tokens, as a chat template's: what sharing a short prefix costs or saves
    (the share_min_tokens default)."""
    rng = np.random.default_rng(13)
    common = rng.integers(0, vocab, size=max(1, round(header * scale))).tolist()
    samples = workload(
        vocab,
        prompt_range=_scaled(256, 1024, scale),
        response_mean=250.0 * scale,
        response_clip=_scaled(16, 1024, scale),
    )
    return [Sample(prompt=common + s.prompt[len(common) :], response=s.response) for s in samples]


def multi_turn(vocab: int, scale: float = 1.0, *, conversations: int = 8, seed: int = 12) -> list[Sample]:
    """`conversations` trees of 4 samples, two levels of sharing:

        system (U[256, 512]) + user 1 (U[64, 256])             shared by the conversation's 4 samples
          + assistant 1 (Exp(200), [32, 512]) + user 2 (U[32, 128])    one branch per pair of samples
            + assistant 2 (Exp(250), [16, 1024])               each sample's own: the action window

    Samples 4c..4c+3 are conversation c; 4c, 4c+1 share branch 0 and 4c+2, 4c+3 branch 1."""
    rng = np.random.default_rng(seed)

    def tokens(low: int, high: int) -> list[int]:
        low, high = _scaled(low, high, scale)
        out: list[int] = rng.integers(0, vocab, size=int(rng.integers(low, high + 1))).tolist()
        return out

    def exponential(mean: float, low: int, high: int) -> list[int]:
        r = np.clip(round(rng.exponential(mean * scale)), *_scaled(low, high, scale))
        out: list[int] = rng.integers(0, vocab, size=int(r)).tolist()
        return out

    samples = []
    for _ in range(conversations):
        root = tokens(256, 512) + tokens(64, 256)
        for _ in range(2):
            branch = root + exponential(200.0, 32, 512) + tokens(32, 128)
            samples += [Sample(prompt=branch, response=exponential(250.0, 16, 1024)) for _ in range(2)]
    return samples


def _sorted_lcps(samples: list[Sample]) -> tuple[list[list[int]], list[int]]:
    """The token sequences in lexicographic order and each one's common prefix with the one before
    (0 for the first): a trie's nodes are each sequence's positions from that prefix on."""
    seqs = sorted(s.tokens for s in samples)
    lcps = [0]
    for a, b in itertools.pairwise(seqs):
        n = min(len(a), len(b))
        diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
        lcps.append(int(diff[0]) if diff.size else n)
    return seqs, lcps


def unique_tokens(samples: list[Sample]) -> int:
    """Tokens of a trie over the sequences (distinct prefixes): what full prefix sharing computes."""
    seqs, lcps = _sorted_lcps(samples)
    return sum(len(s) - lcp for s, lcp in zip(seqs, lcps, strict=True))


def one_level_tokens(samples: list[Sample], min_shared: int = 64) -> int:
    """Tokens computed when only one level is shared: sequences fall into groups that pairwise share
    at least `min_shared` leading tokens (the server's share_min_tokens), and each group computes
    its members' longest common prefix once and every member's remainder (a multi-turn tree's later
    branches are not shared)."""
    seqs, lcps = _sorted_lcps(samples)
    total, group_lcp, members = 0, 0, 0
    for s, lcp in zip(seqs, lcps, strict=True):
        if members and lcp >= min_shared:  # sorted: the group's common prefix is the least adjacent one
            group_lcp, members = min(group_lcp, lcp), members + 1
            total += len(s)
            continue
        total -= (members - 1) * group_lcp if members else 0
        group_lcp, members = len(s), 1
        total += len(s)
    return total - (members - 1) * group_lcp


def unique_floor_flops(
    shape: dict[str, int | bool], non_embedding_params: int, samples: list[Sample]
) -> float:
    """floor_flops counted on the trie's tokens: 2·params·unique tokens + 2·vocab·hidden·actions +
    the attention each unique token needs (at position p it attends to p + 1 keys: QKᵀ and PV are
    4·hidden·(p + 1) per layer; over a sequence unshared that is 2·hidden·L(L + 1), floor_flops' L²)."""
    hidden, layers, vocab = (
        int(shape["hidden_size"]),
        int(shape["num_hidden_layers"]),
        int(shape["vocab_size"]),
    )
    seqs, lcps = _sorted_lcps(samples)
    unique = sum(len(s) - lcp for s, lcp in zip(seqs, lcps, strict=True))
    # positions lcp..L-1 are the nodes a sequence adds: sum of (p + 1) over them
    keys = sum((len(s) * (len(s) + 1) - lcp * (lcp + 1)) // 2 for s, lcp in zip(seqs, lcps, strict=True))
    actions = sum(len(s.response) for s in samples)
    return 2.0 * non_embedding_params * unique + 2.0 * vocab * hidden * actions + 4.0 * layers * hidden * keys


def host_info(vocab: int, moe: MoeShape | None = None) -> EngineInfo:
    """What the host-only benchmarks (no model) build answers and limits from: a bf16 policy of
    `vocab` tokens and 32,768 positions, with `moe`'s sparse layers where given."""
    return EngineInfo(
        model="bench",
        demo=False,
        architecture="bench",
        dtype="bfloat16",
        device="cpu",
        attention_backend="none",
        decoder="fused",
        kernels="none",
        vocab_size=vocab,
        max_positions=32768,
        versions={},
        max_batch_tokens=MOE_BATCH_TOKENS if moe is not None else BATCH_TOKENS,
        moe=moe,
    )
