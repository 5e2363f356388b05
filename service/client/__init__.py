"""logprobd's Python client: `Client` and `AsyncClient` over one server or a set of replicas.

Imports httpx and nothing of the server, so a trainer can use it beside its own stack. The torch
adapters for OpenRLHF, verl and TRL live in `service.client.adapters`, which imports torch;
`WeightPusher` and `push_weights` (a trainer's weights pushed over NCCL or gloo) import torch when
they run.
"""

from service.client._async import AsyncClient
from service.client._sync import Client
from service.client.errors import LogprobdConnectionError, LogprobdError
from service.client.push import PushResult, WeightPusher, push_weights
from service.client.replicas import resolve_replicas
from service.client.retry import RetryPolicy
from service.client.wire import RolloutStats, Scores, Usage, group_prompts

__all__ = [
    "AsyncClient",
    "Client",
    "LogprobdConnectionError",
    "LogprobdError",
    "PushResult",
    "RetryPolicy",
    "RolloutStats",
    "Scores",
    "Usage",
    "WeightPusher",
    "group_prompts",
    "push_weights",
    "resolve_replicas",
]
