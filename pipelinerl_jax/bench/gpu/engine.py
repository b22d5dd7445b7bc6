"""The engine section: the paged decode attention reads (XLA, Pallas, cuDNN) checked against each
other and timed at H = 256; then the JAX engine with the fastest correct one at H = 256 (256-token
prompts, 1024 new tokens each, no early stop): tokens/s, the bytes a step must move (params +
live KV) over the measured copy bandwidth (the roofline share), the KV pool against a dense
cache; with a weight update before every token step (the engine's cost alone, then with the
trainer's publish copy); the XLA read at H = 256; H = 64, 512, 1024; one host collection per
step."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any

from pipelinerl_jax.bench.gpu import section as section_lib


# Paged decode attention tried besides 'xla' (models/layers/paged_attention.py): on a GPU each is
# checked against the XLA read, timed, and the fastest correct one runs the engine; on CPU
# (--quick) the Pallas kernel runs in its interpreter, for the numbers only.
ENGINE_KERNELS = ('pallas', 'cudnn')
ENGINE_MORE_SLOTS = (1024,)    # H values run past presets.Sizes.engine_slots (full sizes only)
ENGINE_PAGE_SIZE = 16
ATTENTION_TOLERANCE = 3e-2     # largest difference of a kernel's bf16 output from the XLA read


def kv_cache_bytes(config, num_slots: int, max_len: int) -> int:
  """Bytes of the engine's KV cache: keys and values, [L, H, S, K, Dh] each, in config.dtype."""
  itemsize = 2 if config.dtype == 'bfloat16' else 4
  return (2 * config.num_layers * num_slots * max_len * config.num_kv_heads * config.head_dim
          * itemsize)


def attention_case(config, h: int, prompt_len: int, new_tokens: int, seed: int = 0) -> dict:
  """A decode step's attention inputs at the engine's shapes: a pool sized as the engine's
  (every slot at full length), H rows of lengths spread over a run (prompt .. prompt + new
  tokens), pages handed out in random order, and q for one layer."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pipelinerl_jax.models.layers import paged_attention as paged
  z = ENGINE_PAGE_SIZE
  max_len = prompt_len + new_tokens
  width = -(-max_len // z)
  unit = 1 << max(0, width - 1).bit_length()
  pages = -(-(1 + h * width) // unit) * unit
  rng = np.random.default_rng(seed)
  lengths = rng.integers(prompt_len, max_len + 1, h).astype(np.int32)
  ids = rng.permutation(np.arange(1, pages))[:h * width].reshape(h, width).astype(np.int32)
  for r, n in enumerate(lengths):  # entries past a row's pages are the trash page, as in the engine
    ids[r, -(-n // z):] = paged.TRASH_PAGE
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  shape = (config.num_layers, pages, config.num_kv_heads, z, config.head_dim)
  pool = paged.PagedKVCache(jax.random.normal(keys[0], shape, config.dtype),
                            jax.random.normal(keys[1], shape, config.dtype))
  q = jax.random.normal(keys[2], (h, 1, config.num_kv_heads,
                                  config.num_heads // config.num_kv_heads, config.head_dim),
                        config.dtype)
  itemsize = jnp.dtype(config.dtype).itemsize
  live = int(lengths.sum()) * 2 * config.num_kv_heads * config.head_dim * itemsize
  xla_width = min(1 << max(0, int(-(-lengths.max() // z)) - 1).bit_length(), width)
  return dict(q=q, pool=pool, table=jnp.asarray(ids), xla_width=xla_width,
              positions=jnp.asarray(lengths - 1)[:, None], live_bytes_per_layer=live,
              lengths=lengths)


def check_attention(impl: str, case: dict, repeats: int, interpret: bool) -> dict[str, Any]:
  """One layer's decode attention by `impl` against the XLA read of the same pages: the largest
  difference, and the time of a call (the read of the live keys and values of one layer)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pipelinerl_jax.models.layers import paged_attention as paged
  layer = jnp.int32(1)

  def read(impl, width, interpret=False):
    return jax.jit(lambda q, pool, table, pos: paged.attend(
        q, pool, layer, table[:, :width], pos, implementation=impl, interpret=interpret))

  args = (case['q'], case['pool'], case['table'], case['positions'])
  ref = np.asarray(read('xla', case['xla_width'])(*args).astype(jnp.float32))
  width = case['table'].shape[1]
  f = read(impl, case['xla_width'] if impl == 'xla' else width, interpret)
  t0 = time.perf_counter()
  out = np.asarray(jax.block_until_ready(f(*args)).astype(jnp.float32))
  first_s = time.perf_counter() - t0
  error = float(np.max(np.abs(out - ref)))
  runs = section_lib.wall_times(lambda: f(*args), repeats)
  t = statistics.median(runs)
  return dict(implementation=impl, max_error=error, correct=error <= ATTENTION_TOLERANCE,
              finite=bool(np.isfinite(out).all()), interpret=interpret,
              compile_s=first_s, seconds_per_layer=t, seconds_runs=runs,
              live_bytes_per_layer=case['live_bytes_per_layer'],
              read_gb_per_s=case['live_bytes_per_layer'] / t / 1e9,
              mean_length=float(case['lengths'].mean()))


def run(s: section_lib.Section) -> None:
  """At the headline H (256 at full sizes): the XLA read (checked, timed) and the engine on it;
  the kernels' reads, checked against XLA and timed; the engine with the fastest correct read,
  with no update, an update before every token step (the engine's own cost) and with the
  trainer's publish copy too; then the other H values, largest first, and the other way of
  collecting tokens (a GPU's default is every 4 steps, overlapped: then every step, waited for;
  on a CPU the other way round). Items the time left cannot hold are skipped."""
  import jax
  import jax.numpy as jnp
  from pipelinerl_jax.bench import generation as gen_bench
  from pipelinerl_jax.bench import train_step as train_bench
  from pipelinerl_jax.generation import budget
  from pipelinerl_jax.generation import jax_engine as engine_lib
  from pipelinerl_jax.models import transformer
  from pipelinerl_jax.pipeline import placements

  z = s.sizes
  device = jax.devices()[0]
  on_gpu = jax.default_backend() == 'gpu'
  config = dataclasses.replace(train_bench.MODEL_PRESETS[z.engine_model], dtype='bfloat16')
  master = [transformer.init_params(config, jax.random.PRNGKey(i)) for i in (0, 1)]
  publish = placements.copy_params_fn(device, config.dtype)  # the trainer's copy to the engine
  served = [publish(p) for p in master]  # bf16, as the engine holds them
  max_len = z.prompt_len + z.new_tokens
  limit = section_lib.memory_limit_bytes(device)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(served[0]))
  kv_token_bytes = budget.kv_page_bytes(config.num_layers, config.num_kv_heads,
                                        config.head_dim, 1, config.dtype)
  # The bandwidth a step's bytes are held against: one device copy of 1 GiB (read + write).
  flat = jnp.ones(((z.copy_mib << 20) // 4,), jnp.float32)
  copy_bw = 2 * flat.nbytes / statistics.median(
      section_lib.wall_times(lambda: jnp.copy(flat), z.repeats))
  del flat
  slots = list(z.engine_slots) + ([] if s.args.quick else list(ENGINE_MORE_SLOTS))
  headline = max(h for h in slots if h <= 256)

  case = attention_case(config, headline, z.prompt_len, z.new_tokens)
  timed = {}

  def read(impl: str) -> None:
    try:
      r = check_attention(impl, case, z.repeats, interpret=not on_gpu and impl != 'xla')
      s.add(f'attention {impl}', slots=headline, copy_gb_per_s=copy_bw / 1e9,
            of_copy_bandwidth=r['read_gb_per_s'] * 1e9 / copy_bw, **r)
      if r['correct'] and r['finite'] and not r['interpret']:
        timed[impl] = r['seconds_per_layer']
    except Exception as e:
      s.fail(f'attention {impl}', e)

  sync = engine_lib.EngineConfig.sync_every  # the default: on a GPU 4, on a CPU 1
  last = None  # (H, seconds per step, warm-up seconds) of the previous run, to predict the next

  def engine(h: int, impl: str, modes: tuple[str, ...], sync_every: int = sync) -> None:
    nonlocal last
    tag = f'H={h} {impl}' + ('' if sync_every == sync else f' sync_every={sync_every}')
    dense = kv_cache_bytes(config, h, max_len)
    need = 2 * param_bytes + 2 * 4 * config.num_params + dense + 4 * 4 * h * config.vocab_size
    if need > section_lib.MEMORY_HEADROOM * limit:
      s.skip(tag, f'needs ~{need / 2**30:.1f} GiB, the device offers {limit / 2**30:.1f}')
      return
    if last is not None:
      predicted = len(modes) * last[1] * h / last[0] * (z.new_tokens + 16) * 1.5 + last[2]
      if predicted > s.remaining():
        s.skip(tag, f'time budget (predicted {predicted:.0f} s)')
        return
    engine_config = engine_lib.EngineConfig(
        num_slots=h, max_seq_len=max_len, min_prefill_len=min(16, z.prompt_len),
        page_size=ENGINE_PAGE_SIZE, decode_attention=impl, sync_every=sync_every)
    try:
      eng = engine_lib.JaxEngine(config, served[0], engine_config)
    except Exception as e:
      s.fail(tag, e)
      return
    try:
      t0 = time.perf_counter()
      widths = eng.precompile()
      version = eng.version
      for seed in (1, 2):  # two short waves compile prefill (the second: committed state)
        version = gen_bench.run_once(
            eng, section_lib.make_requests(h, z.prompt_len, 2, config.vocab_size, seed),
            lambda v: served[v % 2], 0, h, version)['version']
      warmup_s = time.perf_counter() - t0
      for mode in modes:
        name = f'{tag} {mode}'
        params_for = ((lambda v: publish(master[v % 2])) if mode == 'update+publish' else
                      (lambda v: served[v % 2]))
        try:
          traces, compiles = sum(engine_lib.TRACES.values()), section_lib.compile_count()
          before = eng.stats()
          r = gen_bench.run_once(eng, section_lib.make_requests(h, z.prompt_len, z.new_tokens,
                                                                config.vocab_size, 3),
                                 params_for, 0 if mode == 'none' else 1, h, version)
          version = r.pop('version')
          after = eng.stats()
        except Exception as e:
          s.fail(name, e)
          continue
        decode_steps = after['decode_steps'] - before['decode_steps']
        # Bytes a decode step must move: the params once, and every sequence's keys and values
        # (on average over the run, each sequence holds prompt + half the new tokens).
        live_kv = h * (z.prompt_len + z.new_tokens / 2) * kv_token_bytes
        step_s = r['wall_s'] / max(decode_steps, 1)
        pool = sum(x.nbytes for x in jax.tree.leaves(eng._state.pool))
        last = (h, step_s, warmup_s)
        s.add(name, slots=h, mode=mode, attention=impl, sync_every=after['sync_every'],
              model=z.engine_model, dtype=config.dtype, prompt_len=z.prompt_len,
              new_tokens=z.new_tokens, decode_steps=decode_steps, seconds_per_step=step_s,
              bytes_per_step=param_bytes + live_kv, param_bytes=param_bytes,
              live_kv_bytes=live_kv, copy_gb_per_s=copy_bw / 1e9,
              roofline=(param_bytes + live_kv) / copy_bw / step_s,
              kv_cache_bytes=pool, dense_kv_bytes=dense, kv_over_dense=pool / dense,
              kv_peak_bytes=after['kv_pages_peak'] * ENGINE_PAGE_SIZE * kv_token_bytes,
              kv_bytes_per_token=kv_token_bytes, preemptions=after.get('preemptions', 0),
              warmup_s=warmup_s, decode_widths=widths,
              retraces=sum(engine_lib.TRACES.values()) - traces,
              compiles=_difference(section_lib.compile_count(), compiles),
              memory=section_lib.device_memory(device), **r)
    finally:
      eng.close()
      gc.collect()

  # The XLA read and the engine on it first: a kernel that crashes the process (a compiler
  # fault) then costs only what follows.
  kernels = ENGINE_KERNELS if on_gpu else ('pallas',)
  read('xla')
  engine(headline, 'xla', ('none',))
  for impl in kernels:
    read(impl)
  del case
  best = min(timed, key=timed.get) if timed else 'xla'
  modes = ('update', 'update+publish') if best == 'xla' else ('none', 'update', 'update+publish')
  engine(headline, best, modes)
  for h in sorted(slots, reverse=True):
    if h != headline:
      engine(h, best, ('none',))
  engine(headline, best, ('none',), sync_every=0 if on_gpu else engine_lib.SYNC_EVERY)


def _difference(a: int | None, b: int | None) -> int | None:
  return None if a is None or b is None else a - b


def describe(item: dict[str, Any]) -> str:
  """One table cell: the item's main figures."""
  g = item.get
  fmt_si = section_lib.fmt_si
  if 'read_gb_per_s' in item:
    return (f"H={g('slots')}, mean length {g('mean_length'):.0f}: max |diff| from xla "
            f"{g('max_error'):.2g}{'' if g('correct') else ' (WRONG)'}, "
            f"{1e6 * g('seconds_per_layer'):.0f} us/layer, reads {g('read_gb_per_s'):.0f} GB/s "
            f"({g('of_copy_bandwidth'):.0%} of copy)" + (' [interpreter]' if g('interpret')
                                                         else ''))
  return (f"{g('tokens_per_s'):.0f} tok/s, {1e3 * g('seconds_per_step'):.2f} ms/step, "
          f"roofline {g('roofline'):.0%} ({fmt_si(g('bytes_per_step'), 'B')}/step), "
          f"{g('updates')} updates, KV {fmt_si(g('kv_cache_bytes'), 'B')} "
          f"({g('kv_over_dense'):.2f} of dense, peak {fmt_si(g('kv_peak_bytes'), 'B')}), "
          f"compiles while timed {g('compiles')}")
