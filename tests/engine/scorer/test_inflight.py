"""The micro-batch's host copy of its extras: top ids come to the host as int32 (narrowed before the
copy), one block per field for the whole micro-batch, and each job gets views of its own rows."""

from __future__ import annotations

import numpy as np
import torch

from service.core.jobs import SequenceJob
from service.engine.batch.asks import Extras
from service.engine.heads.base import ExtraScores
from service.engine.scorer.inflight import HOST_ID_DTYPE, InFlight, extra_host

VOCAB = 151_936


def _job(actions: int, k: int) -> SequenceJob:
    return SequenceJob(
        tokens=np.arange(actions + 1, dtype=np.int64),
        actions=np.arange(1, actions + 1, dtype=np.int64),
        temperature=1.0,
        return_entropy=False,
        top_logprobs=k,
    )


def test_top_ids_reach_the_host_as_int32_and_each_job_gets_views_of_its_rows() -> None:
    counts, k = [3, 0, 4], 5
    rows = sum(counts)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (rows, k), generator=gen, dtype=torch.int64)
    logprobs = -torch.rand(rows, k, generator=gen)
    scores = ExtraScores(ids, logprobs, torch.arange(1, rows + 1), None, None, None)
    asked = Extras(rows=np.arange(rows), index=torch.arange(rows), top=k)
    host = extra_host(torch.device("cpu"), asked, scores)
    assert host is not None
    assert host.top_ids is not None
    assert host.top_ids.dtype == HOST_ID_DTYPE == torch.int32
    jobs = [_job(n, k) for n in counts]
    flight = InFlight(
        jobs=jobs,
        actions_per_sequence=counts,
        logprobs=torch.zeros(rows),
        entropy=None,
        ref_logprobs=None,
        values=None,
        done=None,
        extras=host,
    )
    got = flight.result()
    starts = np.cumsum([0, *counts[:-1]])
    for s, n, first in zip(got, counts, starts.tolist(), strict=True):
        assert s.top_ids is not None
        assert s.top_logprobs is not None
        assert (s.top_ids.dtype, s.top_ids.shape) == (np.dtype(np.int32), (n, k))
        assert s.top_ids.tolist() == ids[first : first + n].tolist()
        assert s.top_logprobs.tolist() == logprobs[first : first + n].tolist()
        if n:
            assert np.shares_memory(s.top_ids, host.top_ids.numpy())  # a view, not a copy
