# Two commands do all the set-up on a fresh machine:
#   make bench   creates .venv, installs kvtier (with vLLM and matplotlib), runs the default benchmark
#                (kvtier bench e2e, a few minutes): prints the tables, writes bench-results/e2e.json, plots/
#   make test    creates .venv, installs kvtier with its test, bench and mooncake extras (and
#                libibverbs1, which the Mooncake binaries link, with apt-get when it is missing) and
#                vLLM (test-only, for the connector tests), runs the whole suite
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

# vLLM is a test-only dependency, never part of kvtier's install. Its own requirements want a
# CUDA torch and a certifi the registry does not serve, so it goes in without the resolver,
# with the pure-Python packages its offloading connector imports pinned in a file.
$(VENV)/.installed-vllm: $(VENV)/.installed tests/vllm/requirements.txt
	$(PIP) --no-deps vllm==0.33.0
	$(PIP) --no-deps -r tests/vllm/requirements.txt
	touch $@

# The Mooncake wheel's binaries link libibverbs.so.1, even with no RDMA hardware (protocol "tcp").
$(VENV)/.installed-mooncake: $(VENV)/.installed
	@ldconfig -p | grep -q 'libibverbs\.so\.1 ' || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1)
	$(PIP) -e '.[test,mooncake]'
	touch $@

# matplotlib (the bench extra) for `kvtier bench e2e --plot`.
$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) -e '.[bench]'
	touch $@

install: $(VENV)/.installed

# vLLM too: the benchmark sets kvtier beside vLLM's own CPU offloading manager where vLLM imports.
bench: $(VENV)/.installed-vllm $(VENV)/.installed-bench
	mkdir -p bench-results
	$(VENV)/bin/kvtier bench e2e --plot bench-results/plots --json bench-results/e2e.json

test: $(VENV)/.installed-vllm $(VENV)/.installed-mooncake $(VENV)/.installed-bench
	KVTIER_REQUIRE_VLLM=1 KVTIER_REQUIRE_MOONCAKE=1 $(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
