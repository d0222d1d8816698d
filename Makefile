# Two entry points: `make demo` and `make test`. Both create .venv and install what they need.
# The schedule workbench needs no torch; the test suite installs the CPU build of torch 2.13
# (from this machine's wheel cache) to check our CSV export against torch's own parser and validator.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.installed-base
TESTING := $(VENV)/.installed-test
DEMO_DIR ?= demo-output

.PHONY: install demo test bench clean

$(BASE): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $(BASE)

$(TESTING): $(BASE)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(TESTING)

install: $(BASE)

demo: $(BASE)
	$(VENV)/bin/pipeloom demo --out $(DEMO_DIR)

test: $(TESTING)
	PIPELOOM_REQUIRE_TORCH=1 $(PY) -m pytest -q -n 2

bench: $(BASE)
	$(PY) benchmarks/scale.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) build *.egg-info
