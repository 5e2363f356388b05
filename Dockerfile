# logprobd on a CUDA GPU. From the repository root:
#   docker build -t logprobd:0.1.0 .
#   docker run --gpus all --shm-size 8g -p 8000:8000 -v /srv/models:/models:ro \
#     -e LOGPROBD_MODEL=/models/Qwen2.5-7B-Instruct logprobd:0.1.0
# Settings are LOGPROBD_* environment variables (README, Configuration); the models are a
# read-only volume at /models. The host needs an NVIDIA driver for CUDA 12.8 (>= 570) and the
# NVIDIA container toolkit.

# torch's CUDA wheels bring their own CUDA libraries; the runtime image is the CUDA userland
# the NVIDIA container toolkit expects, on Ubuntu 24.04, whose python3 is 3.12.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# torch, the CUDA build it comes from, and the flash-attn wheel built for that pair.
ARG TORCH_VERSION=2.8.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# flash-attn: its maintainers publish prebuilt wheels for each (CUDA major, torch minor, Python,
# C++11 ABI) on their GitHub release; `pip install flash-attn --no-build-isolation` looks for the
# same wheel, but falls back to compiling from source (nvcc, about an hour) when none matches. We
# install the prebuilt wheel by URL, so a torch/CUDA/Python mismatch fails the build at once.
# FLASH_ATTN_WHEEL_TAG must follow TORCH_VERSION; FLASH_ATTN_VERSION="" leaves flash-attn out (the
# service then uses torch's own varlen attention, which needs torch >= 2.10).
ARG FLASH_ATTN_VERSION=2.8.3
ARG FLASH_ATTN_WHEEL_TAG=cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# Python 3.12. gcc, libc headers and Python headers: Triton (under liger-kernel's fused kernels)
# compiles its small launcher modules with the system C compiler the first time it runs.
# Ubuntu's security updates replace these versions in place, so they are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv \
    && groupadd --system --gid 10001 logprobd \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/logprobd \
        --shell /usr/sbin/nologin logprobd \
    && mkdir /models

# The heaviest layer first, so it is cached across every change below it.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# Its own layer, after torch's: changing the wheel does not download torch again.
# hadolint ignore=DL3059
RUN if [ -n "${FLASH_ATTN_VERSION}" ]; then pip install \
    "https://github.com/Dao-AILab/flash-attention/releases/download/v${FLASH_ATTN_VERSION}/flash_attn-${FLASH_ATTN_VERSION}+${FLASH_ATTN_WHEEL_TAG}.whl"; \
    fi

# The service's dependencies and the extras named in EXTRAS (comma-separated; `fused` is liger-kernel,
# `hopper` flash-attn 4 and quack-kernels, measured on torch 2.11 + CUDA 13, not on this image's pair)
# from pyproject.toml alone, so this layer is rebuilt only when they change, not on every source edit.
ARG EXTRAS=fused
WORKDIR /opt/logprobd
COPY pyproject.toml ./
RUN EXTRAS="${EXTRAS}" python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = [e for e in os.environ['EXTRAS'].split(',') if e]; \
print('\n'.join(p['dependencies'] + [r for e in extras for r in p['optional-dependencies'][e]]))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY README.md ./
COPY service ./service
RUN pip install --no-deps . && rm -rf build ./*.egg-info

# Caches on /tmp: under Kubernetes the root filesystem is read-only and /tmp an emptyDir.
# HF_HUB_OFFLINE: models come from the mounted volume, never from a hub.
ENV HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    TRITON_CACHE_DIR=/tmp/triton \
    XDG_CACHE_HOME=/tmp/cache

USER 10001:10001
WORKDIR /home/logprobd
VOLUME ["/models"]
EXPOSE 8000

# 200 only once the model is loaded and warmed up (minutes for a large model); 503 while draining.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/ready', timeout=4)"]

ENTRYPOINT ["python", "-m", "service"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
