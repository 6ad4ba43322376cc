# Quick start: `make demo` (set up, then run the demo on this machine) and `make test`
# (set up, then lint, type-check and run the whole test suite). Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# This machine's CPU build of PyTorch. On a GPU machine install your own torch into the venv
# first (or set TORCH_SPEC, e.g. TORCH_SPEC=torch): autoplan itself needs torch>=2.13.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test lint typecheck pytest clean

setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# The suite also runs the Ray Train launcher and torchft replica groups: the `ray` and
# `torchft` extras, installed for the tests only. DeepSpeed (its config class checks
# `autoplan export --to deepspeed`) is an sdist whose build imports torch: built against the
# venv's torch (no build isolation, which would fetch another torch), about 15 s. torchtitan
# (its ConfigManager loads `autoplan export --to torchtitan`) imports triton, whose wheel imports
# on a CPU machine too (Python 3.11+); the torch spec keeps pip from replacing the venv's torch.
# torchao (the `fp8` extra: fp8 plans' float8 linears) declares no torch requirement, but a
# future one could: the same torch spec holds it to the venv's torch.
$(BIN)/.installed-extras: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e ".[dev,ray,torchft,fp8]" "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --no-build-isolation "deepspeed>=0.16"
	if $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  $(BIN)/python -m pip install -q "torchtitan>=0.3" triton "$(TORCH_SPEC)"; \
	else echo "torchtitan needs Python 3.11+: its loader test will skip"; fi
	touch $@

demo: setup
	$(BIN)/python examples/demo.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: setup
	$(BIN)/mypy

# Three pytest-xdist workers on the two cores, each taking the next test as it finishes one
# (`--dist load`): the multi-process tests leave part of the cores idle (process starts,
# rendezvous, waits), which the others fill. They used to run one after another on one worker
# (`--dist loadgroup`), but pytest 9.2 ignores the group pytest-xdist 3.8 writes into a test's
# id, so since then they have been spread like the rest: 742 s of pytest here, the three
# workers' busy times within 3% of each other (2026-11-29). Session fixtures that cost seconds
# are computed once for all workers (tests/conftest.py: pipeline_reference).
pytest: $(BIN)/.installed-extras
	$(BIN)/pytest -q -n 3 --dist load --durations=15

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
