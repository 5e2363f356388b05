"""The real clients against a real `python -m service serve`, equal to the float64 reference.

- TRL 1.16.0's `VLLMClient(base_url).get_sequence_logprobs(sequences, prompt_lengths, top_logprobs,
  temperature)` (trl/generation/vllm_client.py): GET /health, GET /v1/models, POST /v1/completions
  with `prompt_logprobs`; its dict against the reference's top-K of log_softmax(logits / T) over the
  completion positions. A stand-in `vllm` module answers TRL's import check only.
- lm-evaluation-harness 0.4.13's `LocalCompletionsAPI` (local-completions, tokenized_requests) and
  its `_loglikelihood_tokens` on token-id (context, continuation) requests: `echo`, `logprobs` 1,
  `max_tokens` 1, temperature 0; its (sum of log-probs, is greedy) against the reference at T = 1.
- service.client.teacher.get_sequence_logprobs (POST /logprobs in compact frames) returns the dict TRL's
  client does, at the edges too; its TeacherClient in a TRL distillation trainer's `teacher_client`
  gives that trainer's own code the same tensors as TRL's VLLMClient.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from service.client.errors import LogprobdError
from service.client.teacher import TeacherClient, get_sequence_logprobs
from tests.support import releases
from tests.support.teacher import MAX_TOP, TOLERANCE, Reference, top_k

PROMPTS = [[1, 17, 23, 5, 9, 41], [1, 60, 2, 33]]
COMPLETIONS = [[[12, 13, 77, 4], [12, 90], [50, 51, 52, 53, 54]], [[8, 8, 8], [70, 3, 2]]]


def batch() -> tuple[list[list[int]], list[int]]:
    """Each prompt's G completions, sent together as TRL's trainers send them."""
    sequences, prompt_lengths = [], []
    for prompt, group in zip(PROMPTS, COMPLETIONS, strict=True):
        for completion in group:
            sequences.append(prompt + completion)
            prompt_lengths.append(len(prompt))
    return sequences, prompt_lengths


def expected_trl(
    reference: Reference, sequences: list[list[int]], lengths: list[int], k: int, t: float
) -> Any:
    """TRL's dict from the reference: per completion position, the top K (ties: the lower id) and the
    token's own."""
    out: dict[str, list[Any]] = {
        "logprobs": [],
        "logprob_token_ids": [],
        "actual_logprobs": [],
        "actual_token_ids": [],
    }
    for sequence, length in zip(sequences, lengths, strict=True):
        lp = reference.logprobs(sequence, t)
        rows = range(length - 1, len(sequence) - 1)  # row p-1 is the distribution of token p
        top = [top_k(lp[r], k) for r in rows]
        out["logprobs"].append([[lp[r, v].item() for v in ids] for r, ids in zip(rows, top, strict=True)])
        out["logprob_token_ids"].append(top)
        out["actual_logprobs"].append([[lp[p - 1, sequence[p]].item()] for p in range(length, len(sequence))])
        out["actual_token_ids"].append([[sequence[p]] for p in range(length, len(sequence))])
    return out


def assert_trl_dicts(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> None:
    assert list(got) == ["logprobs", "logprob_token_ids", "actual_logprobs", "actual_token_ids"]
    assert got["logprob_token_ids"] == want["logprob_token_ids"]
    assert got["actual_token_ids"] == want["actual_token_ids"]
    for key in ("logprobs", "actual_logprobs"):
        flat_got = [v for seq in got[key] for pos in seq for v in pos]
        flat_want = [v for seq in want[key] for pos in seq for v in pos]
        assert len(flat_got) == len(flat_want)
        torch.testing.assert_close(
            torch.tensor(flat_got, dtype=torch.float64),
            torch.tensor(flat_want, dtype=torch.float64),
            atol=TOLERANCE,
            rtol=0,
        )


@pytest.mark.parametrize(("k", "temperature"), [(5, 1.0), (1, 0.7), (3, 1.6)])
def test_trl_get_sequence_logprobs(
    teacher_server: str, teacher_reference: Reference, k: int, temperature: float
) -> None:
    with releases.vllm_standing_in():
        from trl.generation.vllm_client import VLLMClient  # type: ignore[import-not-found]

        client = VLLMClient(base_url=teacher_server, connection_timeout=60.0)
    assert client.model == "teacher"  # from GET /v1/models
    sequences, lengths = batch()
    got = client.get_sequence_logprobs(sequences, lengths, top_logprobs=k, temperature=temperature)
    assert_trl_dicts(got, expected_trl(teacher_reference, sequences, lengths, k, temperature))
    chunked = client.get_sequence_logprobs(
        sequences, lengths, top_logprobs=k, temperature=temperature, chunk_size=2
    )
    assert_trl_dicts(chunked, got)


def trls_own(url: str, sequences: list[list[int]], lengths: list[int], k: int, t: float) -> Any:
    """TRL's VLLMClient.get_sequence_logprobs against the server at `url`."""
    with releases.vllm_standing_in():
        from trl.generation.vllm_client import VLLMClient

        client = VLLMClient(base_url=url, connection_timeout=60.0)
    return client.get_sequence_logprobs(sequences, lengths, top_logprobs=k, temperature=t)


def test_teacher_helper_returns_trls_dict(teacher_server: str, teacher_reference: Reference) -> None:
    sequences, lengths = batch()
    got = get_sequence_logprobs(teacher_server, sequences, lengths, top_logprobs=4, temperature=0.8)
    assert_trl_dicts(got, expected_trl(teacher_reference, sequences, lengths, 4, 0.8))
    assert all(len(pos) == 4 for seq in got["logprobs"] for pos in seq)
    # the same dict as TRL's own call, every value equal: the helper's come as float32 frames from
    # /logprobs, TRL's as JSON from /v1/completions (the server in float32 here)
    assert got == trls_own(teacher_server, sequences, lengths, 4, 0.8)


def test_teacher_helper_at_the_edges_as_trl(teacher_server: str) -> None:
    # prompt length 0 (the first position has no distribution), a sequence all prompt (no completion
    # positions), a sequence of one token
    sequences = [[1, 17, 23, 5], [1, 60, 2], [9], [4, 4, 4, 4, 4]]
    lengths = [0, 3, 1, 2]
    got = get_sequence_logprobs(teacher_server, sequences, lengths, top_logprobs=3, temperature=1.3)
    trl = trls_own(teacher_server, sequences, lengths, 3, 1.3)
    assert [len(x) for x in got["logprobs"]] == [4, 0, 0, 3]
    assert got["logprobs"][0][0] == [-math.inf] * 3  # position 0: padding
    assert got == trl
    with pytest.raises(ValueError, match="prompt lengths"):
        get_sequence_logprobs(teacher_server, sequences[:1], [-1])
    # a K past the server's --max-top-logprobs: the server's 422, naming the field, and nothing left
    # in flight (the helper's requests go two at a time)
    many = [[1, 17, 23, 5]] * 12
    with pytest.raises(LogprobdError) as refused:
        get_sequence_logprobs(teacher_server, many, [1] * 12, top_logprobs=MAX_TOP + 1)
    assert refused.value.status == 422
    assert refused.value.field == "top_logprobs"


def test_trls_distillation_trainer_takes_the_teacher_client_in_place_of_vllms(teacher_server: str) -> None:
    """TRL's ServerDistillationTrainer fetches its teacher's log-probs through `self.teacher_client`
    (TRL's VLLMClient): with logprobd's TeacherClient there instead, its own code gives the same
    tensors. Completions of 4, 2 and 5 tokens after a 6-token prompt, right-padded."""
    trainer = releases.trl_server_distillation()
    prompt, group = PROMPTS[0], COMPLETIONS[0]
    width = len(prompt) + max(len(c) for c in group)
    rows = [prompt + c + [0] * (width - len(prompt) - len(c)) for c in group]
    real = [[1] * (len(prompt) + len(c)) + [0] * (width - len(prompt) - len(c)) for c in group]
    labels = torch.tensor(rows)
    labels[torch.tensor(real) == 0] = -100
    labels[:, : len(prompt)] = -100
    inputs = {"input_ids": torch.tensor(rows), "attention_mask": torch.tensor(real), "labels": labels}

    def teacher(client: Any) -> dict[str, torch.Tensor]:
        state = SimpleNamespace(teacher_client=client, loss_top_k=5, temperature=0.9)
        got: dict[str, torch.Tensor] = trainer._get_teacher_token_logprobs_from_server(
            state, inputs, len(prompt)
        )
        return got

    with releases.vllm_standing_in():
        from trl.generation.vllm_client import VLLMClient

        vllms = VLLMClient(base_url=teacher_server, connection_timeout=60.0)
    with TeacherClient(teacher_server) as ours:
        want, got = teacher(vllms), teacher(ours)
    assert list(got) == ["actual_logprobs", "topk_logprobs", "topk_token_ids"]
    assert got["topk_token_ids"].shape == (3, 5, 5)
    for key in got:
        assert torch.equal(got[key], want[key]), key


def test_lm_eval_local_completions_loglikelihood(
    teacher_server: str, teacher_reference: Reference, teacher_dir: Path
) -> None:
    api = releases.lm_eval_local_completions(
        base_url=f"{teacher_server}/v1/completions",
        model="teacher",
        tokenizer_backend="huggingface",
        tokenizer=str(teacher_dir),
        tokenized_requests=True,
        batch_size=3,
        max_length=256,
    )
    context = [1, 17, 23, 5]
    lp = teacher_reference.logprobs(context)
    greedy = [int(lp[-1].argmax())]  # a continuation the model would pick: is_greedy
    lp = teacher_reference.logprobs(context + greedy)
    greedy.append(int(lp[-1].argmax()))
    requests = [
        (None, context, [9, 41, 12]),
        (None, [1, 60], [2, 33, 8, 8]),
        (None, context, greedy),
        (None, [1], [50]),
    ]
    results = api._loglikelihood_tokens(requests, disable_tqdm=True)
    assert len(results) == len(requests)
    for (_, ctx, cont), (total, is_greedy) in zip(requests, results, strict=True):
        lp = teacher_reference.logprobs(ctx + cont)
        want = sum(lp[len(ctx) + j - 1, token].item() for j, token in enumerate(cont))
        argmax = all(int(lp[len(ctx) + j - 1].argmax()) == token for j, token in enumerate(cont))
        assert math.isclose(total, want, abs_tol=TOLERANCE * len(cont)), (ctx, cont, total, want)
        assert is_greedy == argmax
    assert results[2][1] is True
