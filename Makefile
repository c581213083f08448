# The README's two commands: `make demo` (set up from nothing, run the demo) and `make test`.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel this kind of machine keeps on disk; override for a CUDA build, e.g.
# make demo TORCH_SPEC='torch==2.13.0'  (a torch the Python already has is reused).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo serve test check setup frameworks browser prometheus

demo: setup
	$(BIN)/ampwatch demo

serve: setup
	$(BIN)/ampwatch serve

# The checks run first, so CI (.ci/run) fails on a lint, format or type error before the suite.
# The suite runs on every core, a test file to a worker (`--dist loadfile`: a module's
# fixtures are built once and its tests keep their order); plain `pytest` runs serially.
# Both run the package's docstring examples too (testpaths and the root conftest.py).
test: setup check frameworks browser prometheus
	$(BIN)/pytest -n auto --dist loadfile

# Lint, format and types (settings in pyproject.toml). mypy checks the packages under their
# installed names through a link tree built from the install's package mapping.
check: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python .ci/package_tree.py build/typecheck
	$(BIN)/mypy

setup: $(VENV)/.installed

# The framework integrations' tests (tests/integrations) train under the real frameworks;
# the demo does not need them.
frameworks: $(VENV)/.frameworks

# torch first, from an exact pin, so the range in pyproject.toml installs nothing more
# (otherwise pip would fetch a several-GB CUDA build).
$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "Reusing the torch that $(PYTHON) already has"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[all,test]"
	@# plotly.js's cartesian bundle (npm registry): the dashboard loads ~1 s faster with it,
	@# and serves the full bundle without it.
	-$(BIN)/ampwatch fetch-plotly
	@touch $@

# Lightning, transformers + accelerate, megatron-core, DeepSpeed, next to the torch above.
# DeepSpeed is an sdist that imports torch to build: no build isolation (else pip's build env
# fetches another torch) and no ops compiled (DS_BUILD_OPS=0); its range is the `deepspeed`
# extra's.
$(VENV)/.frameworks: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[all,test,lightning,transformers,megatron]"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-build-isolation "$$($(BIN)/python -c \
		"import sys; t = __import__('tomllib' if sys.version_info >= (3, 11) else 'tomli'); \
		print(t.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['deepspeed'][1])")"
	@touch $@

# The dashboard's browser tests drive Debian's chromium; without it (and without root to
# install it) they skip with that reason.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
		|| echo "chromium is not installed: the browser tests will skip"

# The Prometheus tests (a real Prometheus scraping a collector; promtool on the exposition
# and on deploy/prometheus's rules) use Debian's prometheus package, installed here as
# chromium is above; without it they skip with that reason.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; } \
		|| echo "prometheus is not installed: the Prometheus tests will skip"
