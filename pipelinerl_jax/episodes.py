"""Multi-turn episodes: the bookkeeping of one episode, as functions the actor and the
evaluation share (they drive the engine; this module never touches it).

An episode of a task with an `Environment` is one training sample: its completion is turn 1,
observation 1, turn 2, ..., the last turn. Model tokens carry log mu and the policy version that
drew them (loss_mask 1); observation tokens are fed, never sampled or trained (loss_mask 0, log
mu 0, the version of the token before them). Each turn is one engine request whose prompt is the
whole history (`api.Request.continues` names the turn it continues).

The reward is the episode return: the sum of the environment's step rewards. How an episode
ends (`Episode.outcome`):
  'done'        the environment said done (its last step's `score` gives the status and the
                mask; an environment that gives no score: status 'no_answer')
  'turn_limit'  the last allowed turn (`Task.max_turns`, or no room left for another) was
                answered without done: the episode ends there, status as for 'done'
  'cut'         the observation would overflow the token budget (`Task.max_episode_tokens`
                after the prompt) or the engine's max_seq_len: it is not fed and the episode
                ends at the model's turn, status 'no_answer' (no final answer was given)
  'env_error'   step raised (or answered something that is not an EnvStep): reward 0, status
                'unparsable'; reset raised: the same, and masked (there is no turn to train)
All of these are counted in the step's metrics; none stops the actor.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Callable, Sequence

import numpy as np

from pipelinerl_jax.generation import api
from pipelinerl_jax.tasks import base as tasks_base

OUTCOMES = ('done', 'turn_limit', 'cut', 'env_error')
# A longer observation string is cut without being encoded: no tokenizer packs this many
# characters into one token, and encoding a flood of text costs time on the actor's hot path.
MAX_CHARS_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class Limits:
  """What bounds an episode: the task's turn limit and budget, the engine's length."""
  sampling: api.SamplingParams     # each turn's; max_tokens is the per-turn limit
  max_turns: int
  max_episode_tokens: int = 0      # after the prompt; 0 = no budget beyond the turns' own
  max_seq_len: int = 0             # prompt + episode, the engine's limit; 0 = none

  def __post_init__(self):
    if self.max_turns < 1 or self.max_episode_tokens < 0 or self.max_seq_len < 0:
      raise ValueError(f'episode limits: need max_turns >= 1, max_episode_tokens >= 0, '
                       f'max_seq_len >= 0; got {self.max_turns}, {self.max_episode_tokens}, '
                       f'{self.max_seq_len}')

  def end(self, prompt_len: int) -> float:
    """The most tokens (prompt included) the episode may hold."""
    ends = [math.inf]
    if self.max_episode_tokens:
      ends.append(prompt_len + self.max_episode_tokens)
    if self.max_seq_len:
      ends.append(self.max_seq_len)
    return min(ends)


def limits_of(task: tasks_base.Task, sampling: api.SamplingParams,
              max_seq_len: int = 0) -> Limits:
  return Limits(sampling=sampling, max_turns=task.max_turns,
                max_episode_tokens=task.max_episode_tokens, max_seq_len=max_seq_len)


@dataclasses.dataclass
class Episode:
  """One episode's state; lists grow turn by turn (`prompt_tokens` + `tokens` is the history)."""
  problem: tasks_base.Problem
  env: tasks_base.Environment
  request_id: str                  # the first turn's; later turns add '/turn<k>'
  seed: int                        # the first turn's
  metadata: dict
  prompt_tokens: list[int] = dataclasses.field(default_factory=list)
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  routes: list[np.ndarray] = dataclasses.field(default_factory=list)  # MoE: [Ls, Xk] a token
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  turn_lengths: list[int] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  tool_calls: int = 0
  tool_errors: int = 0
  finish_reason: api.FinishReason = 'stop'   # of the last turn
  score: tasks_base.Score | None = None      # set when the episode ends
  outcome: str = ''
  last_request_id: str = ''

  @property
  def done(self) -> bool:
    return self.score is not None

  @property
  def turns(self) -> int:
    return len(self.turn_lengths)


@dataclasses.dataclass(frozen=True)
class EpisodeStats:
  """What the step's metrics record keeps of a finished episode."""
  turns: int
  tool_calls: int
  tool_errors: int
  model_tokens: int
  observation_tokens: int
  versions: int                    # distinct policy versions among its model tokens
  outcome: str


def turn_request_id(episode: Episode, turn: int) -> str:
  """Turn 1 keeps the episode's id (a one-turn episode's request is today's request)."""
  return episode.request_id if turn == 1 else f'{episode.request_id}/turn{turn}'


def turn_seed(episode: Episode, turn: int) -> int:
  if turn == 1:
    return episode.seed
  return zlib.crc32(f'{episode.seed}/turn{turn}'.encode()) & 0x7FFFFFFF


def _end(episode: Episode, outcome: str, score: tasks_base.Score) -> None:
  episode.outcome, episode.score = outcome, score


def start(problem: tasks_base.Problem, env: tasks_base.Environment,
          encode_prompt: Callable[[tasks_base.Problem], list[int]], limits: Limits, *,
          request_id: str, seed: int, metadata: dict | None = None
          ) -> tuple[Episode, api.Request | None]:
  """A new episode and its first turn's request; None when it ended before a turn (its
  environment's reset raised). `encode_prompt` encodes the reset text as a problem's prompt
  (its own errors, e.g. a prompt over max_prompt_len, are the caller's, as for a one-turn task)."""
  episode = Episode(problem=problem, env=env, request_id=request_id, seed=seed,
                    metadata=dict(metadata or {}))
  try:
    text = env.reset(problem)
    if not isinstance(text, str):
      raise TypeError(f'reset returned {type(text).__name__}, not str')
  except Exception:  # pylint: disable=broad-except -- a faulty env ends its episode, not the run
    _end(episode, 'env_error', tasks_base.Score(0.0, 'unparsable', mask=True))
    return episode, None
  episode.prompt_tokens = list(encode_prompt(dataclasses.replace(problem, prompt=text)))
  return episode, next_request(episode, limits)


def next_request(episode: Episode, limits: Limits) -> api.Request:
  """The request of the episode's next turn: the whole history as its prompt, max_tokens the
  per-turn limit or what the budget leaves, whichever is less."""
  turn = episode.turns + 1
  history = episode.prompt_tokens + episode.tokens
  room = limits.end(len(episode.prompt_tokens)) - len(history)
  max_tokens = int(min(limits.sampling.max_tokens, room))
  if max_tokens < 1:
    raise ValueError(f'episode {episode.request_id}: no room for turn {turn} (history '
                     f'{len(history)} tokens); the caller checks the room before asking')
  sampling = (limits.sampling if max_tokens == limits.sampling.max_tokens
              else dataclasses.replace(limits.sampling, max_tokens=max_tokens))
  request_id = turn_request_id(episode, turn)
  episode.last_request_id = request_id
  return api.Request(request_id=request_id, prompt_tokens=history, sampling=sampling,
                     seed=turn_seed(episode, turn), metadata={**episode.metadata, 'turn': turn},
                     continues=None if turn == 1 else turn_request_id(episode, turn - 1),
                     continuable=turn < limits.max_turns)


def _safe_step(env: tasks_base.Environment, text: str, truncated: bool, last: bool
               ) -> tasks_base.EnvStep | None:
  """env.step, or None when it raised or answered something that is not an EnvStep."""
  try:
    step = env.step(text, truncated=truncated, last=last)
  except Exception:  # pylint: disable=broad-except -- see _end's callers
    return None
  if not isinstance(step, tasks_base.EnvStep) or not math.isfinite(float(step.reward)):
    return None
  if step.observation is not None and not isinstance(step.observation, str):
    return None
  return step


def on_turn(episode: Episode, completion: api.Completion, *,
            decode: Callable[[np.ndarray], str], encode_text: Callable[[str], list[int]],
            limits: Limits) -> api.Request | None:
  """Adds a finished turn to the episode, asks the environment, and returns the next turn's
  request, or None when the episode has ended (`episode.score` set; see the module docstring)."""
  n = len(completion.tokens)
  episode.tokens += [int(t) for t in completion.tokens]
  episode.logprobs += [float(x) for x in completion.logprobs]
  episode.versions += [int(v) for v in completion.versions]
  if completion.routes is not None:
    episode.routes += list(completion.routes)
  episode.loss_mask += [1] * n
  episode.turn_lengths.append(n)
  episode.finish_reason = completion.finish_reason
  end = limits.end(len(episode.prompt_tokens))
  room = end - len(episode.prompt_tokens) - len(episode.tokens)
  # `last`: no further turn could follow (the turn limit, or no room for a token of observation
  # and one of answer).
  last = episode.turns >= limits.max_turns or room < 2
  step = _safe_step(episode.env, decode(completion.tokens),
                    truncated=completion.finish_reason == 'length', last=last)
  if step is None:
    episode.reward = 0.0
    _end(episode, 'env_error', tasks_base.Score(0.0, 'unparsable'))
    return None
  episode.reward += float(step.reward)
  episode.tool_calls += bool(step.tool_call)
  episode.tool_errors += bool(step.tool_error)
  if step.done or step.observation is None or last:
    final = step.score or tasks_base.Score(episode.reward, 'no_answer')
    _end(episode, 'done' if step.done or step.observation is None else 'turn_limit',
         tasks_base.Score(episode.reward, final.status, mask=final.mask))
    return None
  observation = step.observation
  ids = ([] if len(observation) > (room - 1) * MAX_CHARS_PER_TOKEN
         else list(encode_text(observation)))
  if len(observation) > (room - 1) * MAX_CHARS_PER_TOKEN or len(ids) > room - 1:
    _end(episode, 'cut', tasks_base.Score(episode.reward, 'no_answer'))
    return None
  version = episode.versions[-1]
  episode.tokens += ids
  episode.logprobs += [0.0] * len(ids)
  episode.versions += [version] * len(ids)
  if episode.routes:  # observation tokens are never replayed: zeros hold their places
    episode.routes += [np.zeros_like(episode.routes[-1])] * len(ids)
  episode.loss_mask += [0] * len(ids)
  return next_request(episode, limits)


def completion(episode: Episode) -> api.Completion:
  """The finished episode as one completion (the actor's groups and the evaluation take these);
  its loss mask is `loss_mask(episode)`."""
  return api.Completion(request_id=episode.request_id, prompt_tokens=list(episode.prompt_tokens),
                        tokens=np.asarray(episode.tokens, np.int32),
                        logprobs=np.asarray(episode.logprobs, np.float32),
                        versions=np.asarray(episode.versions, np.int64),
                        routes=np.stack(episode.routes) if episode.routes else None,
                        finish_reason=episode.finish_reason, metadata=episode.metadata)


def loss_mask(episode: Episode) -> np.ndarray:
  return np.asarray(episode.loss_mask, np.int32)


def stats(episode: Episode) -> EpisodeStats:
  mask = loss_mask(episode)
  model_versions = np.asarray(episode.versions, np.int64)[mask > 0]
  return EpisodeStats(turns=episode.turns, tool_calls=episode.tool_calls,
                      tool_errors=episode.tool_errors, model_tokens=int(mask.sum()),
                      observation_tokens=int(mask.size - mask.sum()),
                      versions=len(np.unique(model_versions)), outcome=episode.outcome)


def step_metrics(episodes: Sequence[EpisodeStats]) -> dict[str, float]:
  """The step record's episode keys (means over the step's episodes, and the share of each
  outcome); {} for a one-turn task's step. Pure."""
  if not episodes:
    return {}
  mean = lambda xs: float(np.mean(xs))
  out = {
      'episode/turns_mean': mean([e.turns for e in episodes]),
      'episode/turns_max': float(max(e.turns for e in episodes)),
      'episode/tool_calls_mean': mean([e.tool_calls for e in episodes]),
      'episode/tool_errors_mean': mean([e.tool_errors for e in episodes]),
      'episode/frac_tool_call': mean([e.tool_calls > 0 for e in episodes]),
      'episode/tokens_per_turn': (sum(e.model_tokens for e in episodes)
                                  / max(sum(e.turns for e in episodes), 1)),
      'episode/observation_tokens_mean': mean([e.observation_tokens for e in episodes]),
      'episode/versions_mean': mean([e.versions for e in episodes]),
  }
  for outcome in OUTCOMES:
    out[f'episode/frac_{outcome}'] = mean([e.outcome == outcome for e in episodes])
  return out


def run(engine: api.Engine, episodes_and_requests: Sequence[tuple[Episode, api.Request | None]],
        *, decode: Callable[[np.ndarray], str], encode_text: Callable[[str], list[int]],
        limits: Limits) -> list[Episode]:
  """Runs episodes to their end on an idle engine (the evaluation's loop; the actor interleaves
  the same steps with its own admission). Returns the episodes in the order given."""
  if engine.num_unfinished:
    raise ValueError(f'engine has {engine.num_unfinished} unfinished requests of its own')
  by_id: dict[str, Episode] = {}
  for episode, request in episodes_and_requests:
    if request is not None:
      by_id[request.request_id] = episode
      engine.submit(request)
  while by_id:
    if engine.num_unfinished == 0:
      raise RuntimeError(f'engine has no work left but {len(by_id)} turns are missing')
    for c in engine.step():
      episode = by_id.pop(c.request_id)
      request = on_turn(episode, c, decode=decode, encode_text=encode_text, limits=limits)
      if request is None:
        engine.release(c.request_id)
      else:
        by_id[request.request_id] = episode
        engine.submit(request)
  return [episode for episode, _ in episodes_and_requests]
