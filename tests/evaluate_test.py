"""Evaluation: the pass@k estimator, and the CLI agreeing with the in-training evaluation."""

import json
import math

import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import evaluate
from pipelinerl_jax import evaluation
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.tasks import arithmetic
from pipelinerl_jax.tasks.base import Score


@pytest.mark.parametrize('n,c,k,expected', [
    (4, 0, 1, 0.0),
    (4, 4, 4, 1.0),
    (5, 2, 1, 2 / 5),                    # pass@1 is the fraction correct
    (5, 2, 2, 1 - 3 / 10),               # 1 - C(3,2)/C(5,2)
    (10, 3, 5, 1 - 21 / 252),            # 1 - C(7,5)/C(10,5)
    (4, 1, 4, 1.0),                      # n - c < k: any k-subset holds the correct one
    (8, 1, 2, 1 - 21 / 28),              # 1 - C(7,2)/C(8,2) = 1/4
])
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
  assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts_and_stays_exact_for_large_n():
  for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)):
    with pytest.raises(ValueError, match='pass_at_k needs'):
      evaluation.pass_at_k(n, c, k)
  # Exact binomials: no overflow, and equal to the product form 1 - prod (1 - k / i).
  product = 1 - math.prod(1 - 10 / i for i in range(1000 - 7 + 1, 1001))
  assert evaluation.pass_at_k(1000, 7, 10) == pytest.approx(product, rel=1e-12)


O = evaluation.Outcome
# The equivalence a math task's math-verify gives these answers: 1/2 = 0.5, else equal text.
HALF = {frozenset({'1/2', '0.5'})}
same = lambda a, b: a == b or frozenset({a, b}) in HALF


@pytest.mark.parametrize('answers,correct,expected', [
    # One class of two equivalent answers (1/2 and 0.5) against '3': the majority is right.
    (['1/2', '3', '0.5'], [True, False, True], 1.0),
    # '5' twice (wrong) against '6' once (right): the majority is wrong.
    (['5', '6', '5'], [False, True, False], 0.0),
    # A tie of two classes of 2, one right: half (the expected value of a random tie break),
    # whichever comes first.
    (['7', '8', '8', '7'], [True, False, False, True], 0.5),
    (['8', '7', '7', '8'], [False, True, True, False], 0.5),
    # Three classes of one, one right: a third.
    (['a', 'b', 'c'], [True, False, False], 1 / 3),
    # No answer does not vote: '4' (wrong) beats three silent samples.
    ([None, None, '4', None], [False, False, False, False], 0.0),
    ([None, '2', None], [False, True, False], 1.0),
    ([None, None], [False, False], 0.0),  # nobody voted
])
def test_majority_vote_matches_hand_counted_votes(answers, correct, expected):
  assert evaluation.majority_correct(answers, correct, same) == pytest.approx(expected)


def test_summary_numbers_match_hand_computed_values():
  """Two benchmarks, scripted outcomes; every number below is counted by hand."""
  # Problem A (gold 1/2), n = 4: answers 1/2, 0.5, 3, none; correct T T F F; 10, 20, 30, 40
  # tokens, the last cut at the limit.
  a = [O(True, '1/2', 10), O(True, '0.5', 20), O(False, '3', 30), O(False, None, 40, True)]
  # Problem B, n = 4: answers 7 8 8 7, correct T F F T; 5 tokens each, none cut.
  b = [O(True, '7', 5), O(False, '8', 5), O(False, '8', 5), O(True, '7', 5)]
  # Problem C (second benchmark), n = 4: all wrong, all the same answer, all cut.
  c = [O(False, '9', 100, True)] * 4
  result = evaluation.summarize({'x': [a, b], 'y': [c]}, k=2, same=same)
  x, y = result['datasets']['x'], result['datasets']['y']
  # avg@4: A 2/4, B 2/4 -> x 0.5; C 0 -> y 0; over all three problems (0.5 + 0.5 + 0) / 3.
  assert x['avg@4'] == pytest.approx(0.5) and y['avg@4'] == 0.0
  assert result['avg@4'] == pytest.approx(1 / 3)
  assert x['pass@1'] == pytest.approx(0.5)  # pass@1 estimated from n samples is avg@n
  # pass@2 = 1 - C(n - c, 2) / C(n, 2): A and B (c = 2) 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6.
  assert x['pass@2'] == pytest.approx(5 / 6) and y['pass@2'] == 0.0
  assert result['pass@2'] == pytest.approx((5 / 6 + 5 / 6 + 0) / 3)
  # maj@2 over the blocks (samples 0-1, 2-3):
  #   A: {1/2, 0.5} one class of 2, right -> 1; {3, none}: '3' alone, wrong -> 0; A = 0.5
  #   B: {7, 8} tie, one right -> 0.5; {8, 7} tie -> 0.5; B = 0.5
  #   C: 0.   x = 0.5, y = 0, all = 1/3.
  assert x['maj@2'] == pytest.approx(0.5) and y['maj@2'] == 0.0
  assert result['maj@2'] == pytest.approx(1 / 3)
  # Mean tokens per problem, then over problems: A 25, B 5 -> x 15; C 100; all (25+5+100)/3.
  assert x['mean_tokens'] == pytest.approx(15.0) and y['mean_tokens'] == 100.0
  assert result['mean_tokens'] == pytest.approx(130 / 3)
  # Share cut at the limit: A 1/4, B 0 -> x 1/8; C 1; all (1/4 + 0 + 1) / 3.
  assert x['truncated'] == pytest.approx(1 / 8) and y['truncated'] == 1.0
  assert result['truncated'] == pytest.approx(1.25 / 3)
  assert (x['num_problems'], y['num_problems'], result['num_problems'], result['n']) == (2, 1, 3, 4)
  # maj@4 (one block): A {1/2, 0.5} x2 vs {3}: right -> 1; B a 2-2 tie -> 0.5; C 0.
  four = evaluation.summarize({'x': [a, b], 'y': [c]}, k=4, same=same)
  assert four['datasets']['x']['maj@4'] == pytest.approx(0.75) and four['maj@4'] == 0.5
  # Without the equivalence (plain text), A's 1/2 and 0.5 split: a 3-way tie of ones, 1/2 and
  # 0.5 right -> 2/3 for maj@4.
  plain = evaluation.summarize({'x': [a]}, k=4)
  assert plain['maj@4'] == pytest.approx(2 / 3)
  record = evaluation.metrics_record(result)
  assert set(record) == {f'eval/{d}{m}' for d in ('', 'x/', 'y/') for m in
                         ('pass@1', 'pass@2', 'maj@2', 'mean_tokens', 'truncated')}
  one = evaluation.summarize({'a': [[O(True), O(False)]]}, k=2)
  assert set(evaluation.metrics_record(one)) == {'eval/pass@1', 'eval/pass@2', 'eval/maj@2',
                                                 'eval/mean_tokens', 'eval/truncated'}
  greedy = evaluation.summarize({'a': [[O(True)], [O(False)], [O(True)]]}, k=1)
  assert greedy['num_problems'] == 3 and greedy['pass@1'] == pytest.approx(2 / 3)
  assert greedy['maj@1'] == 0.0  # these samples gave no answers: no votes


def test_equivalence_asks_the_task_once_per_distinct_pair():
  class Task:
    asked = []

    def same_answers(self, pairs):
      self.asked += pairs
      return [frozenset(p) in HALF for p in pairs]

  task = Task()
  same_as = evaluation.equivalence(task, [['1/2', '0.5', '1/2', None], ['3', '3'], ['0.5', '1/2']])
  assert sorted(map(sorted, task.asked)) == [['0.5', '1/2']]  # 1/2 vs 0.5, once
  assert same_as('1/2', '0.5') and same_as('0.5', '1/2') and same_as('3', '3')
  assert not same_as('3', '1/2')


def test_cli_matches_the_in_training_evaluation(model_dir, tmp_path, monkeypatch):
  # An untrained model solves nothing; a rule on the text's length makes about half the samples
  # "correct", so pass@1 / pass@k are informative numbers (the training sees it as its reward).
  monkeypatch.setattr(arithmetic.ArithmeticTask, 'score', lambda self, problem, text, *_: (
      Score(1.0, 'correct') if len(text) % 2 == 0 else Score(0.0, 'wrong')))
  c = config_lib.load_preset()
  c.rl.batch_size, c.rl.group_size, c.generation.num_slots = 16, 4, 16
  c.rl.total_steps, c.rl.max_time_s = 2, 0.0
  c.eval.every_steps, c.eval.num_problems, c.eval.k = 2, 6, 3
  c.log.progress, c.log.tensorboard = False, False
  summary = launch.run_experiment(c, str(tmp_path / 'run'), model_dir=model_dir)
  records = metrics_lib.read_metrics(str(tmp_path / 'run' / 'metrics.jsonl'))
  assert 'eval/pass@1' not in records[0]
  logged = records[1]  # step 2: evaluated with the params that step produced (the final ones)
  assert 0 < logged['eval/pass@1'] < 1

  # The same params through the CLI's path: an HF dir (float32, so bit-identical) + the config.
  m = c.model
  model_config = hf_schema.load_config(model_dir, param_dtype=m.param_dtype, dtype=m.dtype,
                                   lm_head_fp32=m.lm_head_fp32, remat=m.remat)
  checkpoint = tmp_path / 'step2'
  hf_checkpoint.save_params(summary['final_state'].params, model_config, checkpoint,
                            dtype='float32')
  c.model.path = model_dir  # tokenizer (the checkpoint dir holds weights and config only)
  result = evaluate.evaluate_checkpoint(c, str(checkpoint), out_dir=str(tmp_path / 'cli'))
  for key in ('pass@1', 'pass@3', 'maj@3', 'mean_tokens', 'truncated'):
    assert result[key] == logged[f'eval/{key}'], key
  in_run = [json.loads(line) for line in open(tmp_path / 'run' / 'eval' / 'samples-2.jsonl')]
  cli = [json.loads(line) for line in open(tmp_path / 'cli' / 'samples.jsonl')]
  assert len(cli) == 6 * 3 and cli == in_run  # same completions, sample by sample
  assert set(cli[0]) >= {'problem_id', 'prompt', 'completion', 'status', 'reward'}
  saved = json.loads((tmp_path / 'cli' / 'results.json').read_text())
  assert saved['pass@1'] == result['pass@1'] and saved['checkpoint'] == str(checkpoint)
