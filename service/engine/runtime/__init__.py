"""What this host can run: optional kernel packages (packages.py) and Triton, imported on first use
(triton_jit.py); host arrays onto the device without a wait (copies.py)."""
