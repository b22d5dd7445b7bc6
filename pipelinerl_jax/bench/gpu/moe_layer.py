"""The moe_layer section: one Qwen3-30B-A3B MoE layer's experts, forward and backward, the
grouped matmul (`jax.lax.ragged_dot`) against the dense reference, whole and as one device's
share of an expert axis (the assignments outside its experts sorted past its groups and
dropped): seconds of each path, the grouped path's difference from the reference in fp32 for
the output and every gradient, and whether it stays finite. The measurement is
bench/moe_layer.py's, one process per split, each an item as it ends.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

from pipelinerl_jax.bench.gpu import section as section_lib


def run(s: section_lib.Section) -> None:
  for split in s.sizes.moe_expert_splits:
    name = f'expert_split={split}'
    if s.remaining() < 20:
      s.skip(name, 'time budget')
      continue
    out = pathlib.Path(s.args.workdir) / f'moe_layer_{split}.json'
    cmd = [sys.executable, '-m', 'pipelinerl_jax.bench.moe_layer', f'--expert_split={split}',
           f'--out={out}'] + (['--quick'] if s.args.quick else [])
    report = section_lib.bench_report(s, name, cmd, out)
    if report is None:
      continue
    seconds = {r['path']: r['seconds'] for r in report['timings']}
    s.add(name, sizes=report['sizes'], dtype=report['args']['dtype'],
          experts_held=report['experts_held'], ragged_s=seconds.get('ragged'),
          dense_s=seconds.get('dense'), relative_difference=report['relative_difference'],
          max_relative_difference=max(report['relative_difference'].values()),
          finite=report['finite'])


def describe(item: dict[str, Any]) -> str:
  g = item.get
  dense = f", dense {g('dense_s') * 1e3:.2f} ms" if g('dense_s') is not None else ''
  return (f"{g('experts_held')} experts held: grouped {g('ragged_s') * 1e3:.2f} ms{dense} "
          f"(fwd+bwd); fp32 difference {g('max_relative_difference'):.1e}, "
          f"finite {g('finite')}")
