# memos-ref: every target sets itself up (venv + pinned packages) on a machine with only python3, pip and make.
#   make lab    open JupyterLab on notebooks/        make test   ruff + pytest + every notebook (nbmake)
#   make demo   generate with each cache, print a table   make bench  the decode benchmark (table + plot)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is pinned: other versions pull several GB of CUDA wheels on machines without a GPU.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.memos-ref-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export MPLBACKEND := Agg

.PHONY: setup lab test lint unit notebooks demo bench clean

setup: $(STAMP)

# Re-runs only when pyproject.toml or this Makefile change; otherwise `make setup` is instant.
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

lab: setup
	$(BIN)/jupyter lab --notebook-dir=notebooks

lint: setup
	$(BIN)/ruff check memos_ref kernels edge tests notebooks
	$(BIN)/ruff format --check memos_ref kernels edge tests

unit: setup
	$(BIN)/python -m pytest tests

notebooks: setup
	$(BIN)/python -m pytest --nbmake --nbmake-timeout=120 notebooks

test: lint unit notebooks

demo: setup
	$(BIN)/python -m memos_ref.demo

bench: setup
	$(BIN)/python -m memos_ref.bench decode --plot bench_results/decode.png

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache bench_results
