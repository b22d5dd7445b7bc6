"""Pick a PipelineRL configuration for a cluster: the Appendix A model (see throughput.py).

  python -m pipelinerl_jax.sim --N=128 --B=128 --plot=/tmp/sim.png     # illustrative curve
  python -m pipelinerl_jax.sim --N=128 --B=128 --max_lag=8 --out=/tmp/sim.json
      --gen_bench=/tmp/pipelinerl_jax_bench/generation.json      # bench/generation.py output
      --train_bench=/tmp/bench_train_step.json                   # bench/train_step.py output

Prints r_conv for each G, the top pipeline configurations (I, H, r_pipe, g_max) and the
speedup of the best one over the best conventional G; writes everything as JSON (--out) and
plots r_pipe against I for a few H, with r_conv as horizontal lines (--plot).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from pipelinerl_jax.sim import throughput


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m pipelinerl_jax.sim',
                              description=__doc__.split('\n')[0])
  p.add_argument('--N', type=int, default=128, help='accelerators')
  p.add_argument('--B', type=int, default=128, help='samples per optimizer step')
  p.add_argument('--gen_bench', default=None,
                 help='bench.generation JSON for U(h); default: the illustrative curve')
  p.add_argument('--gen_mode', default='none', help='which bench.generation mode to read')
  p.add_argument('--train_bench', default=None, help='bench.train_step JSON for tau')
  p.add_argument('--train_model', default=None, help='model in --train_bench, if several')
  p.add_argument('--tau', type=float, default=None, help='s/token per accelerator (overrides)')
  p.add_argument('--mean_len', type=float, default=2048, help='mean sample length L̄, tokens')
  p.add_argument('--max_len', type=float, default=8192, help='max sample length L, tokens')
  p.add_argument('--max_lag', type=int, default=None, help='keep configurations with g_max <= it')
  p.add_argument('--max_h', type=float, default=None,
                 help='memory cap on in-flight sequences per accelerator')
  p.add_argument('--G', default='1,2,4,8,16,32', help='conventional optimizer steps per batch')
  p.add_argument('--top', type=int, default=10, help='pipeline rows to print')
  p.add_argument('--out', default='/tmp/pipelinerl_jax_sim.json', help='JSON output path')
  p.add_argument('--plot', default=None, help='PNG output path (matplotlib)')
  return p


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    args.G = [int(g) for g in args.G.split(',') if g.strip()]
  except ValueError:
    args.G = []
  if not args.G or min(args.G) < 1:
    parser.error('--G must be positive integers, e.g. 1,2,4')
  if args.N < 2 or args.B < 1:
    parser.error('need --N >= 2 and --B >= 1')
  # A measured U(h) with the made-up tau (or the reverse) gives numbers that mean nothing.
  measured = (args.gen_bench is not None, args.train_bench is not None or args.tau is not None)
  if measured[0] != measured[1]:
    parser.error('give --gen_bench together with --train_bench or --tau (or neither)')
  return args


def _rate(x: float) -> str:
  return f'{x:,.0f}'


def format_report(report: dict) -> str:
  inp = report['inputs']
  curve = report['curve']
  lines = [f'note: {n}' for n in report['notes']] + [
      f"U(h) [{curve['source']}]: " +
      ', '.join(f'{h:g}:{u:,.0f}' for h, u in curve['points']) + ' tokens/s per accelerator',
      f"tau = {inp['tau']:.3g} s/token ({1 / inp['tau']:,.0f} tokens/s per training accelerator); "
      f"L̄ = {inp['mean_len']:g}, L = {inp['max_len']:g} tokens; "
      f"N = {inp['N']}, B = {inp['B']}, max_lag = {inp['max_lag']}",
      '',
      'Conventional (all N generate B·G samples at h = B·G/N each, then all N train):',
      f"{'G':>4} {'h':>8} {'r_gen':>12} {'r_train':>12} {'r_conv':>12} {'lag':>4}",
  ]
  for c in report['conventional']:
    lines.append(f"{c['G']:>4} {c['h']:>8.3g} {_rate(c['r_gen']):>12} {_rate(c['r_train']):>12} "
                 f"{_rate(c['r_conv']):>12} {c['lag']:>4}")
  lines += [
      '',
      f"Pipeline, top {len(report['top'])} (I generators at H in flight each, N − I trainers):",
      f"{'I':>4} {'H':>6} {'U(H)·I':>12} {'(N−I)/tau':>12} {'r_pipe':>12} {'g_max':>6}",
  ]
  for c in report['top']:
    lines.append(f"{c['I']:>4} {c['H']:>6g} {_rate(c['r_gen']):>12} {_rate(c['r_train']):>12} "
                 f"{_rate(c['r_pipe']):>12} {c['g_max']:>6}")
  best, conv = report['best'], report['best_conventional']
  lines += ['', f"best pipeline I={best['I']} H={best['H']:g}: r_pipe = {_rate(best['r_pipe'])} "
                f"tokens/s, g_max = {best['g_max']}"]
  if conv is not None:
    lines.append(f"best conventional G={conv['G']}: r_conv = {_rate(conv['r_conv'])} tokens/s "
                 f"-> speedup {report['speedup']:.2f}x")
  return '\n'.join(lines)


def model_mismatch(args: argparse.Namespace) -> list[str]:
  """U(h) and tau only combine when both benches ran the same model: say so when they did not."""
  gen_model = json.loads(pathlib.Path(args.gen_bench).read_text()).get('model') or {}
  results = json.loads(pathlib.Path(args.train_bench).read_text())['results']
  train_model = next((r.get('model_config') or {} for r in results
                      if args.train_model in (None, r['model'])), {})
  keys = ('vocab_size', 'hidden_size', 'num_layers', 'num_heads', 'intermediate_size')
  diff = [k for k in keys
          if k in gen_model and k in train_model and gen_model[k] != train_model[k]]
  if not diff:
    return []
  return ['the generation and train benches ran different models (' +
          ', '.join(f'{k} {gen_model[k]} vs {train_model[k]}' for k in diff) +
          '): the rates they give do not describe one model']


def simulate(args: argparse.Namespace) -> dict:
  """Everything the CLI prints, writes and plots, as one JSON-ready dict."""
  if args.gen_bench is None:
    points, tau = throughput.ILLUSTRATIVE_POINTS, throughput.ILLUSTRATIVE_TAU
    source = 'ILLUSTRATIVE curve, not measured'
  else:
    points = throughput.utilization_from_bench_json(args.gen_bench, args.gen_mode)
    tau = (args.tau if args.tau is not None else
           throughput.tau_from_train_bench_json(args.train_bench, args.train_model))
    source = f'{args.gen_bench}, mode {args.gen_mode}'
  use_train_bench = args.gen_bench and args.train_bench and args.tau is None
  notes = model_mismatch(args) if use_train_bench else []
  lengths = throughput.Lengths(mean=args.mean_len, max=args.max_len)
  conv = [throughput.conventional(args.N, args.B, g, points, tau, args.max_h) for g in args.G]
  best, table = throughput.best_config(args.N, args.B, points, tau, lengths, args.max_lag,
                                       max_h=args.max_h)
  feasible = [c for c in table if args.max_lag is None or c.g_max <= args.max_lag]
  # Compare like with like: a conventional G whose lag G − 1 exceeds max_lag is out too.
  conv_ok = [c for c in conv if args.max_lag is None or c.lag <= args.max_lag]
  best_conv = max(conv_ok, key=lambda c: c.r_conv) if conv_ok else None
  return dict(
      notes=notes,
      inputs=dict(N=args.N, B=args.B, tau=tau, mean_len=lengths.mean, max_len=lengths.max,
                  max_lag=args.max_lag, max_h=args.max_h, G=args.G),
      curve=dict(source=source, points=[list(p) for p in points],
                 illustrative=args.gen_bench is None),
      conventional=[c._asdict() for c in conv],
      best=best._asdict(),
      best_conventional=best_conv._asdict() if best_conv else None,
      speedup=best.r_pipe / best_conv.r_conv if best_conv and best_conv.r_conv > 0 else None,
      top=[c._asdict() for c in feasible[:args.top]],
      table=[c._asdict() for c in table])


def plot(report: dict, path: str):
  import matplotlib  # noqa: PLC0415  (only the CLI needs it, and only with --plot)
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415

  table = report['table']
  grid = sorted({c['H'] for c in table})
  # The best H and four spread over the grid: enough to see where U(H)·I meets (N − I)/tau.
  hs = sorted({report['best']['H']} | {grid[round(k * (len(grid) - 1) / 3)] for k in range(4)})
  fig, ax = plt.subplots(figsize=(8, 5))
  for h in hs:
    rows = sorted((c['I'], c['r_pipe']) for c in table if c['H'] == h)
    ax.plot([i for i, _ in rows], [r for _, r in rows], label=f'pipeline H={h:g}')
  conv = report['conventional']
  for k, c in enumerate(conv):
    color = plt.cm.viridis(k / max(1, len(conv) - 1))
    ax.axhline(c['r_conv'], ls='--', lw=1, color=color, label=f"conventional G={c['G']}")
  best = report['best']
  ax.plot([best['I']], [best['r_pipe']], 'r*', ms=12,
          label=f"best I={best['I']} H={best['H']:g} (g_max={best['g_max']})")
  inp = report['inputs']
  ax.set(xlabel='I (generation accelerators)', ylabel='tokens/s',
         title=f"N={inp['N']}, B={inp['B']}, U(h): {report['curve']['source']}")
  ax.title.set_fontsize(9)
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  try:
    report = simulate(args)
  except ValueError as e:  # unreadable bench file, or no configuration within --max_lag
    raise SystemExit(f'error: {e}') from e
  print(format_report(report), flush=True)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1))
  print(f'wrote {out}')
  if args.plot:
    pathlib.Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot(report, args.plot)
    print(f'wrote {args.plot}')
  return report
