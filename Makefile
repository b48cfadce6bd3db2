# The two README commands: `make demo` (the main job) and `make test` (every test; .ci/run calls it).
# Both set up what they need: .venv (pinned, requirements.txt), .libtpu (libtpu for deviceless
# compiles) and .torch-tpu-env (torch-tpu for the TPU wrapper tests), each in its own folder.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
LIBTPU_VERSION := 0.0.42.*
PYTEST_ARGS ?=

.PHONY: setup nix-check demo test format build bench publish publish-dry-run clean

setup: $(VENV)/.installed $(VENV)/.repo-paths .libtpu/.installed .torch-tpu-env/.installed \
	.tokamax/.installed nix-check

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -r requirements.txt
	touch $@

# The repository's module folders go on the venv's path through one .pth file in its
# site-packages, so scripts, benchmarks and tests run as programs import each other's modules by
# name with no sys.path edits of their own; pytest reads the same list from pyproject.toml
# (`pythonpath`; tests/test_shared_contract.py keeps the two equal).
REPO_PATHS := tests scripts torch-ext benchmarks
$(VENV)/.repo-paths: $(VENV)/.installed Makefile
	$(PY) -c "import pathlib, sys, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], \
		'pallas_tpu_kernels_repo.pth').write_text(''.join(str(pathlib.Path(d).resolve()) + '\n' \
		for d in sys.argv[1:]))" $(REPO_PATHS)
	touch $@

# libtpu lives outside the venv: installed into the venv it would make jax look for a TPU.
.libtpu/.installed: $(VENV)/.installed
	rm -rf .libtpu
	$(PIP) install -q --disable-pip-version-check --no-deps --target .libtpu "libtpu==$(LIBTPU_VERSION)"
	touch $@

# tokamax (the anchor whose published TPU timings validate benchmarks/llo_schedule.py's model) lives
# outside the venv like libtpu: benchmarks/validate_schedule.py imports its splash and ragged-dot
# kernel modules from here. 0.0.12 is the newest on the index; its pure-python deps come along,
# flax (qwix's) does not: the validator stubs qwix, which only the quantized paths use.
TOKAMAX_VERSION := 0.0.12
.tokamax/.installed: $(VENV)/.installed
	rm -rf .tokamax
	$(PIP) install -q --disable-pip-version-check --no-deps --target .tokamax \
		"tokamax==$(TOKAMAX_VERSION)" einshape jaxtyping wadler-lindig "typeguard==2.13.3" \
		immutabledict absl-py
	touch $@

# torch-tpu autoloads on `import torch` and, without a TPU, kills the process: it must never be in
# the venv. The TPU wrapper tests put this folder on PYTHONPATH of a subprocess only.
.torch-tpu-env/.installed: $(VENV)/.installed
	rm -rf .torch-tpu-env
	$(PIP) install -q --disable-pip-version-check --no-deps --target .torch-tpu-env \
		"torch-tpu==0.2.0" "libtpu==0.0.52" portpicker frozendict pyzmq absl-py immutabledict
	touch $@

# flake.nix syntax check needs nix-instantiate (Debian's nix-bin); install it when we are root.
nix-check:
	@command -v nix-instantiate >/dev/null || { [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && apt-get install -y -qq nix-bin) >/dev/null 2>&1; } || \
		echo "note: nix-instantiate unavailable; flake.nix syntax tests need it"

build: $(VENV)/.installed
	$(PY) scripts/build.py

demo: setup build
	$(PY) scripts/demo.py

# Lint and format check first (ruff, configured in pyproject.toml): a few seconds, and a style
# slip fails before the suite starts. `make format` fixes what it can.
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -p no:cacheprovider -n auto --dist worksteal --durations=25 $(PYTEST_ARGS)

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	JAX_PLATFORMS=cpu $(PY) benchmarks/run.py

publish-dry-run: build
	$(PY) scripts/publish.py --dry-run

publish: build
	$(PY) scripts/publish.py

clean:
	rm -rf dist
