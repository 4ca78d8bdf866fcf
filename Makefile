# cosyserve — set-up and checks. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of torch from this machine's local wheel; override e.g. TORCH_SPEC="torch" elsewhere.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo_out

.PHONY: install demo test clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	@$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $@

demo: install
	@$(BIN)/cosyserve demo --out $(DEMO_DIR)

test: install
	@$(BIN)/python -m pytest -q

clean:
	rm -rf $(DEMO_DIR) .pytest_cache
