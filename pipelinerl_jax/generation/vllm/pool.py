"""`api.Engine` over several generator processes (one per GPU or tensor-parallel group).

  submit(request)  -> one child, chosen per group: the G samples of a prompt stay together
                      (shared prompt, one scheduler), a new group goes to the least-loaded child
  step()           <- the completions every child has finished
  update_params    -> every child, same version (each child reads its own shared-memory segment)
  num_unfinished   =  the sum over children

Each child is a `GeneratorProcess`, so restarts are per child: a child that dies is replaced
and its in-flight requests re-submitted to the replacement; the others keep running.

With generation.remote.weight_transport 'gloo' / 'nccl', each child is its own two-rank group
with the trainer (so one child's restart never touches the others' groups); an update is
broadcast to the children one after the other, which costs the trainer N sends where one
N+1-rank group would cost one (a possible next step on GPU hosts).

One copy of the weights per child: a segment shared by all children would need a lock that
survives a reader dying while holding it (a dead holder would block every other child), which
a multiprocessing lock is not. On CPU the extra copies cost one memcpy of the params each.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from typing import Any

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation.vllm import child as child_lib
from pipelinerl_jax.generation.vllm import process


def group_key(request: api.Request) -> Any:
  """What keeps requests together: the actor's group id, else the request itself."""
  return request.metadata.get('group', request.request_id)


class GeneratorPool(api.Engine):
  """`submit` and `update_params` may be called from any thread, `step` from one."""

  def __init__(self, model_dir: str | os.PathLike, engine_config=None, *, num_generators: int,
               version: int = 0,
               config: child_lib.ProcessConfig = child_lib.ProcessConfig(),
               name: str = 'vllm_process', devices=None):
    """`devices`: each child's CUDA_VISIBLE_DEVICES entries (`placement.assign_devices`);
    None = every child inherits the parent's."""
    if num_generators < 1:
      raise ValueError(f'num_generators={num_generators} must be >= 1')
    if devices is not None and len(devices) != num_generators:
      raise ValueError(f'{len(devices)} device shares for {num_generators} generators')
    self.config = config
    self.children: list[process.GeneratorProcess] = []
    try:  # started one after the other: vLLM start-up is CPU-bound
      for i in range(num_generators):
        child_config = config if devices is None else dataclasses.replace(
            config, devices=tuple(devices[i]))
        self.children.append(process.GeneratorProcess(
            model_dir, engine_config, version=version, config=child_config, name=f'{name}[{i}]'))
    except BaseException:
      self.close()
      raise
    self._lock = threading.Lock()
    self._route: dict[Any, int] = {}  # group key -> child, while the group has requests out
    self._open = collections.Counter()  # group key -> requests submitted, not yet returned
    self._key_of: dict[str, Any] = {}   # request id -> group key

  def submit(self, request: api.Request) -> None:
    key = group_key(request)
    with self._lock:
      child = self._route.get(key)
      if child is None:
        child = min(range(len(self.children)),  # serving first: not one being restarted
                    key=lambda i: (not self.children[i].serving, self.children[i].num_unfinished))
      self.children[child].submit(request)
      self._route[key] = child
      self._open[key] += 1
      self._key_of[request.request_id] = key

  def step(self) -> list[api.Completion]:
    """Collects from every child, waiting up to `poll_s` in all for a first completion."""
    deadline = time.monotonic() + self.config.poll_s
    while True:
      done = [c for child in self.children for c in child.step(timeout=0.0)]
      if done or not self.num_unfinished or time.monotonic() >= deadline:
        break
      time.sleep(0.002)
    with self._lock:
      for c in done:
        key = self._key_of.pop(c.request_id)
        self._open[key] -= 1
        if not self._open[key]:
          del self._open[key], self._route[key]
    return done

  def update_params(self, params: Any, version: int) -> None:
    for child in self.children:
      child.update_params(params, version)

  def wait_loaded(self, version: int, timeout: float = 60.0) -> None:
    for child in self.children:
      child.wait_loaded(version, timeout)

  def stats(self) -> dict[str, Any]:
    per_child = [child.stats() for child in self.children]
    total = lambda k: sum(s.get(k) or 0 for s in per_child)
    return dict(
        tokens_generated=total('tokens_generated'), tokens_per_s=total('tokens_per_s'),
        busy_slots=total('busy_slots'), num_slots=total('num_slots'), pending=total('pending'),
        updates=min(s.get('updates') or 0 for s in per_child),
        version=min(s['version'] for s in per_child),  # loaded everywhere
        restarts=total('restarts'), requeued=total('requeued'), generators=per_child)

  @property
  def num_unfinished(self) -> int:
    return sum(child.num_unfinished for child in self.children)

  def close(self) -> None:
    for child in self.children:
      child.close()
