"""Where a run's numbers go: DIR/metrics.jsonl (one object per optimizer step), TensorBoard
event files, a live progress line, DIR/curves.png and the summary at the end; and the
generation/training overlap those numbers are judged by."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

REQUIRED_KEYS = ('step', 'time_s', 'samples', 'reward_mean', 'ess', 'lag_min', 'lag_mean',
                 'lag_max', 'gen_tokens_per_s', 'train_tokens_per_s', 'loss')


class MetricsWriter:

  def __init__(self, workdir: str, tensorboard: bool = True, progress: bool = True,
               every: int = 10):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', buffering=1)
    self._tb = None
    if tensorboard:
      import tensorboardX  # imported lazily: not needed by library users who only log JSON
      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, 'tb'))
    self._progress = progress
    self._tty = sys.stdout.isatty()
    self._every = every

  def write(self, record: dict[str, Any]) -> None:
    self._jsonl.write(json.dumps(record, sort_keys=True) + '\n')
    if self._tb is not None:
      for k, v in record.items():
        if isinstance(v, (int, float)) and k != 'step':
          # TensorBoard tags allow [A-Za-z0-9_./-]: eval/pass@4 -> eval/pass_at_4 (else
          # tensorboardX renames it itself and logs a line about it at every write).
          self._tb.add_scalar(k.replace('@', '_at_'), v, record['step'])
    if self._progress:
      # A live line on a terminal; in a log file, a line every `every` steps.
      if self._tty:
        sys.stdout.write('\r' + progress_line(record) + '  ')
        sys.stdout.flush()
      elif record['step'] % self._every == 0 or record['step'] == 1:
        print(progress_line(record), flush=True)

  def close(self) -> None:
    if self._progress and self._tty:
      sys.stdout.write('\n')
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


def progress_line(r: dict[str, Any]) -> str:
  return (f"step {r['step']:>4}  t {r['time_s']:6.1f}s  reward {r['reward_mean']:.3f}  "
          f"ess {r.get('ess', float('nan')):.3f}  lag {r['lag_min']:.0f}/{r['lag_mean']:.2f}/"
          f"{r['lag_max']:.0f}  gen {r.get('gen_tokens_per_s', 0):7.0f} tok/s  "
          f"train {r['train_tokens_per_s']:7.0f} tok/s  loss {r['loss']:+.4f}")


def read_metrics(path: str) -> list[dict[str, Any]]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def smooth(values: Sequence[float], window: int) -> list[float]:
  """Trailing mean: rewards swing +-0.1 step to step on small batches."""
  out, acc = [], []
  for v in values:
    acc.append(v)
    acc = acc[-window:]
    out.append(sum(acc) / len(acc))
  return out


def plot_curves(records: list[dict[str, Any]], path: str, title: str = '') -> None:
  """Reward, ESS and lag (min / mean / max) against wall-clock time."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  t = [r['time_s'] for r in records]
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  axes[0].plot(t, [r['reward_mean'] for r in records], alpha=0.35, label='per step')
  axes[0].plot(t, smooth([r['reward_mean'] for r in records], 10), label='mean of 10')
  axes[0].set(title='reward', xlabel='time (s)', ylim=(-0.02, 1.02))
  axes[0].legend()
  axes[1].plot(t, [r['ess'] for r in records], label='ESS')
  if 'ess_truncated' in records[0]:
    axes[1].plot(t, [r['ess_truncated'] for r in records], label='ESS (truncated w)')
  axes[1].set(title='effective sample size', xlabel='time (s)', ylim=(0, 1.02))
  axes[1].legend()
  for key in ('lag_max', 'lag_mean', 'lag_min'):
    axes[2].plot(t, [r[key] for r in records], label=key)
  axes[2].set(title='token lag (optimizer steps)', xlabel='time (s)')
  axes[2].legend()
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
