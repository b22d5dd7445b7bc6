"""The task of a config: `make_task(config.task, tokenizer)`."""

from __future__ import annotations

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.tasks import arithmetic
from pipelinerl_jax.tasks import base
from pipelinerl_jax.tasks import calculator
from pipelinerl_jax.tasks import data
from pipelinerl_jax.tasks import math as math_task
from pipelinerl_jax.tasks import reasoning


def make_task(config: config_lib.TaskConfig, tokenizer=None) -> base.Task:
  """A math task owns a verify worker pool: `close()` it when done. `tokenizer` gives math
  prompts the model's chat template (arithmetic, reasoning and calculator prompts are plain
  text)."""
  cut = dict(truncated=config.reward.truncated, truncated_reward=config.reward.truncated_reward)
  if config.name == 'arithmetic':
    return arithmetic.ArithmeticTask(ops=config.ops, digits=config.digits,
                                     sft_pool_mod=config.sft_pool_mod, **cut)
  if config.name == 'reasoning':
    return reasoning.ReasoningTask(ops=config.ops, min_digits=config.min_digits,
                                   max_digits=config.digits, sft_max_digits=config.sft_max_digits,
                                   sft_pool_mod=config.sft_pool_mod, **cut)
  if config.name == 'calculator':
    return calculator.CalculatorTask(ops=config.ops, digits=config.digits,
                                     sft_pool_mod=config.sft_pool_mod,
                                     sft_tool_share=config.sft_tool_share,
                                     max_turns=config.max_turns,
                                     max_episode_tokens=config.max_episode_tokens, **cut)
  if config.name == 'math':
    render = data.PromptRenderer.from_config(config, tokenizer)  # before the files: its checks
    train_sets, test_sets = math_task.load_splits(
        config.train_files, config.test_files, config.test_fraction, config.problem_field,
        config.answer_field, config.answer_rule)
    weights = config.train_weights or (1.0,) * len(train_sets)
    return math_task.MathTask(list(zip(train_sets, weights)), render, config.reward,
                              test_sets=test_sets, answer_format=config.answer_format,
                              score_fn=config.score_fn, timeout_s=config.verify_timeout_s,
                              num_workers=config.verify_workers)
  raise ValueError(f'config.task.name: unknown task {config.name!r}')
