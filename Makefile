# The two quick-start commands: `make demo` runs the default experiment,
# `make test` runs the test suite. Each creates .venv on first use.
# `make test-slow` runs the tests marked slow (CI runs both).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $(STAMP)

.PHONY: demo test test-slow
demo: $(STAMP)
	$(VENV)/bin/python launch.py

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 -m "not slow" tests

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 -m slow tests
