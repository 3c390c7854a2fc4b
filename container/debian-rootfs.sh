#!/usr/bin/env bash
# A Debian bookworm root file system with python3, imported as the image BASE, for hosts that reach Debian's
# package mirrors but no image registry:
#   sudo container/debian-rootfs.sh && podman build -f container/Containerfile --build-arg BASE=localhost/debian-python:bookworm .
set -euo pipefail
TAG=${1:-localhost/debian-python:bookworm}
OUT=$(mktemp -d)/rootfs.tar
mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$OUT"
podman import "$OUT" "$TAG"
echo "imported $TAG"
