# `make demo` and `make test` are the two commands the README opens with.
PYTHON ?= python3
VENV ?= .venv
# The torch build this project is tested with; override for another CUDA/CPU build.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH_SPEC)
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# One torch thread, as the test suite runs it: the README shows what that prints. Another thread
# count sums in another order, trains to slightly different weights and prints other numbers
# (two threads: CIDEr-D 5.75, hit 0.977 against one thread's 5.69, 0.972).
demo: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/captioner demo

test: venv
	$(VENV)/bin/python -m pytest -q -n 2 --dist worksteal

# For development: everything but the tests marked slow (the demo, the browser, real data). CI runs `make test`.
test-fast: venv
	$(VENV)/bin/python -m pytest -q -n 2 --dist worksteal -m "not slow"

.PHONY: venv demo test test-fast
