"""New weights for a running server: one update at a time per served model, staged off the engine
thread and applied by the batcher between micro-batches (updates.py), replicas that follow a version
file on shared storage (follow.py), and weights a trainer pushes in SGLang's protocol (push.py, its
groups in groups.py); a reload and a push exclude each other (gate.py)."""
