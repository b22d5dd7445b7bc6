"""Wires a run together and owns its lifecycle: model, engine, actor and trainer threads.

Actor and trainer run in two threads of this process (JAX releases the GIL while it computes),
so generation and training overlap. The main thread only supervises: the first exception in
either loop, or Ctrl-C, stops both within seconds, and the error names the loop that failed.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import losses
from pipelinerl_jax import packing
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax import warmstart
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import engine as engine_lib
from pipelinerl_jax.models import hf_io
from pipelinerl_jax.models import transformer
from pipelinerl_jax.pipeline import actor as actor_lib
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import stream as stream_lib
from pipelinerl_jax.pipeline import trainer as trainer_lib
from pipelinerl_jax.tasks import arithmetic

STOP_TIMEOUT_S = 10.0


class RunError(RuntimeError):
  """A loop of the run failed; the message names it and the original error."""


def make_task(config: ml_collections.ConfigDict, tokenizer=None):
  """The task of config.task. A math task owns a verify worker pool: `close()` it when done
  (run() does). `tokenizer` gives the math prompts its chat template."""
  t = config.task
  if t.name == 'arithmetic':
    return arithmetic.ArithmeticTask(**{k: t[k] for k in config_lib.TASK_KEYS})
  if t.name == 'math':
    from pipelinerl_jax.tasks import math as math_task  # loads `datasets`: only when asked for
    train_sets, _ = math_task.load_splits(t.train_files, t.test_files, t.test_fraction,
                                          t.problem_field, t.answer_field)
    weights = t.train_weights or (1.0,) * len(train_sets)
    return math_task.MathTask(list(zip(train_sets, weights)), tokenizer,
                              math_task.RewardConfig(**t.reward.to_dict()),
                              timeout_s=t.verify_timeout_s, num_workers=t.verify_workers)
  raise ValueError(f'config.task.name: unknown task {t.name!r} (known: arithmetic, math)')


def copy_params_fn(device) -> Callable:
  """Params -> a fresh copy on the generation device. The engine must never hold a buffer that
  the donated train step will reuse (see api.Engine.update_params): `device_put` alone may hand
  back the very shard that already sits on `device`, so copy first (in the train sharding),
  then move."""
  copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p))
  return lambda params: jax.device_put(copy(params), device)


def stream_capacity(mode: str, batch_size: int, num_slots: int, max_lag: int,
                    conventional_steps: int) -> int:
  """Admission credits, in samples (see stream.py).

  Conventional: exactly one generated batch of B * G samples. Pipeline: (max_lag + 1) * B makes
  max_lag a bound, and H + B keeps no more queued than the trainer's next batch: when
  generation outpaces training, extra queued samples would only wait and grow stale.
  """
  if mode == 'conventional':
    return batch_size * conventional_steps
  return min((max_lag + 1) * batch_size, num_slots + batch_size)


def generation_device(mesh):
  """The JAX engine's device: the first one the train mesh leaves free, else the first."""
  free = [d for d in jax.devices() if d not in set(mesh.devices.flat)]
  return free[0] if free else jax.devices()[0]


def visible_gpus() -> list[str]:
  """The GPUs this process sees, in JAX's order, as CUDA_VISIBLE_DEVICES entries (what a child's
  CUDA_VISIBLE_DEVICES must name); [] on a host without GPUs."""
  gpus = [d for d in jax.devices() if d.platform == 'gpu']
  env = [s.strip() for s in os.environ.get('CUDA_VISIBLE_DEVICES', '').split(',') if s.strip()]
  return env[:len(gpus)] if env else [str(i) for i in range(len(gpus))]


def engine_publisher(config: ml_collections.ConfigDict, mesh) -> Callable:
  """What the trainer hands to `engine.update_params`: always a fresh copy (never buffers
  the donated train step reuses); for the JAX engine, on its device."""
  if config.generation.backend == 'jax':
    return copy_params_fn(generation_device(mesh))
  return jax.jit(lambda p: jax.tree.map(jnp.copy, p))  # vLLM copies into its own tensors


def make_engine(config: ml_collections.ConfigDict, model_config, model_dir: str, *, mesh,
                eos_token_id: int, params, version: int = 0) -> api.Engine:
  g = config.generation
  max_len = g.max_prompt_len + g.max_new_tokens
  if g.backend == 'jax':
    device = generation_device(mesh)
    return engine_lib.JaxEngine(
        model_config, copy_params_fn(device)(params),
        engine_lib.EngineConfig(num_slots=g.num_slots, max_seq_len=max_len,
                                eos_token_ids=(eos_token_id,), recompute_kv=g.recompute_kv),
        version=version, device=device)
  # vLLM starts from the checkpoint on disk, which is what `params` were loaded from.
  from pipelinerl_jax.generation import vllm_engine  # imports vLLM: only when asked for
  engine_config = vllm_engine.VllmEngineConfig(
      max_num_seqs=-(-g.num_slots // g.num_generators), max_model_len=max_len,
      eos_token_ids=(eos_token_id,), kv_cache_bytes=g.vllm_kv_cache_mb << 20,
      lm_head_fp32=config.model.lm_head_fp32)
  if g.backend == 'vllm':
    return vllm_engine.VllmEngine(model_dir, engine_config, version=0)
  from pipelinerl_jax.generation import generator_process
  from pipelinerl_jax.generation import generator_pool
  devices = generator_process.assign_devices(
      visible_gpus(), mesh.devices.size, g.num_generators, g.generator_devices, per_child_max=1)
  process_config = generator_process.ProcessConfig(
      max_restarts=g.max_restarts, weight_transport=g.weight_transport,
      transport_timeout_s=g.transport_timeout_s, devices=devices[0])
  if g.num_generators == 1:
    return generator_process.GeneratorProcess(model_dir, engine_config, version=0,
                                              config=process_config)
  return generator_pool.GeneratorPool(model_dir, engine_config, num_generators=g.num_generators,
                                      devices=devices,
                                      version=0, config=process_config)


def pad_prompt_check(max_len: int) -> Callable[[list[int], str], list[int]]:
  def check(tokens: list[int], problem_id: str) -> list[int]:
    if not tokens or len(tokens) > max_len:
      raise ValueError(f'problem {problem_id}: prompt has {len(tokens)} tokens, '
                       f'config.generation.max_prompt_len is {max_len}')
    return tokens
  return check


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
  """Total time during which an interval of `a` and one of `b` both ran."""
  total = 0.0
  b = sorted(b)
  for s, e in sorted(a):
    for bs, be in b:
      if bs >= e:
        break
      total += max(0.0, min(e, be) - max(s, bs))
  return total


def resolve_model_dir(config: ml_collections.ConfigDict) -> str:
  """config.model.path, or the demo model, built once into the cache (keyed by its settings)."""
  if config.model.path:
    if not os.path.isfile(os.path.join(config.model.path, hf_io.CONFIG_FILE)):
      raise FileNotFoundError(f'config.model.path: no {hf_io.CONFIG_FILE} in {config.model.path}')
    return config.model.path
  demo = config_lib.demo_config(config)
  cache = config.model.cache_dir or os.path.expanduser('~/.cache/pipelinerl_jax')
  out = os.path.join(cache, f'demo-{warmstart.settings_hash(demo)}')
  return str(warmstart.build_demo_model(out, demo))


def run_experiment(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """What `main` runs: validate, find or build the model, then RL."""
  config_lib.validate(config)
  model_dir = resolve_model_dir(config)
  stamp = warmstart.read_stamp(model_dir)
  if stamp:
    print(f"model: {model_dir} (warm start: greedy accuracy {stamp['greedy_accuracy']:.2f}, "
          f"sampled {stamp['sampled_accuracy']:.2f})")
  return run(config, workdir, model_dir=model_dir)


def summary_text(summary: dict[str, Any], workdir: str) -> str:
  records = summary['records']
  if not records:
    return f'no optimizer step completed; see {workdir}'
  first, last = records[0], records[-1]
  tail = records[-10:]
  reward_tail = sum(r['reward_mean'] for r in tail) / len(tail)
  return (f"done: {summary['steps']} steps, {summary['samples']} samples in "
          f"{last['time_s']:.0f} s of RL. reward {first['reward_mean']:.3f} (first step) -> "
          f"{reward_tail:.3f} (mean of last {len(tail)}); max lag {summary['max_lag_seen']}, "
          f"stale samples dropped {summary['stale_dropped']}; generation/training overlap "
          f"{summary['gen_train_overlap_s']:.0f} s. Metrics: {workdir}/metrics.jsonl, "
          f"curves: {workdir}/curves.png")


def run(config: ml_collections.ConfigDict, workdir: str, *, model_dir: str | None = None,
        on_ready: Callable[[dict], None] | None = None) -> dict[str, Any]:
  """Runs RL to config.rl.total_steps (or max_time_s). Returns a summary dict.

  `model_dir` overrides config.model.path (the demo passes the model it built).
  `on_ready` (tests) gets the live objects once both threads run.
  """
  config_lib.validate(config)
  os.makedirs(workdir, exist_ok=True)
  model_dir = model_dir or config.model.path
  if not model_dir:
    raise ValueError('config.model.path: no model directory given')
  g, rl = config.generation, config.rl

  # --- model and placement -----------------------------------------------------------------
  model_config = hf_io.load_config(
      model_dir, param_dtype=config.model.param_dtype, dtype=config.model.dtype,
      lm_head_fp32=config.model.lm_head_fp32, remat=config.model.remat,
      attention=config.model.attention, attention_block_q=config.model.attention_block_q,
      attention_block_kv=config.model.attention_block_kv)
  data, fsdp, tensor = (int(s) for s in config.train.mesh.split(','))
  mesh = sharding_lib.make_mesh(data, fsdp, tensor)
  optimizer = train.make_optimizer(train.OptimizerConfig(**config.optimizer.to_dict()))
  checkpoints = checkpoint_lib.Checkpointer(checkpoint_lib.directory(config, workdir),
                                            config.checkpoint.keep, config.checkpoint.every_steps)
  restored = checkpoint_lib.restore_latest(config, checkpoints, model_config, optimizer, mesh)
  resumed = None  # the checkpoint's meta when resuming
  if restored:
    state, state_sh, resumed = restored
  else:
    shapes = jax.eval_shape(lambda k: transformer.init_params(model_config, k),
                            jax.random.PRNGKey(0))
    params = hf_io.load_params(model_dir, model_config,
                               shardings=sharding_lib.param_shardings(shapes, mesh))
    state, state_sh = train.create_sharded_state(params, optimizer, mesh)
    del params
  schedule = train.lr_schedule(train.OptimizerConfig(**config.optimizer.to_dict()))
  train_step = train.jit_train_step(
      train.make_train_step(model_config, losses.LossConfig(**config.loss.to_dict()), optimizer,
                            schedule, temperature=g.temperature or 1.0),
      state_sh, mesh)
  batch_sh = sharding_lib.batch_sharding(mesh, leading_dims=1)

  data_parallel = sharding_lib.data_parallel_size(mesh)

  def put_batch(batch: dict[str, np.ndarray]):
    num_micro = packing.num_micro_batches(len(batch['tokens']), data_parallel,
                                          config.train.micro_batches, config.train.micro_batch_rows)
    micro = packing.split_microbatches({k: batch[k] for k in train.BATCH_KEYS}, num_micro)
    return jax.device_put(micro, {k: batch_sh for k in micro})

  # --- generation ----------------------------------------------------------------------------
  from transformers import AutoTokenizer  # heavy import, only when a run starts
  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  if tokenizer.eos_token_id is None:
    raise ValueError(f'{model_dir}: the tokenizer has no eos_token; generation could not stop')
  engine = make_engine(config, model_config, model_dir, mesh=mesh,
                       eos_token_id=tokenizer.eos_token_id, params=state.params,
                       version=int(state.step))
  to_generator = engine_publisher(config, mesh)
  if resumed and g.backend != 'jax':  # vLLM loaded model_dir's weights: replace them
    engine.update_params(to_generator(state.params), int(state.step))
  sampling = api.SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                max_tokens=g.max_new_tokens)

  task = make_task(config, tokenizer)
  check_prompt = pad_prompt_check(g.max_prompt_len)
  stop = threading.Event()
  capacity = stream_capacity(rl.mode, rl.batch_size, g.num_slots, rl.max_lag,
                             rl.conventional_steps)
  stream = stream_lib.SampleStream(
      capacity, stop, ledger=stream_lib.GroupLedger(**resumed['data']) if resumed else None)
  group_ids, problems = checkpoint_lib.data_stream(task.problems(config.seed),
                                                   resumed['data'] if resumed else None)
  actor = actor_lib.Actor(
      engine, problems, actor_lib.group_scorer(task),
      encode=lambda p: check_prompt(tokenizer.encode(p.prompt, add_special_tokens=False), p.id),
      decode=lambda t: tokenizer.decode(t, skip_special_tokens=True), stream=stream,
      config=actor_lib.ActorConfig(
          group_size=rl.group_size, num_slots=g.num_slots, sampling=sampling, seed=config.seed,
          advantage_baseline=config.advantage.baseline,
          advantage_normalize_std=config.advantage.normalize_std,
          drop_zero_advantage_groups=config.advantage.drop_zero_groups),
      stop=stop, group_ids=group_ids)

  writer = metrics_lib.MetricsWriter(workdir, tensorboard=config.log.tensorboard,
                                     progress=config.log.progress)
  records: list[dict] = []

  def log(record):
    record.update(actor.counters())
    for name, count in getattr(task, 'counters', {}).items():  # math: timeouts, restarts, ...
      record[f'task/{name}'] = count
    records.append(record)
    writer.write(record)

  evaluate_fn = None
  if config.eval.every_steps:
    from pipelinerl_jax import evaluate as evaluate_lib  # pylint: disable=g-import-not-at-top
    eval_problems = evaluate_lib.eval_sets(config, task)
    eval_device = generation_device(mesh)
    eval_copy = copy_params_fn(eval_device)

    def evaluate_fn(params, step):
      """The CLI's evaluation on the current params (a copy: the train step donates them)."""
      result = evaluate_lib.evaluate_params(config, model_config, eval_copy(params), tokenizer,
                                            task, eval_problems, device=eval_device)
      evaluate_lib.write_samples(os.path.join(workdir, 'eval', f'samples-{step}.jsonl'),
                                 result['samples'])
      return {**evaluate_lib.metrics_record(result), 'eval/seconds': result['seconds']}

  trainer = trainer_lib.Trainer(
      state, train_step, put_batch,
      publish=lambda params, version: engine.update_params(to_generator(params), version),
      stream=stream,
      config=trainer_lib.TrainerConfig(
          batch_size=rl.batch_size, seq_len=config.train.seq_len,
          micro_batches=config.train.micro_batches,
          row_multiple=packing.row_multiple(data_parallel, config.train.micro_batches,
                                            config.train.micro_batch_rows),
          mode=rl.mode, max_lag=rl.max_lag if rl.mode == 'pipeline' else None,
          conventional_steps=rl.conventional_steps, total_steps=rl.total_steps,
          max_time_s=rl.max_time_s, overlong=config.train.overlong),
      stop=stop, log=log, gen_stats=engine.stats,
      after_publish=lambda: save_checkpoint(final=False),
      evaluate=evaluate_fn, eval_every_steps=config.eval.every_steps)
  for name, value in (resumed['counters'] if resumed else {}).items():
    setattr(trainer, name, value)

  def save_checkpoint(final: bool) -> None:
    if final or checkpoints.due(trainer.step):
      checkpoints.save(trainer.state, checkpoint_lib.run_meta(config, model_dir, trainer))

  # --- the two loops -------------------------------------------------------------------------
  errors: list[tuple[str, BaseException]] = []

  def guarded(name, fn):
    def body():
      try:
        fn()
      except stream_lib.Stopped:
        pass
      except BaseException as e:  # reported by the main thread
        errors.append((name, e))
      finally:
        stop.set()  # either loop ending ends the run
    return threading.Thread(target=body, name=name, daemon=True)

  threads = [guarded('actor', actor.run), guarded('trainer', trainer.run)]
  interrupted = False
  t_start = time.monotonic()
  try:
    for t in threads:
      t.start()
    if on_ready is not None:
      on_ready(dict(actor=actor, trainer=trainer, engine=engine, stream=stream, stop=stop,
                    task=task))
    while not stop.is_set():
      stop.wait(0.2)
  except KeyboardInterrupt:
    interrupted = True
    t_interrupt = time.monotonic()
  finally:
    stop.set()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for t in threads:
      t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    t_stopped = time.monotonic()
    engine.close()
    getattr(task, 'close', lambda: None)()  # the math task's verify workers
    writer.close()
  if 'trainer' not in alive and 'trainer' not in [name for name, _ in errors]:
    save_checkpoint(final=True)  # also after Ctrl-C or the time budget: nothing trained is lost
  checkpoints.close()
  if interrupted:
    print(f'\n[run] loops stopped {t_stopped - t_interrupt:.1f} s after the interrupt',
          flush=True)
  if records:
    metrics_lib.plot_curves(records, os.path.join(workdir, 'curves.png'),
                            title=f'{rl.mode}, B={rl.batch_size}, G={rl.group_size}, '
                                  f'H={g.num_slots}')
  if errors:
    name, e = errors[0]
    raise RunError(f'{name} loop failed: {type(e).__name__}: {e}') from e
  if alive:
    raise RunError(f'{", ".join(alive)} did not stop within {STOP_TIMEOUT_S:.0f} s')
  return dict(
      steps=trainer.step, samples=trainer.samples_trained, interrupted=interrupted,
      wall_s=time.monotonic() - t_start, records=records, stale_dropped=trainer.stale_dropped,
      max_lag_seen=trainer.max_lag_seen,
      gen_train_overlap_s=overlap_seconds(actor.busy_intervals, trainer.busy_intervals),
      gen_busy_s=sum(e - s for s, e in actor.busy_intervals),
      train_busy_s=sum(e - s for s, e in trainer.busy_intervals), final_state=trainer.state,
      checkpoint=checkpoints.path if checkpoints.last_saved else None)
