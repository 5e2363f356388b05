"""A decoder's forward over one packed row: transformers' own or the fused one (fused.py), its CUDA graphs
(graphs.py), and the transformers decoder's MLP row chunks (mlp_chunks.py)."""
