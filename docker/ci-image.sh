#!/usr/bin/env bash
# Builds the image from the production Dockerfile with buildah, without a Docker daemon or a registry,
# differing from production in build arguments only: a Debian 12 base made here with debootstrap
# (python3.11), the CPU torch 2.13.0 wheel, no GPU extras. tests/deploy/test_image_served.py then
# serves the demo model inside it and scores a request from outside (.ci/run does both).
#
#   bash docker/ci-image.sh            # prints the build's time and the image's size
#
# Environment: LOGPROBD_IMAGE (the tag built, localhost/logprobd:ci), LOGPROBD_CI_BASE (the base,
# made once with debootstrap when missing), LOGPROBD_WHEELS (a directory holding
# torch-2.13.0+cpu-cp311-*.whl, /opt/wheels: PyPI serves torch's CUDA build only, the CPU build comes
# from torch's own index, which CI cannot reach), LOGPROBD_CA_BUNDLE (the CA certificates pip in the
# build trusts, this machine's). Needs root (buildah's chroot isolation, debootstrap).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${LOGPROBD_IMAGE:-localhost/logprobd:ci}
BASE=${LOGPROBD_CI_BASE:-localhost/logprobd-ci-base:bookworm}
WHEELS=${LOGPROBD_WHEELS:-/opt/wheels}
MIRROR=${LOGPROBD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${LOGPROBD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -q && apt-get install -y -q --no-install-recommends buildah debootstrap
    else
        echo "buildah/debootstrap missing and cannot apt-get install them (not root, or no apt)" >&2
        exit 1
    fi
fi
if ! compgen -G "$WHEELS/torch-2.13.0+cpu-cp311-*.whl" >/dev/null; then
    echo "no torch-2.13.0+cpu-cp311 wheel in $WHEELS (set LOGPROBD_WHEELS)" >&2
    exit 1
fi

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    started=$(date +%s)
    debootstrap --variant=minbase bookworm "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" \
        || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
    # This machine's CA bundle, for pip in the build's RUN steps (its HTTPS may pass a proxy whose CA
    # only the host trusts; pip's own bundle, certifi, does not know it): the base's PIP_CERT.
    mkdir -p "$work/rootfs/usr/local/share/ci-ca"
    cp "$CA_BUNDLE" "$work/rootfs/usr/local/share/ci-ca/ca-certificates.crt"
    tar -C "$work/rootfs" --numeric-owner -cf "$work/rootfs.tar" .
    container=$(buildah from scratch)
    buildah add --quiet "$container" "$work/rootfs.tar" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env PIP_CERT=/usr/local/share/ci-ca/ca-certificates.crt \
        --cmd /bin/bash "$container"
    buildah commit --quiet "$container" "$BASE" >/dev/null
    buildah rm "$container" >/dev/null
    echo "base $BASE (debootstrap, Debian 12 minbase) made in $(($(date +%s) - started)) s"
fi

# RUN steps run chrooted on the host's network: apt-get reaches Debian, pip reaches PyPI. The wheel
# directory is mounted read-only into every RUN step, not copied into the image. The docker format
# keeps the HEALTHCHECK (OCI has none).
buildah rmi "$IMAGE" >/dev/null 2>&1 || true  # the last build's, so runs on one machine do not pile up
started=$(date +%s)
buildah bud --isolation chroot --format docker --quiet --tag "$IMAGE" \
    --volume "$WHEELS:/wheels:ro" \
    --build-arg BASE_IMAGE="$BASE" \
    --build-arg PYTHON=python3.11 \
    --build-arg TORCH=torch==2.13.0+cpu \
    --build-arg TORCH_FIND_LINKS=/wheels \
    --build-arg EXTRAS= \
    . >/dev/null
echo "image $IMAGE built in $(($(date +%s) - started)) s," \
    "$(buildah images --format '{{.Size}}' "$IMAGE" | head -1) (uncompressed)"
