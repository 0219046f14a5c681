# The two commands of the README: `make demo` and `make test`. Both create .venv when missing and install
# every distribution of this repository into it in editable mode.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# core first, then every plugin distribution (each has its own pyproject.toml); new plugins join this list.
DISTS := core plugins/ddp plugins/amp plugins/fsdp plugins/deepspeed plugins/xla plugins/wandb plugins/mlflow plugins/bnb plugins/ao plugins/ft plugins/ray
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2
# Test-only packages installed without their dependencies, so pip cannot replace the pinned torch: torchdata
# (StatefulDataLoader, for the data tests) needs only torch from its declared requests/urllib3/torch.
NO_DEPS_DEV := torchdata==0.11.0
# The `lightning` package, only for the test that passes the wandb SDK's own Fabric logger (which imports it) to our
# Fabric: installed into a folder of its own (tests put it on PYTHONPATH), because it also installs a `fabric` script
# that would replace ours; without its dependencies, so pip cannot touch torch.
LIGHTNING_SITE := $(VENV)/lightning-site
LIGHTNING_SITE_PACKAGES := lightning==2.6.6 lightning-utilities==0.15.3 torchmetrics==1.9.0
# The plugins' libraries are ranges in their pyproject.toml files; constraints.txt holds the exact versions installed
# here and in the bare-install lane. plugins/deepspeed depends on deepspeed (0.19.8 here), an sdist: pip builds it
# without build isolation against the pinned CPU torch (a pure-Python wheel, no ops compiled; about 10 s) and, since
# torch is already satisfied, pulls no CUDA torch. plugins/wandb and plugins/mlflow bring wandb and the MLflow client
# (the full `mlflow`, for the tests' tracking server, comes from requirements-dev.txt); neither depends on torch.
# plugins/bnb brings bitsandbytes (it asks for torch>=2.4,<3, numpy, packaging) and plugins/ao torchao (no
# dependencies): neither replaces torch. plugins/ray brings ray[train] (ray does not depend on torch). The check after
# the install fails the setup if anything brought CUDA packages or replaced torch.
CHECK_TORCH := import importlib.metadata as m, re, torch; \
	pin = re.search(r'^torch==(\S+)', open('requirements-dev.txt').read(), re.M).group(1); \
	cuda = sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].lower().startswith(('nvidia-', 'triton'))); \
	assert torch.__version__.split('+')[0] == pin and not cuda, f'torch {torch.__version__} (pin {pin}), CUDA packages {cuda}'

.PHONY: setup demo test test-bare setup-xla test-xla stress lint bench gpu-wheels gpu-lane clean

$(STAMP): requirements-dev.txt constraints.txt $(foreach d,$(DISTS),$(d)/pyproject.toml) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt -c constraints.txt
	$(BIN)/python -m pip install --quiet --no-deps $(NO_DEPS_DEV)
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(LIGHTNING_SITE) $(LIGHTNING_SITE_PACKAGES)
	$(BIN)/python -m pip install --quiet --no-build-isolation -c constraints.txt $(foreach d,$(DISTS),-e $(d))
	$(BIN)/python -c "$(CHECK_TORCH)"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo/train_lm.py

test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -q

# The bare-install lane: wheels of every distribution built and installed with plain pip into a fresh venv
# (.bare/venv) that holds only torch, then the seed articles' calls on 2 CPU processes with ddp (numpy absent),
# fsdp and deepspeed; pip's output must name no warning of ours. About 3-4 minutes; see tests/bare_install/lane.py.
test-bare:
	$(PYTHON) tests/bare_install/lane.py

# The XLA lane: its own venv with the pinned torch 2.9.0 + torch_xla 2.9.0 (torch_xla needs exactly that torch),
# fabric-core and fabric-xla installed editable, then the core's tests on torch 2.9 and the XLA tests on the CPU PJRT
# device (each multi-device scenario in its own subprocess with a timeout). About 7 GB; see plugins/xla/README.md.
XLA_VENV := .venv-xla
XLA_BIN := $(XLA_VENV)/bin
XLA_STAMP := $(XLA_VENV)/.installed

$(XLA_STAMP): requirements-xla.txt core/pyproject.toml plugins/xla/pyproject.toml Makefile
	test -x $(XLA_BIN)/python || $(PYTHON) -m venv $(XLA_VENV)
	$(XLA_BIN)/python -m pip install --quiet --upgrade pip
	$(XLA_BIN)/python -m pip install --quiet --no-cache-dir -r requirements-xla.txt
	$(XLA_BIN)/python -m pip uninstall --quiet --yes triton
	$(XLA_BIN)/python -m pip install --quiet --no-build-isolation --no-deps -e core -e plugins/xla pluggy
	touch $(XLA_STAMP)

setup-xla: $(XLA_STAMP)

test-xla: $(XLA_STAMP)
	$(XLA_BIN)/python -m pytest -q -p no:cacheprovider tests/core
	PJRT_DEVICE=CPU $(XLA_BIN)/python -m pytest -q -p no:cacheprovider tests/plugins/xla

# Repeats short successful 2-process jobs (ddp script, ddp launch(fn), ddp_spawn, fsdp) with a busy process beside
# them and counts non-zero exits: a run whose work succeeded must exit 0 every time. STRESS_ARGS="--runs 20" for less.
STRESS_ARGS ?= --runs 200
stress: $(STAMP)
	$(BIN)/python tests/stress/stress_exit.py $(STRESS_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check core plugins tests examples benchmarks docs/spikes

# lightning-fabric is an optional comparator: installed without its dependencies (so pip cannot swap the pinned
# torch), plus the small ones it needs; a failed install only drops it from the comparison. It also installs a
# `fabric` console script over ours, so fabric-core is reinstalled right after (ours must stay `fabric`). `make bench
# BENCH_ARGS=--quick` for a short run.
bench: $(STAMP)
	@$(BIN)/python -c "import lightning_fabric" 2>/dev/null || { \
		$(BIN)/python -m pip install --quiet --no-deps lightning-fabric lightning-utilities fsspec packaging typing-extensions && \
		$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --force-reinstall -e core; } || \
		echo "lightning-fabric could not be installed: benchmarking without it"
	@grep -q "fabric_core" $(BIN)/fabric || { echo "$(BIN)/fabric is not fabric-core's CLI"; exit 1; }
	@$(BIN)/python -c "import re, torch; pin = re.search(r'^torch==(\S+)', open('requirements-dev.txt').read(), re.M).group(1); \
		assert torch.__version__.split('+')[0] == pin, f'torch is {torch.__version__}, requirements-dev.txt pins {pin}'"
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# The GPU lane (at most 8 minutes on one lent GPU, no network there): `make gpu-wheels` here fetches the small wheels
# it installs offline (bitsandbytes with only the CPU and one CUDA release's library, torchao, torchft, DeepSpeed, their
# missing dependencies, setuptools: about 15 MiB into .gpu-wheels/, git-ignored, which the device call carries), then
# `make gpu-lane` there installs them and our distributions into a folder of its own, runs every CUDA path of every
# plugin (the table in benchmarks/gpu_lane.py), dry-checks the Ray launcher's GPU bundles and Transformer Engine, then
# benchmarks/gpu_bench.py; results in benchmarks/results/. `make gpu-lane DRY=1` lists every CUDA path and checks the
# wiring on a machine without CUDA: nothing installed, the CUDA tests must all skip. See benchmarks/gpu_lane.py.
gpu-wheels: $(STAMP)
	$(BIN)/python benchmarks/gpu_wheels.py $(GPU_WHEELS_ARGS)

gpu-lane:
	$(PYTHON) benchmarks/gpu_lane.py $(if $(DRY),--dry-run,) $(GPU_LANE_ARGS)

clean:
	rm -rf $(VENV) $(XLA_VENV) .gpu-wheels .bare demo_output
