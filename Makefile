# Two entry points for a fresh machine (each creates .venv on first use):
#   make demo   install (no torch), then replay the built-in scenario under every scheduler and search capacity at SLA
#   make test   install with the executor and test tools, then run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CORE := $(VENV)/.installed-core
DEV := $(VENV)/.installed-dev

.PHONY: demo test bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(CORE): pyproject.toml constraints-dev.txt | $(VENV)/bin/python
	$(PY) -m pip install -q -c constraints-dev.txt -e .
	touch $(CORE)

$(DEV): pyproject.toml constraints-dev.txt | $(VENV)/bin/python
	$(PY) -m pip install -q -c constraints-dev.txt -e '.[dev]'
	touch $(DEV) $(CORE)

demo: $(CORE)
	$(VENV)/bin/slicesched replay --capacity --force

test: $(DEV)
	$(PY) -m pytest -n 2 --dist loadgroup -p no:cacheprovider

bench: $(DEV)
	for b in benchmarks/[!_]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
