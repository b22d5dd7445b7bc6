"""Per-step metrics of in-flight updates and length cut-offs, on hand-made samples whose answers
are known: policy versions per sample, multi-version share, first / last token lag, and the
share of completions that hit the length limit."""

import numpy as np
import pytest

from pipelinerl_jax.generation import api
from pipelinerl_jax.pipeline import actor as actor_lib
from pipelinerl_jax.pipeline import trainer as trainer_lib
from pipelinerl_jax.tasks import Problem, Score


def test_version_stats_of_hand_made_samples():
  # At step 10: one sample written by version 9 alone (lag 1 throughout); one begun at 6 and
  # finished at 9 across three updates; one begun at 7, updated once, in the middle.
  samples = [np.array([9, 9, 9]), np.array([6, 6, 7, 8, 8, 9]), np.array([7, 8])]
  got = trainer_lib.version_stats(samples, step=10)
  assert got == dict(versions_per_sample_mean=pytest.approx((1 + 4 + 2) / 3),
                     versions_per_sample_max=4.0, frac_multi_version=pytest.approx(2 / 3),
                     lag_first_token_mean=pytest.approx((1 + 4 + 3) / 3),
                     lag_last_token_mean=pytest.approx((1 + 1 + 2) / 3))


def test_version_stats_single_version_and_empty():
  got = trainer_lib.version_stats([np.array([3, 3]), np.array([2])], step=3)
  assert got['versions_per_sample_max'] == 1.0 and got['frac_multi_version'] == 0.0
  assert got['lag_first_token_mean'] == got['lag_last_token_mean'] == 0.5
  # Versions need not be sorted to be counted (a sample is the order its tokens came in).
  assert trainer_lib.version_stats([np.array([5, 4, 5])], 6)['versions_per_sample_mean'] == 2.0
  empty = trainer_lib.version_stats([np.array([], np.int32)], step=3)
  assert empty['versions_per_sample_mean'] == 0.0 and empty['frac_multi_version'] == 0.0


def test_length_limit_share():
  assert trainer_lib.length_limit_stats([True, False, False, True]) == dict(
      frac_hit_length_limit=0.5)
  assert trainer_lib.length_limit_stats([]) == dict(frac_hit_length_limit=0.0)


def _completion(n, reason, version):
  return api.Completion(request_id='r', prompt_tokens=[1], tokens=np.zeros(n, np.int32),
                        logprobs=np.zeros(n, np.float32),
                        versions=np.full(n, version, np.int64), finish_reason=reason, metadata={})


def test_a_group_keeps_every_samples_length_flag_masked_ones_too():
  completions = [_completion(3, 'stop', 0), _completion(5, 'length', 1),
                 _completion(5, 'length', 1), _completion(2, 'stop', 0)]
  scores = [Score(1.0, 'correct'), Score(0.0, 'no_answer', mask=True), Score(0.0, 'no_answer'),
            Score(0.0, 'wrong')]
  group = actor_lib.make_group(0, Problem('p', '1+1=', '2'), completions, scores,
                               actor_lib.ActorConfig(4, 4, api.SamplingParams(max_tokens=5)))
  assert group.hit_length_limit == [False, True, True, False]
  assert len(group.samples) == 3  # the masked one is not trained, but it hit the limit
