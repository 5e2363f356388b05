"""PackedScorer: the ScoringEngine over one packed row per micro-batch.

A micro-batch is packed once (tokens, positions, boundaries, action indices); every model the batch
asks for (the policy always; the reference policy and the critic when a sequence wants them) runs
its decoder over that same PackedBatch and its own head on the action positions only.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import service
from service.engine import weights
from service.engine.attention import AttentionBackend, choose_backend, register
from service.engine.base import (
    EngineInfo,
    ModelInfo,
    OutOfMemory,
    ReloadOrder,
    StagedWeights,
    Target,
    WeightsRejected,
    WeightsState,
)
from service.engine.chunking import chunk_mlps
from service.engine.critic import Critic, load_critic, read_value_head
from service.engine.head import ActionScores, LogitTransform, score_actions
from service.engine.kernels import apply_fused_kernels
from service.engine.loading import LoadedModel, load_model, resolve_device, resolve_dtype, text_part
from service.engine.packing import PackedBatch, pack
from service.jobs import FloatArray, SequenceJob, SequenceScores
from service.settings import Settings

log = logging.getLogger(__name__)

# |own forward - ours| <= RTOL * max|logit| + ATOL, per dtype, in the start-up self-check
_SELF_CHECK_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


class CausalLM:
    """A causal LM split into its decoder and its head, so the head runs on action rows only."""

    def __init__(self, model: Any, chunk_rows: int) -> None:
        self.model = model
        self.decoder = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.transform = LogitTransform.from_config(model.config)
        self.chunk_rows = chunk_rows
        embed_rows = model.get_input_embeddings().num_embeddings
        self.vocab_size = min(int(embed_rows), int(self.lm_head.out_features))

    def hidden(self, batch: PackedBatch) -> torch.Tensor:
        out = self.decoder(**batch.forward_kwargs())
        hidden: torch.Tensor = out.last_hidden_state[0]  # [N, H]
        return hidden

    def logprobs(self, batch: PackedBatch, want_entropy: bool) -> ActionScores:
        return score_actions(
            hidden=self.hidden(batch).index_select(0, batch.hidden_index),
            targets=batch.targets,
            inv_temperature=batch.inv_temperature,
            lm_head=self.lm_head,
            transform=self.transform,
            chunk_rows=self.chunk_rows,
            want_entropy=want_entropy,
        )

    @torch.inference_mode()
    def check_head(self, tokens: torch.Tensor) -> float:
        """Largest |Δ| between the model's own logits and ours on one sequence; raise if too large.

        Catches a model whose forward transforms its final logits in a way LogitTransform misses.
        """
        own = self.model(input_ids=tokens[None], use_cache=False).logits[0].float()  # [L, V]
        hidden = self.decoder(input_ids=tokens[None], use_cache=False).last_hidden_state[0]
        ours = self.transform(self.lm_head(hidden).float())  # [L, V]
        rtol, atol = _SELF_CHECK_TOL[hidden.dtype]
        delta = float((own - ours).abs().max())
        bound = rtol * float(own.abs().max()) + atol
        if not delta <= bound:
            raise RuntimeError(
                f"{type(self.model).__name__}: its own forward gives logits that differ from "
                f"lm_head(hidden) + {self.transform} by {delta:.3g} (allowed {bound:.3g}); it applies a "
                "final-logit transform logprobd does not reproduce, so its scores would be wrong"
            )
        return delta


def _critic_values(critic: Critic, batch: PackedBatch) -> torch.Tensor:
    hidden = critic.decoder(**batch.forward_kwargs()).last_hidden_state[0]  # [N, H]
    return critic.head(hidden.index_select(0, batch.hidden_index))  # [A] float32: head(h_{t-1})


class PackedScorer:
    def __init__(
        self,
        loaded: LoadedModel,
        device: torch.device,
        backend: AttentionBackend,
        settings: Settings,
        kernels: str = "none",
        *,
        reference: LoadedModel | None = None,
        critic: Critic | None = None,
    ) -> None:
        self._policy = CausalLM(loaded.model, settings.logits_chunk_rows)
        self._reference = CausalLM(reference.model, settings.logits_chunk_rows) if reference else None
        self._critic = critic
        self._device = device
        config = loaded.model.config
        text = text_part(config)
        vocab = self._policy.vocab_size
        if self._reference is not None and self._reference.vocab_size != vocab:
            raise ValueError(
                f"reference model vocabulary {self._reference.vocab_size} differs from the policy's {vocab}"
            )
        if critic is not None:
            vocab = min(vocab, int(critic.decoder.get_input_embeddings().num_embeddings))
        models = [_model_info("policy", loaded.name, loaded.model)]
        if reference is not None:
            models.append(_model_info("reference", reference.name, reference.model))
        if critic is not None:
            models.append(_model_info("critic", f"critic ({critic.head.format} value head)", critic.decoder))
        self._info = EngineInfo(
            model=loaded.name,
            demo=loaded.demo,
            architecture=(config.architectures or [type(loaded.model).__name__])[0],
            dtype=str(loaded.model.dtype).removeprefix("torch."),
            device=str(device),
            attention_backend=backend.name,
            kernels=kernels,
            vocab_size=vocab,
            max_positions=int(getattr(text, "max_position_embeddings", 0) or 0) or 1 << 30,
            versions=_versions(),
            models=tuple(models),
        )
        now = time.time()
        initial = {
            "policy": (settings.weights_version, settings.model or loaded.name),
            "reference": (settings.ref_weights_version, settings.ref_model),
            "critic": (settings.critic_weights_version, settings.critic),
        }
        self._weights: dict[str, WeightsState] = {
            m.role: WeightsState(m.role, initial[m.role][0], str(initial[m.role][1]), "initial", now)
            for m in models
        }

    @classmethod
    def from_settings(cls, settings: Settings) -> PackedScorer:
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        backend = choose_backend(settings.attention, device)
        attn = register(backend)

        def prepare(model: Any) -> str:
            kernels = apply_fused_kernels(model, settings.kernels, device)
            chunk_mlps(model, settings.mlp_chunk_tokens)  # after the kernels: wraps their MLP
            return kernels

        loaded = load_model(settings.model, settings.model_name, dtype, device, attn)
        kernels = prepare(loaded.model)
        reference = None
        if settings.ref_model is not None:
            reference = load_model(settings.ref_model, None, dtype, device, attn, role="reference")
            prepare(reference.model)
        critic = _load_critic(settings.critic, dtype, device, attn, prepare)
        return cls(loaded, device, backend, settings, kernels, reference=reference, critic=critic)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def weights(self) -> Mapping[str, WeightsState]:
        return self._weights

    def stage(self, order: ReloadOrder) -> StagedWeights:
        """Read, check and place new weights for `order.target`; the served ones are untouched."""
        module, prefix, head = self._reloadable(order.target), "", None
        if order.target == "critic":
            assert self._critic is not None
            prefix = f"{module.base_model_prefix}."
            if not order.path.is_dir():
                raise WeightsRejected(f"{order.path}: a critic reload needs the checkpoint directory")
            try:
                head = read_value_head(order.path, int(module.config.hidden_size), self._device)
            except (OSError, ValueError) as exc:
                raise WeightsRejected(str(exc)) from exc
        weights.check_config(order.path, text_part(module.config))
        mode = weights.choose_mode(order.mode, weights.module_bytes(module), self._device)
        return weights.stage(
            dataclasses.replace(order, mode=mode),
            module,
            prefix=prefix,
            allow_extra=lambda name: bool(prefix) and not name.startswith(prefix),  # the critic's heads
            extra=head,
        )

    def apply(self, staged: StagedWeights) -> WeightsState:
        """Serve the staged weights from the next micro-batch on. Engine thread only."""
        assert isinstance(staged, weights.Staged)
        target = staged.order.target
        weights.apply(staged)
        if target == "critic":
            assert self._critic is not None
            assert staged.extra is not None
            self._critic = Critic(self._critic.decoder, staged.extra)
        state = WeightsState(
            target,
            staged.order.version,
            str(staged.order.path),
            staged.mode,
            time.time(),
            self._weights[target].reloads + 1,
        )
        self._weights = {**self._weights, target: state}
        return state

    def _reloadable(self, target: Target) -> Any:
        model = {
            "policy": self._policy.model,
            "reference": self._reference.model if self._reference else None,
            "critic": self._critic.decoder if self._critic else None,
        }[target]
        if model is None:
            raise WeightsRejected(f"this server has no {target} model to reload")
        return model

    def score(self, jobs: Sequence[SequenceJob]) -> list[SequenceScores]:
        try:
            return self._score(jobs)
        except torch.OutOfMemoryError as exc:
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
            tokens = sum(job.num_tokens for job in jobs)
            raise OutOfMemory(f"out of memory on {len(jobs)} sequences, {tokens} tokens") from exc

    @torch.inference_mode()
    def _score(self, jobs: Sequence[SequenceJob]) -> list[SequenceScores]:
        batch = pack(jobs, self._device)
        splits = np.cumsum(batch.actions_per_sequence)[:-1]

        def per_sequence(values: torch.Tensor | None) -> list[FloatArray] | None:
            return None if values is None else np.split(values.float().cpu().numpy(), splits)

        policy = self._policy.logprobs(batch, batch.want_entropy)
        ref = None
        if self._reference is not None and any(job.return_ref for job in jobs):
            ref = self._reference.logprobs(batch, want_entropy=False).logprobs
        values = None
        if self._critic is not None and any(job.return_values for job in jobs):
            values = _critic_values(self._critic, batch)
        lp, ent = per_sequence(policy.logprobs), per_sequence(policy.entropy)
        rf, vl = per_sequence(ref), per_sequence(values)
        assert lp is not None
        return [
            SequenceScores(
                logprobs=lp[i],
                entropy=ent[i] if ent is not None and job.return_entropy else None,
                values=vl[i] if vl is not None and job.return_values else None,
                ref_logprobs=rf[i] if rf is not None and job.return_ref else None,
            )
            for i, job in enumerate(jobs)
        ]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every model's kernels once and check the heads reproduce the models' own final logits."""
        rng = random.Random(0)
        vocab = self._info.vocab_size
        n = min(64, self._info.max_positions)
        jobs = [
            SequenceJob(
                tokens=np.asarray([rng.randrange(vocab) for _ in range(n)], dtype=np.int64),
                actions=np.arange(1, n, dtype=np.int64),
                temperature=1.0,
                return_entropy=True,
                return_values=self._critic is not None,
                return_ref=self._reference is not None,
            )
            for _ in range(4)
        ]
        self.score(jobs)
        tokens = torch.from_numpy(jobs[0].tokens).to(self._device)
        delta = self._policy.check_head(tokens)
        if self._reference is not None:
            delta = max(delta, self._reference.check_head(tokens))
        log.info("warm-up done; head self-check max |Δ logits| = %.3g", delta)


def _load_critic(
    path: Path | None, dtype: torch.dtype, device: torch.device, attn: str, prepare: Any
) -> Critic | None:
    if path is None:
        return None
    critic = load_critic(path, dtype, device, attn)
    prepare(critic.decoder)
    return critic


def _model_info(role: Target, name: str, model: Any) -> ModelInfo:
    params = list(model.parameters())
    return ModelInfo(
        role=role,
        name=name,
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in params),
        memory_bytes=sum(p.numel() * p.element_size() for p in params)
        + sum(b.numel() * b.element_size() for b in model.buffers()),
    )


def _versions() -> dict[str, str]:
    import transformers

    versions = {
        "service": service.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        import flash_attn

        versions["flash_attn"] = str(flash_attn.__version__)
    except ImportError:
        pass
    return versions
