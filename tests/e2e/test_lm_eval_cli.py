"""lm-evaluation-harness' command line, exactly as docs/api.md prints it, against a real `python -m
service serve` (the `teacher_server` fixture): the served URL, model name and tokenizer put in, and a local
multiple-choice task (lm_eval_task/: a YAML and a JSON lines file, read offline) in place of
hellaswag. Every choice's log-likelihood lm-eval reports is the float64 reference's sum over the
choice's tokens, its is-greedy flag the reference's argmax, and the accuracy it prints follows.

lm-eval's command line and what it imports are requirements-lm-eval.txt, installed by `make install`
into $(VENV)/lm-eval; `lm_eval` runs as `python -m lm_eval` of this venv with that on its path.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support import ROOT
from tests.support.teacher import TOLERANCE, Reference, save_tokenizer

LM_EVAL = Path(sys.prefix) / "lm-eval"
TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "logprobd_tiny"


def documented_command() -> list[str]:
    """The console block under docs/api.md's 'lm-evaluation-harness against logprobd', as argv."""
    section = (ROOT / "docs" / "api.md").read_text().split("### lm-evaluation-harness against logprobd\n")[1]
    block = re.search(r"```console\n\$ (.*?)\n```", section, re.DOTALL)
    assert block is not None, "no console block in the lm-evaluation-harness section"
    return shlex.split(block.group(1).replace("\\\n", " "))


def local(command: list[str], served: str, tokenizer: Path, output: Path) -> list[str]:
    """The documented command pointed at this server and the local task; nothing else changed."""
    assert command[0] == "lm_eval"
    args = command[1:]
    at = args.index("--tasks") + 1
    assert args[at] == "hellaswag"
    args[at] = TASK
    at = args.index("--model_args") + 1
    model_args = dict(pair.split("=", 1) for pair in args[at].split(","))
    model_args["base_url"] = served + urlsplit(model_args["base_url"]).path
    model_args["model"] = "teacher"  # the name GET /v1/models reports: the directory's
    model_args["tokenizer"] = str(tokenizer)
    args[at] = ",".join(f"{key}={value}" for key, value in model_args.items())
    extra = ["--include_path", str(TASK_DIR), "--output_path", str(output), "--log_samples"]
    return [sys.executable, "-m", "lm_eval", *args, *extra]


def ids(text: str) -> list[int]:
    """The word-level tokenizer's ids (save_tokenizer): `w17` is 17."""
    return [int(word[1:]) for word in text.split()]


def expected(reference: Reference, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The continuation's log-likelihood after the context, and whether each token is the argmax."""
    lp = reference.logprobs(context + continuation)
    rows = [len(context) + j - 1 for j in range(len(continuation))]  # row t - 1 predicts token t
    pairs = list(zip(rows, continuation, strict=True))
    total = sum(lp[row, token].item() for row, token in pairs)
    return total, all(int(lp[row].argmax()) == token for row, token in pairs)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The teacher's tokenizer alone: in the checkpoint's directory, AutoTokenizer would read its
    config.json's qwen2 and build Qwen2's byte-level BPE over the vocabulary, which has no merges."""
    directory = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(directory)
    return directory


def test_the_documented_lm_eval_command_scores_a_task(
    teacher_server: str, teacher_reference: Reference, tokenizer_dir: Path, tmp_path: Path
) -> None:
    if not (LM_EVAL / "lm_eval").is_dir():
        raise RuntimeError(f"lm-eval's command line is not installed in {LM_EVAL}: run `make install`")
    command = local(documented_command(), teacher_server, tokenizer_dir, tmp_path / "out")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(LM_EVAL), os.environ.get("PYTHONPATH", "")) if p),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    (samples_file,) = (tmp_path / "out").rglob(f"samples_{TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    documents = [json.loads(line) for line in (TASK_DIR / f"{TASK}.jsonl").read_text().splitlines()]
    assert [s["doc"] for s in sorted(samples, key=lambda s: s["doc_id"])] == documents
    correct = []
    for sample in samples:
        doc = sample["doc"]
        scores = []
        for choice, ((loglikelihood, greedy), *_) in zip(doc["choices"], sample["resps"], strict=True):
            want, argmax = expected(teacher_reference, ids(doc["context"]), ids(choice))
            tolerance = TOLERANCE * len(ids(choice))
            assert math.isclose(float(loglikelihood), want, abs_tol=tolerance), (doc, choice)
            assert greedy == str(argmax)
            scores.append(want)
        correct.append(float(max(range(len(scores)), key=scores.__getitem__) == doc["label"]))
        assert sample["acc"] == correct[-1]
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"][TASK]
    assert results["acc,none"] == pytest.approx(sum(correct) / len(correct))
    assert f"|{TASK}|" in done.stdout.replace(" ", "")  # the results table
