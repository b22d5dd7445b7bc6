"""Benchmark of the trainer in several processes: the same train step on a mesh of the same
size, in 1 process and in N (here on localhost with CPU collectives; on GPUs, one per host),
with what process 0 adds per step: packing the batch and sending it to the others.

  python -m pipelinerl_jax.bench.multiprocess --model=tiny,50m --devices=2 --processes=1,2
  python -m pipelinerl_jax.bench.multiprocess --rows=192 --seq_len=16384 --steps=0  # send only
  python -m pipelinerl_jax.bench.multiprocess --quick

Each configuration runs as its own processes (distributed.LocalProcesses), `--devices` CPU
devices in all, split evenly among them. Process 0 packs random samples
(bench/train_step.py's batch) and, per step, announces the step and broadcasts the packed batch
exactly as pipeline/multiprocess.py does; every process places its rows and runs the jitted
step (AdamW, as a run does), ended by `jax.block_until_ready`. `--steps=0` times packing and
sending only. Prints one row per (model, processes) and writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

RESULT_KEYS = ('model', 'processes', 'devices', 'rows', 'seq_len', 'tokens', 'batch_mib',
               'pack_s', 'send_s_median', 'step_s_median', 'step_s_min', 'tokens_per_s',
               'loadavg')
QUICK_DEFAULTS = dict(model='tiny', rows=8, seq_len=64, steps=2, devices=2)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m pipelinerl_jax.bench.multiprocess',
                              description=__doc__.split('\n')[0])
  p.add_argument('--model', default='tiny', help='bench/train_step.py presets, comma-separated')
  p.add_argument('--processes', default='1,2', help='process counts to compare, comma-separated')
  p.add_argument('--devices', type=int, default=2, help='CPU devices in all (mesh 1,devices,1)')
  p.add_argument('--rows', type=int, default=16, help='packed rows per step')
  p.add_argument('--seq_len', type=int, default=512, help='positions per packed row')
  p.add_argument('--steps', type=int, default=5, help='timed steps (0: pack and send only)')
  p.add_argument('--warmup', type=int, default=1, help='untimed steps after the first')
  p.add_argument('--out', default='/tmp/bench_multiprocess.json', help='JSON output path')
  p.add_argument('--quick', action='store_true', help=f'small defaults: {QUICK_DEFAULTS}')
  p.add_argument('--child', nargs=3, metavar=('PROCESS', 'PROCESSES', 'ADDRESS'),
                 help=argparse.SUPPRESS)  # one of the benchmarked processes
  p.add_argument('--child_out', help=argparse.SUPPRESS)
  return p


def parse_args(argv: list[str]) -> argparse.Namespace:
  args = build_parser().parse_args(argv)
  if args.quick:
    given = {a.split('=')[0].lstrip('-') for a in argv if a.startswith('--')}
    for k, v in QUICK_DEFAULTS.items():
      if k not in given:
        setattr(args, k, v)
  args.model = [m for m in args.model.split(',') if m]
  args.processes = [int(n) for n in str(args.processes).split(',') if n]
  for n in args.processes:
    if n < 1 or args.devices % n:
      raise SystemExit(f'--processes={n}: --devices={args.devices} must split evenly')
  return args


# --- one benchmarked process -------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
  """Process `PROCESS` of `PROCESSES`: every model's steps; process 0 writes the results."""
  import jax
  import numpy as np

  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax import distributed
  from pipelinerl_jax import packing
  from pipelinerl_jax import sharding as sharding_lib
  from pipelinerl_jax import train
  from pipelinerl_jax.bench import train_step as train_bench
  from pipelinerl_jax.models import transformer
  from pipelinerl_jax.pipeline import build as build_lib
  from pipelinerl_jax.pipeline import multiprocess

  index, count, address = int(args.child[0]), int(args.child[1]), args.child[2]
  distributed.initialize(config_lib.TrainConfig(
      num_processes=count, distributed=config_lib.DistributedConfig(
          coordinator_address=address, process_id=index) if count > 1 else
      config_lib.DistributedConfig()))
  commands = multiprocess.Commands() if count > 1 else None
  mesh = sharding_lib.make_mesh(1, -1, 1)
  put_batch = build_lib.batch_placer(config_lib.TrainConfig(), mesh)
  results = []
  for name in args.model:
    model_config = train_bench.MODEL_PRESETS[name]
    batch, pack_s = None, 0.0
    if distributed.is_primary():
      rng = np.random.default_rng(0)
      samples = train_bench.random_samples(rng, int(0.9 * args.rows * args.seq_len),
                                           args.seq_len, model_config.vocab_size)
      t0 = time.perf_counter()
      batch, _ = packing.pack_samples(samples, args.seq_len, row_multiple=len(jax.devices()))
      pack_s = time.perf_counter() - t0
      batch = {k: batch[k] for k in train.BATCH_KEYS}

    def send(batch):
      """Process 0: announce and broadcast; the others: receive. The batch every process has."""
      if commands is None:
        return batch
      if distributed.is_primary():
        commands.send('train', arrays=batch)
        return batch
      return commands.receive()[2]

    state = step = None
    if args.steps:
      optimizer = train.make_optimizer(config_lib.OptimizerConfig(lr=1e-6))
      params = jax.jit(lambda k: transformer.init_params(model_config, k),
                       out_shardings=sharding_lib.param_shardings(
                           jax.eval_shape(lambda k: transformer.init_params(model_config, k),
                                          jax.random.PRNGKey(0)), mesh))(jax.random.PRNGKey(0))
      state, state_sh = train.create_sharded_state(params, optimizer, mesh)
      step = train.jit_train_step(
          train.make_train_step(model_config, config_lib.LossConfig(), optimizer, lambda _: 1e-6),
          state_sh, mesh)
    send_s, step_s = [], []
    for i in range(1 + args.warmup + max(args.steps, 3)):
      t0 = time.perf_counter()
      got = send(batch)
      t1 = time.perf_counter()
      if step is not None:
        state, metrics = jax.block_until_ready(step(state, put_batch(got)))
      t2 = time.perf_counter()
      if i > args.warmup:
        send_s.append(t1 - t0)
        step_s.append(t2 - t1)
    if distributed.is_primary():
      tokens = int((batch['segment_ids'] > 0).sum())
      results.append(dict(
          model=name, processes=count, devices=len(jax.devices()), rows=len(batch['tokens']),
          seq_len=args.seq_len, tokens=tokens,
          batch_mib=sum(x.nbytes for x in batch.values()) / 2**20, pack_s=pack_s,
          send_s_median=float(np.median(send_s)),
          step_s_median=float(np.median(step_s)) if args.steps else None,
          step_s_min=float(np.min(step_s)) if args.steps else None,
          tokens_per_s=tokens / float(np.median(step_s)) if args.steps else None,
          loadavg=os.getloadavg()[0]))
  if commands is not None and distributed.is_primary():
    commands.stop(error=None, grace_s=0)
  if args.child_out:
    with open(args.child_out, 'w') as f:
      json.dump(results, f)


# --- the launcher ------------------------------------------------------------------------------


def run_config(args: argparse.Namespace, processes: int, workdir: str) -> list[dict]:
  from pipelinerl_jax import distributed  # imports jax: not needed by the launcher before
  out = os.path.join(workdir, f'{processes}.json')
  forwarded = [f'--model={",".join(args.model)}', f'--rows={args.rows}',
               f'--seq_len={args.seq_len}', f'--steps={args.steps}', f'--warmup={args.warmup}']
  argv = lambda i, address: [sys.executable, '-m', 'pipelinerl_jax.bench.multiprocess',
                             *forwarded, '--child', str(i), str(processes), address,
                             *([f'--child_out={out}'] if i == 0 else [])]
  with distributed.LocalProcesses(argv, processes, args.devices // processes,
                                  os.path.join(workdir, f'logs-{processes}')) as procs:
    codes = procs.wait(3600)
    if codes != [0] * processes:
      raise SystemExit(f'{processes} processes exited with {codes}:\n' +
                       procs.output(codes.index(next(c for c in codes if c != 0)))[-3000:])
  with open(out) as f:
    return json.load(f)


def format_table(results: list[dict]) -> str:
  def ms(x):
    return '-' if x is None else f'{1e3 * x:.1f}'
  head = ('model', 'processes', 'devices', 'rows x T', 'batch MiB', 'pack ms', 'send ms',
          'step ms', 'tokens/s', 'load')
  rows = [head] + [(r['model'], str(r['processes']), str(r['devices']),
                    f"{r['rows']} x {r['seq_len']}", f"{r['batch_mib']:.1f}", ms(r['pack_s']),
                    ms(r['send_s_median']), ms(r['step_s_median']),
                    '-' if r['tokens_per_s'] is None else f"{r['tokens_per_s']:.0f}",
                    f"{r['loadavg']:.1f}") for r in results]
  widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
  lines = ['  '.join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
  lines.insert(1, '  '.join('-' * w for w in widths))
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.child:
    child(args)
    return {}
  with tempfile.TemporaryDirectory() as workdir:
    results = [r for n in args.processes for r in run_config(args, n, workdir)]
  report = dict(config={k: v for k, v in vars(args).items()
                        if k not in ('out', 'child', 'child_out')}, results=results)
  print(format_table(results), flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(report, f, indent=2)
  print(f'wrote {args.out}')
  return report


if __name__ == '__main__':
  main()
