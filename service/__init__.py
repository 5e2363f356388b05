"""logprobd: per-token log-prob scoring for RL trainers, over HTTP."""

__version__ = "0.1.0"
