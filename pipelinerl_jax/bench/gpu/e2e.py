"""The e2e section: short PipelineRL runs of the `tiny` preset and of the `reasoning` preset (the
paper's regime: samples decoded across several updates), TensorBoard off: reward, first steps
against last steps. Their warm-started demo models are built once, on CPU, with
--prepare_models and carried to the GPU (--model_cache), as building them there would take the
budget."""

from __future__ import annotations

import math
import pathlib
import statistics
import time
from typing import Any

from pipelinerl_jax.bench.gpu import section as section_lib


def reward_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
  """First-k against last-k mean reward of a run's per-step records (k = 10, fewer when the run
  is short), and a curve of (step, time_s, reward_mean) thinned to at most 200 points."""
  rewards = [float(r['reward_mean']) for r in records]
  if not rewards:
    return dict(steps=0, reward_first=None, reward_last=None, reward_rise=None, rising=None,
                reward_window=0, curve=[])
  k = max(1, min(10, len(rewards) // 3))
  first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
  stride = max(1, math.ceil(len(records) / 200))
  curve = [(r['step'], round(float(r['time_s']), 2), round(float(r['reward_mean']), 4))
           for r in records[::stride]]
  return dict(steps=len(rewards), reward_first=first, reward_last=last,
              reward_rise=last - first, rising=last > first, reward_window=k, curve=curve)


def e2e_config(preset: str, model_cache: str, quick: bool):
  """The ConfigDict of an e2e run of `preset` (its RL length is set by the caller)."""
  from pipelinerl_jax import config as config_lib
  c = config_lib.load_preset(preset)
  c.log.tensorboard = False       # tensorboardX is not on the GPU image
  c.log.progress = not quick
  c.model.cache_dir = model_cache
  c.checkpoint.every_steps = 0    # one save, at the end
  if quick:                       # an untrained model, a few small steps
    c.model.demo.max_steps = 0
    c.model.demo.eval_problems = 8
    c.rl.batch_size, c.rl.group_size, c.generation.num_slots = 16, 4, 16
  return c


def prepare_models(directory: str, presets: tuple[str, ...]) -> list[str]:
  """Builds (or finds) the warm-started demo model of each e2e preset in `directory`."""
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.demo import warmstart
  return [warmstart.model_dir_for(config_lib.validate(e2e_config(p, directory, quick=False)))
          for p in presets]


def run(s: section_lib.Section) -> None:
  """Each of the preset's e2e runs in turn, each given an even share of what is left."""
  presets = s.sizes.e2e_presets
  for i, preset in enumerate(presets):
    if i and s.remaining() < 20:  # the first always starts; its share ends it
      s.skip(f'{preset} preset', 'time budget')
      continue
    run_preset(s, preset, share_s=s.remaining() / (len(presets) - i))


def run_preset(s: section_lib.Section, preset: str, share_s: float) -> None:
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.demo import warmstart
  from pipelinerl_jax.pipeline import launch

  z = s.sizes
  c = e2e_config(preset, s.args.model_cache, s.args.quick)
  t0 = time.perf_counter()
  model_dir = warmstart.model_dir_for(config_lib.validate(c))  # found in a carried cache
  warmstart_s = time.perf_counter() - t0
  c.rl.total_steps = z.e2e_steps
  # What is left after teardown, the final checkpoint and the plot (~20 s on a slow host).
  c.rl.max_time_s = (min(z.e2e_rl_s, max(10.0, share_s - warmstart_s - 30.0)) if z.e2e_rl_s
                     else 0.0)
  rl_dir = pathlib.Path(s.args.workdir) / 'e2e' / f'{preset}-{int(time.time())}'
  records, error, rl_s = section_lib.run_records(
      lambda: launch.run_experiment(c, str(rl_dir), model_dir=model_dir), rl_dir)
  median = lambda key: section_lib.median_of(records, key)
  fields = dict(preset=preset, warmstart_s=warmstart_s, rl_s=rl_s, max_time_s=c.rl.max_time_s,
                batch_size=c.rl.batch_size, group_size=c.rl.group_size,
                num_slots=c.generation.num_slots, **reward_summary(records),
                gen_tokens_per_s_median=median('gen_tokens_per_s'),
                train_step_s_median=median('train_step_s'),
                lag_max=max((r['lag_max'] for r in records), default=None), workdir=str(rl_dir))
  if error:
    s.record['items'].append(dict(name=f'{preset} preset', status='error', error=error,
                                  **fields))
    s.save()
  else:
    s.add(f'{preset} preset', **fields)


def describe(item: dict[str, Any]) -> str:
  """One table cell: the item's main figures (an error item's too: the steps it logged)."""
  g = item.get
  if g('reward_first') is None:
    return f"no step logged; {g('error', '')}"
  text = (f"{g('steps')} steps in {g('rl_s'):.0f} s (+{g('warmstart_s'):.0f} s warm start): "
          f"reward {g('reward_first'):.3f} -> {g('reward_last'):.3f} "
          f"(means of first/last {g('reward_window')})")
  return text + (f"; {g('error')}" if g('error') else '')
