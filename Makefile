# Two entry points that work on a fresh clone: `make train` and `make test`.
# The virtualenv is refreshed only when pyproject.toml changes, so a second call starts in seconds.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC := torch==2.13.0

.PHONY: venv train test test-fast clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	@# CPU torch first, so nothing that depends on torch can pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

# A short CPU pretraining run of the tiny model on the built-in corpus.
train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q --durations=20 $(ARGS)

clean-venv:
	rm -rf $(VENV)
