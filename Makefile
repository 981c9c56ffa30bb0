# Every target sets up .venv itself. TORCH pins the wheel: 2.13.0 is a CPU build from local disk on
# our CPU machines and the CUDA build from PyPI on a GPU machine.
PY ?= python3
VENV := .venv
TORCH ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=

$(VENV)/.installed: pyproject.toml
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/pip install -q "$(TORCH)"
	$(VENV)/bin/pip install -q -e '.[test]'
	@touch $@

.PHONY: setup serve test test-slow test-all bench lint
setup: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/swaserve serve $(ARGS)

# The suite in two tiers (docs/testing.md): `test` is the fast tier, what to run while working; `test-slow`
# the tests marked slow (tests/slow_tier.txt and @pytest.mark.slow); `test-all` both, one after the other,
# as CI does (.ci/run).
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -rs -m "not slow" $(PYTEST_ARGS)

test-slow: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -rs -m slow $(PYTEST_ARGS)

test-all: test test-slow

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed
	$(VENV)/bin/swaserve bench serve $(ARGS)
