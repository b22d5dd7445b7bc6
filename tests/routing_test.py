"""The pool's bookkeeping without Ray: routing of groups, exactly-once completions, evictions
after a restart, and the per-node core allocation of generator actors."""

import dataclasses

import numpy as np
import pytest

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import routing as routing_lib
from pipelinerl_jax.generation.actors import placement


def request(group, index):
  return api.Request(f'{group}/{index}', [1, 2], api.SamplingParams(max_tokens=4),
                     seed=index, metadata=dict(group=group, index=index))


def completion(r):
  return api.Completion(r.request_id, list(r.prompt_tokens), np.zeros(1, np.int32),
                        np.zeros(1, np.float32), np.zeros(1, np.int64), 'length', r.metadata)


def route(routing, r):
  i = routing.choose(r)
  routing.assign(i, r)
  return i


def test_a_group_stays_on_one_generator_and_new_groups_go_to_the_least_loaded():
  routing = routing_lib.Routing(3)
  placed = {g: {route(routing, request(g, j)) for j in range(4)} for g in range(3)}
  assert all(len(at) == 1 for at in placed.values())
  assert sorted(next(iter(at)) for at in placed.values()) == [0, 1, 2]
  for j in range(4):  # generator 1 finishes its group: the next group goes there
    assert routing.accept(1, completion(request(1, j)))
  assert route(routing, request(7, 0)) == 1
  assert routing.load(0) == 4 and routing.load(1) == 1 and routing.num_unfinished == 9


def test_each_request_id_is_accepted_once_and_only_from_its_generator():
  routing = routing_lib.Routing(2)
  r = request(0, 0)
  i = route(routing, r)
  with pytest.raises(ValueError, match="request id '0/0' is already unfinished"):
    routing.choose(r)
  assert not routing.accept(1 - i, completion(r))  # from a generator that does not hold it
  assert routing.accept(i, completion(r))
  assert not routing.accept(i, completion(r))      # a duplicate
  assert routing.num_unfinished == 0


def test_evicted_requests_are_routed_again_to_the_generators_that_serve():
  routing = routing_lib.Routing(2)
  requests = [request(g, j) for g in range(2) for j in range(3)]
  where = {r.request_id: route(routing, r) for r in requests}
  assert where['0/0'] != where['1/0']
  dead = where['0/0']
  assert routing.accept(dead, completion(request(0, 0)))
  routing.serving[dead] = False              # restarting: lost its requests
  evicted = routing.evict(dead)
  assert [r.request_id for r in evicted] == ['0/1', '0/2']  # oldest first, the finished one not
  assert not routing.accept(dead, completion(request(0, 1)))  # what it had is no longer its
  for r in evicted:
    assert route(routing, r) == 1 - dead
  routing.serving[dead] = True
  assert route(routing, request(5, 0)) == dead  # now the least loaded
  done = [routing.accept(1 - dead, completion(r)) for r in evicted + requests[3:]]
  assert all(done) and routing.num_unfinished == 1


def test_a_continued_turn_goes_to_the_generator_that_decoded_its_previous_turn():
  """Even when its group has nothing left there (so group routing would pick the least
  loaded); `release` names that generator once, and an eviction forgets what it held."""
  routing = routing_lib.Routing(2)
  turn1 = dataclasses.replace(request(0, 0), continuable=True)
  at = route(routing, turn1)
  assert route(routing, request(1, 0)) == 1 - at
  assert routing.accept(at, completion(turn1))  # group 0 has nothing left anywhere
  assert route(routing, request(2, 0)) == route(routing, request(2, 1)) == at
  assert routing.load(at) == 2 > routing.load(1 - at)  # a new group would go to 1 - at
  turn2 = dataclasses.replace(request(0, 0), request_id='0/0/turn2', continues='0/0',
                              continuable=True)
  assert routing.choose(turn2) == at
  routing.assign(at, turn2)
  assert routing.accept(at, completion(turn2))
  assert routing.release('0/0/turn2') == at and routing.release('0/0/turn2') is None
  # A generator that restarts lost the KV: its turns are routed like any request.
  turn3 = dataclasses.replace(turn2, request_id='x', continues=None)
  i = route(routing, turn3)
  assert routing.accept(i, completion(turn3))
  routing.evict(i)
  assert routing.release('x') is None


def test_no_generator_serving_means_no_choice():
  routing = routing_lib.Routing(2)
  routing.serving = [False, False]
  assert routing.choose(request(0, 0)) is None


def test_cores_are_disjoint_per_node_then_shared_evenly():
  cores = placement.CoreAllocator()
  assert cores.take('a', [0, 1, 2, 3], 2) == (0, 1)
  assert cores.take('a', [0, 1, 2, 3], 2) == (2, 3)
  assert cores.take('b', [0, 1], 1) == (0,)          # another node: its own count
  assert cores.take('a', [0, 1, 2, 3], 1) == (0,)    # oversubscribed: the least used
  cores.release('a', (2, 3))
  assert cores.take('a', [0, 1, 2, 3], 2) == (2, 3)  # released cores come back first
  with pytest.raises(ValueError):
    cores.take('a', [], 1)


def test_free_cores_are_those_nobody_holds_and_stay_held():
  cores = placement.CoreAllocator()
  cores.take('a', [0, 1, 2, 3], 1)
  assert cores.take_free('a', [0, 1, 2, 3]) == (1, 2, 3)   # the trainer's, beside a generator
  assert cores.take_free('a', [0, 1, 2, 3]) == ()          # all held now
  cores.release('a', (0,))                                  # a generator restarts ...
  assert cores.take('a', [0, 1, 2, 3], 1) == (0,)           # ... onto its own core again


def test_free_gpus_follow_the_device_rules():
  gpus = [str(i) for i in range(8)]
  assert placement.free_gpus(gpus, 5) == ['5', '6', '7']
  assert placement.free_gpus(gpus, 4, '6,7') == ['6', '7']
  assert placement.free_gpus([], 1) == []
  with pytest.raises(ValueError, match='belong to the train mesh'):
    placement.free_gpus(gpus, 4, '3')


def test_assign_devices_splits_the_gpus_the_mesh_leaves_free():
  gpus = [str(i) for i in range(8)]
  assert placement.assign_devices(gpus, 4, 4) == [('4',), ('5',), ('6',), ('7',)]
  assert placement.assign_devices(gpus, 4, 2) == [('4', '5'), ('6', '7')]
  # A remainder stays unused.
  assert placement.assign_devices(gpus, 5, 2, per_child_max=1) == [('5',), ('6',)]
  assert placement.assign_devices(gpus, 2, 2, '5,7') == [('5',), ('7',)]
  # The trainer's own ids.
  assert placement.assign_devices(['3', '1', '6'], 1, 2) == [('1',), ('6',)]
  assert placement.assign_devices([], 1, 3) == [(), (), ()]  # CPU host: nothing to assign


@pytest.mark.parametrize('visible, used, n, requested, per_child_max, match', [
    ('', 1, 1, '0', None, 'this host has no GPUs'),
    ('01234567', 8, 1, '', None, 'the train mesh uses 8 of 8 GPUs, leaving 0'),
    ('01234567', 6, 3, '', None, 'leaving 2 for generation.num_generators=3'),
    ('01234567', 4, 2, '3,4', None, r'GPU\(s\) 3 belong to the train mesh'),
    ('01234567', 4, 2, '5,9', None, r'GPU\(s\) 9 are not visible'),
    ('01234567', 4, 2, '5,5', None, 'names a GPU twice'),
    ('01234567', 4, 2, '5,6,7', None, 'do not split evenly'),
    ('01234567', 4, 2, '', 1, r'tensor parallelism.*num_generators=4'),
])
def test_assign_devices_refuses_impossible_assignments(visible, used, n, requested,
                                                       per_child_max, match):
  with pytest.raises(ValueError, match=match) as e:
    placement.assign_devices(list(visible), used, n, requested, per_child_max)
  assert str(e.value).startswith('config.generation.remote.devices')
  assert '\n' not in str(e.value)
