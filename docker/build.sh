#!/usr/bin/env bash
# Build the three crossdraft images (drafter, verifier, gateway) with `docker build`.
#
# Usage: docker/build.sh [--require-docker] [--push] [--dry-run] [-h|--help]
#   --require-docker  exit 3 (instead of 0) when no Docker engine is reachable
#   --push            docker push the images after building them
#   --dry-run         print the docker commands instead of running them (needs no engine)
#
# Environment:
#   REGISTRY           name prefix, e.g. ghcr.io/acme (default: none, plain local names)
#   TAG                image tag (default: the version in pyproject.toml)
#   VARIANT            cpu | cuda (default: cuda): the torch build in the drafter and verifier
#                      images, whose tags get a -$VARIANT suffix; the gateway is always CPU-only
#   TORCH_INDEX_URL    index for torch in the drafter/verifier builds (default: by VARIANT)
#   BASE_IMAGE         base image of all three (default: the one pinned in the Dockerfiles)
#   DOCKER             the docker CLI (default: docker)
#   DOCKER_BUILD_ARGS  extra arguments for every docker build (split on whitespace)
#
# Exit status: 0 built (or skipped: no Docker engine), 2 bad usage, 3 no engine with
# --require-docker, else the failing docker command's status.
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

require_docker=0
push=0
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --require-docker) require_docker=1 ;;
    --push) push=1 ;;
    --dry-run) dry_run=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "build.sh: unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done

VARIANT="${VARIANT:-cuda}"
case "$VARIANT" in
  cpu | cuda) ;;
  *) echo "build.sh: VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 2 ;;
esac
DOCKER="${DOCKER:-docker}"

# The engine check comes first and uses shell builtins only (works with a bare PATH).
engine_ok() {
  command -v "$DOCKER" >/dev/null 2>&1 || return 1
  if command -v timeout >/dev/null 2>&1; then
    timeout 30 "$DOCKER" info >/dev/null 2>&1
  else
    "$DOCKER" info >/dev/null 2>&1
  fi
}
if [ "$dry_run" = 0 ] && ! engine_ok; then
  if ! command -v "$DOCKER" >/dev/null 2>&1; then
    why="the '$DOCKER' CLI is not on PATH"
  else
    why="'$DOCKER info' failed: no engine is reachable (is the daemon running, DOCKER_HOST set?)"
  fi
  if [ "$require_docker" = 1 ]; then
    echo "build.sh: no Docker engine: $why; images NOT built (--require-docker)" >&2
    exit 3
  fi
  echo "build.sh: no Docker engine: skipped ($why). Nothing was built."
  exit 0
fi

# Repository root = the build context (its .dockerignore applies).
here="${BASH_SOURCE[0]%/*}"
[ "$here" = "${BASH_SOURCE[0]}" ] && here=.
root="$(cd "$here/.." && pwd)"
cd "$root"

if [ -z "${TAG:-}" ]; then
  TAG="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)"
  TAG="${TAG:-dev}"
fi
prefix="${REGISTRY:+${REGISTRY%/}/}"
revision="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
created="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

common=(--build-arg "VERSION=$TAG" --build-arg "REVISION=$revision" --build-arg "CREATED=$created")
[ -n "${BASE_IMAGE:-}" ] && common+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
extra=()
# Word splitting is the point here: DOCKER_BUILD_ARGS holds several arguments.
# shellcheck disable=SC2206
[ -n "${DOCKER_BUILD_ARGS:-}" ] && extra=($DOCKER_BUILD_ARGS)

run() {
  if [ "$dry_run" = 1 ]; then
    printf '%q ' "$@"
    printf '\n'
  else
    "$@"
  fi
}

images=()
build() { # build NAME IMAGE [BUILD ARGS...]
  local name="$1" image="$2"
  shift 2
  echo "==> $image (docker/$name.Dockerfile)"
  run "$DOCKER" build -f "docker/$name.Dockerfile" -t "$image" "${common[@]}" "$@" ${extra[@]+"${extra[@]}"} .
  images+=("$image")
}

server_args=(--build-arg "VARIANT=$VARIANT")
[ -n "${TORCH_INDEX_URL:-}" ] && server_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")

build drafter "${prefix}crossdraft-drafter:${TAG}-${VARIANT}" "${server_args[@]}"
build verifier "${prefix}crossdraft-verifier:${TAG}-${VARIANT}" "${server_args[@]}"
build gateway "${prefix}crossdraft-gateway:${TAG}"

if [ "$push" = 1 ]; then
  for image in "${images[@]}"; do
    run "$DOCKER" push "$image"
  done
fi
if [ "$dry_run" = 1 ]; then
  echo "dry run, would build: ${images[*]}"
else
  echo "built: ${images[*]}"
fi
