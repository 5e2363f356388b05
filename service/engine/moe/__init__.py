"""The fused decoder's mixture-of-experts layer (layer.py) and its Triton routing, grouping, counting and
combining kernels with torch twins (kernels.py)."""
