"""Orbax checkpoints of a run, for exact resume; and params from a checkpoint or an HF dir.

A checkpoint is one step directory under config.checkpoint.dir holding two items:
  state/  the TrainState (step = policy version, params, optimizer state). Every array is
          written with its sharding and restored straight into the trainer's shardings. With
          LoRA the params are the adapters and the optimizer state theirs: the frozen base is
          not copied, it is the model dir that meta/ names (and config.model.lora says how).
  meta/   JSON: the seed, the data position (see stream.GroupLedger), trainer counters, the
          run's config and model dir.
Orbax writes a step into a temporary directory and renames it once complete, so a save cut
short (a second Ctrl-C, a crash) never becomes the latest checkpoint. Such a partial save is
removed when the next run opens the directory, and at once when a save fails (a full disk): left
behind, it would keep the disk full. A latest checkpoint that does not restore (a truncated
file, a non-finite state) is moved aside as <step>.unreadable and the run resumes from the one
before it, saying so.

Why a resume can be exact: training uses no randomness, sampling is keyed by (seed, group id,
sample index), and group i is always problem i of `task.problems(seed)`. So the restored state,
seed and data position make the resumed run generate the same groups under the same weights.
That holds in conventional mode, where a checkpoint is taken at a sync boundary and every
admitted group has been trained. In pipeline mode the groups in flight at save time are lost;
the resumed run generates them again, under the restored weights (everything trained or
dropped before the save is skipped, so no problem is trained twice).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import jax
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import train
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import files as hf_files
from pipelinerl_jax.models.hf import peft as hf_peft
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models import transformer

STATE, META = 'state', 'meta'


def directory(config: config_lib.Config, workdir: str) -> str:
  """config.checkpoint.dir, or <workdir>/checkpoints; absolute (orbax wants that)."""
  return os.path.abspath(config.checkpoint.dir or os.path.join(workdir, 'checkpoints'))


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f'{type(e).__name__}: {lines[0] if lines else ""}'[:300]


def _manager(path: str | os.PathLike, keep: int | None = None,
             read_only: bool = False) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=not read_only, read_only=read_only,
      # Synchronous: the next train step donates the state's buffers.
      enable_async_checkpointing=False,
      cleanup_tmp_directories=not read_only)  # partial saves of a run that died
  try:
    return ocp.CheckpointManager(os.path.abspath(path), options=options,
                                 item_names=(STATE, META))
  except Exception as e:  # e.g. the path is a file
    raise ValueError(f'{path}: not a usable checkpoint directory ({_first_line(e)})') from None


def trainable_params(model_config: transformer.ModelConfig, rng: jax.Array,
                     lora: config_lib.LoraSettings | None = None):
  """What a run trains, freshly initialized: every param, or with `lora` the adapters (in the
  param dtype)."""
  if lora is None:
    return transformer.init_params(model_config, rng)
  return lora_lib.init_adapters(model_config, lora, rng, model_config.param_dtype)


def abstract_state(model_config: transformer.ModelConfig, optimizer: optax.GradientTransformation,
                   mesh, lora: config_lib.LoraSettings | None = None
                   ) -> tuple[train.TrainState, train.TrainState]:
  """(ShapeDtypeStructs carrying the trainer's shardings, the shardings): a restore target."""
  shapes = jax.eval_shape(
      lambda k: train.init_train_state(trainable_params(model_config, k, lora), optimizer),
      jax.random.PRNGKey(0))
  shardings = train.state_shardings(shapes, mesh)
  target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)
  return target, shardings


def state_bytes(model_config: transformer.ModelConfig,
                optimizer: optax.GradientTransformation,
                lora: config_lib.LoraSettings | None = None) -> int:
  """Bytes of one checkpoint's arrays (params and optimizer state), from shapes alone."""
  shapes = jax.eval_shape(
      lambda k: train.init_train_state(trainable_params(model_config, k, lora), optimizer),
      jax.random.PRNGKey(0))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


class Checkpointer:
  """A run's checkpoints: save every `every_steps` (0: only when asked), keep the last `keep`."""

  def __init__(self, path: str, keep: int, every_steps: int):
    self.path, self.every_steps = path, every_steps
    self._manager = _manager(path, keep=keep)
    self.last_saved = self.latest_step() or 0

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def due(self, step: int) -> bool:
    """A multiple of every_steps was reached since the last save (conventional mode publishes
    only every conventional_steps steps, so the boundary may be passed, not hit)."""
    return bool(self.every_steps) and step // self.every_steps > self.last_saved // self.every_steps

  def save(self, state: train.TrainState, meta: dict[str, Any]) -> bool:
    """Writes step `state.step` unless it is 0 (the model dir is that) or already saved."""
    step = int(state.step)
    if step == 0 or step in self._manager.all_steps():
      return False
    try:
      self._manager.save(step, args=ocp.args.Composite(
          **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}))
      self._manager.wait_until_finished()
    except Exception as e:
      removed = self._remove_partial(step)
      why = _first_line(e)
      if 'No space left on device' in str(e):  # orbax's message buries it at its end
        why = f'no space left on device: {shutil.disk_usage(self.path).free >> 20} MB free'
      latest = self.latest_step()
      raise OSError(f'{self.path}: could not write the checkpoint of step {step} ({why}); '
                    f'{removed}' + (f'the latest complete one is step {latest}'
                                    if latest is not None else 'no complete one exists yet')
                    ) from None
    self.last_saved = step
    return True

  def _remove_partial(self, step: int) -> str:
    """Deletes what a failed save of `step` left (orbax's temporary directory)."""
    partial = [p for p in Path(self.path).glob(f'{step}.orbax-checkpoint-tmp*')]
    for p in partial:
      shutil.rmtree(p, ignore_errors=True)
    return 'its partial files were removed; ' if partial else ''

  def set_aside(self, step: int) -> str:
    """Renames step dir `step` to <step>.unreadable (orbax ignores that name), so the run's
    later save of that step is not skipped as already done; returns the new path."""
    src = Path(self.path) / str(step)
    dst = src.with_name(f'{step}.unreadable')
    n = 1
    while dst.exists():
      n += 1
      dst = src.with_name(f'{step}.unreadable.{n}')
    src.rename(dst)
    self._manager.reload()
    return str(dst)

  def restore(self, target: train.TrainState, step: int | None = None
              ) -> tuple[train.TrainState, dict[str, Any]]:
    """(state placed as `target` says, meta) of `step` (default: the latest)."""
    step = self.latest_step() if step is None else step
    step_dir = os.path.join(self.path, str(step))
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          **{STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()}))
    except Exception as e:
      raise ValueError(f'{step_dir}: cannot restore this checkpoint ({_first_line(e)})'
                       ) from None
    # One jitted program: leaf by leaf, each sharded leaf would be its own collective (on 8
    # simulated CPU devices under load, XLA's 40 s rendezvous timeout then aborted the process).
    if not bool(jax.jit(train.all_finite)(restored[STATE])):
      raise ValueError(f'{step_dir}: the checkpoint holds non-finite params or optimizer state')
    return restored[STATE], restored[META]

  def close(self) -> None:
    self._manager.close()


def run_meta(config: config_lib.Config, model_dir: str, trainer_meta: dict[str, Any]
             ) -> dict[str, Any]:
  """What a resumed run needs besides the TrainState (`trainer_meta`: the trainer's
  `checkpoint_meta()`), and what export needs to find the model."""
  return dict(**trainer_meta, seed=config.seed, model_dir=os.path.abspath(model_dir),
              config=dataclasses.asdict(config))


def check_resumable(meta: dict[str, Any], config: config_lib.Config, path: str) -> None:
  """The data stream is a function of the seed: another seed would not continue this run."""
  if meta['seed'] != config.seed:
    raise ValueError(f"config.seed: {config.seed} differs from the checkpoint's seed "
                     f"{meta['seed']} in {path}; use that seed, or set config.checkpoint.dir to a "
                     'new directory')


def saved_lora(meta: dict[str, Any]) -> config_lib.LoraSettings | None:
  """The LoRA a checkpoint's state was trained with (None: every weight; also for checkpoints
  written before LoRA existed)."""
  saved = meta.get('config', {}).get('model', {}).get('lora')
  return lora_lib.active(config_lib.LoraSettings(**saved)) if saved else None


def check_same_trainable(meta: dict[str, Any], config: config_lib.Config, path: str,
                         model_config: transformer.ModelConfig) -> None:
  """A checkpoint holds what its run trained (every weight, or adapters of one rank on one set
  of the model's projections): another config.model.lora could not restore it. Targets the model
  does not have make no difference (a list written before the Gated DeltaNet's existed)."""
  saved, wanted = saved_lora(meta), lora_lib.active(config.model.lora)
  # A's init seed: no matter once saved.
  trained = lambda l: l and (l.rank, l.alpha, lora_lib.targets_in(model_config, l))
  if trained(saved) != trained(wanted):
    describe = lambda l: 'full fine-tuning' if l is None else (
        f'LoRA rank {l.rank} alpha {l.alpha:g} on '
        f'{",".join(lora_lib.targets_in(model_config, l))}')
    raise ValueError(f'config.model.lora: this run is {describe(wanted)}, the checkpoints in '
                     f'{path} are {describe(saved)}; use the same settings, or set '
                     'config.checkpoint.dir to a new directory')


def restore_latest(config: config_lib.Config, checkpoints: Checkpointer,
                   model_config: transformer.ModelConfig, optimizer: optax.GradientTransformation,
                   mesh) -> tuple[train.TrainState, train.TrainState, dict[str, Any]] | None:
  """(state in the trainer's shardings, those shardings, meta) of the latest checkpoint when
  config.checkpoint.resume and there is one; None for a fresh start."""
  check_fresh_start(config, checkpoints)
  if not config.checkpoint.resume or checkpoints.latest_step() is None:
    return None
  # Before restoring: a state of another shape would otherwise read as an unreadable checkpoint.
  check_same_trainable(read_meta(checkpoints.path), config, checkpoints.path, model_config)
  target, shardings = abstract_state(model_config, optimizer, mesh,
                                     lora_lib.active(config.model.lora))
  state, meta = _restore_newest_readable(checkpoints, target)
  check_resumable(meta, config, checkpoints.path)
  print(f'[run] resuming from {checkpoints.path} at step {int(state.step)}', flush=True)
  return state, shardings, meta


def _restore_newest_readable(checkpoints: Checkpointer, target: train.TrainState
                             ) -> tuple[train.TrainState, dict[str, Any]]:
  """The newest checkpoint that restores; the ones after it are set aside, each with a line
  saying why. None restoring is a ValueError."""
  problems = []
  for step in reversed(checkpoints.all_steps()):
    try:
      state, meta = checkpoints.restore(target, step)
    except ValueError as e:
      problems.append((step, str(e)))
      continue
    for bad, why in problems:
      moved = checkpoints.set_aside(bad)
      print(f'[run] {why}: moved to {moved}; resuming from step {step} instead', flush=True)
    return state, meta
  raise ValueError(f'{problems[0][1]}, and no earlier checkpoint restores either; move '
                   f'{checkpoints.path} away or set config.checkpoint.dir to a new directory')


def check_fresh_start(config: config_lib.Config, checkpoints: Checkpointer) -> None:
  """A fresh run must not write into another run's checkpoints: its saves would mix with them
  (and the other run's later steps would stay the 'latest')."""
  step = checkpoints.latest_step()
  if not config.checkpoint.resume and step is not None:
    raise ValueError(f'config.checkpoint.resume: is False, but {checkpoints.path} holds '
                     f'checkpoints of another run (latest step {step}); set config.checkpoint.dir '
                     'to another directory or delete them')


def data_stream(problems: Iterator, position: dict[str, Any] | None
                ) -> tuple[Iterator[int] | None, Iterator]:
  """(group ids, their problems) from a saved data position (None: a fresh run's 0, 1, ...):
  problem i goes to group i, and groups at or above `next_group` that were already finished with
  are skipped."""
  if position is None:
    return None, problems
  start, skip = position['next_group'], set(position['done_above'])
  ids = (i for i in itertools.count(start) if i not in skip)
  return ids, (p for i, p in enumerate(problems) if i >= start and i not in skip)


# ---------------------------------------------------------------------------------------------
# Reading checkpoints outside a run (evaluation, export).


def is_hf_dir(path: str | os.PathLike) -> bool:
  p = Path(path)
  return (p / hf_schema.CONFIG_FILE).is_file() and (
      (p / hf_checkpoint.SINGLE_FILE).is_file() or (p / hf_checkpoint.INDEX_FILE).is_file())


def locate(path: str | os.PathLike, step: int | None = None) -> tuple[Path, int]:
  """(checkpoints root, step) for a run's checkpoints dir (latest step, or `step`) or for one
  step dir. Raises FileNotFoundError naming the path when there is no checkpoint there."""
  p = Path(path).absolute()
  if not p.is_dir():
    raise FileNotFoundError(f'{p}: no such checkpoint directory')
  if (p / STATE).is_dir() and p.name.isdigit():
    if step is not None and step != int(p.name):
      raise ValueError(f'{p}: is the checkpoint of step {p.name}, not of step {step}')
    return p.parent, int(p.name)
  steps = _manager(p, read_only=True).all_steps()
  if not steps:
    raise FileNotFoundError(f'{p}: no checkpoint here (expected step directories with '
                            f'{STATE}/ and {META}/)')
  if step is None:
    return p, max(steps)
  if step not in steps:
    raise FileNotFoundError(f'{p}: no checkpoint of step {step} (have {sorted(steps)})')
  return p, step


def read_meta(path: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
  root, step = locate(path, step)
  try:
    return _manager(root, read_only=True).restore(
        step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
  except Exception as e:
    raise ValueError(f'{root / str(step)}: cannot read {META}/ ({_first_line(e)})') from None


def load_params(path: str | os.PathLike, model_config: transformer.ModelConfig,
                shardings=None, step: int | None = None, model_dir: str | None = None):
  """Params from an orbax checkpoint (a run's checkpoints dir: the latest step, or `step`; or
  one step dir) or from an HF dir (config.json + safetensors), cast to model_config.param_dtype.

  `shardings`: a pytree of shardings shaped like the params (None: all on the first device).
  Only the params are read from an orbax checkpoint, not the optimizer state. A LoRA run's
  checkpoint gives `lora.Adapted`: its adapters, on the base its meta names (the model dir the
  run loaded; `model_dir` where it has moved), which is held in model_config.dtype as in the run
  (`shardings` then places the base).
  """
  if is_hf_dir(path):
    return hf_checkpoint.load_params(path, model_config, shardings=shardings)
  root, step = locate(path, step)
  meta = read_meta(root, step)
  lora = saved_lora(meta)
  if lora is None:
    return _restore_params(root, step, model_config, None, shardings)
  adapters = _restore_params(root, step, model_config, lora, None)
  base_dir = model_dir or meta['model_dir']
  if not is_hf_dir(base_dir):
    raise FileNotFoundError(f'{base_dir}: the base model of the LoRA checkpoint {root / str(step)} '
                            'is not there (pass the model dir where it is now)')
  base = hf_checkpoint.load_params(base_dir, frozen_base_config(model_config), shardings=shardings)
  return lora_lib.Adapted(base, adapters, lora.scale)


def is_peft_dir(path: str | os.PathLike) -> bool:
  """A PEFT LoRA adapter dir (`export --format=peft` writes one)."""
  p = Path(path)
  return (p / hf_peft.CONFIG_FILE).is_file() and (p / hf_peft.WEIGHTS_FILE).is_file()


def read_peft_config(path: str | os.PathLike) -> tuple[config_lib.LoraSettings, str]:
  """(the LoRA settings, the base model it names) of a PEFT adapter dir; a LoRA this project
  cannot serve (rsLoRA, DoRA, other modules) is refused in one line."""
  file = Path(path) / hf_peft.CONFIG_FILE
  try:
    c = json.loads(file.read_text())
    targets = c['target_modules']
    targets = [targets] if isinstance(targets, str) else list(targets)
    lora = config_lib.LoraSettings(rank=int(c['r']), alpha=float(c['lora_alpha']),
                                   targets=tuple(t.split('.')[-1] for t in targets))
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise ValueError(f'{file}: not a LoRA adapter config this project reads ({_first_line(e)})'
                     ) from None
  if c.get('use_rslora') or c.get('use_dora') or c.get('peft_type', 'LORA') != 'LORA':
    raise ValueError(f'{file}: only plain LoRA adapters are read (not rsLoRA, DoRA or other PEFT '
                     'types)')
  return lora, str(c.get('base_model_name_or_path') or '')


_PEFT_DTYPES = {'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16}


def load_peft_adapters(path: str | os.PathLike, model_config: transformer.ModelConfig,
                       lora: config_lib.LoraSettings) -> dict:
  """The adapters pytree (a [L, Di, Ra], b [L, Ra, Do], in model_config.param_dtype) of a PEFT
  adapter dir, by the names PEFT writes (`hf.peft.tensor_name`); a missing or misshapen tensor
  is named in one line."""
  file = Path(path) / hf_peft.WEIGHTS_FILE
  header, start = hf_files.read_safetensors_header(file)
  mmap = np.memmap(file, dtype=np.uint8, mode='r')

  def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    entry = header.get(name)
    if entry is None:
      raise ValueError(f'{file}: no tensor {name} (rank {lora.rank}, targets '
                       f'{", ".join(lora.targets)})')
    if entry['dtype'] not in _PEFT_DTYPES or tuple(entry['shape']) != shape:
      raise ValueError(f'{file}: {name} is {entry["dtype"]}{entry["shape"]}, expected a float '
                       f'tensor of shape {list(shape)}')
    begin, end = entry['data_offsets']
    return mmap[start + begin:start + end].view(_PEFT_DTYPES[entry['dtype']]).reshape(shape)

  rows = hf_peft.stacked(tensor, model_config, lora)
  return lora_lib.nest({path: jax.numpy.asarray(np.stack(r).astype(np.float32),
                                                dtype=model_config.param_dtype)
                        for path, r in rows.items()})


def frozen_base_config(model_config: transformer.ModelConfig) -> transformer.ModelConfig:
  """The model config the frozen base of a LoRA run is loaded with: held in the compute dtype
  (it is never updated, so no master copy in param_dtype is needed)."""
  return dataclasses.replace(model_config, param_dtype=model_config.dtype)


def _restore_params(root: Path, step: int, model_config: transformer.ModelConfig,
                    lora: config_lib.LoraSettings | None, shardings):
  """The state's params (every weight, or the adapters) of one step."""
  shapes = jax.eval_shape(functools.partial(trainable_params, model_config, lora=lora),
                          jax.random.PRNGKey(0))
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda _: device, shapes)
  target = {'params': jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)}
  try:
    restored = _manager(root, read_only=True).restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)}))
  except Exception as e:
    raise ValueError(f'{root / str(step)}: cannot read params ({_first_line(e)})') from None
  return restored[STATE]['params']
