"""The head on the action rows only: one score_actions contract (base.py) and its implementations side
by side: chunked.py (with fused_kernel.py's Triton pass) and vocab_parallel.py."""
