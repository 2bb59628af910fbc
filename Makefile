# Set-up path. torch is installed first and pinned: an unpinned torch pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed
# Everything with Python in it; folders a checkout does not have are skipped.
LINTED := $(wildcard src tests scripts benchmarks examples)

.PHONY: demo lint test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(VENV)/bin/python pyproject.toml
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet $(TORCH_PIN)
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dsv4 generate

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)

test: lint
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV)
