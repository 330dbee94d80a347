# syntax=docker/dockerfile:1
# crossdraft verifier: gRPC model server holding the target model (python -m verifier).
#
# Build from the repository root (the build context must be the root: .dockerignore lives there):
#   docker build -f docker/verifier.Dockerfile -t crossdraft-verifier:cuda .
#   docker build -f docker/verifier.Dockerfile --build-arg VARIANT=cpu -t crossdraft-verifier:cpu .
# or all three images at once: docker/build.sh
#
# Base image choice: python:3.11-slim (Debian bookworm) for both variants, not nvidia/cuda.
# The default torch==2.13.0 wheel on PyPI is CUDA-enabled and carries its own CUDA runtime,
# cuBLAS, cuDNN and NCCL as nvidia-* wheels; the only thing it needs from the host is the
# driver, which the NVIDIA Container Toolkit mounts in (`docker run --gpus all`). An
# nvidia/cuda *runtime* base would ship a second copy of the same libraries and would need
# Python 3.11 installed on top of Ubuntu (deadsnakes or a source build). One base for both
# variants also keeps the CPU and CUDA images identical apart from the torch wheel.
#   VARIANT=cuda (default): torch from PyPI (CUDA build); CROSSDRAFT_DEVICE defaults to cuda.
#   VARIANT=cpu:            torch from https://download.pytorch.org/whl/cpu (no CUDA libs,
#                           ~1 GB instead of ~5 GB); CROSSDRAFT_DEVICE defaults to cpu.
# TORCH_INDEX_URL overrides the index torch comes from (a mirror, another CUDA build, ...).
# BASE_IMAGE: pin a digest in production (python:3.11.14-slim-bookworm@sha256:...).
#
# Models are not baked in: they are cached under CROSSDRAFT_HOME=/models (a volume). Pull once:
#   docker run --rm -v crossdraft-models:/models --entrypoint crossdraft IMAGE models pull qwen2.5-coder-1.5b
# then run:
#   docker run --gpus all -v crossdraft-models:/models -e CROSSDRAFT_MODEL=qwen2.5-coder-1.5b -p 50062:50062 IMAGE

ARG BASE_IMAGE=python:3.11.14-slim-bookworm

# ---------------------------------------------------------------------------------------------
# builder: a venv at /opt/venv with the locked dependencies, the generated gRPC stubs and the
# crossdraft package itself (non-editable), so the runtime stage needs no source tree.
# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS builder

ARG VARIANT=cuda
ARG TORCH_INDEX_URL=""
ARG TORCH_VERSION=2.13.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src

# 1) torch first, from the index that decides CPU or CUDA; its CUDA deps (nvidia-*, triton)
#    come with it. 2) the lock: everything else at its exact pin (torch is already satisfied:
#    2.13.0+cpu matches ==2.13.0). Wheels only: nothing in the lock needs a compiler.
COPY requirements.lock ./
RUN case "${VARIANT}" in \
      cpu)  default_index=https://download.pytorch.org/whl/cpu ;; \
      cuda) default_index=https://pypi.org/simple ;; \
      *)    echo "VARIANT must be cpu or cuda, got '${VARIANT}'" >&2; exit 1 ;; \
    esac \
 && pip install --only-binary=:all: --index-url "${TORCH_INDEX_URL:-$default_index}" "torch==${TORCH_VERSION}" \
 && pip install --only-binary=:all: -r requirements.lock

# The package, with its gRPC stubs generated here (crossdraft/v1 is not in the repository and
# .dockerignore keeps any local copy out), then installed into the venv (not editable).
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY crossdraft/ crossdraft/
COPY drafter/ drafter/
COPY verifier/ verifier/
COPY gateway/ gateway/
RUN mkdir -p crossdraft/v1 \
 && python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/crossdraft/v1/*.proto \
 && echo '# Generated from proto/crossdraft/v1 at image build; do not edit.' > crossdraft/v1/__init__.py \
 && pip install --no-deps --no-build-isolation . \
 && python -I -c "from crossdraft.v1 import drafter_pb2_grpc, verifier_pb2_grpc, gateway_pb2; import verifier.server"

# ---------------------------------------------------------------------------------------------
# runtime: the venv only, as a fixed non-root user.
# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime

ARG VARIANT=cuda
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown

LABEL org.opencontainers.image.title="crossdraft-verifier" \
      org.opencontainers.image.description="crossdraft verifier: gRPC server of the target model for lossless cross-vocabulary speculative decoding (${VARIANT})" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="python:3.11.14-slim-bookworm"

# Fixed UID/GID 10001 so a host directory or volume for /models can be chowned to match.
RUN groupadd --system --gid 10001 crossdraft \
 && useradd --system --uid 10001 --gid crossdraft --home-dir /home/crossdraft --create-home \
      --shell /usr/sbin/nologin crossdraft \
 && mkdir -p /models \
 && chown crossdraft:crossdraft /models

COPY --from=builder /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CROSSDRAFT_HOME=/models \
    CROSSDRAFT_DEVICE=${VARIANT} \
    CROSSDRAFT_HOST=0.0.0.0 \
    CROSSDRAFT_PORT=50062 \
    CROSSDRAFT_METRICS_PORT=9092 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

VOLUME ["/models"]
WORKDIR /home/crossdraft
USER 10001:10001

# 50062: gRPC (verifier service, grpc.health.v1, reflection); 9092: Prometheus metrics (CROSSDRAFT_METRICS_PORT; 0 turns it off).
EXPOSE 50062 9092

# grpc.health.v1 says SERVING only once the model is loaded, which can take minutes for a big
# model (failures during the start period do not count). Checks 127.0.0.1, so keep
# CROSSDRAFT_HOST at 0.0.0.0 (or a loopback-reachable address). Imports no torch: fast.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-m", "crossdraft.serving.healthcheck", "verifier"]

ENTRYPOINT ["python", "-m", "verifier"]
CMD []
