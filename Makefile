# Two commands do all the set-up on a fresh machine:
#   make bench   creates .venv, installs kvtier, runs the default benchmark
#   make test    creates .venv, installs kvtier with its test extras, runs the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt
# NIXL logs INFO lines to stdout; keep them out of CLI output and test logs.
export NIXL_LOG_LEVEL ?= WARN

.PHONY: bench test lint install clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $@

install: $(VENV)/.installed

bench: $(VENV)/.installed
	$(VENV)/bin/kvtier bench copy

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
