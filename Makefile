# pagedserve developer commands. `make run` and `make test` work on a fresh machine.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed
TINY_MODEL ?= models/tiny-llama
MODEL ?= $(TINY_MODEL)

.PHONY: setup proto test lint run tiny-model bench gpu-check images clean

setup: $(STAMP) proto

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

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
	  proto/pagedserve/v1/*.proto

test: setup
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check .

tiny-model: setup
	test -f $(TINY_MODEL)/config.json || $(PY) -m executor_svc.tiny_model --out $(TINY_MODEL)

run: setup tiny-model
	$(PY) -m pagedserve.demo --model $(MODEL)

bench: setup
	$(PY) -m benchmarks.run_all --quick

gpu-check: setup
	$(PY) -m cupy_kernels.gpu_check

clean:
	rm -rf .venv models .pytest_cache .hypothesis
