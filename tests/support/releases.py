"""The RL trainers' own scoring code, imported from their PyPI releases (requirements-frameworks.txt).

`make install` puts the releases in `<venv>/frameworks` with `pip install --no-deps --target`; that
folder is on `sys.path` only while one of the loaders below imports from it, so nothing else in the
test session sees those packages. What a release imports but cannot have here (deepspeed, flash-attn,
peft, tensordict: a GPU, a cluster or a compiled extension for another torch; pandas, datasets,
pyarrow: TRL's data pipeline) is a stand-in module for that import only, and every stand-in is gone
from `sys.modules` once the import is done. A stand-in class raises when it is instantiated, so a
stand-in that the scoring path reached would fail the test; the maths is the release's own code.

A package whose `__init__` pulls a cluster in (verl's imports ray, OpenRLHF's deepspeed) is entered
bare: its modules load from the installed files, its `__init__` does not run. After the import,
none of the releases' modules stays in `sys.modules` (transformers would take accelerate for
installed); the functions keep the modules they were loaded with.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers.utils.import_utils

FRAMEWORKS = Path(sys.prefix) / "frameworks"


class StandIn:
    """A name from a stand-in module: usable as a base class or an annotation, never instantiated."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{type(self).__module__}.{type(self).__name__} is a test stand-in and was called")


class StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (StandIn,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every import under the named top-level packages with a `StandInModule`."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _availability_checks() -> list[Any]:
    """transformers' cached `is_<package>_available` checks: one answered while a stand-in stands
    would stay wrong for the session, so those filled during an import are cleared after it."""
    members = vars(transformers.utils.import_utils).values()
    return [f for f in members if callable(f) and hasattr(f, "cache_info") and hasattr(f, "cache_clear")]


@contextmanager
def importing(stand_ins: Sequence[str] = (), bare: Sequence[str] = ()) -> Iterator[None]:
    """Import from the installed releases, with `stand_ins` (top-level names) standing in and the
    packages `bare` entered without running their `__init__`."""
    if not (FRAMEWORKS / "openrlhf").is_dir():
        raise RuntimeError(f"the framework releases are not installed in {FRAMEWORKS}: run `make install`")
    finder = _StandIns(stand_ins)
    checks = {f: f.cache_info().currsize for f in _availability_checks()}
    before = set(sys.modules)
    sys.path.append(str(FRAMEWORKS))
    sys.meta_path.insert(0, finder)
    try:
        for name in bare:
            spec = importlib.machinery.PathFinder.find_spec(name, _bare_path(name.rpartition(".")[0]))
            if spec is None or spec.submodule_search_locations is None:
                raise RuntimeError(f"{name} is not a package in {FRAMEWORKS}")
            package = types.ModuleType(name)
            package.__path__ = list(spec.submodule_search_locations)
            sys.modules[name] = package
        yield
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(FRAMEWORKS))
        for name in set(sys.modules) - before:
            if name.partition(".")[0] in finder.names or _installed_here(sys.modules[name]):
                del sys.modules[name]
        for check, size in checks.items():
            if check.cache_info().currsize != size:
                check.cache_clear()


def _installed_here(module: types.ModuleType) -> bool:
    """Imported from the releases' folder: once out of `sys.modules`, transformers' availability
    checks (`importlib.util.find_spec`) cannot see it; the functions loaded keep their modules."""
    paths: list[Any] = [getattr(module, "__file__", None) or ""]
    package: Any = getattr(module, "__path__", None)
    # a package's search path, not what a module that makes attributes up on access gives (torch's ops)
    if isinstance(package, list | tuple) or type(package).__name__ == "_NamespacePath":
        paths += list(package)
    return any(str(path).startswith(str(FRAMEWORKS)) for path in paths)


def _bare_path(parent: str) -> list[str] | None:
    return [str(FRAMEWORKS)] if not parent else list(sys.modules[parent].__path__)


@functools.cache
def openrlhf_actor() -> type:
    """openrlhf.models.actor.Actor."""
    with importing(stand_ins=("deepspeed", "flash_attn", "peft"), bare=("openrlhf", "openrlhf.models")):
        from openrlhf.models.actor import Actor  # type: ignore[import-not-found]
    return Actor  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Verl:
    logprobs_from_logits: Callable[..., Any]  # verl.utils.torch_functional
    entropy_from_logits: Callable[..., Any]
    no_padding_2_padding: Callable[..., Any]  # verl.workers.utils.padding


@functools.cache
def verl() -> Verl:
    bare = ("verl", "verl.utils", "verl.workers", "verl.workers.utils")
    with importing(stand_ins=("tensordict",), bare=bare):
        from verl.utils import torch_functional  # type: ignore[import-not-found]
        from verl.workers.utils import padding  # type: ignore[import-not-found]
    return Verl(
        logprobs_from_logits=torch_functional.logprobs_from_logits,
        entropy_from_logits=torch_functional.entropy_from_logits,
        no_padding_2_padding=padding.no_padding_2_padding,
    )


@dataclass(frozen=True)
class Trl:
    add_fused_lm_head: Callable[..., Any]  # trl.trainer.utils
    per_token_logps_and_entropies: Callable[..., Any]  # GRPOTrainer._get_per_token_logps_and_entropies


@functools.cache
def trl() -> Trl:
    with importing(stand_ins=("pandas", "datasets", "pyarrow")):
        from trl.trainer.grpo_trainer import GRPOTrainer  # type: ignore[import-not-found]
        from trl.trainer.utils import add_fused_lm_head  # type: ignore[import-not-found]
    return Trl(
        add_fused_lm_head=add_fused_lm_head,
        per_token_logps_and_entropies=GRPOTrainer._get_per_token_logps_and_entropies,
    )


@contextmanager
def vllm_standing_in(version: str = "0.30.0") -> Iterator[None]:
    """TRL's releases with a stand-in `vllm` at `version` (TRL 1.16 supports 0.22 to 0.31): its
    VLLMClient checks that vLLM is importable on import and again when constructed, so construct it
    inside. Only the import stands in; the requests and the parsing are TRL's."""
    with importing(stand_ins=("vllm", "pandas", "datasets", "pyarrow")):
        module = StandInModule("vllm")
        module.__path__ = []
        module.__version__ = version  # type: ignore[attr-defined]
        module.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
        sys.modules["vllm"] = module
        yield


@functools.cache
def trl_server_distillation() -> Any:
    """trl.experimental.server_distillation's ServerDistillationTrainer, whose teacher is a server
    (its `teacher_client`, TRL's VLLMClient); TRL's experimental-API warning silenced."""
    with vllm_standing_in(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are importing from 'trl.experimental'")
        from trl.experimental.server_distillation.server_distillation_trainer import (  # type: ignore[import-not-found]
            ServerDistillationTrainer,
        )
    return ServerDistillationTrainer


def lm_eval_local_completions(**model_args: Any) -> Any:
    """lm-evaluation-harness' local-completions model (lm_eval.models.openai_completions.
    LocalCompletionsAPI), constructed while its releases are importable: it checks for aiohttp and
    tenacity when constructed."""
    with importing():
        from lm_eval.models.openai_completions import (  # type: ignore[import-not-found]
            LocalCompletionsAPI,
        )

        return LocalCompletionsAPI(**model_args)
