"""Bodies and answers of SGLang's weight-push protocol (its io_struct.py), as its server parses them:
unknown fields ignored, lax types ("29731" is a port; a number is not a version), SGLang's defaults.
Two fields are logprobd's own, which SGLang's clients never send: `target` (which model) and `mode`
(how a version is staged). A body that does not validate is SGLang's 400 error object.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.core.errors import WeightPushInvalid
from service.settings import ReloadMode

Target = Literal["policy", "reference", "critic"]
DEFAULT_GROUP = "weight_update_group"
TARGET_DOC = "logprobd's: which model the weights are for (SGLang's clients leave it out: the policy)."


class _Sglang(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InitGroup(_Sglang):
    """POST /init_weights_update_group: join the trainer's group (it is rank 0 and hosts the store)."""

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(description="This server's first rank (its tensor-parallel ranks follow).")
    world_size: int = Field(description="1 trainer + every inference rank of every server.")
    group_name: str = Field(DEFAULT_GROUP, min_length=1, max_length=256)
    backend: str = Field("nccl", min_length=1, max_length=64, description="nccl, gloo, or cpu:gloo,cuda:nccl")


class UpdateWeights(_Sglang):
    """POST /update_weights_from_distributed: the metadata of one bucket the trainer broadcasts."""

    names: list[str] = Field(description="Hugging Face parameter names, in broadcast order.")
    dtypes: list[str] = Field(description='torch dtypes, "bfloat16" or "torch.bfloat16".')
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = Field(
        True, description="Accepted; a model's prefix cache is dropped whenever its weights change."
    )
    abort_all_requests: bool = Field(
        False, description="Accepted; scoring requests finish on the weights they started on."
    )
    weight_version: str | None = Field(
        None, description="The version these tensors belong to; null: the pending one, or a new one."
    )
    load_format: Literal["flattened_bucket"] | None = Field(
        None, description='null: one broadcast per tensor; "flattened_bucket": one uint8 broadcast.'
    )
    torch_empty_cache: bool = False
    target: Target = Field("policy", description=TARGET_DOC)
    mode: ReloadMode | None = Field(
        None,
        description="logprobd's: how a new version is staged (swap, copy, auto); default reload_mode.",
    )


class DestroyGroup(_Sglang):
    group_name: str = DEFAULT_GROUP


class UpdateWeightVersion(_Sglang):
    """POST /update_weight_version: name the weights served (or a pending push) `new_version`."""

    new_version: str
    abort_all_requests: bool = True
    target: Target = Field("policy", description=TARGET_DOC)


class PauseGeneration(_Sglang):
    mode: str = "abort"


class ContinueGeneration(_Sglang):
    torch_empty_cache: bool = True


class WeightSyncAnswer(BaseModel):
    """SGLang's answer of a weight route: 200 with success true, 400 (409: a conflict) with false."""

    success: bool
    message: str


class VersionAnswer(WeightSyncAnswer):
    new_version: str


class WeightVersion(BaseModel):
    weight_version: str


class GenerationAnswer(BaseModel):
    message: str
    status: str


_Body = TypeVar("_Body", bound=BaseModel)


def parse(model: type[_Body], raw: bytes) -> _Body:
    """`model` from a body (none: {}); SGLang's 400 error object when it does not validate."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "body"
        raise WeightPushInvalid(f"{where}: {first.get('msg', 'invalid')}") from None
