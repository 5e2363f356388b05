"""The prefix cache's device side: each served model's pool of cached blocks (pool.py: keys and values of
every layer, final hidden states) and, per micro-batch, the rows it reads from and writes to them
(row_slots.py), laid out from the torch-free plan the batcher made with the index (core/prefix_cache.py)."""
