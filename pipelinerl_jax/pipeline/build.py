"""Config -> the parts of a run: task, model and tokenizer, generation engine, train state and
step, the publisher that hands each new policy to the engine, checkpoints, the actor and the
trainer. Nothing here starts a loop: `run.py` does.

Where the generation engine runs, and how each new policy reaches it, is placements.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import threading
from typing import Any, Callable

import jax
import numpy as np

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import distributed
from pipelinerl_jax import evaluation
from pipelinerl_jax import packing
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.generation import api
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.hf import tokenizer as hf_tokenizer
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models import transformer
from pipelinerl_jax.pipeline import actor as actor_lib
from pipelinerl_jax.pipeline import placements
from pipelinerl_jax.pipeline import signals
from pipelinerl_jax.pipeline import stream as stream_lib
from pipelinerl_jax.pipeline import trainer as trainer_lib
from pipelinerl_jax.tasks import base as tasks_base
from pipelinerl_jax.tasks import registry


def check_backend_installed(config: config_lib.Config) -> None:
  """The vLLM backend needs vllm and torch, and placement 'ray' needs ray, which the light
  install ([notebooks], or no extra) leaves out: say so in one line before the model is built,
  not in a traceback at engine start."""
  backend = config.generation.backend
  missing = [m for m in ('vllm', 'torch') if importlib.util.find_spec(m) is None]
  if backend != 'jax' and missing:
    raise ValueError(f"config.generation.backend: {backend!r} needs {' and '.join(missing)}, "
                     "not installed here (pip install -e '.[vllm]' on CPU, '.[vllm-gpu]' on "
                     "CUDA; or use backend 'jax')")
  if config.generation.placement == 'ray' and importlib.util.find_spec('ray') is None:
    raise ValueError("config.generation.placement: 'ray' needs ray, not installed here (pip "
                     "install -e '.[ray]'; or use placement 'inline')")


@dataclasses.dataclass
class Learner:
  """The training side of a run: what every trainer process builds, the same way (with several
  processes, see pipeline/multiprocess.py)."""
  model_config: transformer.ModelConfig
  mesh: jax.sharding.Mesh
  state: train.TrainState              # restored or fresh, in the trainer's shardings
  train_step: Callable                 # jitted (state, batch) -> (state, metrics), state donated
  checkpoints: checkpoint_lib.Checkpointer
  resumed: dict[str, Any] | None       # the restored checkpoint's meta; None for a fresh start
  lora: config_lib.LoraSettings | None = None  # config.model.lora: state.params are the adapters
  base: Any = None                     # LoRA: the frozen base, in the trainer's shardings

  def served(self, params):
    """What an engine or an evaluation runs for the trained `params` (`state.params`): those
    params, or with LoRA the base with these adapters."""
    return params if self.lora is None else lora_lib.Adapted(self.base, params, self.lora.scale)


@dataclasses.dataclass
class Parts:
  """Everything a run is made of before its loops start (process 0's, with several processes)."""
  model_dir: str
  learner: Learner
  tokenizer: Any
  task: tasks_base.Task
  engine: api.Engine
  put_batch: Callable                  # packed host batch -> micro-batches on the mesh
  publish: Callable[[Any, int], int]   # (params, version) -> the engine, as a fresh copy;
                                       # returns the bytes handed over
  evaluate: Callable[[Any, int], dict] | None  # (params, step) -> eval metrics
  trainer_cores: tuple[int, ...] | None = None  # train.cores='free': this process's cores


def build_learner(config: config_lib.Config, workdir: str, model_dir: str,
                  started: contextlib.ExitStack | None = None) -> Learner:
  """Model, mesh, train state (restored from the latest checkpoint, or loaded from model_dir)
  and the jitted train step. `started` gets the checkpointer's close (see `build`)."""
  model_config = hf_schema.load_config(
      model_dir, param_dtype=config.model.param_dtype, dtype=config.model.dtype,
      lm_head_fp32=config.model.lm_head_fp32, remat=config.model.remat,
      remat_policy=config.model.remat_policy,
      attention=config.model.attention, attention_block_q=config.model.attention_block_q,
      attention_block_kv=config.model.attention_block_kv,
      moe_dispatch=config.model.moe_dispatch)
  if config.model.moe_routing == 'replay' and not model_config.is_moe:
    raise ValueError(f"config.model.moe_routing: 'replay' routes a mixture of experts, and "
                     f'{model_dir} ({model_config.architecture}) has no experts')
  mesh = sharding_lib.make_mesh(*config.train.mesh_sizes)
  experts_split = mesh.shape['expert']
  if model_config.is_moe and model_config.num_experts % experts_split:
    raise ValueError(f'config.train.mesh: expert={experts_split} does not divide the '
                     f"model's num_experts={model_config.num_experts}")
  optimizer = train.make_optimizer(config.optimizer)
  # Opening the checkpoints is the processes' first collective (orbax syncs them), where gloo
  # waits only 30 s for a peer; a trainer process on another host may start much later.
  distributed.barrier('checkpoints')
  checkpoints = checkpoint_lib.Checkpointer(checkpoint_lib.directory(config, workdir),
                                            config.checkpoint.keep, config.checkpoint.every_steps)
  if started is not None:
    started.callback(_quietly, checkpoints.close)
  restored = checkpoint_lib.restore_latest(config, checkpoints, model_config, optimizer, mesh)
  lora = lora_lib.active(config.model.lora)
  base = None
  if lora is not None or not restored:
    # The model dir's weights: trained (full fine-tuning), or the frozen base of LoRA.
    load_config = model_config if lora is None else checkpoint_lib.frozen_base_config(model_config)
    shapes = jax.eval_shape(lambda k: transformer.init_params(load_config, k),
                            jax.random.PRNGKey(0))
    base = hf_checkpoint.load_params(model_dir, load_config,
                             shardings=sharding_lib.param_shardings(shapes, mesh))
  if restored:
    state, state_sh, resumed = restored
  else:
    params = base if lora is None else checkpoint_lib.trainable_params(
        model_config, jax.random.PRNGKey(config.model.lora.init_seed), lora)
    state, state_sh = train.create_sharded_state(params, optimizer, mesh)
    resumed = None
  if lora is None:
    base = None  # (the trainable params now: the train state owns them)
  train_step = train.jit_train_step(
      train.make_train_step(model_config, config.loss, optimizer,
                            train.lr_schedule(config.optimizer),
                            temperature=config.generation.temperature or 1.0,
                            lora_scale=None if lora is None else lora.scale, mesh=mesh,
                            moe_routing=config.model.moe_routing),
      state_sh, mesh, base=base)
  return Learner(model_config=model_config, mesh=mesh, state=state, train_step=train_step,
                 checkpoints=checkpoints, resumed=resumed, lora=lora, base=base)


def build(config: config_lib.Config, workdir: str, model_dir: str,
          interrupt: threading.Event | None = None, trainers=None) -> Parts:
  """Loads (or restores) everything; the engine starts from the trainer's policy version.

  The tokenizer and the task's data come first, so a bad file is reported before the model
  loads. `interrupt` set (a signal) stops the build at its next phase (signals.Interrupted);
  whatever fails, the parts already started (the task's worker pool, the engine) are closed.
  `trainers` (process 0 of trainer processes as Ray actors: a trainer_actors.Launch): weights
  go to the generators from every process, each with its own pieces.
  """
  started = contextlib.ExitStack()
  try:
    return _build(config, workdir, model_dir, started, lambda: signals.check(interrupt),
                  trainers)
  except BaseException:
    started.close()
    raise


def _quietly(close: Callable[[], None]) -> None:
  """A part closed after another failure: its own error must not replace that one."""
  try:
    close()
  except Exception:
    pass


def _build(config: config_lib.Config, workdir: str, model_dir: str,
           started: contextlib.ExitStack, check_interrupt: Callable[[], None],
           trainers=None) -> Parts:
  tokenizer = hf_tokenizer.load_tokenizer(model_dir)
  stop_ids = hf_tokenizer.stop_token_ids(model_dir, tokenizer)
  task = registry.make_task(config.task, tokenizer)
  started.callback(_quietly, task.close)
  check_interrupt()
  learner = build_learner(config, workdir, model_dir, started)
  model_config, mesh, state = learner.model_config, learner.mesh, learner.state
  check_interrupt()
  version = int(state.step)
  wire_dtype = placements.transport_dtype(config, model_config, model_dir)
  if trainers is None:
    # collective, see whole(); one process: the params
    params = learner.served(distributed.whole(state.params))
  else:
    params = trainers.publication(state.params, version, wire_dtype)  # with every process
  engine = placements.ENGINE_PLACEMENTS[config.generation.placement](
      config, model_config, model_dir, mesh=mesh, eos_token_ids=stop_ids,
      params=params, version=version, cores=trainers and trainers.cores)
  del params
  started.callback(_quietly, engine.close)
  trainer_cores = engine.take_free_cores() if config.train.cores == 'free' else None
  check_interrupt()
  publish = placements.publisher(config, mesh, engine, wire_dtype, trainers)
  g = config.generation
  if learner.resumed and g.backend != 'jax' and g.placement == 'inline':
    publish(state.params, version)  # inline vLLM loaded model_dir's weights
  evaluate = (evaluator(config, workdir, learner, tokenizer, task, stop_ids)
              if config.eval.every_steps else None)
  return Parts(model_dir=model_dir, learner=learner, tokenizer=tokenizer, task=task,
               engine=engine, put_batch=batch_placer(config.train, mesh), publish=publish,
               evaluate=evaluate, trainer_cores=trainer_cores)


def make_actor(config: config_lib.Config, parts: Parts, stream: stream_lib.SampleStream,
               stop: threading.Event) -> actor_lib.Actor:
  g, rl, adv = config.generation, config.rl, config.advantage
  group_ids, problems = checkpoint_lib.data_stream(
      parts.task.problems(config.seed),
      parts.learner.resumed['data'] if parts.learner.resumed else None)
  tokenizer = parts.tokenizer
  return actor_lib.Actor(
      parts.engine, problems, parts.task,
      encode=prompt_encoder(tokenizer, g.max_prompt_len),
      decode=lambda t: tokenizer.decode(t, skip_special_tokens=True), stream=stream,
      config=actor_lib.ActorConfig(
          group_size=rl.group_size, num_slots=g.num_slots,
          sampling=api.SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                      max_tokens=g.max_new_tokens),
          seed=config.seed, advantage_baseline=adv.baseline,
          advantage_normalize_std=adv.normalize_std,
          drop_zero_advantage_groups=adv.drop_zero_groups, max_seq_len=g.max_seq_len),
      stop=stop, group_ids=group_ids,
      encode_text=lambda text: list(tokenizer.encode(text, add_special_tokens=False)))


def make_trainer(config: config_lib.Config, parts: Parts, stream: stream_lib.SampleStream,
                 stop: threading.Event, log: Callable[[dict], None],
                 after_publish: Callable[[], None]) -> trainer_lib.Trainer:
  rl, tr, learner = config.rl, config.train, parts.learner
  trainer = trainer_lib.Trainer(
      learner.state, learner.train_step, parts.put_batch, publish=parts.publish, stream=stream,
      config=trainer_lib.TrainerConfig(
          batch_size=rl.batch_size, seq_len=tr.seq_len, micro_batches=tr.micro_batches,
          row_multiple=packing.row_multiple(sharding_lib.data_parallel_size(learner.mesh),
                                            tr.micro_batches, tr.micro_batch_rows),
          mode=rl.mode, max_lag=rl.max_lag if rl.mode == 'pipeline' else None,
          conventional_steps=rl.conventional_steps, total_steps=rl.total_steps,
          max_time_s=rl.max_time_s, overlong=tr.overlong, max_segments=tr.max_segments_per_row,
          eval_every_steps=config.eval.every_steps),
      stop=stop, log=log, gen_stats=parts.engine.stats, after_publish=after_publish,
      evaluate=parts.evaluate)
  if learner.resumed:
    trainer.restore(learner.resumed)
  return trainer


def prompt_encoder(tokenizer, max_len: int) -> Callable[[tasks_base.Problem], list[int]]:
  """Problem -> prompt token ids; a prompt that is empty or longer than max_len is an error
  naming the problem and the config key."""
  def encode(problem: tasks_base.Problem) -> list[int]:
    tokens = tokenizer.encode(problem.prompt, add_special_tokens=False)
    if not tokens or len(tokens) > max_len:
      raise ValueError(f'problem {problem.id}: prompt has {len(tokens)} tokens, '
                       f'config.generation.max_prompt_len is {max_len}')
    return tokens
  return encode


# --- training --------------------------------------------------------------------------------


def batch_placer(config: config_lib.TrainConfig, mesh) -> Callable:
  """Packed host batch -> its micro-batches [M, rows / M, T], rows split over the mesh."""
  batch_sh = sharding_lib.batch_sharding(mesh, leading_dims=1)
  data_parallel = sharding_lib.data_parallel_size(mesh)

  def put_batch(batch: dict[str, np.ndarray]):
    num_micro = packing.num_micro_batches(len(batch['tokens']), data_parallel,
                                          config.micro_batches, config.micro_batch_rows)
    keys = train.BATCH_KEYS + tuple(k for k in train.OPTIONAL_KEYS if k in batch)
    micro = packing.split_microbatches({k: batch[k] for k in keys}, num_micro)
    if jax.process_count() == 1:
      return jax.device_put(micro, {k: batch_sh for k in micro})
    # Several processes: each places the rows its devices hold. (device_put would first check
    # that every process passed the same batch, by gathering it whole.)
    rows = sharding_lib.local_block(batch_sh, micro['tokens'].shape, axis=1)
    return {k: jax.make_array_from_process_local_data(batch_sh, x[:, rows], x.shape)
            for k, x in micro.items()}
  return put_batch


def evaluator(config: config_lib.Config, workdir: str, learner: Learner, tokenizer, task,
              stop_ids: tuple[int, ...]) -> Callable[[Any, int], dict]:
  """(params, step) -> eval metrics: the CLI's evaluation on a copy of the current params (the
  train step donates them; with LoRA, of the adapters, on the base), its samples written to
  workdir/eval/samples-<step>.jsonl."""
  problems = task.held_out(config.eval.num_problems, config.eval.seed)
  device = placements.generation_device(learner.mesh)
  if learner.lora is None:
    # In the compute dtype, as the publisher's copy: the engine would cast a param-dtype copy
    # (a second copy on the device; the memory plan counts one).
    copy = placements.copy_params_fn(device, learner.model_config.dtype)
  else:
    base = placements.base_on(learner.base, device)
    copy_adapters = placements.copy_params_fn(device)
    copy = lambda adapters: lora_lib.Adapted(base, copy_adapters(adapters), learner.lora.scale)

  def evaluate(params, step: int) -> dict:
    result = evaluation.evaluate_params(config, learner.model_config, copy(params), tokenizer,
                                        task, problems, device=device, stop_ids=stop_ids)
    evaluation.write_samples(os.path.join(workdir, 'eval', f'samples-{step}.jsonl'),
                             result['samples'])
    return {**evaluation.metrics_record(result), 'eval/seconds': result['seconds']}
  return evaluate
