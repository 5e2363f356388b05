"""verl's and OpenRLHF's pushes (docs/client.md, "Sharded trainers"): the docs' snippets run as written,
in this process as a one-rank trainer (a gloo default group), against a real replica
(tests/support/pushing.py), and the replica then scores as the model pushed.

- verl: the worker's `self.actor.engine.get_per_tensor_param()` is FSDPEngine's own composition
  without FSDP (whose gathers need ranks): `convert_weight_keys(module.state_dict(), module)` and
  `unfuse_moe_params` from the verl release (requirements-frameworks.txt), which name the experts one
  by one as a checkpoint does.
- OpenRLHF: `self.actor` is the release's `Actor`, its `.model` DeepSpeed's engine, of which only
  `.module` (the wrapped model) is read; `deepspeed.zero.GatheredParameters` stands in with ZeRO-3's
  contract: each parameter holds nothing until gathered, and its full tensor is zeroed and freed when
  the context ends (ZeRO-3 reuses that memory), so a tensor not copied while gathered would push zeros.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from service.client import LogprobdError, WeightPusher
from service.client.push_sources import gathered_parameters, push_from_ranks
from tests.support import models, releases
from tests.support.pushing import ADMIN, BODY, Replicas, score, version
from tests.support.reference import check_reply

DOCS = Path(__file__).resolve().parents[2] / "docs" / "client.md"


def snippet(name: str) -> str:
    """The code block after `<!-- push: name -->` in docs/client.md."""
    found = re.search(rf"<!-- push: {name} -->\n```python\n(.*?)\n```", DOCS.read_text(), re.DOTALL)
    assert found is not None, name
    return found.group(1)


@contextlib.contextmanager
def one_rank_trainer() -> Iterator[None]:
    """This process as the trainer's only rank (the snippets ask dist.get_rank())."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


@functools.cache
def verl_helpers() -> tuple[Any, Any]:
    """verl.utils.model.convert_weight_keys and verl.workers.engine.fsdp.utils.unfuse_moe_params."""
    import torch.distributed.device_mesh  # noqa: F401 (torch's lazy modules, loaded before the releases')

    bare = ("verl", "verl.utils", "verl.workers", "verl.workers.engine", "verl.workers.engine.fsdp")
    with releases.importing(stand_ins=("tensordict",), bare=bare):
        from verl.utils.model import convert_weight_keys  # type: ignore[import-not-found]
        from verl.workers.engine.fsdp.utils import unfuse_moe_params  # type: ignore[import-not-found]
    return convert_weight_keys, unfuse_moe_params


class VerlEngine:
    """FSDPEngine.get_per_tensor_param's steps on a whole module: state_dict, convert_weight_keys,
    unfuse_moe_params (verl's own functions)."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def get_per_tensor_param(self) -> tuple[Iterator[tuple[str, torch.Tensor]], None]:
        convert_weight_keys, unfuse_moe_params = verl_helpers()
        params = convert_weight_keys(self.module.state_dict(), self.module)
        per_tensor = ((name, param) for name, param in params.items())
        return unfuse_moe_params(per_tensor, self.module.config.model_type), None


class Engine(torch.nn.Module):
    """DeepSpeedEngine, as far as the snippet reads it: a module whose `.module` is the wrapped model."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


class Zero3:
    """ZeRO-3's parameters: empty until gathered; on leaving the context the full tensor is zeroed
    and dropped. `module()` is the `deepspeed` module the snippet imports."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.full = {id(p): p.data for p in model.parameters()}
        self.gathered = 0
        for p in model.parameters():
            p.data = torch.empty(0)

    @contextlib.contextmanager
    def gather(self, params: list[Any], enabled: bool = True) -> Iterator[None]:
        assert enabled
        for p in params:
            p.data = self.full[id(p)].clone()
        self.gathered += len(params)
        yield
        for p in params:
            p.data.zero_()
            p.data = torch.empty(0)

    def module(self) -> types.ModuleType:
        deepspeed = types.ModuleType("deepspeed")
        deepspeed.zero = SimpleNamespace(GatheredParameters=self.gather)  # type: ignore[attr-defined]
        return deepspeed


def test_verl_pushes_its_per_tensor_params_as_the_docs_show(push_replicas: Replicas) -> None:
    model = models.build("qwen3_moe", seed=81)
    names = [name for name, _ in VerlEngine(model).get_per_tensor_param()[0]]
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names  # unfused, a checkpoint's names
    worker = SimpleNamespace(actor=SimpleNamespace(engine=VerlEngine(model)))
    namespace = {"self": worker, "REPLICAS": [push_replicas.main], "ADMIN_KEY": ADMIN, "global_steps": 7}
    with one_rank_trainer():
        try:
            exec(snippet("verl"), namespace)
            exec(snippet("verl"), {**namespace, "global_steps": 8})  # the next step: the same group
        finally:
            worker.pusher.close()
    assert version(push_replicas.main) == "step-8"
    check_reply(score(push_replicas.main), BODY, model)


def test_openrlhf_pushes_its_gathered_parameters_as_the_docs_show(
    push_replicas: Replicas, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = models.build("qwen3_moe", seed=91)
    want = copy.deepcopy(model)
    actor = releases.openrlhf_actor()(model)
    zero3 = Zero3(actor.model)
    actor.model = Engine(actor.model)
    monkeypatch.setitem(sys.modules, "deepspeed", zero3.module())
    strategy = SimpleNamespace(args=SimpleNamespace(ds=SimpleNamespace(zero_stage=3)))
    count = len(list(want.parameters()))
    with one_rank_trainer():
        other_rank = SimpleNamespace(actor=actor, strategy=strategy, pusher=None)  # reads through
        exec(snippet("openrlhf"), {"self": other_rank, "global_step": 5})
        assert zero3.gathered == count
        rank0 = SimpleNamespace(actor=actor, strategy=strategy)
        namespace = {"self": rank0, "REPLICAS": [push_replicas.main], "ADMIN_KEY": ADMIN, "global_step": 5}
        try:
            exec(snippet("openrlhf"), namespace)
        finally:
            rank0.pusher.close()
    assert zero3.gathered == 2 * count
    assert all(p.numel() == 0 for p in model.parameters())  # every one released after its gather
    assert version(push_replicas.main) == "step-5"
    check_reply(score(push_replicas.main), BODY, want)


def test_a_failed_push_still_reads_the_source_through(push_replicas: Replicas) -> None:
    """Rank 0's push is refused at its first bucket; it reads every remaining tensor (the other ranks'
    gathers need it to) before raising; the replica keeps its version."""
    model = models.build("qwen3_moe", seed=95)
    before = version(push_replicas.main)
    embed = model.get_input_embeddings().weight  # the first tensor: a bucket of its own, refused
    zero3 = Zero3(model)
    zero3.full[id(embed)] = torch.ones(models.VOCAB + 1, models.COMMON["hidden_size"])
    refused = re.escape("model.embed_tokens.weight: shape [97, 64]")
    pusher = WeightPusher(push_replicas.main, admin_key=ADMIN, backend="gloo", bucket_bytes=1 << 10)
    with pusher, pytest.raises(LogprobdError, match=refused):
        push_from_ranks(pusher, gathered_parameters(model, zero3.gather), version="refused")
    assert zero3.gathered == len(list(model.parameters()))
    assert version(push_replicas.main) == before
