"""Tensor parallel: which slice of each tensor a rank holds and its collectives (sharding.py), and the
ranks' processes, rank 0 serving and the others following (ranks.py)."""
