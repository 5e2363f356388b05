"""The models a micro-batch runs: each causal LM as its decoder and its head on the action rows,
and the critic; which of them the engine serves (Served).

Boundary: a PackedBatch in, float32 scores of its action rows out ([A] each), left on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from service.engine.batch.packing import PackedBatch
from service.engine.contract import (
    Target,
)
from service.engine.decoder.base import Decoder
from service.engine.heads import vocab_parallel
from service.engine.heads.base import ActionScores, LogitTransform, ScoreActions
from service.engine.heads.chunked import row_multiplier, score_actions
from service.engine.heads.quack_head import QuackHead
from service.engine.loading.critic import Critic
from service.engine.parallel import vocab_layers
from service.engine.strategies.gemm import TokenGemms


class CausalLM:
    """A causal LM split into its decoder and its head, so the head runs on action rows only.
    `fused_head`: the head's GEMM and log-softmax in one kernel, for the calls it serves."""

    def __init__(
        self, model: Any, forward: Decoder, chunk_rows: int, fused_head: QuackHead | None = None
    ) -> None:
        self.model = model
        self.forward = forward  # over model.base_model
        self.lm_head = model.get_output_embeddings()
        self.transform = LogitTransform.from_config(model.config)
        self.chunk_rows = chunk_rows
        self.vocab_size = min(
            vocab_layers.full_rows(model.get_input_embeddings()), vocab_layers.full_rows(self.lm_head)
        )
        sharded = isinstance(self.lm_head, vocab_layers.VocabParallelHead)
        self.score: ScoreActions = vocab_parallel.score_actions if sharded else score_actions
        self.fused_head = None if sharded else fused_head

    def warm_head(self, step: int) -> None:
        """The lm_head's GEMM over every row count a chunk of padded actions can have."""
        weight = self.lm_head.weight
        for rows in sorted({*range(step, self.chunk_rows + 1, step), self.chunk_rows}):
            self.lm_head(torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device))

    def logprobs(self, batch: PackedBatch, want_entropy: bool, *, extras: bool = False) -> ActionScores:
        """The action rows' scores; `extras`: also what rows ask beyond the log-prob (the policy's)."""
        hidden = batch.hidden(lambda rows: self.forward(batch, rows))
        asks = extras and batch.extras is not None
        head = self.fused_head
        if head is not None:
            scale = row_multiplier(
                batch.inv_temperature, self.transform.scale, hidden.shape[0], hidden.device
            )
            if head.serves(self.transform, want_entropy=want_entropy, extras=asks, scaled=scale is not None):
                logprobs = head.logprobs(hidden, self.lm_head.weight, batch.targets, scale)
                return ActionScores(logprobs=logprobs, entropy=None)
        return self.score(
            hidden=hidden,
            targets=batch.targets,
            inv_temperature=batch.inv_temperature,
            lm_head=self.lm_head,
            transform=self.transform,
            chunk_rows=self.chunk_rows,
            want_entropy=want_entropy,
            extras=batch.extras if extras else None,
        )


def critic_values(critic: Critic, forward: Decoder, batch: PackedBatch, gemm: TokenGemms) -> torch.Tensor:
    hidden = batch.hidden(lambda rows: forward(batch, rows))
    return gemm.by_rows(critic.head, hidden)  # [A] float32: head(h_{t-1})


@dataclass(slots=True)
class Served:
    """The models one engine serves: the policy always, the reference and the critic if configured.
    A reload rebinds their parameters in place; a failed self-check swaps a forward (self_check.py)."""

    policy: CausalLM
    reference: CausalLM | None = None
    critic: Critic | None = None
    critic_forward: Decoder | None = None

    def module(self, target: Target) -> Any:
        """The module whose parameters `target`'s weights are; None where it is not served."""
        return {
            "policy": self.policy.model,
            "reference": self.reference.model if self.reference else None,
            "critic": self.critic.decoder if self.critic else None,
        }[target]

    def forward(self, target: Target) -> Decoder | None:
        return {
            "policy": self.policy.forward,
            "reference": self.reference.forward if self.reference else None,
            "critic": self.critic_forward,
        }[target]

    def forwards(self) -> list[Decoder]:
        lms = [lm.forward for lm in (self.policy, self.reference) if lm is not None]
        return lms + [f for f in [self.critic_forward] if f is not None]

    def causal_lms(self) -> list[CausalLM]:
        return [lm for lm in (self.policy, self.reference) if lm is not None]

    def cached_models(self) -> list[Any]:
        """The decoders that keep keys and values for a chunked sequence: every model."""
        return [lm.model for lm in self.causal_lms()] + ([self.critic.decoder] if self.critic else [])

    def roles(self) -> dict[Target, Any]:
        """Each served model's role and its decoder's transformers module (the prefix cache's pools)."""
        roles: dict[Target, Any] = {"policy": self.policy.model}
        if self.reference is not None:
            roles["reference"] = self.reference.model
        if self.critic is not None:
            roles["critic"] = self.critic.decoder
        return roles
