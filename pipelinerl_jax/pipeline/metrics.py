"""Where a run's numbers go: DIR/metrics.jsonl (one object per optimizer step), TensorBoard
event files, optionally Weights & Biases, a live progress line, DIR/curves.png and the summary
at the end; and the generation/training overlap those numbers are judged by.

Every write is synchronous and raises where it fails: a full disk stops the run with one line
naming it. (tensorboardX's SummaryWriter writes from a thread with a bounded queue; when that
thread dies on a write error the queue fills and the trainer blocks forever.)

A resumed run continues the record: metrics.jsonl keeps the records up to the step it resumes
from (later ones, written by a run that died before saving them, move to
metrics.dropped.jsonl), TensorBoard is told to discard them (a SessionLog.START at that step),
and W&B continues the same run (its id is kept in DIR/wandb_run_id).

A skipped update (non-finite, see train.py) is a record of its own in metrics.jsonl:
`{"event": "skipped_update", "update": n, "policy_version": n - 1, ...}`, without a `step`,
since no step was taken; `read_metrics` leaves such records out unless asked.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from typing import Any, Sequence

REQUIRED_KEYS = ('step', 'time_s', 'samples', 'reward_mean', 'ess', 'lag_min', 'lag_mean',
                 'lag_max', 'gen_tokens_per_s', 'train_tokens_per_s', 'loss')
METRICS_FILE, DROPPED_FILE, WANDB_ID_FILE = 'metrics.jsonl', 'metrics.dropped.jsonl', 'wandb_run_id'


class MetricsWriter:
  """Writes each record everywhere it goes. `start_step` (the step a run starts from, 0 when
  fresh) drops records past it from metrics.jsonl and TensorBoard; None appends."""

  def __init__(self, workdir: str, tensorboard: bool = True, progress: bool = True,
               every: int = 10, *, start_step: int | None = None,
               wandb: dict[str, Any] | None = None):
    """`wandb`: keyword arguments of `wandb.init` (project, entity, config) to log there too."""
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    path = os.path.join(workdir, METRICS_FILE)
    self.dropped = 0 if start_step is None else truncate_records(
        path, start_step, os.path.join(workdir, DROPPED_FILE))
    self.time_offset = last_time_s(path)  # a resumed run's clock continues from here
    self._jsonl = open(path, 'a', buffering=1)
    self._tb = _TensorBoard(os.path.join(workdir, 'tb'), (start_step or 0) + 1) if tensorboard \
        else None
    self._wandb = _Wandb(workdir, **wandb) if wandb is not None else None
    self._progress = progress
    self._tty = sys.stdout.isatty()
    self._every = every

  def write(self, record: dict[str, Any]) -> None:
    self._jsonl.write(json.dumps(record, sort_keys=True) + '\n')
    if record.get('event') == 'skipped_update':
      print(f"\n[trainer] update {record['update']} skipped: non-finite loss, gradient or updated "
            f"state (loss {record['loss']:.4g}, grad_norm {record['grad_norm']:.4g}); "
            f"params stay at step {record['policy_version']}", flush=True)
      # TensorBoard: under their own tags (the step's own loss is at that step already). W&B:
      # the next step's record carries the count (its history takes one row per step).
      if self._tb is not None:
        self._tb.write({f'skipped_update/{k}': record[k] for k in ('loss', 'grad_norm')},
                       record['policy_version'])
      return
    scalars = {k: v for k, v in record.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and k != 'step'}
    if self._tb is not None:
      self._tb.write(scalars, record['step'])
    if self._wandb is not None:
      self._wandb.write(scalars, record['step'])
    if self._progress:
      # A live line on a terminal; in a log file, a line every `every` steps.
      if self._tty:
        sys.stdout.write('\r' + progress_line(record) + '  ')
        sys.stdout.flush()
      elif record['step'] % self._every == 0 or record['step'] == 1:
        print(progress_line(record), flush=True)

  def close(self) -> None:
    """Closes every output; the first error is raised once all were tried."""
    if self._progress and self._tty:
      sys.stdout.write('\n')
    errors = []
    for out in (self._jsonl, self._tb, self._wandb):
      try:
        if out is not None:
          out.close()
      except Exception as e:  # a full disk fails the flush; the others must still close
        errors.append(e)
    if errors:
      raise errors[0]


class _TensorBoard:
  """Event files written by the caller's thread, flushed every record."""

  def __init__(self, logdir: str, purge_step: int):
    from tensorboardX import event_file_writer  # lazily: library users may log JSON only
    from tensorboardX.proto import event_pb2
    from tensorboardX.proto import summary_pb2
    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    os.makedirs(logdir, exist_ok=True)
    # The suffix keeps two writers started within one second from sharing (truncating) a file.
    self._writer = event_file_writer.EventsWriter(os.path.join(logdir, 'events'),
                                                  filename_suffix=f'.{time.time_ns()}')
    # TensorBoard discards events at or past this step from earlier files: a resumed run's
    # steps replace those of the run that died before saving them.
    self._writer.write_event(event_pb2.Event(
        step=purge_step, wall_time=time.time(),
        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
    self._writer.flush()

  def write(self, scalars: dict[str, float], step: int) -> None:
    # Tags allow [A-Za-z0-9_./-]: eval/pass@4 -> eval/pass_at_4.
    summary = self._summary_pb2.Summary(value=[
        self._summary_pb2.Summary.Value(tag=k.replace('@', '_at_'), simple_value=float(v))
        for k, v in scalars.items()])
    self._writer.write_event(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                                   summary=summary))
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


class _Wandb:
  """A W&B run for the workdir: the id is kept in DIR/wandb_run_id, so a resumed run continues
  it. W&B's history only moves forward: steps a killed run logged past its checkpoint stay there
  (metrics.jsonl and TensorBoard drop them), and the resumed run's repeats of them are not
  logged again."""

  def __init__(self, workdir: str, project: str, entity: str = '',
               config: dict[str, Any] | None = None):
    import wandb  # the [wandb] extra
    id_path = os.path.join(workdir, WANDB_ID_FILE)
    run_id = ''
    if os.path.exists(id_path):
      with open(id_path) as f:
        run_id = f.read().strip()
    if not run_id:
      run_id = secrets.token_hex(4)  # W&B ids: letters, digits, '-', '_'; 8 is its own length
      with open(id_path, 'w') as f:
        f.write(run_id + '\n')
    self._run = wandb.init(project=project, entity=entity or None, id=run_id, resume='allow',
                           dir=workdir, config=config)
    self._last_step = self._run.starting_step - 1 if self._run.resumed else -1

  def write(self, scalars: dict[str, float], step: int) -> None:
    if step > self._last_step:
      self._run.log(scalars, step=step)
      self._last_step = step
    # else: W&B would drop it with a warning per record (see the class comment)

  def close(self) -> None:
    self._run.finish()


def truncate_records(path: str, start_step: int, dropped_path: str) -> int:
  """Keeps the records of metrics.jsonl up to `start_step` (step records and skipped-update
  events alike); moves later ones to `dropped_path`. Returns how many moved."""
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  keep, drop = [], []
  for line in lines:
    try:
      record = json.loads(line)
      step = record['step'] if 'step' in record else record['update']
    except (ValueError, KeyError, TypeError):  # a line cut short by a kill: not a record
      drop.append(line if line.endswith('\n') else line + '\n')
      continue
    (keep if step <= start_step else drop).append(line)
  if drop:
    with open(dropped_path, 'a') as f:
      f.writelines(drop)
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
      f.writelines(keep)
    os.replace(tmp, path)
  return len(drop)


def last_time_s(path: str) -> float:
  """time_s of the last step record of metrics.jsonl (0 when there is none)."""
  records = read_metrics(path) if os.path.exists(path) else []
  return float(records[-1]['time_s']) if records else 0.0


def progress_line(r: dict[str, Any]) -> str:
  return (f"step {r['step']:>4}  t {r['time_s']:6.1f}s  reward {r['reward_mean']:.3f}  "
          f"ess {r.get('ess', float('nan')):.3f}  lag {r['lag_min']:.0f}/{r['lag_mean']:.2f}/"
          f"{r['lag_max']:.0f}  gen {r.get('gen_tokens_per_s', 0):7.0f} tok/s  "
          f"train {r['train_tokens_per_s']:7.0f} tok/s  loss {r['loss']:+.4f}")


def read_metrics(path: str, events: bool = False) -> list[dict[str, Any]]:
  """The step records of a metrics.jsonl; with `events`, skipped-update records too."""
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return records if events else [r for r in records if 'step' in r]


def smooth(values: Sequence[float], window: int) -> list[float]:
  """Trailing mean: rewards swing +-0.1 step to step on small batches."""
  out, acc = [], []
  for v in values:
    acc.append(v)
    acc = acc[-window:]
    out.append(sum(acc) / len(acc))
  return out


def plot_curves(records: list[dict[str, Any]], path: str, title: str = '') -> None:
  """Reward, ESS, lag (per token; a sample's first and last token), policy versions per sample
  and the shares of multi-version, length-limited and IS-capped samples, against time."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  t = [r['time_s'] for r in records]
  fig, axes = plt.subplots(1, 5, figsize=(23, 3.8))
  axes[0].plot(t, [r['reward_mean'] for r in records], alpha=0.35, label='per step')
  axes[0].plot(t, smooth([r['reward_mean'] for r in records], 10), label='mean of 10')
  axes[0].set(title='reward', xlabel='time (s)', ylim=(-0.02, 1.02))
  axes[0].legend()
  axes[1].plot(t, [r['ess'] for r in records], label='ESS')
  if 'ess_is_capped' in records[0]:
    axes[1].plot(t, [r['ess_is_capped'] for r in records], label='ESS (IS-capped w)')
  axes[1].set(title='effective sample size', xlabel='time (s)', ylim=(0, 1.02))
  axes[1].legend()
  for key in ('lag_max', 'lag_mean', 'lag_min', 'lag_first_token_mean', 'lag_last_token_mean'):
    if key in records[0]:  # (records of older runs lack the per-sample ones)
      axes[2].plot(t, [r[key] for r in records], label=key)
  axes[2].set(title='token lag (optimizer steps)', xlabel='time (s)')
  axes[2].legend()
  # In-flight weight updates at work: policy versions among one sample's tokens.
  for key in ('versions_per_sample_max', 'versions_per_sample_mean'):
    if key in records[0]:
      axes[3].plot(t, [r[key] for r in records], label=key)
  axes[3].set(title='policy versions per sample', xlabel='time (s)')
  axes[3].legend()
  for key in ('frac_multi_version', 'frac_hit_length_limit', 'frac_is_capped'):
    if key in records[0]:
      axes[4].plot(t, [r[key] for r in records], label=key)
  axes[4].set(title='shares of samples (IS-capped: of tokens)', xlabel='time (s)',
              ylim=(-0.02, 1.02))
  axes[4].legend()
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def overlap_seconds(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
  """Total time during which an interval of `a` and one of `b` both ran."""
  total = 0.0
  b = sorted(b)
  for s, e in sorted(a):
    for bs, be in b:
      if bs >= e:
        break
      total += max(0.0, min(e, be) - max(s, bs))
  return total


def summary_text(summary: dict[str, Any], workdir: str) -> str:
  """The line a finished run prints."""
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
