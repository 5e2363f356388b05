"""The fused decoder's mixture-of-experts layer (layer.py): the architecture's routing rule
(routing_rule.py), where each token's slots go (dispatch.py, replaying given routes: replay.py), the
experts' grouped GEMMs (grouped_gemm.py) and the Triton routing, grouping, counting and combining
kernels with torch twins (kernels.py); transformers' own sparse blocks in batch-invariant mode
(transformers_blocks.py)."""
