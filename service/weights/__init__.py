"""New weights for a running server: one update at a time per served model, staged off the engine
thread and applied by the batcher between micro-batches (updates.py), and replicas that follow a
version file on shared storage (follow.py)."""
