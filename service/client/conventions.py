"""Where a trainer's releases disagree, which convention the installed release follows.

Read at call time from the installed distribution's version (`importlib.metadata`), never at import;
a trainer that is not installed gets its current convention.
"""

from __future__ import annotations

import importlib.metadata
import re

# OpenRLHF 0.11.1 divides the logits by the temperature before its entropy (`Actor.forward`), so that
# the entropy and the log-probs describe the same tempered policy; 0.11.0 and older took the entropy
# of the raw logits.
OPENRLHF_TEMPERED_ENTROPY_SINCE = (0, 11, 1)


def openrlhf_tempered_entropy() -> bool:
    """True when the installed OpenRLHF takes its entropy of `logits / T` (>= 0.11.1, or not
    installed), False when it takes it of the raw logits (<= 0.11.0)."""
    try:
        installed = importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return True
    release = release_of(installed)
    return release is None or release >= OPENRLHF_TEMPERED_ENTROPY_SINCE


def release_of(version: str) -> tuple[int, ...] | None:
    """The release numbers a version string starts with: "0.11.0.post1" -> (0, 11, 0); None if none."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    return None if found is None else tuple(int(part) for part in found.group().split("."))
