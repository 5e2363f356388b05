"""PackedScorer: the ScoringEngine over one packed row per micro-batch.

A micro-batch is packed once (tokens, positions, boundaries, action indices); each model that
scores it (today the policy; later a critic or reference model beside it) runs its decoder over the
same PackedBatch and its own head on the action positions only.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import service
from service.engine.attention import AttentionBackend, choose_backend, register
from service.engine.base import EngineInfo
from service.engine.chunking import chunk_mlps
from service.engine.head import LogitTransform, score_actions
from service.engine.kernels import apply_fused_kernels
from service.engine.loading import LoadedModel, load_model, resolve_device, resolve_dtype
from service.engine.packing import PackedBatch, pack
from service.jobs import SequenceJob, SequenceScores
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


class PackedScorer:
    def __init__(
        self,
        loaded: LoadedModel,
        device: torch.device,
        backend: AttentionBackend,
        settings: Settings,
        kernels: str = "none",
    ) -> None:
        self._policy = CausalLM(loaded.model, settings.logits_chunk_rows)
        self._device = device
        config = loaded.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._info = EngineInfo(
            model=loaded.name,
            demo=loaded.demo,
            architecture=(config.architectures or [type(loaded.model).__name__])[0],
            dtype=str(loaded.model.dtype).removeprefix("torch."),
            device=str(device),
            attention_backend=backend.name,
            kernels=kernels,
            vocab_size=self._policy.vocab_size,
            max_positions=int(getattr(text_config, "max_position_embeddings", 0) or 0) or 1 << 30,
            versions=_versions(),
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> PackedScorer:
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        backend = choose_backend(settings.attention, device)
        loaded = load_model(settings.model, settings.model_name, dtype, device, register(backend))
        kernels = apply_fused_kernels(loaded.model, settings.kernels, device)
        chunk_mlps(loaded.model, settings.mlp_chunk_tokens)  # after the kernels: wraps their MLP
        return cls(loaded, device, backend, settings, kernels)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @torch.inference_mode()
    def score(self, jobs: Sequence[SequenceJob]) -> list[SequenceScores]:
        batch = pack(jobs, self._device)
        hidden = self._policy.hidden(batch)  # [N, H]
        scores = score_actions(
            hidden=hidden.index_select(0, batch.hidden_index),
            targets=batch.targets,
            inv_temperature=batch.inv_temperature,
            lm_head=self._policy.lm_head,
            transform=self._policy.transform,
            chunk_rows=self._policy.chunk_rows,
            want_entropy=batch.want_entropy,
        )
        splits = np.cumsum(batch.actions_per_sequence)[:-1]
        logprobs = np.split(scores.logprobs.cpu().numpy(), splits)
        entropy = np.split(scores.entropy.cpu().numpy(), splits) if scores.entropy is not None else None
        return [
            SequenceScores(
                logprobs=logprobs[i], entropy=entropy[i] if entropy and job.return_entropy else None
            )
            for i, job in enumerate(jobs)
        ]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the kernels once and check the head reproduces the model's own final logits."""
        rng = random.Random(0)
        vocab = self._info.vocab_size
        lengths = [min(64, self._info.max_positions) for _ in range(4)]
        jobs = [
            SequenceJob(
                tokens=np.asarray([rng.randrange(vocab) for _ in range(n)], dtype=np.int64),
                actions=np.arange(1, n, dtype=np.int64),
                temperature=1.0,
                return_entropy=True,
            )
            for n in lengths
        ]
        self.score(jobs)
        delta = self._policy.check_head(torch.from_numpy(jobs[0].tokens).to(self._device))
        log.info("warm-up done; head self-check max |Δ logits| = %.3g", delta)


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
