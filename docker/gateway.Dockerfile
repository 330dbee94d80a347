# syntax=docker/dockerfile:1
# crossdraft gateway: REST (:8000) + gRPC (:50051) front door (python -m gateway). Holds no
# model, only the two tokenizers; sessions live in Redis (REDIS_URL).
#
# Build from the repository root (the build context must be the root: .dockerignore lives there):
#   docker build -f docker/gateway.Dockerfile -t crossdraft-gateway .
# or all three images at once: docker/build.sh
#
# Slim and CPU-only: the gateway never runs a model, but it imports torch transitively
# (gateway.core -> crossdraft.decoding, whose sampling math runs on torch tensors), so
# it gets the CPU torch wheel (~200 MB) instead of the CUDA one (GBs of nvidia-* wheels).
# BASE_IMAGE: pin a digest in production (python:3.11.14-slim-bookworm@sha256:...).
#
# Run (tokenizers are read from the same model cache as the model servers, CROSSDRAFT_HOME=/models):
#   docker run -v crossdraft-models:/models -e CROSSDRAFT_VERIFIER=verifier:50062 \
#     -e CROSSDRAFT_DRAFTER=drafter:50061 -e REDIS_URL=redis://redis:6379/0 -p 8000:8000 -p 50051:50051 IMAGE

ARG BASE_IMAGE=python:3.11.14-slim-bookworm

# ---------------------------------------------------------------------------------------------
# builder: a venv at /opt/venv with the locked dependencies, the generated gRPC stubs and the
# crossdraft package itself (non-editable), so the runtime stage needs no source tree.
# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS builder

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src

# 1) torch first, from the CPU index; 2) the lock: everything else at its exact pin (torch is
#    already satisfied: 2.13.0+cpu matches ==2.13.0). Wheels only: nothing needs a compiler.
COPY requirements.lock ./
RUN pip install --only-binary=:all: --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
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
 && python -I -c "from crossdraft.v1 import gateway_pb2, gateway_pb2_grpc, drafter_pb2_grpc, verifier_pb2_grpc; import gateway.server, gateway.service, gateway.rest"

# ---------------------------------------------------------------------------------------------
# runtime: the venv only, as a fixed non-root user.
# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime

ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown

LABEL org.opencontainers.image.title="crossdraft-gateway" \
      org.opencontainers.image.description="crossdraft gateway: REST + gRPC front door for lossless cross-vocabulary speculative decoding" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="python:3.11.14-slim-bookworm"

# Fixed UID/GID 10001 (the same as the model servers) so they can share the /models volume.
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
    CROSSDRAFT_HOST=0.0.0.0 \
    CROSSDRAFT_HTTP_PORT=8000 \
    CROSSDRAFT_GRPC_PORT=50051

VOLUME ["/models"]
WORKDIR /home/crossdraft
USER 10001:10001

# 8000: REST (/v1/..., /healthz, /readyz, /metrics); 50051: gRPC (GatewayService, health, reflection).
EXPOSE 8000 50051

# Readiness, not bare liveness: /readyz is 200 once the gateway reached the model servers,
# loaded the tokenizers and pings Redis (503 before), so `depends_on: condition:
# service_healthy` waits for a gateway that can serve. The start period covers the wait for the
# model servers (CROSSDRAFT_CONNECT_TIMEOUT_S, 900 s by default). No curl in the image: urllib
# (proxies bypassed: the check is for this container, whatever HTTP_PROXY says).
HEALTHCHECK --interval=30s --timeout=10s --start-period=900s --retries=3 \
    CMD ["python", "-m", "crossdraft.serving.healthcheck", "gateway"]

ENTRYPOINT ["python", "-m", "gateway"]
CMD []
