"""The ScoringEngine over packed micro-batches: engine.py launches and collects; build.py, models.py,
inflight.py, reload.py, self_check.py and memory.py do one job each."""
