# Both targets build .venv/ from nothing with Python 3.11 (and reuse it when pyproject.toml is unchanged).
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.k3load-installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "k3load needs Python 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/k3load demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
