# crossdraft: every target installs what it needs by itself.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
STAMP    = $(VENV)/.installed
# models the tests use (pulled once into $CROSSDRAFT_HOME, default ~/.cache/crossdraft)
TEST_MODELS = smollm2-135m gemma3-270m qwen2.5-coder-0.5b
TARGET  ?= qwen2.5-coder-1.5b
DRAFTER ?= qwen2.5-coder-0.5b
PROMPT  ?= def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n
PYTEST_ARGS ?=

.PHONY: venv protos models run generate lint test test-fast coverage fuzz fuzz-grpc bench bench-smoke soak clean

$(STAMP): requirements.lock pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.lock
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# gRPC stubs from proto/ (generated, not committed): crossdraft/v1/*_pb2*.py
PROTOS = $(wildcard proto/crossdraft/v1/*.proto)
protos: crossdraft/v1/__init__.py
crossdraft/v1/__init__.py: $(PROTOS) | $(STAMP)
	mkdir -p crossdraft/v1
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	echo '# Generated from proto/crossdraft/v1 by make protos; do not edit.' > $@

venv: $(STAMP) protos

models: venv
	@for m in $(TEST_MODELS); do $(BIN)/crossdraft models pull $$m || exit 1; done

# The whole stack on the default models (Redis, drafter, verifier, gateway on localhost): sends one
# request, prints it with its stats, then serves REST on :$(HTTP_PORT) and gRPC on :$(GRPC_PORT) until Ctrl-C.
HTTP_PORT ?= 8000
GRPC_PORT ?= 50051
run: venv
	$(BIN)/crossdraft models pull $(TARGET)
	$(BIN)/crossdraft models pull $(DRAFTER)
	$(BIN)/crossdraft up --target $(TARGET) --drafter $(DRAFTER) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--demo-prompt "$$(printf '$(PROMPT)')" --demo-max-tokens 96 $(UP_ARGS)

# The same job in one process (no services): speculative decoding of a code prompt, with stats.
generate: venv
	$(BIN)/crossdraft generate --target $(TARGET) --drafter $(DRAFTER) \
		--prompt "$$(printf '$(PROMPT)')" --max-new-tokens 96

# ruff (rules in pyproject.toml); `make test` runs it first
lint: venv
	$(BIN)/ruff check .

# TEST_WORKERS pytest processes (pytest-xdist), each running whole files (their module fixtures, stacks and
# model loads stay in one process); 0 runs the suite in this process
TEST_WORKERS ?= 2
test: models lint
	$(BIN)/python -m pytest -q -ra --durations=20 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# the REST API fuzzed from its OpenAPI document with many more examples than `make test` uses
fuzz: venv
	CROSSDRAFT_FUZZ_EXAMPLES=$(or $(EXAMPLES),300) $(BIN)/python -m pytest -q -ra tests/e2e/test_openapi_fuzz.py

# every gRPC RPC (drafter, verifier, gateway) fuzzed with many more examples than `make test` uses, fresh
# random seeds each run; prints the answers by status code per RPC
fuzz-grpc: venv
	CROSSDRAFT_GRPC_FUZZ_EXAMPLES=$(or $(EXAMPLES),300) CROSSDRAFT_GRPC_FUZZ_RANDOM=1 \
		$(BIN)/python -m pytest -q -ra -rP tests/e2e/test_grpc_fuzz.py

# unit tests only (no real models)
test-fast: venv
	$(BIN)/python -m pytest -q -ra tests/unit $(PYTEST_ARGS)

# the whole suite under coverage (line + branch, service processes included); prints the table per package
# and writes .cache/coverage/coverage.json (compare two runs: scripts/coverage_table.py NEW --before OLD)
coverage: models
	rm -rf .cache/coverage && mkdir -p .cache/coverage
	$(BIN)/python -m pytest -q -ra --durations=20 --cov --cov-report= $(PYTEST_ARGS)
	$(BIN)/python -m coverage json -q -o .cache/coverage/coverage.json
	$(BIN)/python scripts/coverage_table.py .cache/coverage/coverage.json

bench: venv
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

# Quick check before any change to the decoding path (a few minutes): 2 prompts x 48 tokens, greedy,
# target-only vs each drafter side by side; prints the speedup ratios (results in .cache/bench/).
bench-smoke: venv
	@for m in $(TARGET) qwen2.5-coder-0.5b smollm2-135m gemma3-270m; do $(BIN)/crossdraft models pull $$m >/dev/null || exit 1; done
	$(BIN)/python benchmarks/bench.py --smoke --target $(TARGET) $(BENCH_ARGS)

# Soak test (not part of `make test` or CI): Redis, verifier, drafter and gateway on tiny models on
# 127.0.0.1 under 16 users for 10 minutes (streamed and plain requests, chat sessions, cancellations,
# bad requests, a drafter restart half-way); stops by itself and writes benchmarks/results/soak.json
# and soak.png. A short run: make soak SOAK_ARGS="--duration-s 60 --tag soak-smoke --out .cache/soak"
SOAK_ARGS ?=
soak: venv
	$(BIN)/python benchmarks/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
