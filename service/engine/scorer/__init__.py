"""The ScoringEngine over packed micro-batches: engine.py launches and collects; build.py, models.py,
inflight.py, weight_update.py, self_check.py and memory.py do one job each."""
