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


def test_summary_is_per_dataset_and_over_all_problems():
  result = evaluation.summarize({'a': [[True, False], [False, False]], 'b': [[True, True]]}, k=2)
  assert result['datasets']['a'] == {'num_problems': 2, 'pass@1': 0.25, 'pass@2': 0.5}
  assert result['datasets']['b'] == {'num_problems': 1, 'pass@1': 1.0, 'pass@2': 1.0}
  assert result['pass@1'] == pytest.approx(0.5) and result['pass@2'] == pytest.approx(2 / 3)
  record = evaluation.metrics_record(result)
  assert set(record) == {'eval/pass@1', 'eval/pass@2', 'eval/a/pass@1', 'eval/a/pass@2',
                         'eval/b/pass@1', 'eval/b/pass@2'}
  one = evaluation.summarize({'a': [[True, False]]}, k=2)
  assert set(evaluation.metrics_record(one)) == {'eval/pass@1', 'eval/pass@2'}
  greedy = evaluation.summarize({'a': [[True], [False], [True]]}, k=1)  # k = 1: counted once
  assert greedy['num_problems'] == 3 and greedy['pass@1'] == pytest.approx(2 / 3)


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
  assert result['pass@1'] == logged['eval/pass@1']
  assert result['pass@3'] == logged['eval/pass@3']
  in_run = [json.loads(line) for line in open(tmp_path / 'run' / 'eval' / 'samples-2.jsonl')]
  cli = [json.loads(line) for line in open(tmp_path / 'cli' / 'samples.jsonl')]
  assert len(cli) == 6 * 3 and cli == in_run  # same completions, sample by sample
  assert set(cli[0]) >= {'problem_id', 'prompt', 'completion', 'status', 'reward'}
  saved = json.loads((tmp_path / 'cli' / 'results.json').read_text())
  assert saved['pass@1'] == result['pass@1'] and saved['checkpoint'] == str(checkpoint)
