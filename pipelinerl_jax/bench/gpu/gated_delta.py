"""The gated_delta section: one Gated DeltaNet layer of Qwen3.5 (models/layers/gated_delta.py),
forward and backward on an 8k row, at the 2B's and the 9B's linear-layer shapes: seconds of the
whole layer and of the chunked delta rule alone, XLA's compiled size of the layer's program,
the chunked rule against the recurrent one in fp32 (output, final state, every gradient) and
whether it all stays finite. The measurement is bench/gated_delta.py's, one process per shape,
each an item as it ends.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

from pipelinerl_jax.bench.gpu import section as section_lib


def run(s: section_lib.Section) -> None:
  for shape in s.sizes.gated_delta_shapes:
    name = f'qwen3.5-{shape}'
    if s.remaining() < 20:
      s.skip(name, 'time budget')
      continue
    out = pathlib.Path(s.args.workdir) / f'gated_delta_{shape}.json'
    cmd = [sys.executable, '-m', 'pipelinerl_jax.bench.gated_delta', f'--out={out}',
           *(['--quick'] if s.args.quick else [f'--shape={shape}'])]
    report = section_lib.bench_report(s, name, cmd, out)
    if report is None:
      continue
    s.add(name, dims=report['dims'], sizes=report['sizes'], dtype=report['args']['dtype'],
          layer_s=report['timings']['layer']['seconds'],
          rule_s=report['timings']['rule']['seconds'], compiled_bytes=report['compiled_bytes'],
          relative_difference=report['relative_difference'],
          max_relative_difference=max(report['relative_difference'].values()),
          finite=report['finite'])


def describe(item: dict[str, Any]) -> str:
  g = item.get
  size = (f", program {g('compiled_bytes') / 2**30:.2f} GiB"
          if g('compiled_bytes') is not None else '')
  return (f"{g('sizes')['rows']} x {g('sizes')['tokens']} tokens: layer "
          f"{g('layer_s') * 1e3:.1f} ms, chunked rule {g('rule_s') * 1e3:.1f} ms (fwd+bwd)"
          f"{size}; chunked vs recurrent fp32 {g('max_relative_difference'):.1e}, "
          f"finite {g('finite')}")
