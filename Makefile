# Two entry points (README): `make demo` runs the main job (rtrees demo), `make test` the CI checks.
# Both create the virtual environment from scratch when it is missing.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup test test-kernels test-all lint demo bench docs clean

$(STAMP): pyproject.toml Makefile
	# bubblewrap sandboxes the python tool (train/envs/sandbox.py); needs root (CI runs as root).
	command -v bwrap >/dev/null || { apt-get update -qq && apt-get install -y -qq bubblewrap; } \
		|| echo "warning: bubblewrap not installed; the python environment will refuse to run"
	# headless Chromium for the viewer's browser test (tests/test_viewer_browser.py, Selenium);
	# Debian's packages, since Playwright's browser download needs more than a package mirror.
	command -v chromium >/dev/null && command -v chromedriver >/dev/null \
		|| { apt-get update -qq && apt-get install -y -qq chromium chromium-driver; } \
		|| echo "warning: chromium not installed; the viewer's browser test will skip"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and exactly this version: any other spec pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,ray,s3,gym,reasoning-gym,textworld,docs,agent]'
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -m "not slow" -q --durations=25
	$(MAKE) --no-print-directory test-kernels

# The goldens and the engine's batching/cache equivalences once more under other CPU
# kernels than the machine's best (AVX2 where it has AVX-512, else the generic ones; MKL
# likewise), so that a result which holds on one CPU only fails here, not on a user's
# machine of the same kind (docs/REPRODUCIBILITY.md).
OTHER_KERNELS := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null \
	&& echo ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	|| echo ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2)
test-kernels: $(STAMP)
	env $(OTHER_KERNELS) $(BIN)/python -c "import torch; \
		print('kernels:', torch.backends.cpu.get_cpu_capability(), '($(OTHER_KERNELS))')"
	env $(OTHER_KERNELS) $(BIN)/pytest -q -p no:cacheprovider tests/test_trainer_golden.py \
		tests/test_engine.py tests/test_reuse.py::test_refresh_does_not_depend_on_the_row_budget

test-all: lint
	$(BIN)/pytest -q

demo: $(STAMP)
	$(BIN)/rtrees demo --store store-demo --out out/demo

# The documentation site (mkdocs.yml) into site/, warnings as errors (the variable only
# silences material's banner about MkDocs 2).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) store-demo out site .pytest_cache .mypy_cache .ruff_cache

# Regenerate the trainer's golden trajectory (tests/golden/trainer_calc.json) on purpose only.
.PHONY: golden
golden: $(STAMP)
	$(BIN)/python tests/test_trainer_golden.py --write
