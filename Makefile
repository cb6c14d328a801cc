# nri-accel developer entry points. Everything runs from a local virtualenv (.venv)
# that the first target creates; nothing is installed system-wide.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: all setup demo test test-fast fuzz e2e bench soak proto lint clean

all: test

## setup: create .venv and install nri-accel with its dev tools (idempotent)
setup: $(STAMP)

# editable_mode=compat: the checkout goes on sys.path as a plain path entry, as an
# installed package's directory does; setuptools' default editable import hook costs
# every process start some 15 ms (it imports pathlib, urllib, ...), which `run`'s
# start-up figures (bench_roundtrip.py) would otherwise carry.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' \
	  --config-settings editable_mode=compat
	touch $@

## demo: the built-in 8-GPU demo node and pods through the real daemon (no GPU needed)
demo: $(STAMP)
	$(BIN)/nri-accel demo

## test: the whole test suite
test: $(STAMP)
	$(BIN)/python -m pytest -q

## test-fast: the suite without the slow end-to-end tests
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

## fuzz: the fuzz targets (tests/fuzz) with the long profile: FUZZ_EXAMPLES random examples
# per target, failures kept in .hypothesis/, statistics printed (`make test` runs them short)
FUZZ_EXAMPLES ?= 10000
FUZZ_ARGS ?=
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz NRI_ACCEL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) \
	  $(BIN)/python -m pytest -q tests/fuzz --hypothesis-show-statistics $(FUZZ_ARGS)

## e2e: the end-to-end test against a real containerd (fetches Debian's containerd + runc)
# A failed fetch fails the target (an empty NRI_ACCEL_E2E_BIN would only skip the test).
E2E_CACHE ?= $(HOME)/.cache/nri-accel-e2e
e2e: $(STAMP)
	bin="$$(tests/e2e/fetch-containerd.sh $(E2E_CACHE))" && \
	  NRI_ACCEL_E2E_BIN="$$bin" $(BIN)/python -m pytest -q tests/e2e

## bench: every benchmark under tests/bench/, each prints its figures
bench: $(STAMP)
	@set -e; for b in tests/bench/bench_*.py; do \
	  echo "== $$b"; $(BIN)/python $$b; done

## soak: 100,000 CreateContainer/RemoveContainer through the real daemon; prints RSS,
## fds, asyncio tasks and latency every 10,000 (a few minutes)
soak: $(STAMP)
	$(BIN)/python tests/soak/soak.py

## proto: regenerate the committed protobuf/gRPC code from api/*.proto
proto: $(STAMP)
	$(BIN)/python api/generate.py

## lint: ruff over the project
lint: $(STAMP)
	$(BIN)/ruff check nri_accel tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
