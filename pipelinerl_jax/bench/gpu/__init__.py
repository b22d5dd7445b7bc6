"""The GPU proof kit, `python -m pipelinerl_jax.bench.gpu` (docs/gpu-kit.md).

  runner.py       the command line: one process per section, the time budget, table and JSON
  registry.py     the sections, in the order they run: where a new one is registered
  presets.py      the sizes of --preset=full / short / quick, the train grid, the vLLM sizes
  time_budget.py  how the budget is shared between sections (and between a section's parts)
  section.py      what every section uses in its process: its record, timing, memory, requests
  env.py, train.py, engine.py, publish.py, e2e.py, vllm.py (+ vllm_items.py), collective.py
                  the sections
"""
