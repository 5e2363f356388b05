"""Chosen once at build time and carried by the decoder: how a GEMM over tokens runs (gemm.py) and how a
row-parallel projection adds into the residual (sums.py)."""
