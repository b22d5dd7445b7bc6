"""Where a compiled step's time and FLOPs go: a jax.profiler trace split into attention, matmuls,
lm_head, optimizer and other; and the matmul FLOPs a jaxpr executes.

`profile_breakdown(fn, args, hlo_text, trace_dir)` runs `fn(*args)` once under
`jax.profiler.trace` and reads the `*.trace.json.gz` it writes (Chrome trace JSON; JAX 0.10 and
0.11 both write it beside the `.xplane.pb`, so no extra package is needed). Each device kernel
(on a CPU backend: each XLA op the host runs, less those that only span others, as a while loop
does its body) carries the name of the HLO instruction that launched it (`args.hlo_op`); the
compiled program's text maps that instruction, and the computations it calls, to the JAX name
stacks of what it fused. The model marks its parts with
`jax.named_scope`: 'attention_core' (models/transformer.py), 'lm_head' (`transformer.logits`),
'optimizer' (train.py); a kernel whose ops carry none of these is a matmul when it multiplies
(a dot, a cuBLAS / Triton gemm), else 'other' (norms, RoPE, activations, copies, reductions).
A kernel named like cuDNN's attention counts as attention whatever its scope; one named like a
gemm (cuBLAS's `nvjet_*` on Hopper among them) as a matmul when its op says nothing else.

XLA's GPU command buffers (CUDA graphs) launch a run of kernels as one op: a trace names that op
(`command_buffer_N`) for every kernel in it, so those kernels have no op of their own to place,
and only their names are left. Time in such wrapper ops, or in ops the program text does not
know, that the kernel's name does not place either is 'opaque': past OPAQUE_LIMIT (half) of the
kernel time, the breakdown says `reliable: False` and why, and its shares are not to be read.
Profile a program compiled with command buffers off (bench.train_step does, with
NO_COMMAND_BUFFERS, as JAX's own profile-guided compilation does); `command_buffers(hlo_text)`
counts them in a compiled program.

`matmul_flops(closed_jaxpr)` sums 2 x M x N x K over the jaxpr's dot_generals, a scan's body
times its length (the layers, the micro-batches), every sub-jaxpr (remat's recomputation
included). A while loop's trip count is data-dependent (blockwise attention's tile loops):
its body is left out and counted in `while_loops`; cuDNN's kernel is a custom call, not a
dot_general: both are counted apart, from tiles and causal pairs (bench.train_step).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
from typing import Any, Callable

import numpy as np

CATEGORIES = ('attention', 'matmul', 'lm_head', 'optimizer', 'other')
SCOPES = (('attention_core', 'attention'), ('lm_head', 'lm_head'), ('optimizer', 'optimizer'))
_ATTENTION_KERNEL = re.compile(r'fmha|flash|cudnn', re.I)
_GEMM_KERNEL = re.compile(r'gemm|cublas|cutlass|xmma|wgmma|matmul|dot|nvjet', re.I)
_WRAPPER_OP = re.compile(r'command_buffer', re.I)
OPAQUE_LIMIT = 0.5     # past this share of kernel time in opaque ops, the split is unreliable
# Compiler options of a program to be profiled: no command buffers (the empty set of commands).
NO_COMMAND_BUFFERS = {'xla_gpu_enable_command_buffer': ''}
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$')
# name = type opcode(...): a tuple type holds spaces (and `/*index=5*/` comments): a while loop,
# a fusion of several outputs, cuBLAS's and cuDNN's custom calls (result and workspace).
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+([\w\-]+)\(')
_CALLS = re.compile(r'(?:calls|to_apply|body|condition|branch_computations)=\{?([^}\s,]+'
                    r'(?:,\s*%?[\w.\-]+)*)\}?')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def hlo_instructions(hlo_text: str) -> dict[str, dict[str, Any]]:
  """Every instruction of a compiled program's text: {name: {'scopes': JAX name stacks of it and
  of everything it calls, 'matmul': whether it or what it calls multiplies}}."""
  computations: dict[str, list[tuple[str, str, str, list[str], str]]] = {}
  current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and '=' not in line.split('(')[0]:
      current = computations.setdefault(header.group(1), [])
      continue
    inst = _INSTRUCTION.match(line)
    if inst is None or current is None:
      continue
    called = []
    for group in _CALLS.findall(line):
      called += [c.strip().lstrip('%') for c in group.split(',') if c.strip()]
    op_name = _OP_NAME.search(line)
    target = _TARGET.search(line)
    current.append((inst.group(1), inst.group(2), op_name.group(1) if op_name else '', called,
                    target.group(1) if target else ''))

  memo: dict[str, tuple[str, bool]] = {}

  def computation(name: str, depth: int = 0) -> tuple[str, bool]:
    if name in memo or depth > 50:
      return memo.get(name, ('', False))
    memo[name] = ('', False)  # a cycle guard; filled below
    scopes, mm = [], False
    for _, opcode, op_name, called, target in computations.get(name, []):
      s, m = instruction(opcode, op_name, called, target, depth + 1)
      scopes.append(s)
      mm |= m
    memo[name] = (' '.join(scopes), mm)
    return memo[name]

  def instruction(opcode, op_name, called, target, depth=0):
    scopes, mm = [op_name], opcode in ('dot', 'convolution') or bool(_GEMM_KERNEL.search(target))
    if _ATTENTION_KERNEL.search(target):
      scopes.append('attention_core')
    for c in called:
      s, m = computation(c, depth)
      scopes.append(s)
      mm |= m
    return ' '.join(scopes), mm

  out = {}
  for insts in computations.values():
    for name, opcode, op_name, called, target in insts:
      scopes, mm = instruction(opcode, op_name, called, target)
      out[name] = dict(scopes=scopes, matmul=mm)
  return out


def categorize(kernel: str, info: dict[str, Any] | None) -> str:
  """One of CATEGORIES for a kernel launched by an instruction described by `info`."""
  if _ATTENTION_KERNEL.search(kernel):
    return 'attention'
  scopes = info['scopes'] if info else ''
  for scope, category in SCOPES:
    if scope in scopes:
      return category
  if (info and info['matmul']) or _GEMM_KERNEL.search(kernel):
    return 'matmul'
  return 'other'


def trace_events(trace_dir: str) -> list[dict[str, Any]]:
  """The complete ('X') events of the newest trace under `trace_dir`: the device's kernels when
  there are any (GPU), else the host's XLA ops (CPU: those carrying args.hlo_op)."""
  files = sorted(glob.glob(os.path.join(trace_dir, 'plugins', 'profile', '*', '*.trace.json.gz')),
                 key=os.path.getmtime)
  if not files:
    raise FileNotFoundError(f'no *.trace.json.gz under {trace_dir}/plugins/profile')
  with gzip.open(files[-1], 'rt') as f:
    trace = json.load(f)
  events = trace.get('traceEvents', [])
  process = {e['pid']: e.get('args', {}).get('name', '') for e in events
             if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  complete = [e for e in events if e.get('ph') == 'X']
  on_device = [e for e in complete if process.get(e['pid'], '').startswith('/device:')]
  return on_device or _leaves([e for e in complete if 'hlo_op' in e.get('args', {})])


def _leaves(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The events no other event of their thread starts inside: on a CPU backend a while loop's
  op spans the ops of its body, which would count its time twice."""
  by_thread = collections.defaultdict(list)
  for e in events:
    by_thread[e.get('pid'), e.get('tid')].append(e)
  leaves = []
  for thread in by_thread.values():
    thread.sort(key=lambda e: (e.get('ts', 0.0), -e.get('dur', 0.0)))
    for e, after in zip(thread, thread[1:] + [None]):
      if after is None or after.get('ts', 0.0) >= e.get('ts', 0.0) + e.get('dur', 0.0):
        leaves.append(e)
  return leaves


def command_buffers(hlo_text: str) -> int:
  """Instructions of a compiled program's text that launch an XLA command buffer (a CUDA graph).
  An XLA that forms its command buffers past the HLO (from the thunks) shows none here: the
  trace's opaque share is what tells."""
  count = 0
  for line in hlo_text.splitlines():
    if _INSTRUCTION.match(line) and _WRAPPER_OP.search(line.split('metadata=')[0]):
      count += 1
  return count


def breakdown(events: list[dict[str, Any]], instructions: dict[str, dict[str, Any]],
              top: int = 8) -> dict[str, Any]:
  """Kernel seconds per category, their shares, the `top` instructions and kernel names by
  time, and how much of the time is opaque (see the module doc): `reliable`, and `unreliable`
  saying why when it is not."""
  seconds = collections.Counter({c: 0.0 for c in CATEGORIES})
  by_op: collections.Counter = collections.Counter()
  by_kernel: collections.Counter = collections.Counter()
  category_of, kernel_category = {}, {}
  opaque_s, opaque_ops = 0.0, collections.Counter()
  for e in events:
    op = e.get('args', {}).get('hlo_op') or e.get('name', '?')  # a kernel without its op: by name
    kernel = e.get('name', '')
    info = None if _WRAPPER_OP.search(op) else instructions.get(op)
    category = categorize(kernel, info)
    dur = e.get('dur', 0.0) / 1e6
    seconds[category] += dur
    by_op[op] += dur
    by_kernel[kernel] += dur
    category_of[op], kernel_category[kernel] = category, category
    if info is None and category == 'other':
      opaque_s += dur
      opaque_ops[op] += dur
  total = sum(seconds.values())
  opaque_share = opaque_s / total if total else 0.0
  reliable = opaque_share <= OPAQUE_LIMIT
  unreliable = None if reliable else (
      f'{opaque_share:.0%} of kernel time is in ops the program text does not place '
      f'({", ".join(op for op, _ in opaque_ops.most_common(3))}'
      f'{", ..." if len(opaque_ops) > 3 else ""}): command buffers on? The shares are not '
      'to be read')
  return dict(kernel_s=total, seconds=dict(seconds),
              shares={c: (s / total if total else None) for c, s in seconds.items()},
              kernels=len(events),
              attributed=sum('hlo_op' in e.get('args', {}) for e in events),
              opaque_s=opaque_s, opaque_share=opaque_share, reliable=reliable,
              unreliable=unreliable,
              top=[dict(op=op, category=category_of[op], seconds=s)
                   for op, s in by_op.most_common(top)],
              top_kernels=[dict(kernel=k[:120], category=kernel_category[k], seconds=s)
                           for k, s in by_kernel.most_common(top)])


def profile_breakdown(fn: Callable[[], Any], hlo_text: str, trace_dir: str | None = None
                      ) -> dict[str, Any]:
  """Runs `fn()` once under the profiler and returns `breakdown` of its kernels."""
  import jax
  trace_dir = trace_dir or tempfile.mkdtemp(prefix='step_profile_')
  jax.profiler.start_trace(trace_dir)
  try:
    jax.block_until_ready(fn())
  finally:
    jax.profiler.stop_trace()
  result = breakdown(trace_events(trace_dir), hlo_instructions(hlo_text))
  result['trace_dir'] = trace_dir
  return result


def matmul_flops(closed_jaxpr) -> tuple[float, int]:
  """(FLOPs of every dot_general the jaxpr runs, while loops left out); see the module doc."""
  whiles = [0]

  def walk(jaxpr, times: float) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name == 'dot_general':
        (lhs_contract, _), _ = eqn.params['dimension_numbers']
        lhs = eqn.invars[0].aval.shape
        k = float(np.prod([lhs[d] for d in lhs_contract])) if lhs_contract else 1.0
        total += 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * k * times
        continue
      if name == 'while':
        whiles[0] += 1
        continue
      inner = times * (eqn.params['length'] if name == 'scan' else 1)
      subs = _sub_jaxprs(eqn.params)
      if name == 'cond':  # one branch runs: count the dearest
        total += max((walk(j, inner) for j in subs), default=0.0)
      else:
        total += sum(walk(j, inner) for j in subs)
    return total

  return walk(closed_jaxpr.jaxpr, 1.0), whiles[0]


def _sub_jaxprs(params) -> list:
  import jax.extend
  return [getattr(j, 'jaxpr', j) for j in jax.extend.core.jaxprs_in_params(params)]
