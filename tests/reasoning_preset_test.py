"""The reasoning preset end to end with a tiny SFT budget: the warm start builds for the
reasoning task (its own cache entry), and RL runs a few steps logging the in-flight metrics."""

import os

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.tasks import registry
from pipelinerl_jax.tasks.reasoning import ReasoningTask


def test_preset_sizes_fit_its_task():
  config = config_lib.validate(config_lib.load_preset('reasoning'))
  task = registry.make_task(config.task)
  assert isinstance(task, ReasoningTask) and task.truncated == 'penalize'
  assert config.generation.max_new_tokens == task.max_target_chars() + 1
  longest_prompt = len(f'{10 ** task.max_digits - 1}+{10 ** task.max_digits - 1}=\n')
  assert config.generation.max_prompt_len >= longest_prompt
  # The warm start's positions hold its longest SFT example (more digits than RL).
  sft_longest = len(f'{10 ** task.sft_max_digits - 1}' * 2) + 3 + task.max_target_chars(
      task.sft_max_digits) + 1
  assert config.model.demo.max_position_embeddings >= sft_longest
  assert config.model.demo.max_position_embeddings >= (config.generation.max_prompt_len
                                                      + config.generation.max_new_tokens)


def test_preset_builds_and_runs_a_few_steps(tmp_path):
  c = config_lib.load_preset('reasoning')
  c.model.cache_dir = str(tmp_path / 'cache')
  c.model.demo.max_steps = 2          # the SFT budget knob: a barely trained model
  c.model.demo.sft_examples = 64
  c.model.demo.eval_problems = 8
  c.model.demo.eval_every = 1000
  c.generation.num_slots = 32
  c.rl.total_steps = 3
  c.rl.max_time_s = 0.0
  c.log.progress = False
  c.log.tensorboard = False
  config = config_lib.validate(c)
  model_dir = warmstart.model_dir_for(config)
  stamp = warmstart.read_stamp(model_dir)
  assert stamp['task']['name'] == 'ReasoningTask' and stamp['sft_steps'] == 2
  assert warmstart.model_dir_for(config) == model_dir  # cached
  summary = launch.run_experiment(c, str(tmp_path / 'run'), model_dir=model_dir)
  records = metrics_lib.read_metrics(os.path.join(tmp_path, 'run', 'metrics.jsonl'))
  assert summary['steps'] == 3 and [r['step'] for r in records] == [1, 2, 3]
  for r in records:
    assert r['versions_per_sample_max'] >= r['versions_per_sample_mean'] >= 1
    assert 0 <= r['frac_hit_length_limit'] <= 1 and 0 <= r['frac_multi_version'] <= 1
  # An untrained model rarely stops: cut-off samples are seen and never paid.
  assert any(r['frac_hit_length_limit'] > 0 for r in records)
