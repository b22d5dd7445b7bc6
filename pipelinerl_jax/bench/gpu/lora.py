"""The lora section: an adapter update against a full update on the JAX engine, publish and
apply (the publisher's copy onto the engine's device, the engine taking it between two token
steps), and decode tokens/s with the adapters unmerged against the base alone, at Qwen2.5-1.5B
and Qwen3-8B shapes with rank 32 on all seven projections (`qwen3_8b_lora_1xgpu`'s). The
measurement is bench/lora.py's, one process per size (so memory returns between sizes), each
size an item as it ends.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from pipelinerl_jax.bench import one_process
from pipelinerl_jax.bench.gpu import section as section_lib


def run(s: section_lib.Section) -> None:
  z = s.sizes
  for size in z.lora_sizes:
    name = f'{size} jax'
    if s.remaining() < 30:
      s.skip(name, 'time budget')
      continue
    cmd = [sys.executable, '-m', 'pipelinerl_jax.bench.lora', f'--one={size}:jax',
           f'--rank={z.lora_rank}', f'--repeats={z.lora_repeats}', f'--requests={z.lora_requests}',
           f'--new_tokens={z.lora_new_tokens}', f'--workdir={s.args.workdir}/lora']
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=s.remaining())
    except subprocess.TimeoutExpired:
      s.skip(name, 'time budget (cut short)')
      continue
    row = one_process.parse(proc.stdout)  # bench/lora.py's result for the size
    if proc.returncode or row is None:
      tail = (proc.stderr.strip().splitlines() or [''])[-1]
      s.fail(name, RuntimeError(f'bench.lora {size} exited {proc.returncode}: {tail}'))
      continue
    row['update_ratio'] = row['full_update_s'] / row['lora_update_s']
    row['byte_ratio'] = row['full_bytes'] / row['lora_bytes']
    if row.get('base_tokens_per_s'):
      row['decode_ratio'] = row['lora_tokens_per_s'] / row['base_tokens_per_s']
    s.add(name, **row)


def describe(item: dict[str, Any]) -> str:
  g = item.get
  text = (f"update: full {1e3 * g('full_update_s'):.1f} ms ({g('full_bytes') / 1e6:.0f} MB), "
          f"adapters {1e3 * g('lora_update_s'):.2f} ms ({g('lora_bytes') / 1e6:.1f} MB), "
          f"{g('update_ratio'):.0f}x (bytes {g('byte_ratio'):.0f}x)")
  if g('base_tokens_per_s'):
    text += (f"; decode {section_lib.fmt_si(g('base_tokens_per_s'))} tok/s base, "
             f"{section_lib.fmt_si(g('lora_tokens_per_s'))} with adapters "
             f"({g('decode_ratio'):.2f})")
  return text
