"""Every knob of the service, typed and described; the only code that reads the environment.

Each field is `LOGPROBD_<NAME>` in the environment and `--<name>` on the command line (the command
line wins; a boolean is also `--no-<name>`). The flags are built from these fields in service/flags.py.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, StringConstraints, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.engine.config import (
    BATCH_TOKENS,
    MOE_BATCH_TOKENS,
    Attention,
    Collectives,
    CudaGraphs,
    Device,
    DType,
    EngineConfig,
    HeadKernel,
    Kernels,
    LogLevel,
    MlpKernel,
    MoeKernel,
)
from service.engine.config import DecoderSetting as Decoder

ReloadMode = Literal["auto", "copy", "swap"]
Version = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:+/@-]+$")]

# the engine's choices (service/engine/config.py), under their settings names
__all__ = [
    "GROUPS",
    "Attention",
    "Collectives",
    "CudaGraphs",
    "DType",
    "Decoder",
    "Device",
    "EngineConfig",
    "HeadKernel",
    "Kernels",
    "LogLevel",
    "MlpKernel",
    "MoeKernel",
    "ReloadMode",
    "SettingGroup",
    "Settings",
    "Version",
]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOGPROBD_", extra="forbid", frozen=True)

    model: Path | None = Field(
        None,
        description="Local Hugging Face causal-LM directory (config.json + safetensors). "
        "Unset: serve the built-in random-weight demo model.",
    )
    critic: Path | None = Field(
        None,
        description="Critic checkpoint (OpenRLHF, verl/HF token-classification or TRL value-head format); "
        "enables return_values.",
    )
    ref_model: Path | None = Field(
        None, description="Frozen reference policy directory; enables return_ref_logprobs and kl."
    )
    model_name: str | None = Field(
        None, description="Name reported in responses and /info; defaults to the directory name."
    )
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind.")
    device: Device = Field("auto", description="auto picks cuda when available, else cpu.")
    dtype: DType = Field("auto", description="auto: bfloat16 on cuda, float32 on cpu.")
    attention: Attention = Field(
        "auto",
        description="Packed attention kernel. auto: flash_attn_cute (flash-attn 4, compute capability 8.0+) "
        "if importable, else flash_attn (flash-attn 2) if importable, else torch_varlen on cuda; sdpa (one "
        "call per sequence) on cpu or where the kernels cannot run.",
    )
    decoder: Decoder = Field(
        "auto",
        description="The decoder forward. fused: logprobd's own for Llama, Mistral, Qwen2, Qwen3 and the "
        "mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral (one "
        "GEMM for q|k|v and one for gate|up, RoPE in place, GEMMs that add into the residual); transformers: "
        "the model's own modules, any architecture; auto: fused wherever the model fits (kernels not liger).",
    )
    kernels: Kernels = Field(
        "auto",
        description="Fused kernels. auto: on cuda with triton, the fused decoder's Triton RMSNorm/RoPE/"
        "SwiGLU, or liger-kernel's for the transformers decoder if importable; liger: liger-kernel's, with "
        "the transformers decoder; none: plain torch.",
    )
    mlp_kernel: MlpKernel = Field(
        "auto",
        description="The fused decoder's gate|up projection and SwiGLU. split: a GEMM, then the SwiGLU "
        "kernel; quack: one quack-kernels GEMM whose epilogue applies SwiGLU (CUDA compute capability "
        "9.0+, bf16/fp16); auto: quack where it can run (not with kernels=none), split elsewhere.",
    )
    moe_kernel: MoeKernel = Field(
        "auto",
        description="The fused decoder's mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE, Mixtral). "
        "quack: quack-kernels' varlen GEMMs over every expert at once, the tokens' rows gathered and "
        "SwiGLU applied inside the first (CUDA compute capability 9.0+, bf16/fp16); grouped_mm: torch's "
        "grouped GEMM over every expert at once; neither loops over experts or synchronises with the host. "
        "loop: one GEMM per expert. auto: on cuda the first of quack and grouped_mm that passes a start-up "
        "probe (otherwise loop, with a warning), loop elsewhere.",
    )
    head_kernel: HeadKernel = Field(
        "auto",
        description="The lm_head on calls that ask for log-probs alone (no entropy, top-K or other extras). "
        "quack: one quack-kernels GEMM whose epilogue keeps each row's log-sum-exp and target logit, so "
        "no logits are written (CUDA compute capability 9.0, bf16/fp16, a head without bias or soft-capping; "
        "not in batch-invariant mode); chunked: the GEMM over chunks of logits_chunk_rows rows, then the "
        "log-softmax; auto: quack where it can run and passes a start-up probe (not with kernels=none), "
        "chunked elsewhere. Every other call runs chunked.",
    )
    cuda_graphs: CudaGraphs = Field(
        "auto",
        description="Replay the fused decoder's layers from CUDA graphs, one per padded micro-batch shape: "
        "one launch where there are otherwise ten a layer. auto: on CUDA with the fused decoder, bf16/fp16 "
        "and a flash attention kernel, if a start-up check against the eager forward passes (otherwise "
        "off, with a warning); on: the same, failing the start where they cannot run; off: never.",
    )
    cuda_graph_limit: int = Field(
        768,
        ge=8,  # the graph evicted is never one a micro-batch still in flight replays
        description="Most CUDA graphs one decoder keeps (the least recently used goes first). With "
        "flash-attn 4 two graphs serve every micro-batch of the same padded size and up to 64 sequences, "
        "one for those whose sequences share prefixes: max_batch_tokens / 64, those of the largest 16,384 "
        "tokens' sizes captured at start, the others while the engine idles; a micro-batch of more "
        "sequences adds one of its own when first met. An MoE policy adds a graph per size for "
        "micro-batches that record routes and one for those that replay them, captured while the engine "
        "idles after the start (never evicting one; past the limit the rest run eagerly): 768 holds all "
        "four kinds at an MoE policy's default budget.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs of this host one replica spreads each model over (tensor parallel: one process "
        "per GPU, started by serve; rank 0 serves HTTP). 1: one process, one device. Over 1: the fused "
        "decoder's models only (Llama, Mistral, Qwen2, Qwen3), their query and key/value heads divisible "
        "by it; no CUDA graphs, no batch-invariant mode.",
    )
    tensor_parallel_collectives: Collectives = Field(
        "auto",
        description="The ranks' collectives. auto: NCCL on GPUs (one GPU a rank), gloo on CPU; gloo on GPUs "
        "lets several ranks share one GPU (slower: for checking the sharded path on a one-GPU host).",
    )
    max_batch_tokens: int | None = Field(
        None,
        ge=16,
        description="Token budget of one packed micro-batch (its activation memory). A longer sequence is "
        "scored in chunks of at most this many tokens, each attending to the keys and values kept of the "
        f"chunks before it. Unset: {BATCH_TOKENS:,}, or {MOE_BATCH_TOKENS:,} for a mixture-of-experts policy "
        "on a GPU (fewer micro-batches a round: fewer part-filled expert GEMM tiles); /info says which.",
    )
    max_sequence_tokens: int | None = Field(
        None,
        ge=16,
        description="Longest sequence accepted (413 past it). Unset: the model's max_position_embeddings "
        "(with its rope scaling) or, on a GPU, what memory holds of the sequence's keys and values beside "
        "the weights and a micro-batch, if less (measured at start); set above that, the start fails.",
    )
    batch_invariant: bool = Field(
        False,
        description="Batch-invariant scores: a sequence's log-probs, entropy, values and reference "
        "log-probs are bitwise the same however it is batched (alone, anywhere in any micro-batch, beside "
        "any other request, shared or not, in chunks or whole), across restarts on the same GPU and "
        "software, whatever max_batch_tokens. Every GEMM over tokens runs as one call of a kernel whose "
        "configuration does not depend on the rows (quack's, on Hopper GPUs in bf16/fp16), elsewhere in "
        "calls of 1024 rows with micro-batches padded to them (/info gemm says which); attention reduces "
        "each query over its keys in one order however the queries are cut (docs/semantics.md). Costs "
        "throughput (BENCHMARKS.md).",
    )
    share_prefixes: bool = Field(
        True,
        description="Compute a prefix that several queued sequences share (a GRPO group's prompt, a "
        "multi-turn conversation's earlier turns) once per micro-batch: each sequence's later tokens "
        "attend to the shared tokens' keys and values. The scores are the same function of the same "
        "tokens; the budget counts tokens computed. Bitwise the same scores in batch-invariant mode.",
    )
    share_min_tokens: int = Field(
        16,
        ge=1,
        description="Sequences share their prefix only when it is at least this many tokens long; a "
        "shorter one (a beginning-of-sequence token, a few template tokens) is computed with each "
        "sequence, as sharing it would cost more than it saves.",
    )
    prefix_cache: bool = Field(
        True,
        description="Keep the keys, values and final hidden states the engine computed for token prefixes "
        "across micro-batches and requests, per model and weights version, so a prompt is computed once "
        "whichever request brings it (a GRPO group split over trainer ranks, each step of an agent's "
        "trajectory, a teacher's repeated system prompt). Dropped for a model when its weights change, "
        "and by POST /flush_cache. Scores are the same function of the same tokens; bitwise the same "
        "in batch-invariant mode (docs/semantics.md).",
    )
    prefix_cache_tokens: int | None = Field(
        None,
        ge=16,
        description="Tokens each served model's prefix cache holds (the least recently used go first). "
        "Unset: prefix_cache_memory_fraction of the accelerator memory left beside the weights and a "
        "micro-batch's working set (measured at start); 65536 on CPU.",
    )
    prefix_cache_memory_fraction: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="Share of the memory left beside the weights and a micro-batch's working set that the "
        "prefix cache takes when prefix_cache_tokens is unset; the longest sequence is sized from the rest.",
    )
    batch_wait_ms: float = Field(
        5.0,
        ge=0,
        description="Wait up to this long after a request arrives for others to fill its micro-batch, while "
        "the GPU is idle or busy with the micro-batch before it.",
    )
    launch_hold_ms: float = Field(
        25.0,
        ge=0,
        description="On an idle GPU, the event loop waits up to this long for a micro-batch's launch to "
        "be queued, the GIL released, so requests parsed meanwhile do not slow the launch (0: never).",
    )
    mlp_chunk_tokens: int | None = Field(
        None,
        ge=0,
        description="Run decoder MLPs over at most this many tokens at a time (0: all at once); unset: as "
        "many as keep a chunk's gate|up activations within 640 MiB (all of a 16k-token micro-batch up to "
        "Qwen2.5-1.5B's width, 8192 tokens at 7B's).",
    )
    logits_chunk_rows: int = Field(
        512, ge=1, description="Rows of [rows, vocab] logits materialised at once by the lm_head."
    )
    drain_seconds: float = Field(
        5.0,
        ge=0,
        description="On SIGTERM, report draining (readiness and new requests 503) for this long while "
        "in-flight requests go on, so load balancers stop routing here; then shut down and exit 0.",
    )
    max_body_bytes: int = Field(64 << 20, ge=1024, description="Largest request body accepted (413 past it).")
    max_request_sequences: int = Field(4096, ge=1, description="Most rows in one request (413 past it).")
    stream_batch_tokens: int = Field(
        4096,
        ge=16,
        description="Most tokens a micro-batch computes while it holds a prompt of a /v1/completions answer "
        "sent a choice at a time (a large answer of several prompts): the first choices go out while later "
        "prompts compute. At most max_batch_tokens counts.",
    )
    max_top_logprobs: int = Field(
        1024,
        ge=1,
        description="Largest K a request may ask per position: `top_logprobs`, and /v1/completions' "
        "`prompt_logprobs` and `logprobs` (422 past it).",
    )
    max_request_tokens: int = Field(
        1 << 20, ge=1, description="Most real tokens one request may hold (413 past it)."
    )
    max_queued_tokens: int = Field(
        1 << 21,
        ge=1,
        description="Tokens the queue may hold; a request that would pass it gets 429 with Retry-After. "
        "A request is admitted whatever its size when nothing is queued (it could never be otherwise; "
        "max_request_tokens bounds it), so the queue may hold more than this for one request.",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Default deadline of a scoring request (504 past it, its work dropped)."
    )
    max_request_timeout_s: float = Field(
        3600.0, gt=0, description="Largest deadline a request may ask for with `timeout_s`."
    )
    api_keys: SecretStr | None = Field(
        None, description="Comma-separated bearer API keys; set, scoring routes answer 401 without one."
    )
    api_keys_file: Path | None = Field(None, description="File of bearer API keys, one per line.")
    admin_api_keys: SecretStr | None = Field(
        None,
        description="Comma-separated bearer keys for /admin/* (weight reload); unset, /admin/* answers 403. "
        "Admin keys are also accepted on the scoring routes.",
    )
    admin_api_keys_file: Path | None = Field(None, description="File of admin bearer keys, one per line.")
    weights_version: Version = Field(
        "initial", description="Version label of the policy weights loaded at start (reported per response)."
    )
    ref_weights_version: Version = Field(
        "initial", description="Version label of the reference weights at start."
    )
    critic_weights_version: Version = Field(
        "initial", description="Version label of the critic weights at start."
    )
    reload_mode: ReloadMode = Field(
        "auto",
        description="How POST /admin/weights and a weight push apply new weights. swap: stage a second copy "
        "on the device, then copy it in there (a pause of milliseconds); copy: stage in host memory, then "
        "copy in place between micro-batches (no second device copy; a push holds one bucket at most, per "
        "group, on the device beyond the served weights); auto: swap when the device has room, else copy.",
    )
    reload_roots: str | None = Field(
        None,
        description="Colon-separated directories that reload paths must lie under (after resolving links); "
        "unset: any local path.",
    )
    weights_follow: Path | None = Field(
        None,
        description="JSON version file on shared storage ({path, version[, target, mode]} or a list of "
        "them): reload whatever it names that is not served yet, without an admin request.",
    )
    weights_follow_interval_s: float = Field(2.0, gt=0, description="How often to look at weights_follow.")
    weight_push_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A trainer's weight-update group (SGLang's /init_weights_update_group): how long its "
        "rendezvous and each bucket's broadcasts may take. Past it the push is given up, the group torn "
        "down (the served weights stay; a new init is accepted).",
    )
    weight_push_partial_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A pushed version that is neither complete nor committed (/continue_generation, "
        "/end_weight_update, a bucket of another version) this long after its last bucket is dropped; "
        "the last complete version keeps serving.",
    )
    weight_push_max_groups: int = Field(
        8,
        ge=1,
        description="How many trainer groups (SGLang's /init_weights_update_group) may be open at once: a "
        "trainer's pipeline stages push their layers over a group each (slime: one per stage), their "
        "buckets arriving side by side. Each open group holds a thread and its backend's connections "
        "(NCCL: a communicator on the GPU). One more answers 409.",
    )
    weight_push_addresses: str | None = Field(
        None,
        description="Comma-separated addresses or networks (CIDR) of the trainers this server may dial "
        "for a weight push (master_address, resolved); unset: any.",
    )
    auth_all_routes: bool = Field(
        False, description="Also require a key on /health/*, /info and /metrics (open by default)."
    )
    log_level: LogLevel = Field("info", description="Log level.")
    docs_ui: bool = Field(
        False,
        description="Serve Swagger UI at /docs and ReDoc at /redoc. They load their scripts, styles and "
        "fonts from public CDNs (cdn.jsdelivr.net, fonts.googleapis.com), so they work only where the "
        "browser reaches the internet; /openapi.json is always served.",
    )

    @field_validator("weight_push_addresses")
    @classmethod
    def _networks(cls, value: str | None) -> str | None:
        for entry in (value or "").split(","):
            if entry.strip():
                ipaddress.ip_network(entry.strip(), strict=False)  # ValueError: not an address or network
        return value

    def push_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """weight_push_addresses as networks (an address is a network of one); empty: any."""
        entries = (self.weight_push_addresses or "").split(",")
        return [ipaddress.ip_network(entry.strip(), strict=False) for entry in entries if entry.strip()]

    def engine_config(self) -> EngineConfig:
        """What the engine reads of these settings (the engine never reads Settings itself)."""
        return EngineConfig(**{name: getattr(self, name) for name in EngineConfig.__dataclass_fields__})


@dataclass(frozen=True)
class SettingGroup:
    """Settings on one topic: `serve --help` and docs/configuration.md list them together."""

    title: str
    about: str
    names: tuple[str, ...]


def _group(title: str, about: str, names: str) -> SettingGroup:
    return SettingGroup(title, about, tuple(names.split()))


# Every field of Settings in exactly one group (tests/test_flags_help.py), in the order shown.
GROUPS = (
    _group(
        "model",
        "The checkpoints, and the devices and precision they run in.",
        "model critic ref_model model_name device dtype tensor_parallel_size tensor_parallel_collectives",
    ),
    _group(
        "scoring",
        "How the forward computes: kernels, batch invariance, shared prefixes and the prefix cache "
        "(docs/performance.md).",
        "attention decoder kernels mlp_kernel moe_kernel head_kernel cuda_graphs batch_invariant "
        "share_prefixes share_min_tokens prefix_cache prefix_cache_tokens prefix_cache_memory_fraction",
    ),
    _group(
        "batching",
        "Micro-batches and the queue in front of them.",
        "max_batch_tokens batch_wait_ms launch_hold_ms stream_batch_tokens max_queued_tokens",
    ),
    _group(
        "memory",
        "What a sequence and a micro-batch may hold at once.",
        "max_sequence_tokens mlp_chunk_tokens logits_chunk_rows cuda_graph_limit",
    ),
    _group(
        "HTTP",
        "Where the server listens, what one request may ask, and the keys it needs.",
        "host port max_body_bytes max_request_sequences max_request_tokens max_top_logprobs "
        "request_timeout_s max_request_timeout_s api_keys api_keys_file admin_api_keys admin_api_keys_file "
        "auth_all_routes docs_ui",
    ),
    _group(
        "weights",
        "The weights' version labels and how new weights are loaded or pushed while serving.",
        "weights_version ref_weights_version critic_weights_version reload_mode reload_roots weights_follow "
        "weights_follow_interval_s weight_push_timeout_s weight_push_partial_timeout_s "
        "weight_push_max_groups weight_push_addresses",
    ),
    _group("operations", "Shutting down and logging.", "drain_seconds log_level"),
)
