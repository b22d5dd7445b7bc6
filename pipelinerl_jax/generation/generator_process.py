"""A `VllmEngine` in its own process (multiprocessing spawn), behind the `api.Engine` interface.

  parent (trainer side)                      child (generator)
  submit(request)  -- request queue -------> engine.submit
  update_params    -- shm_weights segment -> between two steps: lock, check, load, ack
  step()           <- result queue --------- completions + stats after each step

The child loops on its own: it drains requests, loads the newest complete update from the
shared-memory segment when there is one (under the segment lock, so the trainer never rewrites
bytes being loaded), runs one engine step and ships finished completions. `step()` in the parent
collects what has arrived (waiting up to `poll_s` when work is outstanding), so
`api.generate` works unchanged; the child does not wait for the parent between tokens.

Failure reporting: an exception in the child is sent back with its traceback before the child
exits, and every parent call first checks that the child is alive, so a crashed or killed
generator raises `GeneratorDied` (with the exit code and the child's last error) instead of
leaving the trainer waiting. `update_params` raises TimeoutError when the child holds the
segment longer than `lock_timeout_s`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import time
import traceback
from pathlib import Path
from typing import Any

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import shm_weights
from pipelinerl_jax.models import hf_io


class GeneratorDied(RuntimeError):
  """The generator process is gone; its exit code and last error are in the message."""


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
  transport_dtype: str = 'float32'  # dtype of the tensors in shared memory
  checksum: bool = True             # crc32 of the payload, checked by the reader before loading
  lock_timeout_s: float = 60.0
  start_timeout_s: float = 300.0
  poll_s: float = 0.05              # how long `step()` waits for results when work is outstanding


def _child_main(model_dir, engine_config, version, seg_name, manifest_capacity, lock,
                requests: mp.Queue, results: mp.Queue, cfg: ProcessConfig):
  """The generator loop (runs in the child)."""
  os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'
  try:
    from pipelinerl_jax.generation import vllm_engine
    engine = vllm_engine.VllmEngine(model_dir, engine_config, version=version)
    seg = shm_weights.Segment.attach(seg_name, lock, manifest_capacity)
    results.put(('ready', engine.version))
    closing, last_report = False, 0.0
    while not closing:
      try:  # block briefly only when idle, so an idle child does not spin
        msg = requests.get(timeout=0.01 if engine.num_unfinished == 0 else 0)
      except queue.Empty:
        msg = None
      while msg is not None:
        if msg[0] == 'submit':
          engine.submit(msg[1])
        elif msg[0] == 'close':
          closing = True
        try:
          msg = requests.get_nowait()
        except queue.Empty:
          msg = None
      loaded = _load_newest(seg, engine, cfg, results)
      done = engine.step() if engine.num_unfinished else []
      if done or loaded or time.monotonic() - last_report > 0.5:
        results.put(('step', done, engine.stats()))
        last_report = time.monotonic()
    engine.close()
    seg.close()
    results.put(('closed', None))
  except BaseException:
    results.put(('error', traceback.format_exc()))
    raise


def _load_newest(seg: shm_weights.Segment, engine, cfg: ProcessConfig, results) -> bool:
  """Loads the segment's update if it is newer than the engine's weights. A corrupt segment or
  a rejected load is reported to the parent; the engine keeps serving its current version."""
  h = seg.header()
  if h['state'] != shm_weights.VALID or h['version'] <= max(engine.version, _rejected[0]):
    return False
  from pipelinerl_jax.generation import vllm_engine
  seg.acquire(cfg.lock_timeout_s, 'trainer (writer)')
  try:
    version, views = shm_weights.read_update(seg, verify=cfg.checksum)
    if version <= engine.version:
      return False
    engine.update_hf_tensors(views, version)
    del views
    engine.apply_update()  # copies out of the segment before the lock is released
    seg.write_header(acked=version)
    return True
  except (shm_weights.TransportError, vllm_engine.WeightUpdateError) as e:
    _rejected[0] = seg.header()['version']  # do not retry the same bytes
    results.put(('update_error', _rejected[0], f'{type(e).__name__}: {e}'))
    return False
  finally:
    views = None
    seg.lock.release()


_rejected = [-1]  # (child process) the last segment version whose load failed


class GeneratorProcess(api.Engine):
  """Parent-side handle; `submit` and `update_params` may be called from any thread, `step`
  from one."""

  def __init__(self, model_dir: str | os.PathLike, engine_config=None, *, version: int = 0,
               config: ProcessConfig = ProcessConfig()):
    from pipelinerl_jax.generation import vllm_engine  # config type only; vLLM starts in the child
    self.config = config
    self.model_config = hf_io.load_config(model_dir)
    self._entries, size, capacity = shm_weights.manifest_for(self.model_config,
                                                            config.transport_dtype)
    engine_config = engine_config or vllm_engine.VllmEngineConfig()
    self._max_model_len = engine_config.max_model_len
    ctx = mp.get_context('spawn')
    self._seg = shm_weights.Segment.create(size, ctx.Lock(), capacity)
    self._requests, self._results = ctx.Queue(), ctx.Queue()
    self._proc = ctx.Process(
        target=_child_main, name='pipelinerl-generator', daemon=True,
        args=(str(Path(model_dir)), engine_config, version,
              self._seg.name, capacity, self._seg.lock, self._requests, self._results, config))
    self._proc.start()
    self._ids: set[str] = set()
    self._inbox: list[api.Completion] = []
    self._update_errors: dict[int, str] = {}
    self._stats: dict[str, Any] = {'version': version}
    self._last_error: str | None = None
    self._closed = False
    self._ready = False
    deadline = time.monotonic() + config.start_timeout_s
    while not self._ready:
      self._receive(timeout=1.0)
      if not self._ready and time.monotonic() > deadline:
        self.close()
        raise TimeoutError(f'generator did not start within {config.start_timeout_s:.0f}s')

  # --- api.Engine ------------------------------------------------------------------------------

  def submit(self, request: api.Request) -> None:
    self._check_alive()
    # Checked here too: a request the child refuses would take the whole generator down.
    prompt, n = list(request.prompt_tokens), request.sampling.max_tokens
    if not prompt or min(prompt) < 0 or max(prompt) >= self.model_config.vocab_size:
      raise ValueError(f'request {request.request_id!r}: empty prompt or ids outside the vocab')
    if len(prompt) + n > self._max_model_len:
      raise ValueError(f'request {request.request_id!r}: prompt {len(prompt)} + max_tokens {n} '
                       f'exceeds max_model_len={self._max_model_len}')
    if request.request_id in self._ids:
      raise ValueError(f'request id {request.request_id!r} is already unfinished')
    self._ids.add(request.request_id)
    self._requests.put(('submit', request))

  def update_params(self, params: Any, version: int) -> None:
    """Writes the update into shared memory now (one copy); the child loads it between two of
    its steps. Returns once written; `wait_loaded` waits for the child's acknowledgement."""
    self._check_alive()
    timing = shm_weights.write_update(self._seg, params, self.model_config, version,
                                      dtype=self.config.transport_dtype,
                                      checksum=self.config.checksum,
                                      timeout=self.config.lock_timeout_s)
    self._stats['last_write_s'] = timing['write_s']

  def wait_loaded(self, version: int, timeout: float = 60.0) -> None:
    """Blocks until the child has loaded `version` (or a newer one); raises the child's error
    if it rejected that update."""
    deadline = time.monotonic() + timeout
    while self._seg.header()['acked'] < version:
      self._receive(timeout=0.005)
      rejected = [e for v, e in self._update_errors.items() if v >= version]
      if rejected:
        raise RuntimeError(f'generator rejected version {version}: {rejected[0]}')
      if time.monotonic() > deadline:
        raise TimeoutError(f'generator did not load version {version} within {timeout:.0f}s')

  def step(self) -> list[api.Completion]:
    self._check_alive()
    if not self._inbox:
      self._receive(timeout=self.config.poll_s if self._ids else 0.0)
    while self._receive(timeout=0.0):
      pass
    done, self._inbox = self._inbox, []
    self._ids.difference_update(c.request_id for c in done)
    return done

  def stats(self) -> dict[str, Any]:
    return dict(self._stats, pid=self._proc.pid, alive=self._proc.is_alive())

  @property
  def num_unfinished(self) -> int:
    return len(self._ids)

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    if self._proc.is_alive():
      self._requests.put(('close',))
      self._proc.join(timeout=30)
    if self._proc.is_alive():
      self._proc.kill()  # our own child, by its handle
      self._proc.join(timeout=10)
    self._seg.close(unlink=True)

  # --- internals -------------------------------------------------------------------------------

  def _receive(self, timeout: float) -> bool:
    """Handles one message from the child, if one comes within `timeout`; False if none."""
    try:
      msg = self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait()
    except queue.Empty:
      self._check_alive()
      return False
    kind = msg[0]
    if kind == 'step':
      self._inbox += msg[1]
      self._stats = {**self._stats, **msg[2]}
    elif kind == 'update_error':
      self._update_errors[msg[1]] = msg[2]
      self._stats['last_update_error'] = f'version {msg[1]}: {msg[2]}'
    elif kind == 'ready':
      self._ready = True
    elif kind == 'error':
      self._last_error = msg[1]
      self._check_alive(wait_exit=True)
    return True

  def _check_alive(self, wait_exit: bool = False):
    if self._closed:
      raise RuntimeError('generator is closed')
    if wait_exit:
      self._proc.join(timeout=10)
    if not self._proc.is_alive():
      if self._last_error is None:  # the child may have sent its traceback before dying
        try:
          while True:
            msg = self._results.get_nowait()
            if msg[0] == 'error':
              self._last_error = msg[1]
        except (queue.Empty, OSError, EOFError):
          pass
      raise GeneratorDied(f'generator process {self._proc.pid} exited with code '
                          f'{self._proc.exitcode}' +
                          (f'; its last error:\n{self._last_error}' if self._last_error else
                           ' without reporting an error (killed?)'))
