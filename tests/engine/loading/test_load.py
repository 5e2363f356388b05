"""The one loading path: the configured models by a Loader, whole or as this rank's shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.engine.loading import shards
from service.engine.loading.load import Shards, Whole, load_models
from service.engine.parallel.sharding import Shard
from tests.support.device import settings_for

CPU = torch.device("cpu")


def test_the_whole_loader_reads_the_policy_and_the_reference_each_from_its_directory(
    model_dirs: dict[str, Path],
) -> None:
    config = settings_for(model_dirs["qwen2"], ref_model=model_dirs["llama"], model_name="p").engine_config()
    models = load_models(config, Whole(torch.float32, CPU, "sdpa"))
    assert (models.policy.name, models.policy.demo, models.sharded) == ("p", False, None)
    assert models.reference is not None
    assert models.critic is None
    assert type(models.policy.model).__name__ == "Qwen2ForCausalLM"
    assert type(models.reference.model).__name__ == "LlamaForCausalLM"
    assert models.reference.name == model_dirs["llama"].resolve().name


def test_no_model_is_the_demo_policy_whole_and_refused_as_shards() -> None:
    models = load_models(settings_for(None).engine_config(), Whole(torch.float32, CPU, "sdpa"))
    assert models.policy.demo
    place = shards.Placement(torch.float32, CPU, "sdpa", Shard(0, 2))
    with pytest.raises(ValueError, match="not the demo model"):
        load_models(settings_for(None).engine_config(), Shards(place))
