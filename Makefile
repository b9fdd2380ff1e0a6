# Two entry points that work on a fresh clone: `make train` and `make test`.
# The virtualenv is refreshed only when pyproject.toml changes, so a second call starts in seconds.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC := torch==2.13.0
# Where the CPU torch wheel comes from. Empty: pip's own configuration (on the project's machines it finds
# the +cpu wheel locally). On a machine whose pip reaches only the public index, where torch==2.13.0 on
# Linux x86-64 is the CUDA build, name PyTorch's CPU wheel index: make test TORCH_INDEX_URL=<that index>.
TORCH_INDEX_URL ?=

.PHONY: venv train test test-fast clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	@# CPU torch first, so nothing that depends on torch can pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)")
	@$(PY) -c "import torch; print('installed torch', torch.__version__, '(CUDA ' + torch.version.cuda + ' build: \
	not the CPU wheel; see TORCH_INDEX_URL in the Makefile)' if torch.version.cuda else '(CPU build)')"
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

# A short CPU pretraining run of the tiny model on the built-in corpus.
train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q --durations=20 $(ARGS)

clean-venv:
	rm -rf $(VENV)
