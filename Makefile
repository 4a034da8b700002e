# Two commands do all the set-up on a fresh machine:
#   make bench   creates .venv, installs kvtier, runs the default benchmark (kvtier bench e2e, ~1 min)
#   make test    creates .venv, installs kvtier with its test extras and vLLM (test-only, for the
#                connector tests), runs the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt
# NIXL logs INFO lines to stdout; keep them out of CLI output and test logs.
export NIXL_LOG_LEVEL ?= WARN
# UCX's InfiniBand modules load the system's libibverbs beside the one NIXL bundles, and a
# process with a NIXL agent then crashes at exit (no RDMA device here; see README).
export UCX_MODULES ?= ^ib*

.PHONY: bench test lint install clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $@

# vLLM is a test-only dependency, never part of kvtier's install. Its own requirements want a
# CUDA torch and a certifi the registry does not serve, so it goes in without the resolver,
# with the pure-Python packages its offloading connector imports pinned in a file.
$(VENV)/.installed-vllm: $(VENV)/.installed tests/vllm/requirements.txt
	$(PIP) --no-deps vllm==0.33.0
	$(PIP) --no-deps -r tests/vllm/requirements.txt
	touch $@

install: $(VENV)/.installed

bench: $(VENV)/.installed
	$(VENV)/bin/kvtier bench e2e

test: $(VENV)/.installed-vllm
	KVTIER_REQUIRE_VLLM=1 $(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
