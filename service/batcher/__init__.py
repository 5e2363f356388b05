"""Bounded FIFO of scored sequences, merged into packed micro-batches under a token budget.

Between the routes and the engine: `Batcher.submit` takes a request's normalised `SequenceJob`s and
answers a `Scored` (their `SequenceScores` in order, the weights versions they ran on); the engine
sees only micro-batches (`ScoringEngine.launch`), chunks of long sequences and weight swaps
(`apply`, between micro-batches). `policy.py` decides what forms each micro-batch (synchronous);
`runner.py` moves the work between the queue, the engine thread and the requests' futures.
"""

from service.batcher.policy import LOOKAHEAD, sharing
from service.batcher.runner import IN_FLIGHT, LAUNCH_HOLD_S, Applied, Batcher, Scored

__all__ = [
    "IN_FLIGHT",
    "LAUNCH_HOLD_S",
    "LOOKAHEAD",
    "Applied",
    "Batcher",
    "Scored",
    "sharing",
]
