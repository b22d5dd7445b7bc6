"""One generator actor's engine in its own thread, free of Ray: built from the first weights,
stepped while there is work, later weights applied between two token steps, and its completions
kept, numbered, until the pool acknowledges them.

  apply(tree, v, views)  weights as version v: the first builds the engine (and starts the thread),
                         later ones go to the running engine; `views` are HF-named tensors from a
                         collective transport, `release()`d once no longer read. With
                         `checksums`, returns the checksum of the params handed to the engine
  submit(requests)       into the engine (waiting here until it exists); ids already held skipped
  release(ids)           finished turns whose episodes ended: the engine frees what it kept
  poll(ack, wait_s)      completions numbered after `ack`, waiting up to `wait_s` for one; raises
                         the loop's error if it died
  stats(), close()

Every call into the engine that starts, steps or reloads it runs in the loop's one thread (vLLM's
start-up; OpenMP sizes its pool per thread); `submit`, `release` and new weights come from the
actor's Ray threads, which `api.Engine` allows. The engine comes from the project's one
factory (generation/engines.py), which imports JAX or vLLM only when the first weights arrive.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import engines


class DecodeLoop:
  """The engine, its thread and its outbox. `model()` gives the model config (loaded once, by the
  actor, after it pinned its cores)."""

  def __init__(self, name: str, engine_spec: engines.EngineSpec, model_dir: str, *,
               staged_updates: bool, model: Callable[[], Any], checksums: bool = False):
    self.name, self._spec, self._model_dir = name, engine_spec, model_dir
    self._staged, self._model = staged_updates, model
    self._checksums = checksums  # the JAX engine's only (config refuses it with vLLM)
    self._handed: str | None = None  # the checksum of the params the engine was last handed
    self._engine: api.Engine | None = None
    self._waiting: list[api.Request] = []     # submitted before the engine exists
    self._outbox: list[tuple[int, api.Completion]] = []
    self._ids: set[str] = set()               # submitted here, completion not yet acknowledged
    self._seq = 0
    self._cond = threading.Condition()
    self._error: str | None = None            # the decode loop's death
    self._closed = False
    self._thread: threading.Thread | None = None
    self._updates = 0
    self._update_s = 0.0

  @property
  def started(self) -> bool:
    return self._engine is not None

  # --- weights in ------------------------------------------------------------------------------

  def apply(self, tree, version: int, hf_views=None, release=None) -> str | None:
    """`release()` (collective transports) is called once `hf_views` are no longer read. Returns
    `layout.params_checksum` of the params handed to the engine when the loop was made with
    `checksums`, else None."""
    start = time.perf_counter()
    if self._engine is None:
      # The decode thread builds the engine: every call into it (vLLM's start-up, steps and
      # weight reloads; OpenMP sizes its pool per thread) then runs in that one thread.
      built = threading.Event()
      self._thread = threading.Thread(target=self._decode,
                                      args=(tree, version, hf_views, release, built),
                                      name=f'{self.name}-decode', daemon=True)
      self._thread.start()
      built.wait()
      if self._error is not None:
        raise RuntimeError(self._error)
    elif hf_views is not None and self._spec.backend == 'vllm':
      self._engine.update_hf_tensors(hf_views, version, release)  # released once loaded
    else:
      import jax
      if hf_views is not None:
        from pipelinerl_jax.generation.transport import hf_tensors
        # a copy: the views are free after it
        tree = hf_tensors.update_from_hf(hf_views, self._model(), self._spec.lora)
        release()
      # On the device before this returns, so "version v applied" means it is there. (On CPU
      # the device array may alias the object store's copy, which it then keeps alive.)
      tree = jax.block_until_ready(jax.device_put(tree, jax.local_devices()[0]))
      self._note_handed(tree)
      self._engine.update_params(tree, version)
    self._updates += 1
    self._update_s += time.perf_counter() - start
    with self._cond:
      self._cond.notify_all()
    return self._handed

  def _note_handed(self, tree) -> None:
    if self._checksums:
      from pipelinerl_jax.generation.transport import layout
      self._handed = layout.params_checksum(tree)

  def _build(self, tree, version: int, hf_views, release) -> api.Engine:
    """The engine, on this actor's device, serving `version` (imports JAX or vLLM now)."""
    spec, model = self._spec, self._model()
    # Object store: each tensor of an update comes to the GPU on its own, after vLLM started
    # (a collective's staging buffer was allocated before, at the actor's `join`).
    build = dict(model_dir=self._model_dir, staged_updates=self._staged)
    if spec.backend == 'vllm' and hf_views is not None:
      engine = engines.make_engine(spec, model, version=-1, **build)
      engine.update_hf_tensors(hf_views, version, release)
      engine.apply_update()  # serves `version`, not the checkpoint, from its first token
      return engine
    if hf_views is not None:
      from pipelinerl_jax.generation.transport import hf_tensors
      tree = hf_tensors.update_from_hf(hf_views, model, spec.lora)
    if spec.backend == 'jax':
      import jax
      build['device'] = jax.local_devices()[0]
    self._note_handed(tree)
    return engines.make_engine(spec, model, params=tree, version=version, **build)

  # --- requests and completions ----------------------------------------------------------------

  def submit(self, requests: list[api.Request]) -> None:
    """Ids this loop already holds are skipped, so the pool may re-send what it is unsure
    arrived."""
    with self._cond:
      requests = [r for r in requests if r.request_id not in self._ids]
      self._ids.update(r.request_id for r in requests)
      if self._engine is None:
        self._waiting += requests
        return
    for r in requests:
      self._engine.submit(r)
    with self._cond:
      self._cond.notify_all()

  def release(self, request_ids: list[str]) -> None:
    """`api.Engine.release` for each id; before the engine exists nothing is held."""
    if self._engine is None:
      return
    for rid in request_ids:
      self._engine.release(rid)

  def poll(self, ack: int, wait_s: float) -> list[tuple[int, api.Completion]]:
    """Drops what `ack` acknowledged, then returns the rest (waiting up to `wait_s` for one)."""
    deadline = time.monotonic() + wait_s
    with self._cond:
      self._ids.difference_update(c.request_id for s, c in self._outbox if s <= ack)
      self._outbox = [(s, c) for s, c in self._outbox if s > ack]
      while not self._outbox and self._error is None and time.monotonic() < deadline:
        self._cond.wait(max(0.0, deadline - time.monotonic()))
      if self._error is not None:
        raise RuntimeError(self._error)
      return list(self._outbox)

  def stats(self) -> dict[str, Any]:
    stats = dict(self._engine.stats()) if self._engine is not None else {}
    stats.update(weight_updates=self._updates, weight_update_s=self._update_s,
                 waiting=len(self._waiting))
    stats.setdefault('version', -1)
    return stats

  # --- the thread ------------------------------------------------------------------------------

  def _decode(self, tree, version: int, hf_views, release, built: threading.Event) -> None:
    """Builds the engine from the first weights, then steps it while there is work; an idle
    vLLM engine still loads a pending update (which frees the staging buffer for the next)."""
    refused = ()
    try:
      try:
        engine = self._build(tree, version, hf_views, release)
      finally:
        del tree, hf_views
        if release is not None:
          release()  # loaded (or failed): no-op when the engine released it already
      if self._spec.backend == 'vllm':
        from pipelinerl_jax.generation.vllm import engine as vllm_engine
        refused = vllm_engine.WeightUpdateError  # not loaded; still serving the previous one
      with self._cond:
        self._engine = engine
        waiting, self._waiting = self._waiting, []
      for r in waiting:
        engine.submit(r)
      built.set()
      while not self._closed:
        if engine.num_unfinished == 0:
          if self._spec.backend == 'vllm':
            try:
              engine.apply_update()
            except refused:
              pass
          with self._cond:
            self._cond.wait(0.01)
          continue
        try:
          done = engine.step()
        except refused:
          continue
        if done:
          with self._cond:
            for c in done:
              self._seq += 1
              self._outbox.append((self._seq, c))
            self._cond.notify_all()
    except BaseException as e:
      last = traceback.format_exc().strip().splitlines()[-1]
      with self._cond:
        self._error = f'{self.name}: the decode loop failed: {last}'
        self._cond.notify_all()
      del e
    finally:
      built.set()

  def close(self) -> None:
    self._closed = True
    if self._thread is not None:
      self._thread.join(10)
    if self._engine is not None:
      self._engine.close()
