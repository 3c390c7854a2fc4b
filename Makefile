# The two quick-start targets: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
VENV ?= .venv
BIN = $(VENV)/bin

$(VENV)/.installed: pyproject.toml scripts/setup.sh scripts/get-helm.sh
	bash scripts/setup.sh $(VENV)
	bash scripts/get-helm.sh

.PHONY: setup demo test
setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/moe-offload serve --policy static --fraction 0.5

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q
