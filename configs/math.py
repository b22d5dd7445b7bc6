"""RL on math. Presets: `--config=configs/math.py:tiny` (the CPU demo; the default).

Every field and its meaning is in pipelinerl_jax/config.py:base_config; override any of them on
the command line, e.g. `--config.rl.mode=conventional --config.rl.conventional_steps=4`.
"""

from pipelinerl_jax import config as config_lib

PRESETS = ('tiny',)


def get_config(arg=None):
  preset = arg or 'tiny'
  if preset not in PRESETS:
    raise ValueError(f'configs/math.py: unknown preset {preset!r} (known: {", ".join(PRESETS)})')
  c = config_lib.base_config()
  if preset == 'tiny':
    # A ~100k-param Qwen2-format model built and SFT-warmed locally on 2-digit addition, then
    # PipelineRL on unseen problems, all on 2 CPU cores. See demo-calibration in the README.
    c.task.name = 'arithmetic'
    c.task.ops = ('+',)
    c.task.digits = 2
    c.generation.num_slots = 128
    c.generation.max_prompt_len = 8
    c.generation.max_new_tokens = 12
    c.rl.batch_size = 128            # 16 prompts x 8 samples per optimizer step
    c.rl.group_size = 8
    c.rl.max_lag = 4
    c.rl.total_steps = 100_000       # the time budget below ends the demo
    c.rl.max_time_s = 600.0
    c.optimizer.lr = 3e-4
    c.optimizer.max_grad_norm = 1.0
    c.train.seq_len = 128
  return c
