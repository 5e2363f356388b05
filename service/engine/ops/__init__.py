"""The decoder's kernels: packed attention (attention.py), RMSNorm / RoPE / SwiGLU (elementwise.py), the
gate|up projection (gate_up.py), a fused RoPE (rope.py) and liger-kernel's patches (liger.py)."""
