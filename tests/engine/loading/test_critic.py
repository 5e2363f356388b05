"""Loading a critic says what matters: no transformers report calling its value head UNEXPECTED."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from service.engine.loading.critic import load_critic
from tests.support import critics


@pytest.mark.parametrize("fmt", ["trl", "openrlhf", "token_classification"])
def test_a_critic_loads_without_transformers_calling_its_heads_unexpected(
    fmt: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    directory = critics.save(fmt, tmp_path / fmt)
    with caplog.at_level(logging.INFO, logger="service.engine.loading.critic"):
        critic = load_critic(directory, torch.float32, torch.device("cpu"), "sdpa")
    assert critic.head.format == fmt
    printed = capfd.readouterr()
    assert "UNEXPECTED" not in printed.err + printed.out
    assert "UNEXPECTED" not in caplog.text
    loaded = [r.getMessage() for r in caplog.records if r.name == "service.engine.loading.critic"]
    assert any("value head) from" in m and "not in it" in m for m in loaded)
    assert not any(r.levelno >= logging.WARNING for r in caplog.records if r.name.startswith("service"))
