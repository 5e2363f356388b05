"""A micro-batch on the device: SequenceJobs packed into one row (packing.py), the keys and values a long
sequence keeps between its chunks and the shared-prefix key gather (kv_store.py, key_gather.py), what its
rows ask beyond the log-prob (asks.py), and its MoE routes (route_buffers.py lays out device_routes.py's)."""
