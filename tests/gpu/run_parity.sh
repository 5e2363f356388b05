#!/usr/bin/env bash
# The parity suite on a CUDA host, in bf16, fp16 and float32, plus the GPU kernel twins and tensor
# parallel over two ranks sharing the GPU (gloo).
# The service side runs on cuda with the packed varlen backend (flash-attn if importable, else
# torch's varlen_attn); the reference is always the model's own eager forward in float32.
# Writes parity-<dtype>.json (largest |Δ| per architecture) into ${OUT:-.}.
#
# Usage, on the GPU host from the repository root (with fastapi & co on PYTHONPATH):
#   bash tests/gpu/run_parity.sh
set -uo pipefail
out=${OUT:-.}
python=${PYTHON:-python3}
"$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
status=0
for dtype in bfloat16 float16 float32; do
  echo "== parity on cuda, $dtype"
  LOGPROBD_TEST_DEVICE=cuda LOGPROBD_TEST_DTYPE=$dtype LOGPROBD_TEST_REPORT="$out/parity-$dtype.json" \
    "$python" -m pytest tests/parity/test_parity.py tests/parity/test_ppo.py tests/engine tests/parity/test_tensor_parallel.py -q -W ignore::UserWarning -p no:cacheprovider || status=1
  cat "$out/parity-$dtype.json" 2>/dev/null
done
exit $status
