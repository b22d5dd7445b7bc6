"""Weight updates to the generator actors, newest wins, over one of three transports.

  object store   one `ray.put` of the params as host arrays, which every actor on a node reads
                 zero-copy from Ray's object store; from several trainer processes, their pieces
                 (`shards.Published`), which each actor assembles
  gloo / nccl    a bucketed broadcast per actor over its own two-rank group (transport/
                 collective.py), all from one sender thread, in the wire dtype
                 (budget.wire_dtype)

Newest update wins: an actor has at most one update in flight; when it finishes, the actor is
sent the latest version published since, never the ones in between. Every update carries its
version and the digest of its layout (transport/layout.py), and the actor applies it whole or
refuses it; with spec.verify_updates it also carries the checksum of its values
(layout.params_checksum, in the wire dtype), which the actor checks against what it handed its
engine. With LoRA (the engine spec's `lora`) an update is the adapters alone, on every
transport: over a collective as PEFT-named tensors in the param dtype. A collective transfer
that fails or misses its deadline is reported in one line, its communicator destroyed, and the
actor killed, so that Ray restarts it into a new group (restarts.py), which then gets the
latest version.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import jax
import numpy as np
import ray

from pipelinerl_jax import cluster
from pipelinerl_jax.generation.actors import generator as generator_lib
from pipelinerl_jax.generation.actors import members as members_lib
from pipelinerl_jax.generation.transport import layout
from pipelinerl_jax.generation.transport import shards


class Updates:
  """The latest published version and how it reaches each member. Calls marked (under the lock)
  expect the pool's lock held; `publish` takes it itself."""

  def __init__(self, spec: generator_lib.GeneratorSpec, model_config,
               members: Sequence[members_lib.Member], lock: threading.RLock):
    self.spec, self.model_config = spec, model_config
    self._members, self._lock = members, lock
    self.latest: tuple[Any, int, str] | None = None  # (object ref or params, version, digest)
    self._checksum = ''  # the latest version's, with spec.verify_updates
    self.transport_errors: list[str] = []
    self.sender = self._plan = None
    self.lora = spec.engine.lora
    if spec.transport != 'object_store':
      from pipelinerl_jax.generation.transport import collective
      from pipelinerl_jax.generation.transport import hf_tensors
      self._plan = collective.make_plan(hf_tensors.update_shapes(model_config, self.lora),
                                        spec.wire_dtype, spec.bucket_mb << 20)
      # torch's cuda:0 and JAX's first device are the first visible GPU.
      self.sender = collective.Sender('cuda:0' if spec.transport == 'nccl' else 'cpu')
      self._gather_device = jax.local_devices()[0]
      # Where the groups' stores and the trainer's gloo rank listen: as the generators reach
      # this host.
      self.address = (cluster.interface_address(spec.interface) if spec.interface
                      else ray.util.get_node_ip_address())

  def publish(self, params: Any, version: int) -> None:
    """Object store: copies `params` to host and into the object store before returning (the
    caller may then donate them); the actors load them as soon as they are free. Collective:
    broadcasts to each serving actor in turn, each within transport_timeout_s."""
    if isinstance(params, shards.Published):  # several trainer processes: their pieces
      with self._lock:
        self.latest = (params, version, params.digest)
        self.dispatch()
      return
    if self.spec.transport == 'object_store':
      host = jax.tree.map(np.asarray, jax.device_get(params))
      latest = (ray.put(host), version, layout.tree_digest(host))
      checksum = layout.params_checksum(host) if self.spec.verify_updates else ''
      with self._lock:
        self.latest, self._checksum = latest, checksum
        self.dispatch()
      return
    checksum = ''
    if self.spec.verify_updates:  # what the wire carries: each leaf in its dtype, on one device
      wire = self.spec.wire_dtype
      checksum = layout.params_checksum(params, lambda x: np.asarray(
          jax.device_put(x, self._gather_device).astype(wire)))
    with self._lock:
      self.latest, self._checksum = (params, version, ''), checksum
      members = [m for m in self._members if m.comm is not None and m.recover is None]
    for m in members:
      self.send(m, params, version, checksum)

  def is_current(self, m: members_lib.Member) -> bool:
    """Whether `m` has loaded the latest published version (or nothing was published)."""
    return self.latest is None or m.version >= self.latest[1]

  def dispatch(self) -> None:
    """(under the lock) Object store: the latest version to every actor without an update in
    flight that has an older one."""
    if self.latest is None or self.spec.transport != 'object_store':
      return
    ref, version, digest = self.latest
    for m in self._members:
      if m.update is None and m.recover is None and m.version < version:
        if isinstance(ref, shards.Published):
          m.update = m.handle.update_shards.remote(ref.refs, version, digest, m.incarnation)
        else:
          m.update = m.handle.update.remote(ref, version, digest, m.incarnation, self._checksum)

  def resend(self, m: members_lib.Member) -> None:
    """(under the lock) The latest version to an actor that restarted: over the object store
    with the others; over a collective, into a new group, from a thread of its own."""
    if self.spec.transport == 'object_store':
      self.dispatch()
      return
    self.join(m)
    params, version, _ = self.latest
    threading.Thread(target=self.send, args=(m, params, version, self._checksum),
                     daemon=True).start()

  def join(self, m: members_lib.Member) -> None:
    """A new two-rank group with the actor (trainer rank 0), for a collective transport; a
    group that fails to form is torn down before this raises."""
    from pipelinerl_jax.generation.transport import collective
    self.drop(m)
    rendezvous = collective.Rendezvous(self.spec.transport, self.spec.transport_timeout_s,
                                       host=self.address)
    try:
      joined = m.handle.join.remote(rendezvous.endpoint)
      m.comm = rendezvous.connect(device='cuda:0' if self.spec.transport == 'nccl' else None)
      ray.get(joined, timeout=self.spec.transport_timeout_s)
    except BaseException:
      self.drop(m)
      raise
    finally:
      rendezvous.close()

  def drop(self, m: members_lib.Member) -> None:
    """Destroys the trainer's end of the actor's group, if any (bounded: an abort may block)."""
    comm, m.comm = m.comm, None
    if comm is not None:
      from pipelinerl_jax.generation.transport import collective
      collective.destroy(comm)

  def send(self, m: members_lib.Member, params, version: int, checksum: str = '') -> None:
    """Broadcasts one update to one actor within the deadline, from the sender thread; a
    transfer that fails or misses it is reported in one line (the sender has destroyed the
    communicator) and the actor killed, so Ray restarts it into a new group."""
    from pipelinerl_jax.generation.transport import hf_tensors
    spec = self.spec
    with m.send_lock:
      comm = m.comm
      if comm is None:
        return
      received = m.handle.receive.remote(version, m.incarnation, checksum)
      try:
        self.sender.send(comm, self._plan, lambda: hf_tensors.gathered_update_tensors(
            params, self.model_config, self._gather_device, spec.wire_dtype, self.lora), version,
            timeout_s=spec.transport_timeout_s)
      except Exception as error:  # the sender has destroyed the communicator
        m.comm = None
        if members_lib.incarnation_changed(m):  # it died and came back: the restart re-joins it
          return
        what = (f'did not complete within {spec.transport_timeout_s:.0f}s '
                '(generation.remote.transport_timeout_s)' if isinstance(error, TimeoutError)
                else f'failed ({type(error).__name__}: {error})')
        line = (f'{m.name} (node {m.info.get("node_ip")}): weight update {version} over '
                f'generation.remote.weight_transport={spec.transport!r} {what}; the group is '
                'unusable, the actor is restarted')
        print(f'[generators] {line}', flush=True)
        self.transport_errors.append(line)
        ray.kill(m.handle, no_restart=False)  # Ray restarts it; restarts.py re-joins it
        return
    with self._lock:
      m.update = received

  def close(self) -> None:
    for m in self._members:
      self.drop(m)
    if self.sender is not None:
      self.sender.close()
