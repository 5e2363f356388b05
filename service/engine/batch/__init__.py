"""A micro-batch on the device: SequenceJobs packed into one row (packing.py), and the keys and values a long
sequence keeps between its chunks (kv_store.py)."""
