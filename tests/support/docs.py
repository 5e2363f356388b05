"""docs/hooks.py, the documentation site's MkDocs hooks (it is not a package), loaded as a module."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.support import ROOT


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as mkdocs loads a hook (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module
