"""Tensor parallel's plan and collectives: which slice of each tensor a rank holds and the all-reduces
that join the parts (sharding.py), and the vocabulary-parallel embedding and lm_head (vocab_layers.py).
The ranks' processes are tensor_parallel/'s."""
