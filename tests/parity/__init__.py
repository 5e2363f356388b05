"""The whole service, in process, against the independent references of tests/support/ (per-sequence
float32, float64 distributions, critics): every architecture and layout, PPO outputs, long and
shared sequences, batch invariance, tensor parallel, concurrency, routed experts. The modules marked
`parity` run again on cuda in each dtype under `make test-gpu`."""
