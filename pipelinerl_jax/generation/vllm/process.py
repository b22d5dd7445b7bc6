"""A `VllmEngine` in its own process (multiprocessing spawn), behind the `api.Engine` interface:
the parent's handle. What runs in the child is child.py.

  parent (trainer side)                      child (generator)
  submit(request)  -- request queue -------> engine.submit
  update_params    -- shared-memory segment -> between two steps: lock, check, load, ack
  step()           <- result queue --------- completions + stats after each step

The child loops on its own: it drains requests, loads the newest complete update from the
shared-memory segment when there is one (under the segment lock, so the trainer never rewrites
bytes being loaded), runs one engine step and ships finished completions. `step()` in the parent
collects what has arrived (waiting up to `poll_s` when work is outstanding), so
`api.generate` works unchanged; the child does not wait for the parent between tokens.

Death and restart: an exception in the child is sent back with its traceback before the child
exits, and every parent call first checks that the child is alive. A dead child is replaced by
a fresh one that starts from the checkpoint and loads the segment's newest update (the latest
published weights, which live in the parent's segment and survive the child) before serving.
The replacement starts in a background thread: meanwhile `step()` returns nothing after
`poll_s`, submits are held back, and a `GeneratorPool` keeps serving from its other children.
The requests that were in flight there are re-submitted to it from their prompts (partial
tokens are discarded, so they run under the current policy). A request id completes at most
once: the parent keeps every submitted request until its completion arrives and drops any
completion whose id is not outstanding. After `max_restarts` restarts in all, a death raises
`GeneratorDied` with a one-line message naming the backend and the exit code or signal.
`update_params` raises TimeoutError when the child holds the segment longer than
`lock_timeout_s`; a child that died holding it is restarted and the write retried.

Collective transport (`weight_transport` 'gloo' on CPU, 'nccl' on CUDA; 'nccl' is UNRUN): the
trainer and each child form their own two-rank group (trainer rank 0, child rank 1; see
`collective.Rendezvous`) once the child's engine is up. `update_params` announces the version on
the request queue and broadcasts the buckets; a receiver thread in the child fills a staging
buffer, and the child's loop applies it whole, between two engine steps, then acknowledges it.
A send or receive that does not finish within `transport_timeout_s` ends in a one-line
TimeoutError (never a hang); the group is then unusable, so the child is killed (or exits) and
restarted. A restarted child joins a new group (new port) and is sent the latest published
params before it serves (the parent keeps a reference to them: they are the fresh copy the
trainer published).

Devices: `devices` are this child's CUDA_VISIBLE_DEVICES entries (see
`placement.assign_devices`), set in the child before vLLM (or CUDA) starts; () leaves the
environment as it is.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Any

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation.transport import collective
from pipelinerl_jax.generation.transport import hf_tensors
from pipelinerl_jax.generation.transport import shm
from pipelinerl_jax.generation.vllm import child
from pipelinerl_jax.generation.vllm import engine as vllm_engine
from pipelinerl_jax.models import hf_io


class GeneratorDied(RuntimeError):
  """The generator process is gone; its exit code and last error are in the message."""


def describe_exit(exitcode: int | None) -> str:
  """'exit code 1' / 'killed by signal SIGKILL' for a multiprocessing exit code."""
  if exitcode is None:
    return 'still running'
  if exitcode < 0:
    try:
      return f'killed by signal {signal.Signals(-exitcode).name}'
    except ValueError:
      return f'killed by signal {-exitcode}'
  return f'exit code {exitcode}'


def _last_line(text: str | None) -> str:
  lines = [l for l in (text or '').strip().splitlines() if l.strip()]
  return lines[-1].strip() if lines else ''


class GeneratorProcess(api.Engine):
  """Parent-side handle; `submit` and `update_params` may be called from any thread, `step`
  from one. `name` labels errors (the config backend that made it)."""

  def __init__(self, model_dir: str | os.PathLike, engine_config=None, *, version: int = 0,
               config: child.ProcessConfig = child.ProcessConfig(), name: str = 'vllm_process'):
    self.config, self.name = config, name
    self._collective = config.weight_transport != 'shm'
    self.model_dir = str(Path(model_dir))
    self.model_config = hf_io.load_config(model_dir)
    self._entries, size, self._capacity = shm.manifest_for(self.model_config,
                                                                  config.transport_dtype)
    self._engine_config = engine_config or vllm_engine.VllmEngineConfig()
    self._max_model_len = self._engine_config.max_model_len
    self._initial_version = version
    self._acked = version      # collective transports: the newest version the child loaded
    self._latest = None        # collective transports: (params, version) last published
    self._comm = None          # collective transports: rank 0's communicator for this child
    self._plan = child.transport_plan(self.model_config, config) if self._collective else None
    self._ctx = mp.get_context('spawn')
    self._seg = shm.Segment.create(size, self._ctx.Lock(), self._capacity)
    self._state_lock = threading.RLock()  # queues, child handle, in-flight map, inbox, stats
    self._write_lock = threading.RLock()  # held by a parent-side writer of the weights
    self._inflight: dict[str, api.Request] = {}  # submitted; no completion received yet
    self._inbox: list[api.Completion] = []       # received; not yet returned by step()
    self._update_errors: dict[int, str] = {}
    self._stats: dict[str, Any] = {'version': version}
    self.restarts = 0
    self.requeued = 0
    self._serving = True  # a child is up and gets submits directly
    self._restarting: threading.Thread | None = None
    self._restart_error: BaseException | None = None
    self.last_error: str | None = None  # the child's last traceback
    self._closed = False
    self._start_child()
    if not self._proc.is_alive():
      self._drain_after_death()
      self._closed = True
      self._seg.close(unlink=True)
      raise GeneratorDied(self._death_message('did not start'))

  # --- api.Engine ------------------------------------------------------------------------------

  def submit(self, request: api.Request) -> None:
    self._ensure_alive()
    # Checked here too: a request the child refuses would take the whole generator down.
    prompt, n = list(request.prompt_tokens), request.sampling.max_tokens
    if not prompt or min(prompt) < 0 or max(prompt) >= self.model_config.vocab_size:
      raise ValueError(f'request {request.request_id!r}: empty prompt or ids outside the vocab')
    if len(prompt) + n > self._max_model_len:
      raise ValueError(f'request {request.request_id!r}: prompt {len(prompt)} + max_tokens {n} '
                       f'exceeds max_model_len={self._max_model_len}')
    with self._state_lock:
      if request.request_id in self._inflight or any(c.request_id == request.request_id
                                                     for c in self._inbox):
        raise ValueError(f'request id {request.request_id!r} is already unfinished')
      self._inflight[request.request_id] = request
      if self._serving:  # else the replacement child gets it with the re-submitted ones
        self._requests.put(('submit', request))

  def update_params(self, params: Any, version: int) -> None:
    """Writes the update into shared memory now (one copy); the child loads it between two of
    its steps (a child being restarted loads it when it starts). Returns once written;
    `wait_loaded` waits for the child's acknowledgement. Collective transports: returns once
    broadcast (the child has it staged); a child being restarted is sent it when it is up."""
    if self._collective:
      self._ensure_alive()  # raises once restarts are used up; may start a restart
      with self._state_lock:  # a restart in progress sends `_latest` before it serves
        self._latest = (params, version)
        if not self._serving:
          return
      with self._write_lock:
        if self._proc.is_alive() and self._comm is not None:  # else the restart sends it
          self._send(params, version)
      return
    for attempt in range(2):
      self._ensure_alive()
      try:
        with self._write_lock:
          timing = shm.write_update(self._seg, params, self.model_config, version,
                                            dtype=self.config.transport_dtype,
                                            checksum=self.config.checksum,
                                            timeout=self.config.lock_timeout_s,
                                            reader_alive=lambda: self._proc.is_alive())
        break
      except shm.HolderDied:  # the next _ensure_alive frees the lock
        if attempt:
          raise
    self._stats['last_write_s'] = timing['write_s']

  def wait_loaded(self, version: int, timeout: float = 60.0) -> None:
    """Blocks until the child has loaded `version` (or a newer one); raises the child's error
    if it rejected that update."""
    deadline = time.monotonic() + timeout
    while self._acked_version() < version:
      if self._ensure_alive():
        self._receive(timeout=0.005)
      else:
        time.sleep(0.05)
      rejected = [e for v, e in self._update_errors.items() if v >= version]
      if rejected:
        raise RuntimeError(f'generator rejected version {version}: {rejected[0]}')
      if time.monotonic() > deadline:
        raise TimeoutError(f'generator did not load version {version} within {timeout:.0f}s')

  def step(self, timeout: float | None = None) -> list[api.Completion]:
    """Collects what the child finished; waits up to `timeout` (default `poll_s`) for a first
    result when work is outstanding and nothing has arrived (or, while a replacement child
    starts, for that long)."""
    timeout = self.config.poll_s if timeout is None else timeout
    if self._ensure_alive():
      if not self._inbox:
        self._receive(timeout=timeout if self._inflight else 0.0)
      while self._receive(timeout=0.0):
        pass
    elif timeout > 0:
      time.sleep(timeout)
    with self._state_lock:
      done, self._inbox = self._inbox, []
    return done

  def stats(self) -> dict[str, Any]:
    return dict(self._stats, pid=self._proc.pid, alive=self._proc.is_alive(),
                serving=self._serving, restarts=self.restarts, requeued=self.requeued)

  @property
  def num_unfinished(self) -> int:
    with self._state_lock:
      return len(self._inflight) + len(self._inbox)

  @property
  def serving(self) -> bool:
    """False while a replacement child starts."""
    return self._serving

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    restart = self._restarting
    if restart is not None:  # it notices `_closed` within a second and stops its child
      restart.join(timeout=30)
    if self._proc.is_alive():
      self._requests.put(('close',))
      self._proc.join(timeout=30)
    if self._proc.is_alive():
      self._proc.kill()  # our own child, by its handle
      self._proc.join(timeout=10)
    self._seg.close(unlink=True)

  # --- collective transport --------------------------------------------------------------------

  def _acked_version(self) -> int:
    return self._acked if self._collective else self._seg.header()['acked']

  def _transport_error(self, what: str, timed_out: bool) -> str:
    within = (f' within {self.config.transport_timeout_s:.0f}s '
              '(generation.remote.transport_timeout_s)' if timed_out else '')
    return (f'{self.name}: {what} over generation.remote.weight_transport='
            f'{self.config.weight_transport!r}{within}; the group is unusable, the generator '
            'is restarted')

  def _in_thread(self, fn, what: str):
    """Runs `fn` with a deadline: a collective that never completes must not hang the caller.
    On timeout or error the child is killed (so `_ensure_alive` restarts it) and a one-line
    error raised; if the child died by itself, its restart takes over and nothing is raised."""
    out: dict[str, Any] = {}

    def body():
      try:
        out['value'] = fn()
      except BaseException as e:
        out['error'] = e

    thread = threading.Thread(target=body, name=f'weights-{self.name}', daemon=True)
    thread.start()
    thread.join(self.config.transport_timeout_s)
    timed_out = thread.is_alive()  # before the kill below ends it with a connection error
    if timed_out or 'error' in out:
      self._comm = None
      if not timed_out:  # a peer that died resets the connection a moment before it is reaped
        self._proc.join(timeout=2.0)
        if not self._proc.is_alive():
          return None  # the child died: its replacement is sent the latest params
      if self._proc.is_alive():
        self._proc.kill()  # our own child, by its handle
        self._proc.join(timeout=10)
      if timed_out:
        raise TimeoutError(self._transport_error(f'{what} did not complete', True))
      raise RuntimeError(self._transport_error(
          f'{what} failed ({type(out["error"]).__name__}: {_last_line(str(out["error"]))})',
          False))
    return out.get('value')

  def _send(self, params, version: int) -> None:
    """(under _write_lock) Announces `version`, then broadcasts it to the child."""
    comm, device = self._comm, 'cuda:0' if self.config.weight_transport == 'nccl' else 'cpu'
    self._requests.put(('weights', version))
    start = time.perf_counter()
    self._in_thread(lambda: collective.send(
        comm, self._plan, hf_tensors.hf_torch_tensors(params, self.model_config), version,
        device=device), f'weight update {version}')
    self._stats['last_write_s'] = time.perf_counter() - start

  # --- child lifecycle -------------------------------------------------------------------------

  def _start_child(self):
    """Starts a child on fresh queues and waits for its 'ready' (or its death); with a
    collective transport, then joins a new group with it."""
    self._requests, self._results = self._ctx.Queue(), self._ctx.Queue()
    rendezvous = None
    if self._collective:
      rendezvous = collective.Rendezvous(self.config.weight_transport,
                                           self.config.transport_timeout_s)
      self._comm = None
    self._proc = self._ctx.Process(
        target=child.child_main, name=f'pipelinerl-generator-{self.name}', daemon=True,
        args=(self.model_dir, self._engine_config, self._initial_version, self._seg.name,
              self._capacity, self._seg.lock, self._requests, self._results, self.config,
              rendezvous and rendezvous.endpoint))
    self._proc.start()
    self._ready = False
    deadline = time.monotonic() + self.config.start_timeout_s
    while not self._ready and self._proc.is_alive():
      self._receive(timeout=1.0)
      timed_out = not self._ready and time.monotonic() > deadline
      if self._closed or timed_out:
        self._proc.kill()
        self._proc.join(timeout=10)
      if timed_out:
        raise TimeoutError(f'{self.name} generator did not start within '
                           f'{self.config.start_timeout_s:.0f}s')
    if rendezvous is not None and self._ready:
      self._acked = self._initial_version  # a fresh child serves the checkpoint
      device = 'cuda:0' if self.config.weight_transport == 'nccl' else None
      self._comm = self._in_thread(lambda: rendezvous.connect(device), 'joining the group')

  def _ensure_alive(self) -> bool:
    """True when a child is serving. A dead child is replaced in a background thread (see the
    module docstring; False until the replacement serves), or GeneratorDied is raised once
    `max_restarts` are used."""
    if self._closed:
      raise RuntimeError(f'{self.name} generator is closed')
    with self._state_lock:
      if self._restarting is not None:
        if self._restarting.is_alive():
          return False
        self._restarting = None
        if self._restart_error is not None:
          error, self._restart_error = self._restart_error, None
          raise error
      if self._proc.is_alive():
        return True
      self._serving = False
      self._drain_after_death()
      if self.restarts >= self.config.max_restarts:
        raise GeneratorDied(self._death_message('died'))
      self.restarts += 1
      self._stats['last_death'] = describe_exit(self._proc.exitcode)
      for q in (self._requests, self._results):  # may hold a message cut by the death
        q.close()
        q.cancel_join_thread()
      with self._write_lock:  # no parent writer holds the segment lock now
        if self._seg.lock.acquire(timeout=0):
          self._seg.lock.release()
        else:  # the dead child held it: it would never be released
          self._seg.lock = self._ctx.Lock()
      self._stats['restart_version'] = self._seg.header()['version']
      self._restarting = threading.Thread(target=self._restart, name=f'restart-{self.name}',
                                          daemon=True)
      self._restarting.start()
      return False

  def _restart(self):
    """(background thread) One replacement child; once it is ready, every outstanding request
    goes to it from its prompt. A replacement that dies is replaced by the next call."""
    try:
      # A collective child gets the latest params before it serves; shm writers never wait.
      with self._write_lock if self._collective else contextlib.nullcontext():
        self._start_child()
        sent = None
        while self._ready and not self._closed and self._proc.is_alive():
          with self._state_lock:  # `update_params` sets `_latest` under this lock
            if not self._collective or self._latest is None or self._latest is sent:
              for request in self._inflight.values():
                self._requests.put(('submit', request))
              self.requeued += len(self._inflight)
              self._serving = True
              break
            sent = self._latest
          if self._comm is None:
            break  # the group failed: this child is dead or killed; the next call replaces it
          self._send(*sent)
          deadline = time.monotonic() + self.config.transport_timeout_s
          while (self._acked < sent[1] and sent[1] not in self._update_errors
                 and self._proc.is_alive() and time.monotonic() < deadline):
            self._receive(timeout=0.05)
    except BaseException as e:  # raised by the next _ensure_alive, in the caller's thread
      self._restart_error = e

  def _death_message(self, what: str) -> str:
    return (f'{self.name} generator (pid {self._proc.pid}) {what}: '
            f'{describe_exit(self._proc.exitcode)}; restarts used {self.restarts} of '
            f'generation.remote.max_restarts={self.config.max_restarts}' +
            (f'; its last error: {_last_line(self.last_error)}' if self.last_error else
             ' (no error reported: killed?)'))

  def _drain_after_death(self):
    """Completions and the error the dead child sent before dying; stops at the first message
    that cannot be read (one cut short by the death)."""
    writer = getattr(self._results, '_writer', None)  # our copy of the pipe's write end:
    if writer is not None:  # closed, a message cut short reads as EOF instead of blocking
      writer.close()
    for _ in range(10_000):
      try:
        if not self._receive(timeout=0.0):
          return
      except EOFError:
        return

  def _receive(self, timeout: float) -> bool:
    """Handles one message from the child, if one comes within `timeout`; False if none."""
    try:
      msg = self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait()
    except (queue.Empty, OSError, ValueError):  # nothing, or a queue closed by a restart
      return False
    kind = msg[0]
    with self._state_lock:
      if kind == 'step':
        for c in msg[1]:  # at most once per id: a completion not outstanding is dropped
          if self._inflight.pop(c.request_id, None) is not None:
            self._inbox.append(c)
        self._stats = {**self._stats, **msg[2]}
      elif kind == 'update_error':
        self._update_errors[msg[1]] = msg[2]
        self._stats['last_update_error'] = f'version {msg[1]}: {msg[2]}'
      elif kind == 'loaded':
        self._acked = max(self._acked, msg[1])
        self._stats['version'] = self._acked
      elif kind == 'ready':
        self._ready = True
        self._stats['version'] = msg[1]
      elif kind == 'error':
        self.last_error = msg[1]
        self._proc.join(timeout=10)  # it exits right after reporting
    return True
