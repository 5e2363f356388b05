# logprobd on a CUDA GPU. From the repository root:
#   docker build -t logprobd:0.1.0 .
#   docker run --gpus all --shm-size 8g -p 8000:8000 -v /srv/models:/models:ro \
#     -e LOGPROBD_MODEL=/models/Qwen2.5-7B-Instruct logprobd:0.1.0
# Settings are LOGPROBD_* environment variables (README, Configuration); the models are a
# read-only volume at /models. The host needs an NVIDIA driver for CUDA 13.0 (>= 580) and the
# NVIDIA container toolkit.
#
# The default is the stack BENCHMARKS.md measured: torch 2.11 (CUDA 13.0), transformers 5.17 and the
# `hopper` extra (flash-attn 4 + quack-kernels on nvidia-cutlass-dsl[cu13]), every pin in
# docker/constraints.txt, everything from PyPI. For GPUs before Ampere, or flash-attn 2 instead:
#   docker build --build-arg EXTRAS=fused --build-arg FLASH_ATTN_VERSION=2.8.3 -t logprobd:fa2 .
# (flash-attn 2 from PyPI is an sdist: it compiles against the installed torch, which needs nvcc, i.e.
# BASE_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04, and about an hour.)

#
# CI builds this same file with other build arguments only (docker/ci-image.sh, docs/deploying.md): a
# Debian base made locally, its python3.11, the CPU torch 2.13.0 wheel and no GPU extras:
#   --build-arg BASE_IMAGE=localhost/logprobd-ci-base:bookworm --build-arg PYTHON=python3.11 \
#   --build-arg TORCH=torch==2.13.0+cpu --build-arg TORCH_FIND_LINKS=/wheels --build-arg EXTRAS=

# torch's CUDA wheels bring their own CUDA libraries; the runtime image is the CUDA userland
# the NVIDIA container toolkit expects, on Ubuntu 24.04, whose python3 is 3.12.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# The base's Python (its apt packages PYTHON, PYTHON-venv and PYTHON-dev make the venv).
ARG PYTHON=python3.12
# The torch requirement, under docker/constraints.txt; PyPI's torch 2.11.0 for Linux x86_64 is the
# CUDA 13.0 build. TORCH_FIND_LINKS: a directory of wheels (mounted into the build) pip also searches
# for it, e.g. a CPU build that PyPI does not serve; "" searches PyPI alone.
ARG TORCH=torch==2.11.0
ARG TORCH_FIND_LINKS=""

# Extras of pyproject.toml (comma-separated): `fused` is liger-kernel, `hopper` flash-attn 4 and
# quack-kernels (their nvidia-cutlass-dsl with its CUDA 13 libraries, the `cu13` extra).
ARG EXTRAS=fused,hopper
# "" leaves flash-attn 2 out (attention=auto then takes flash-attn 4, else torch's varlen kernel).
ARG FLASH_ATTN_VERSION=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# Python (3.12 by default). gcc, libc headers and Python headers: Triton (under liger-kernel's fused
# kernels) compiles its small launcher modules with the system C compiler the first time it runs.
# Ubuntu's security updates replace these versions in place, so they are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "${PYTHON}" "${PYTHON}-venv" "${PYTHON}-dev" gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && "${PYTHON}" -m venv /opt/venv \
    && groupadd --system --gid 10001 logprobd \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/logprobd \
        --shell /usr/sbin/nologin logprobd \
    && mkdir /models

WORKDIR /opt/logprobd
COPY docker/constraints.txt ./

# The heaviest layer first, so it is cached across every change below it.
# The installed torch joins the constraints: no later step may replace it.
RUN pip install -c constraints.txt ${TORCH_FIND_LINKS:+--find-links "${TORCH_FIND_LINKS}"} "${TORCH}" \
    && python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >> constraints.txt

# Its own layer, after torch's: changing it does not download torch again. --no-build-isolation:
# flash-attn 2 builds against the torch installed above.
# hadolint ignore=DL3059
RUN if [ -n "${FLASH_ATTN_VERSION}" ]; then \
        pip install --no-build-isolation -c constraints.txt "flash-attn==${FLASH_ATTN_VERSION}"; \
    fi

# The service's dependencies (the client's and the `server` extra) and the extras named in EXTRAS, from
# pyproject.toml alone, so this layer is rebuilt only when they change, not on every source edit. An
# extra's `logprobd[server]` (each GPU extra brings the server) is left out: `server` is listed anyway.
COPY pyproject.toml ./
RUN EXTRAS="${EXTRAS}" python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = ['server'] + [e for e in os.environ['EXTRAS'].split(',') if e]; \
print('\n'.join(p['dependencies'] + [r for e in extras for r in p['optional-dependencies'][e] \
if not r.startswith(p['name'] + '[')] \
+ (['nvidia-cutlass-dsl[cu13]'] if 'hopper' in extras else [])))" > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# setup.py compiles the native JSON row reader (service/wire/_jsonrows.c) with the gcc above; the image
# must have it (the service would fall back to a slower reader), so the build checks that it loads
# from site-packages (-P: not from ./service, the copied source).
COPY README.md setup.py ./
COPY service ./service
RUN pip install --no-deps . && rm -rf build ./*.egg-info \
    && python -P -c "from service.wire import _jsonrows"

# Caches on /tmp: under Kubernetes the root filesystem is read-only and /tmp an emptyDir.
# HF_HUB_OFFLINE: models come from the mounted volume, never from a hub.
# The compiled kernels (Triton's, quack's, flash-attn 4's, whose cache is off unless turned on) under
# /tmp/kernels: a restart of the container finds them, and the Helm chart can mount a volume there
# that every pod shares (compileCache), so a new pod skips the compiles too (BENCHMARKS.md, start-up).
ENV HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    TRITON_CACHE_DIR=/tmp/kernels/triton \
    QUACK_CACHE_DIR=/tmp/kernels/quack \
    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 \
    FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/kernels/flash_attn_cute \
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
