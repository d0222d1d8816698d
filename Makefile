# Two entry points: `make demo` and `make test`. Both create .venv and install what they need.
# The schedule workbench needs no torch; the runtime demo and the test suite install the CPU build
# of torch 2.13 (from this machine's wheel cache; the package itself accepts a range of versions).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.installed-base
TORCH := $(VENV)/.installed-torch
TESTING := $(VENV)/.installed-test
DEMO_DIR ?= demo-output

.PHONY: install demo test check bench clean browser

$(BASE): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $(BASE)

$(TORCH): $(BASE)
	$(PY) -m pip install -q torch==2.13.0
	touch $(TORCH)

$(TESTING): $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $(TESTING)

install: $(BASE)

demo: $(TORCH)
	$(VENV)/bin/pipeloom demo --out $(DEMO_DIR)
	@echo "== training a small GPT with ZB-V on 2 CPU ranks (gloo), timed per action =="
	rm -rf $(DEMO_DIR)/trace
	$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt.py \
		--schedule zbv --steps 6 --trace $(DEMO_DIR)/trace
	$(VENV)/bin/pipeloom trace $(DEMO_DIR)/trace -o $(DEMO_DIR)/measured-trace.json --png $(DEMO_DIR)/measured.png

# The playground's browser tests drive Debian's chromium; install it when missing and apt-get is usable
# (root). Without it those tests skip and say why.
browser:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
		|| echo "could not install chromium: the browser tests will skip"; fi

# Lint and type-check (configuration in pyproject.toml, reasons in docs/development.md). mypy keeps its
# cache in .mypy_cache: the first run takes about a minute (torch's stubs), later ones a few seconds.
check: $(TESTING)
	$(VENV)/bin/ruff check pipeloom tests benchmarks
	$(VENV)/bin/mypy

test: $(TESTING) browser check
	PIPELOOM_REQUIRE_TORCH=1 $(PY) -m pytest -q -n 2 --dist worksteal

bench: $(BASE)
	$(PY) benchmarks/scale.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) build *.egg-info
