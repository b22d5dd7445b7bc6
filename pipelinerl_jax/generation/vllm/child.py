"""What runs in a vLLM generator process: the loop that drains requests, applies the newest
complete weight update between two engine steps and ships completions back (see process.py for
the parent's side and the protocol), and the two ways updates arrive: a shared-memory segment
(`ShmLoader`) or a collective broadcast received by a background thread (`Receiver`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback

from pipelinerl_jax.generation.transport import collective
from pipelinerl_jax.generation.transport import hf_tensors
from pipelinerl_jax.generation.transport import shm
from pipelinerl_jax.generation.vllm import engine as vllm_engine


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
  transport_dtype: str = 'float32'  # dtype of the tensors in shared memory
  checksum: bool = True             # crc32 of the payload, checked by the reader before loading
  lock_timeout_s: float = 60.0
  start_timeout_s: float = 300.0
  poll_s: float = 0.05              # how long `step()` waits for results when work is outstanding
  max_restarts: int = 3             # child deaths survived (in all) before GeneratorDied
  weight_transport: str = 'shm'     # 'shm' | 'gloo' (CPU) | 'nccl' (CUDA, UNRUN); checked
                                    # by config.RemoteConfig
  transport_timeout_s: float = 120.0  # collective transports: joining the group, one update
  bucket_mb: int = 256              # collective transports: broadcast bucket size
  devices: tuple[str, ...] = ()     # the child's CUDA_VISIBLE_DEVICES; () = inherit


def transport_plan(model_config, cfg: ProcessConfig) -> collective.Plan:
  """The bucket layout both sides of a collective transport derive from the model."""
  return collective.make_plan(hf_tensors.expected_shapes(model_config), cfg.transport_dtype,
                              cfg.bucket_mb << 20)


class Receiver:
  """Receives announced updates in a background thread, one at a time, into a fresh
  staging buffer each; the loop takes the newest complete one between two engine steps."""

  def __init__(self, endpoint, model_config, cfg: ProcessConfig):
    self._cfg = cfg
    device = 'cuda:0' if endpoint.backend == 'nccl' else 'cpu'
    self._device = device
    self._comm = collective.join(endpoint, 1, cfg.transport_timeout_s, device)
    self._plan = transport_plan(model_config, cfg)
    self._announced: queue.Queue = queue.Queue()
    self._staged: queue.Queue = queue.Queue()
    threading.Thread(target=self._run, name='weights-receiver', daemon=True).start()

  def announce(self, version: int) -> None:
    self._announced.put(version)

  def _run(self):
    while True:
      version = self._announced.get()
      try:
        got = collective.receive(self._comm, self._plan, device=self._device,
                                         timeout_s=self._cfg.transport_timeout_s)
        if got[0] != version:
          raise ValueError(f'announced version {version}, received {got[0]}')
        self._staged.put(got)
      except BaseException as e:  # the group is unusable now: the loop ends the child
        self._staged.put(e)
        return

  def newest(self):
    """(version, views) of the newest complete update, or None; raises the receive error."""
    newest = None
    while True:
      try:
        got = self._staged.get_nowait()
      except queue.Empty:
        return newest
      if isinstance(got, BaseException):
        raise RuntimeError(f'generation.remote.weight_transport={self._cfg.weight_transport!r}: '
                           f'{type(got).__name__}: {got}') from got
      newest = got


def child_main(model_dir, engine_config, version, seg_name, manifest_capacity, lock,
               requests: mp.Queue, results: mp.Queue, cfg: ProcessConfig, endpoint=None):
  """The generator loop: the process's target."""
  os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'
  if cfg.devices:  # before anything starts CUDA in this process
    os.environ['CUDA_VISIBLE_DEVICES'] = ','.join(cfg.devices)
  receiver = None
  try:
    engine = vllm_engine.VllmEngine(model_dir, engine_config, version=version)
    seg = shm.Segment.attach(seg_name, lock, manifest_capacity)
    shm_loader = ShmLoader(seg, cfg)
    if endpoint is None:
      shm_loader.load_newest(engine, results)  # a restarted child serves the latest weights
    results.put(('ready', engine.version))
    if endpoint is not None:  # the parent joins on 'ready', then sends the latest params
      receiver = Receiver(endpoint, engine.model_config, cfg)
      results.put(('joined', None))
    closing, last_report = False, 0.0
    while not closing:
      try:  # block briefly only when idle, so an idle child does not spin
        msg = requests.get(timeout=0.01 if engine.num_unfinished == 0 else 0)
      except queue.Empty:
        msg = None
      while msg is not None:
        if msg[0] == 'submit':
          engine.submit(msg[1])
        elif msg[0] == 'weights':
          receiver.announce(msg[1])
        elif msg[0] == 'close':
          closing = True
        try:
          msg = requests.get_nowait()
        except queue.Empty:
          msg = None
      if receiver is None:
        loaded = shm_loader.load_newest(engine, results)
      else:
        loaded = apply_staged(receiver, engine, results)
      done = engine.step() if engine.num_unfinished else []
      if done or loaded or time.monotonic() - last_report > 0.5:
        results.put(('step', done, engine.stats()))
        last_report = time.monotonic()
    engine.close()
    seg.close()
    results.put(('closed', None))
  except BaseException:
    results.put(('error', traceback.format_exc()))
    if receiver is not None:  # a thread may be stuck in the collective: do not wait for it
      results.close()
      results.join_thread()
      os._exit(1)
    raise


def apply_staged(receiver: Receiver, engine, results) -> bool:
  """Loads the newest received update whole; a rejected one is reported, the engine keeps
  serving (and rolls back, see VllmEngine.apply_update). A receive error ends the child."""
  got = receiver.newest()
  if got is None:
    return False
  version, views = got
  if version <= engine.version:
    return False
  try:
    engine.update_hf_tensors(views, version)
    engine.apply_update()
    results.put(('loaded', version))
    return True
  except vllm_engine.WeightUpdateError as e:
    results.put(('update_error', version, f'{type(e).__name__}: {e}'))
    return False


class ShmLoader:
  """Loads the shared-memory segment's update between two engine steps when it is newer than
  the engine's weights. A corrupt segment or a rejected load is reported to the parent and not
  retried (the same bytes would fail again); the engine keeps serving its current version."""

  def __init__(self, seg: shm.Segment, cfg: ProcessConfig):
    self.seg, self.cfg = seg, cfg
    self.rejected = -1  # the last segment version whose load failed

  def load_newest(self, engine, results) -> bool:
    seg = self.seg
    h = seg.header()
    if h['state'] != shm.VALID or h['version'] <= max(engine.version, self.rejected):
      return False
    seg.acquire(self.cfg.lock_timeout_s, 'trainer (writer)')
    views = None
    try:
      version, views = shm.read_update(seg, verify=self.cfg.checksum)
      if version <= engine.version:
        return False
      engine.update_hf_tensors(views, version)
      views = None
      engine.apply_update()  # copies out of the segment before the lock is released
      seg.write_header(acked=version)
      return True
    except (shm.TransportError, vllm_engine.WeightUpdateError) as e:
      self.rejected = seg.header()['version']
      results.put(('update_error', self.rejected, f'{type(e).__name__}: {e}'))
      return False
    finally:
      views = None  # no view of the segment may outlive the lock
      seg.lock.release()
