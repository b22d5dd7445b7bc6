"""Benchmarks: --quick / --smoke runs end to end (train step, generation, log-prob agreement,
learning speed, LoRA and MoE-replay learning; one MoE layer's runs in the GPU kit's moe_layer
section, gpu_kit_test), the reward trend the learning benches share, the FLOP count the
train-step bench reports, and the throughput model calibrated on a learning-speed run
(bench/throughput_model.py, learning_speed --report)."""

import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.bench import ablations
from pipelinerl_jax.bench import reward_trend
from pipelinerl_jax.bench import throughput_model
from pipelinerl_jax.bench import train_step as bench
from pipelinerl_jax.models import transformer
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.sim import throughput as tp

import needs  # tests/ is on sys.path
import xla_env

ROOT = pathlib.Path(__file__).resolve().parent.parent

POSITIVE_KEYS = ('params', 'flop_params', 'devices', 'rows', 'seq_len', 'micro', 'samples',
                 'tokens', 'fill', 'compile_s', 'step_s_median', 'step_s_min', 'tokens_per_s',
                 'flops_per_step', 'flop_per_s')


def test_quick_run_writes_json_and_prints_table(tmp_path):
  """As a user runs it: `python -m`, so the script itself sets up the 4 simulated devices of
  its mesh before jax starts (conftest's 8 simulated devices are dropped to prove it)."""
  out = tmp_path / 'bench.json'
  env = xla_env.one_device()
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.bench.train_step', '--quick', '--mesh=1,2,2',
       f'--out={out}'], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stderr[-3000:]

  report = json.loads(out.read_text())
  assert report['config']['quick'] and report['config']['mesh'] == [1, 2, 2]
  (result,) = report['results']
  missing = set(bench.RESULT_KEYS) - result.keys()
  assert not missing, missing
  for key in POSITIVE_KEYS:
    assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
  assert math.isfinite(result['loss'])
  assert result['model'] == 'tiny' and result['mesh'] == '1,2,2' and result['devices'] == 4
  assert result['step_s_min'] <= result['step_s_median']
  # Packed: several samples share a row, so the segment mask was exercised.
  assert result['samples'] > result['rows']

  lines = proc.stdout.splitlines()
  assert lines[0].split()[:3] == ['model', 'params', 'mesh']
  assert set(lines[1]) <= {'-', ' '}
  assert lines[2].split()[:3] == ['tiny', '238k', '1,2,2']


def test_flop_params_leave_out_only_the_embedding_lookup():
  tied = []
  for name, config in bench.MODEL_PRESETS.items():
    shapes = jax.eval_shape(functools.partial(transformer.init_params, config),
                            jax.random.PRNGKey(0))
    total = sum(x.size for x in jax.tree.leaves(shapes))
    assert total == config.num_params, name
    embedding = shapes['embed']['embedding'].size
    if config.tie_embeddings:  # the one table is the lm_head's matmul: every param counts
      assert 'lm_head' not in shapes and bench.flop_params(config) == total, name
      tied.append(name)
    else:  # untied: the lm_head matmul is counted, the lookup is not
      assert 'lm_head' in shapes and bench.flop_params(config) == total - embedding, name
  assert tied == ['qwen2.5-0.5b', 'qwen2.5-1.5b']
  # The published sizes: 0.49B and 1.54B parameters.
  assert round(bench.MODEL_PRESETS['qwen2.5-0.5b'].num_params / 1e7) == 49
  assert round(bench.MODEL_PRESETS['qwen2.5-1.5b'].num_params / 1e7) == 154


def test_train_flops_counts_each_sample_with_its_own_context():
  config = bench.MODEL_PRESETS['tiny']
  # Row 0 packs samples of 3 and 2 positions and one padding position; row 1 one of 4.
  segment_ids = np.array([[1, 1, 1, 2, 2, 0],
                          [1, 1, 1, 1, 0, 0]])
  n = bench.flop_params(config)
  width = config.num_heads * config.head_dim
  want = 6 * n * 9 + 12 * config.num_layers * width * (3**2 + 2**2 + 4**2)
  assert bench.train_flops(config, segment_ids) == want


def test_generation_bench_quick_compares_backends(tmp_path):
  """Both backends when vLLM is importable (else the JAX engine alone), each with and without
  updates; the JSON rows are what sim.throughput reads (per backend)."""
  from pipelinerl_jax.sim import throughput
  backends = 'jax,vllm' if needs.have('vllm') else 'jax'
  out = tmp_path / 'gen.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.bench.generation', '--quick', '--slots=1,2',
       '--modes=none,update', f'--backends={backends}', f'--out={out}',
       f'--workdir={tmp_path}'], cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=xla_env.one_device())
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads(out.read_text())['rows']
  assert {(r['backend'], r['slots'], r['mode']) for r in rows} == {
      (b, h, m) for b in backends.split(',') for h in (1, 2) for m in ('none', 'update')}
  for r in rows:
    assert r['tokens_per_s'] > 0 and r['tokens'] > 0 and r['mean_busy'] <= r['slots']
    assert (r['updates'] > 0) == (r['mode'] == 'update')
  for b in backends.split(','):
    assert [h for h, _ in throughput.utilization_from_bench_json(out, backend=b)] == [1, 2]
  assert proc.stdout.splitlines()[1].split()[:3] == ['backend', 'H', 'mode']


@pytest.mark.needs('vllm')
def test_logprob_agreement_quick_runs_bf16_with_fp32_head(tmp_path):
  """One variant, one vLLM start-up: every variant runs the same code in a process of its own.
  That fp32 serving gives the trainer's log pi is vllm_engine_test's (and reward_test's, at
  every version a run serves)."""
  out = tmp_path / 'lpa.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.bench.logprob_agreement', '--quick',
       '--variants=bf16+lm_head_fp32', f'--out={out}', f'--workdir={tmp_path}'],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=xla_env.one_device())
  assert proc.returncode == 0, proc.stderr[-3000:]
  (bf16,) = json.loads(out.read_text())['rows']
  assert bf16['variant'] == 'bf16+lm_head_fp32' and 0 < bf16['tokens'] <= 4 * 16  # --quick
  # bf16 runs, and is compared with both trainers (its size: see the bench doc)
  assert 0 < bf16['mean_abs_vs_fp32_trainer'] < 1.0
  assert 0 <= bf16['mean_abs_vs_bf16_trainer'] < 1.0
  assert 'bf16+lm_head_fp32' in proc.stdout


def test_learning_speed_smoke_writes_json_and_png(tmp_path):
  """The learning-speed benchmark end to end in --smoke mode (untrained model, 3 steps per
  mode and seed) on 2 seeds: the JSON has its keys and a per-seed entry for each mode, and the
  figure exists. Its numbers mean nothing."""
  out = tmp_path / 'learning_speed.json'
  env = xla_env.one_device()
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.bench.learning_speed', '--smoke', '--seeds=0,1',
       '--modes=pipeline,conv2', f'--out={out}', f'--cache_dir={tmp_path / "cache"}',
       f'--workdir={tmp_path / "runs"}', '--set=generation.num_slots=8'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]

  report = json.loads(out.read_text())
  assert {'speedup_vs_best_conventional', 'speedup', 'modes', 'curves', 'target', 'seeds',
          'preset', 'definitions'} <= report.keys()
  assert report['seeds'] == [0, 1] and report['preset'] == 'tiny'
  # An untrained model never reaches the target: no speedup, and the note says why.
  assert report['speedup_vs_best_conventional'] is None and report['speedup']['note']
  assert report['speedup']['seeds'] == 2
  assert [m['name'] for m in report['modes']] == ['pipeline', 'conv2']
  for mode in report['modes']:
    assert mode['seeds'] == [0, 1]
    assert mode['time_to_target'] == mode['samples_to_target'] == [None, None]
    assert mode['time_to_target_stats'] == dict(median=None, min=None, max=None, n=0, seeds=2)
    assert [s['seed'] for s in mode['per_seed']] == [0, 1]
    for s in mode['per_seed']:
      assert s['name'] == mode['name'] and s['steps'] == 3 and s['samples'] == 48
      assert 0 <= s['lag_min'] <= s['lag_mean'] <= s['lag_max']
      assert 0 < s['ess']['min'] <= s['ess']['max'] <= 1 + 1e-6
      assert set(s['to_target']) >= {'0.8'}
    assert set(report['curves'][mode['name']]) == {'seed0', 'seed1'}
  pipeline, conv2 = report['modes']
  assert all(s['num_slots'] == 8 for s in pipeline['per_seed'])   # --set, over --smoke's 16
  assert all(s['num_slots'] == 2 * 16 for s in conv2['per_seed'])   # conventional H = k * B
  assert len(report['curves']['conv2']['seed1']['step']) == 3
  assert sorted(p.name for p in (tmp_path / 'runs' / 'conv2').iterdir()) == ['seed0', 'seed1']
  assert pathlib.Path(report['png']).stat().st_size > 10_000
  assert 'speedup_vs_best_conventional' in proc.stdout and 'over seeds [0, 1]' in proc.stdout
  # The model is calibrated on conv2 (the only conventional mode) from the summaries' tokens.
  assert report['model']['conventional_mode'] == 'conv2'
  assert [s['seed'] for s in report['model']['per_seed']] == [0, 1]
  assert 'model vs measurement' in proc.stdout


def _seeds(name, times_to_target, run_s=300.0):
  """Hand-made `summarize` dicts of one mode, one per seed: time to 0.8 (None: never reached)
  and 1000 samples per second."""
  return [dict(name=name, time_s=run_s,
               to_target={'0.8': None if t is None else dict(time_s=t, samples=int(t) * 1000,
                                                             step=int(t))})
          for t in times_to_target]


def test_seed_stats_skip_seeds_that_never_reached_the_target():
  assert ablations.seed_stats([30.0, None, 10.0, 20.0]) == dict(median=20.0, min=10.0, max=30.0,
                                                                n=3, seeds=4)
  assert ablations.seed_stats([None, None]) == dict(median=None, min=None, max=None, n=0,
                                                    seeds=2)
  over = ablations.to_target_over_seeds(_seeds('conv1', [40.0, None]), 0.8)
  assert over['time_s'] == [40.0, None] and over['samples'] == [40_000, None]
  assert over['samples_stats']['median'] == 40_000 and over['samples_stats']['n'] == 1


def test_speedup_over_seeds_best_conventional_by_median_among_modes_reaching_every_seed():
  pipeline = _seeds('pipeline', [80.0, 50.0, 125.0])
  conventional = {'conv1': _seeds('conv1', [100.0, 100.0, 100.0]),
                  # Faster in its best seed, slower in median: not the best.
                  'conv2': _seeds('conv2', [40.0, 200.0, 200.0]),
                  # Lowest median, but it missed a seed: not a candidate.
                  'conv4': _seeds('conv4', [30.0, None, 30.0])}
  out = ablations.speedup_over_seeds(pipeline, conventional, 0.8)
  assert out['best_conventional'] == 'conv1'
  assert out['value'] == pytest.approx(100.0 / 80.0)
  assert out['per_seed_ratios'] == pytest.approx([1.25, 2.0, 0.8])
  assert (out['ratio_min'], out['ratio_max']) == pytest.approx((0.8, 2.0))
  assert out['spread_crosses_1'] is True
  assert out['lower_bound'] is None and out['pipeline_time_s']['median'] == 80.0

  faster = ablations.speedup_over_seeds(_seeds('pipeline', [50.0, 50.0, 90.0]),
                                        {'conv1': conventional['conv1']}, 0.8)
  assert faster['value'] == pytest.approx(2.0) and faster['spread_crosses_1'] is False


def test_speedup_over_seeds_when_a_side_misses_seeds():
  # The pipeline missed seed 1: no value (its median would flatter it); ratios where both hit.
  out = ablations.speedup_over_seeds(_seeds('pipeline', [50.0, None, 50.0]),
                                     {'conv1': _seeds('conv1', [100.0, 100.0, 40.0])}, 0.8)
  assert out['value'] is None and 'pipeline reached 0.8 in 2 of 3 seeds' in out['note']
  assert out['per_seed_ratios'] == pytest.approx([2.0, None, 0.8])
  assert out['spread_crosses_1'] is True

  # No conventional mode reached it in every seed: the one reaching it in the most seeds.
  out = ablations.speedup_over_seeds(
      _seeds('pipeline', [50.0, 50.0, 50.0]),
      {'conv1': _seeds('conv1', [100.0, None, 100.0]),
       'conv2': _seeds('conv2', [40.0, None, None])}, 0.8)
  assert out['best_conventional'] == 'conv1' and out['value'] == pytest.approx(2.0)
  assert out['per_seed_ratios'] == pytest.approx([2.0, None, 2.0])
  assert 'in every seed' in out['note']

  # No conventional mode ever reached it: a lower bound from the shortest median run.
  out = ablations.speedup_over_seeds(
      _seeds('pipeline', [50.0, 100.0]),
      {'conv1': _seeds('conv1', [None, None], run_s=300.0),
       'conv2': _seeds('conv2', [None, None], run_s=200.0)}, 0.8)
  assert out['value'] is None and out['lower_bound'] == pytest.approx(200.0 / 75.0)

  # The pipeline never reached it: nothing to give.
  out = ablations.speedup_over_seeds(_seeds('pipeline', [None, None]),
                                     {'conv1': _seeds('conv1', [100.0, 100.0])}, 0.8)
  assert out['value'] is None and out['lower_bound'] is None and 'never' in out['note']
  # Another placement of the pipeline is named as itself in the notes.
  out = ablations.speedup_over_seeds(_seeds('pipeline-disjoint', [None]),
                                     {'conv1': _seeds('conv1', [100.0])}, 0.8,
                                     name='pipeline-disjoint')
  assert out['note'].startswith('pipeline-disjoint never reached 0.8')


def test_single_seed_speedup_is_the_seed_aggregate_of_one():
  (pipeline,) = _seeds('pipeline', [50.0])
  conventional = _seeds('conv1', [150.0]) + _seeds('conv2', [100.0])
  out = ablations.speedup(pipeline, conventional, 0.8)
  assert out['best_conventional'] == 'conv2' and out['value'] == pytest.approx(2.0)
  assert out['ratio_min'] == out['ratio_max'] == pytest.approx(2.0)


def test_median_band_over_the_range_every_seed_covers():
  grid, median, low, high = ablations.median_band(
      [[0, 10], [2, 12], [1, 8]], [[0, 10], [2, 12], [11, 18]], num_points=5)
  assert grid[0] == 2 and grid[-1] == 8   # no seed is extrapolated
  # At x: the three curves are x, x and x + 10.
  np.testing.assert_allclose(median, grid)
  np.testing.assert_allclose(low, grid)
  np.testing.assert_allclose(high, grid + 10)
  alone = ablations.median_band([[0, 1, 3]], [[5, 6, 7]])
  assert [list(a) for a in alone] == [[0, 1, 3], [5, 6, 7], [5, 6, 7], [5, 6, 7]]
  assert all(a.size == 0 for a in ablations.median_band([[0, 1], [2, 3]], [[0, 1], [0, 1]]))


def _run(name, seed, tokens, gen_busy_s, train_busy_s, time_s):
  """A hand-made `summarize` dict with what the throughput model reads."""
  return dict(name=name, seed=seed, tokens=tokens, gen_busy_s=gen_busy_s,
              train_busy_s=train_busy_s, time_s=time_s)


def test_throughput_model_rates_and_shared_core_prediction():
  # 1200 tokens: generated in 2 s (600 tok/s), trained in 3 s (400 tok/s), alternating.
  conv = _run('conv1', 0, 1200, 2.0, 3.0, 6.0)
  out = throughput_model.predict(conv, gen_core_scaling=1.0, train_core_scaling=1.6)
  assert out['r_gen'] == pytest.approx(600) and out['r_train'] == pytest.approx(400)
  assert out['r_conv'] == pytest.approx(1 / (1 / 600 + 1 / 400))   # 240: the times add
  # Time sharing the same cores cannot beat alternating phases.
  assert out['speedup_shared'] == 1.0 and out['r_shared'] == pytest.approx(out['r_conv'])
  with pytest.raises(ValueError, match='tokens'):
    throughput_model.predict(dict(conv, tokens=None))
  with pytest.raises(ValueError, match='gen_busy_s'):
    throughput_model.predict(dict(conv, gen_busy_s=0.0))


@pytest.mark.parametrize('train_core_scaling, best', [(1.6, 'disjoint'), (2.0, 'shared')])
def test_throughput_model_disjoint_cores_is_the_simulators_ratio(train_core_scaling, best):
  conv = _run('conv1', 0, 1200, 2.0, 3.0, 6.0)
  out = throughput_model.predict(conv, gen_core_scaling=1.0,
                                 train_core_scaling=train_core_scaling)
  # One core each: generation at 600 (no gain from a 2nd core), training at 400 / scaling.
  train_one_core = 400 / train_core_scaling
  assert out['r_train_one_core'] == pytest.approx(train_one_core)
  assert out['r_disjoint'] == pytest.approx(min(600, train_one_core))
  # The same numbers through sim.throughput directly (U flat, so h and B do not matter).
  pipe = tp.pipeline(N=2, I=1, H=8, points=[(2, 600)], tau=1 / train_one_core, B=4,
                     lengths=[10, 20])
  conv_sim = tp.conventional(N=1, B=4, G=2, points=[(2, 600)], tau=1 / 400)
  assert out['speedup_disjoint'] == pytest.approx(pipe.r_pipe / conv_sim.r_conv)
  # 250 / 240 beats time sharing; 200 / 240 does not: the bound is the better placement.
  assert out['speedup_bound'] == pytest.approx(max(1.0, pipe.r_pipe / conv_sim.r_conv))
  assert out['best_placement'] == best
  assert (out['speedup_bound'] > 1.0) == (best == 'disjoint')


def test_throughput_model_measured_ratio_and_medians_over_seeds():
  pipeline = [_run('pipeline', 1, 1500, 4.0, 4.0, 5.0), _run('pipeline', 0, 900, 2.0, 2.0, 3.0),
              _run('pipeline', 2, 100, 1.0, 1.0, 1.0)]   # seed 2: no conventional run
  conventional = [_run('conv2', 0, 1200, 2.0, 3.0, 6.0), _run('conv2', 1, 1200, 1.0, 3.0, 4.0)]
  out = throughput_model.compare_over_seeds(pipeline, conventional)
  assert [s['seed'] for s in out['per_seed']] == [1, 0]   # paired by seed, not by position
  seed1, seed0 = out['per_seed']
  assert seed0['throughput_ratio_measured'] == pytest.approx((900 / 3) / (1200 / 6))
  assert seed1['throughput_ratio_measured'] == pytest.approx((1500 / 5) / (1200 / 4))
  assert seed1['r_gen'] == pytest.approx(1200)
  assert out['median']['throughput_ratio_measured'] == pytest.approx((1.5 + 1.0) / 2)
  assert out['median']['r_gen'] == pytest.approx((600 + 1200) / 2)


def test_learning_speed_set_parses_overrides_and_refuses_what_is_not_one():
  from pipelinerl_jax.bench import learning_speed
  assert learning_speed.parse_sets(['generation.sync_every=1', 'model.path=/m', 'rl.x=[1, 2]']
                                   ) == {'generation__sync_every': 1, 'model__path': '/m',
                                         'rl__x': [1, 2]}
  for bad in ('generation.sync_every', '=1', 'a__b=1'):
    with pytest.raises(ValueError, match='--set'):
      learning_speed.parse_sets([bad])
  with pytest.raises(SystemExit):  # argparse's one-line error: the config has no such field
    learning_speed.main(['--set=generation.no_such_field=1', '--smoke'])


def test_learning_speed_report_adds_the_model_section(tmp_path):
  """--report on a hand-written learning-speed JSON: one summary lacks `tokens` (a JSON from
  before summaries counted them), so it is read from that run's metrics.jsonl."""
  from pipelinerl_jax.bench import learning_speed
  workdir = tmp_path / 'runs'
  run_dir = workdir / 'conv1' / 'seed0'
  run_dir.mkdir(parents=True)
  (run_dir / 'metrics.jsonl').write_text(
      '\n'.join(json.dumps(dict(step=k, time_s=2.0 * k, tokens=400)) for k in (1, 2, 3))
      + '\n' + json.dumps(dict(event='skipped_update', update=4)) + '\n')
  conv1 = {k: v for k, v in _run('conv1', 0, None, 2.0, 3.0, 6.0).items() if k != 'tokens'}
  report = dict(
      args=dict(workdir=str(workdir)), target=0.8,
      speedup=dict(value=1.4, best_conventional='conv1', note=''),
      modes=[dict(name='pipeline', per_seed=[_run('pipeline', 0, 1500, 4.0, 4.0, 5.0)]),
             dict(name='conv1', per_seed=[conv1]),
             dict(name='conv4', per_seed=[_run('conv4', 0, 5000, 1.0, 1.0, 5.0)]),
             dict(name='pipeline-disjoint',
                  per_seed=[_run('pipeline-disjoint', 0, 2400, 4.0, 4.0, 6.0)])])
  path = tmp_path / 'learning_speed.json'
  path.write_text(json.dumps(report))
  learning_speed.main(['--report', str(path), '--train_core_scaling=2.0'])

  written = json.loads(path.read_text())
  assert written['modes'] == report['modes']   # the rest is left as it was
  model = written['model']
  assert model['conventional_mode'] == 'conv1'   # the speedup's best, not the fastest
  assert model['train_core_scaling'] == 2.0 and model['time_to_target_speedup_measured'] == 1.4
  (seed0,) = model['per_seed']
  assert seed0['r_gen'] == pytest.approx(600) and seed0['r_train'] == pytest.approx(400)
  assert seed0['speedup_disjoint'] == pytest.approx(200 / 240)
  assert model['median']['throughput_ratio_measured'] == pytest.approx(300 / 200)
  # The disjoint placement, measured, beside its prediction (never taken as conventional).
  assert model['disjoint_measured']['median'] == pytest.approx(400 / 200)
  assert model['disjoint_measured']['per_seed'] == [
      dict(seed=0, throughput_ratio_measured=pytest.approx(2.0))]


@pytest.mark.needs('two_cores')
def test_placement_modes_put_generators_and_the_trainer_on_cores_of_their_own():
  base = ablations.preset('tiny')
  c = config_lib.validate(ablations.mode_config(base, 'pipeline-disjoint'))
  cores = len(os.sched_getaffinity(0))
  assert c.rl.mode == 'pipeline' and c.generation.placement == 'ray'
  assert c.train.cores == 'free' and c.cluster.num_cpus == cores
  assert c.generation.num_generators == 1
  assert c.generation.remote.cpus_per_generator == cores // 2
  assert c.generation.num_slots == base.generation.num_slots   # the same H as 'pipeline'
  assert not throughput_model.is_conventional('pipeline-disjoint')
  assert throughput_model.is_conventional('conv4')
  # Conventional RL's own best placement for decoding that does not use a second core: one
  # generator actor per core, the whole batch k*B spread over them.
  per_core = config_lib.validate(ablations.mode_config(base, 'conv4-percore'))
  assert per_core.rl.mode == 'conventional' and per_core.rl.conventional_steps == 4
  assert per_core.generation.placement == 'ray' and per_core.generation.num_generators == cores
  assert per_core.generation.num_slots == 4 * base.rl.batch_size and per_core.train.cores == 'all'
  assert throughput_model.is_conventional('conv4-percore')
  for bad in ('pipeline-shared', 'conv0-percore', 'conv-percore', 'conv4-gpu'):
    with pytest.raises(ValueError, match="expected 'pipeline', 'pipeline-disjoint', 'conv<k>'"):
      ablations.mode_config(base, bad)


def test_attention_bench_quick_compares_memory_of_both_implementations(tmp_path):
  out = tmp_path / 'attention.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.bench.attention', '--quick', '--seq_lens=512',
       f'--out={out}'], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  from pipelinerl_jax.bench import attention as attention_bench
  report = json.loads(out.read_text())
  by_impl = {r['attention']: r for r in report['results']}
  assert set(by_impl) == {'dense', 'blockwise'}
  for r in by_impl.values():
    assert set(attention_bench.RESULT_KEYS) <= r.keys()
    assert r['timed'] and r['step_s_median'] > 0 and r['segments'] >= 2
  assert by_impl['blockwise']['peak_bytes'] < by_impl['dense']['peak_bytes']
  assert proc.stdout.splitlines()[0].split()[:3] == ['attention', 'T', 'segments']


def test_attention_check_takes_its_arrays_as_arguments():
  """Closed over, the check's arrays were constants of its programs, and XLA folded the dense
  reference's matmuls on the host: ~50 s of the H100 run's train section, 12 min on this CPU
  at the 1.5B shapes (7 s as arguments). The check itself runs in the kit's --quick test."""
  import re
  from pipelinerl_jax.bench import attention as attention_bench
  inputs = attention_bench.check_inputs(64, kv_heads=1, group=2, head_dim=8)
  for impl, dtype in (('dense', jnp.float32), ('blockwise', jnp.bfloat16)):
    text = attention_bench.check_program(impl, dtype, 16).lower(*inputs).as_text()
    sizes = [math.prod(int(d) for d in shape.split('x')[:-1])
             for line in text.splitlines() if 'constant' in line
             for shape in re.findall(r'tensor<([^>]*)>', line)]
    assert max(sizes, default=0) < 64, impl  # scalars and small tables only


def test_profile_split_says_when_command_buffers_hide_the_ops():
  """On the H100 every kernel of the step ran inside an XLA command buffer: the trace named the
  buffer, not the op, and 80 % of the time fell in 'other'. Such time is opaque unless the
  kernel's own name places it (cuDNN's attention, cuBLAS's nvjet gemms); past half, the split
  says it is unreliable."""
  from pipelinerl_jax.bench import step_profile
  hlo = '\n'.join([
      'ENTRY %main.1 (p: f32[8]) -> f32[8] {',
      '  %p = f32[8]{0} parameter(0)',
      '  %fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused.3, '
      'metadata={op_name="jit(step)/attention_core/add"}',
      '  %command_buffer_202 = f32[8]{0} call(%fusion.3), to_apply=%command_buffer.202',
      '  %custom-call.7 = (bf16[8,8]{1,0}, s8[4194304]{0}) custom-call(%p, %p), '
      'custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/lm_head/dot_general"}',
      '  ROOT %call.1 = f32[8]{0} call(%p), to_apply=%command_buffer.7',
      '}'])
  assert step_profile.command_buffers(hlo) == 2
  ops = step_profile.hlo_instructions(hlo)
  # A tuple-typed instruction (cuBLAS's result and workspace) is known by its name.
  assert ops['custom-call.7']['matmul'] and 'lm_head' in ops['custom-call.7']['scopes']
  event = lambda op, kernel, us: dict(name=kernel, dur=us, args=dict(hlo_op=op))
  wrapped = [event('command_buffer_202', 'loop_add_fusion', 700.0),
             event('command_buffer_202', 'nvjet_tst_128x256_64x4_h_bz_NNT', 200.0),
             event('command_buffer_202', 'cudnn_generated_fort_native_sdpa_sm90', 100.0)]
  p = step_profile.breakdown(wrapped, ops)
  assert p['seconds']['matmul'] == pytest.approx(2e-4)
  assert p['seconds']['attention'] == pytest.approx(1e-4)
  assert p['opaque_share'] == pytest.approx(0.7) and not p['reliable']
  assert 'command_buffer_202' in p['unreliable']
  assert p['top_kernels'][0] == dict(kernel='loop_add_fusion', category='other',
                                     seconds=pytest.approx(7e-4))
  placed = step_profile.breakdown([event('fusion.3', 'loop_add_fusion', 700.0)] + wrapped[1:],
                                  ops)
  assert placed['reliable'] and placed['unreliable'] is None and placed['opaque_share'] == 0
  assert placed['seconds']['attention'] == pytest.approx(8e-4)
  gemm = step_profile.breakdown([event('custom-call.7', 'nvjet_tst_64x8_NNT', 50.0)], ops)
  assert gemm['seconds']['lm_head'] == pytest.approx(5e-5) and gemm['reliable']


def test_host_trace_counts_a_loop_s_body_not_the_loop(tmp_path):
  """On a CPU backend a while loop's op spans the ops of its body: only the leaves count."""
  import gzip
  from pipelinerl_jax.bench import step_profile
  op = lambda name, ts, dur, tid=1: dict(ph='X', pid=7, tid=tid, ts=ts, dur=dur, name=name,
                                         args=dict(hlo_op=name))
  trace = dict(traceEvents=[
      dict(ph='M', pid=7, name='process_name', args=dict(name='/host:CPU')),
      op('while.3', 0.0, 100.0), op('fusion.1', 10.0, 30.0), op('fusion.2', 50.0, 40.0),
      op('fusion.3', 100.0, 5.0), op('fusion.4', 20.0, 10.0, tid=2)])
  where = tmp_path / 'plugins' / 'profile' / 'run'
  where.mkdir(parents=True)
  with gzip.open(where / 'host.trace.json.gz', 'wt') as f:
    json.dump(trace, f)
  names = sorted(e['name'] for e in step_profile.trace_events(str(tmp_path)))
  assert names == ['fusion.1', 'fusion.2', 'fusion.3', 'fusion.4']


@pytest.mark.serial
def test_ray_sync_bench_writes_json_and_prints_tables(tmp_path):
  """Weight sync to 1 and 2 generator actors and the per-step overhead, on the quick model."""
  out = tmp_path / 'ray_sync.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.bench.ray_sync', '--sizes=quick', '--actors=1,2',
       '--repeats=2', '--groups=2', '--tokens=8', f'--out={out}'], cwd=ROOT,
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'ray overhead ms/step' in proc.stdout
  report = json.loads(out.read_text())
  assert [r['actors'] for r in report['sync']] == [1, 2]
  for r in report['sync']:
    assert 0 < r['put_ms'] <= r['sync_ms'] and r['mb'] > 0
  (step,) = report['step_overhead']
  assert step['decode_steps'] >= 8  # one request's 8 tokens take 8 decode steps at least
  assert 0 < step['actor_engine_ms_per_step'] < step['ray_ms_per_step']


def test_step_profile_counts_loop_matmuls_and_splits_kernel_time_by_scope():
  from pipelinerl_jax.bench import step_profile

  def f(x):
    def body(c, _):
      with jax.named_scope('attention_core'):
        y = jnp.tanh(c @ x)
      return y @ x, None
    c = jax.lax.scan(body, x, None, length=3)[0]
    with jax.named_scope('optimizer'):
      c = c * 0.5 + 1
    return c.sum()

  x = jnp.ones((64, 64))
  grad = jax.grad(f)
  flops, whiles = step_profile.matmul_flops(jax.make_jaxpr(grad)(x))
  assert whiles == 0 and flops == 3 * 2 * 3 * 2 * 64**3  # 3 steps x 2 dots x fwd + 2 bwd each
  loop = lambda x: jax.lax.fori_loop(0, x.shape[0] // 32 + jnp.int32(x[0, 0] > 0), lambda i, c:
                                     c @ x, x)
  assert step_profile.matmul_flops(jax.make_jaxpr(loop)(x)) == (0.0, 1)  # trip count unknown

  compiled = jax.jit(grad).lower(x).compile()
  ops = step_profile.hlo_instructions(compiled.as_text())
  assert any('attention_core' in op['scopes'] and op['matmul'] for op in ops.values())
  jax.block_until_ready(compiled(x))
  p = step_profile.profile_breakdown(lambda: compiled(x), compiled.as_text())
  assert p['kernels'] > 0 and p['kernel_s'] == pytest.approx(sum(p['seconds'].values()))
  assert p['seconds']['attention'] > 0 and p['seconds']['matmul'] > 0
  assert p['seconds']['lm_head'] == 0 and sum(p['shares'].values()) == pytest.approx(1)


# ---------------------------------------------------------------------------------------------
# The learning benches behind docs/lora.md and docs/moe.md: one trend computation, raw rewards.


def test_reward_trend_recovers_a_known_line_and_its_noise():
  steps = np.arange(1, 101)
  exact = reward_trend.trend(steps, 0.3 + 0.002 * steps)
  assert exact['slope'] == pytest.approx(0.2) and exact['slope_se'] == pytest.approx(0, abs=1e-9)
  assert exact['line_first'] == pytest.approx(0.302) and exact['line_last'] == pytest.approx(0.5)
  # Quarters of 25 steps: means at steps 13 and 88.
  assert exact['quarter_first'] == pytest.approx(0.326)
  assert exact['rise'] == pytest.approx(0.15)
  rng = np.random.default_rng(0)
  noisy = reward_trend.trend(steps, 0.3 + 0.002 * steps + rng.normal(0, 0.05, 100))
  assert abs(noisy['slope'] - 0.2) < 3 * noisy['slope_se'] and 0.01 < noisy['slope_se'] < 0.03
  # Two quarters' means of 25 values with sd 0.05 (plus the line within a quarter):
  # sqrt(2 / 25) * 0.05 = 0.014.
  assert noisy['noise'] == pytest.approx(0.0145, rel=0.25)
  assert noisy['rise_over_noise'] == pytest.approx(noisy['rise'] / noisy['noise'])
  short = reward_trend.trend([1, 2, 3], [0.1, 0.2, 0.4])
  assert short['slope'] == pytest.approx(15) and math.isnan(short['rise'])
  assert all(math.isnan(v) for v in reward_trend.trend([1, 2], [0.1, 0.2]).values())
  with pytest.raises(ValueError, match='3 steps but 2 rewards'):
    reward_trend.trend([1, 2, 3], [0.1, 0.2])
  stats = reward_trend.over_seeds([dict(rise=0.1), dict(rise=float('nan')), dict(rise=0.3)],
                                  ['rise'])
  assert stats['rise'] == dict(median=pytest.approx(0.2), min=0.1, max=0.3, n=2, seeds=3)


def _run_learning_bench(module, tmp_path, *flags):
  """`python -m pipelinerl_jax.bench.<module> --smoke` on seed 0 with 8 steps a run (enough for
  the trend's quarters); returns (its JSON, its stdout)."""
  out = tmp_path / f'{module}.json'
  proc = subprocess.run(
      [sys.executable, '-m', f'pipelinerl_jax.bench.{module}', '--smoke', '--seeds=0',
       '--steps=8', f'--out={out}', f'--cache_dir={tmp_path / "cache"}',
       f'--workdir={tmp_path / "runs"}', *flags],
      cwd=ROOT, env=xla_env.one_device(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text()), proc.stdout


def _assert_raw_rewards_give_the_trend(report, tmp_path, names):
  """Every run's JSON keeps its raw per-step rewards, the ones its metrics.jsonl logged, and its
  row's trend is `reward_trend.trend` of them."""
  assert sorted(report['raw']) == sorted(f'{n}/seed0' for n in names)
  for row in report['runs']:
    raw = report['raw'][f"{row['name']}/seed0"]
    logged = metrics_lib.read_metrics(str(tmp_path / 'runs' / row['name'] / 'seed0' /
                                          'metrics.jsonl'))
    assert raw['step'] == [r['step'] for r in logged] == list(range(1, 9))
    assert raw['reward_mean'] == [r['reward_mean'] for r in logged]
    recomputed = reward_trend.trend(raw['step'], raw['reward_mean'])
    assert not math.isnan(recomputed['noise'])   # 8 steps: quarters of 2
    for key, value in recomputed.items():
      assert row[key] == pytest.approx(value, nan_ok=True), key


def test_lora_learning_smoke_keeps_raw_rewards_and_computes_the_trend(tmp_path):
  report, stdout = _run_learning_bench('lora_learning', tmp_path)
  _assert_raw_rewards_give_the_trend(report, tmp_path, ['tiny', 'tiny_lora'])
  full, lora = report['runs']
  assert (full['name'], lora['name']) == ('tiny', 'tiny_lora')
  assert full['steps'] == lora['steps'] == 8 and full['samples'] == lora['samples']
  assert 0 < lora['publish_mb'] < full['publish_mb'] / 3   # adapters only
  assert set(report['over_seeds']) == {'tiny', 'tiny_lora'}
  assert report['over_seeds']['tiny']['rise']['seeds'] == 1
  assert 'rise/noise' in stdout and 'over seeds [0]' in stdout
  assert pathlib.Path(report['png']).stat().st_size > 10_000


def test_moe_replay_smoke_keeps_raw_rewards_and_computes_the_trend(tmp_path):
  report, stdout = _run_learning_bench('moe_replay', tmp_path)
  _assert_raw_rewards_give_the_trend(report, tmp_path, ['replay', 'recompute'])
  assert [r['name'] for r in report['runs']] == ['replay', 'recompute']
  # The mismatch part: one batch scored at lags 0-2 both ways; at lag 0 in fp32 the trainer
  # and the engine agree whatever the routing.
  rows = {(r['dtype'], r['lag'], r['routing']): r for r in report['mismatch']}
  assert set(rows) == {(d, lag, routing) for d in ('float32', 'bfloat16') for lag in (0, 1, 2)
                       for routing in ('replay', 'recompute')}
  assert rows['float32', 0, 'replay']['abs_logp_diff'] < 1e-4
  assert rows['float32', 0, 'recompute']['routes_differ'] == 0
  assert 'routes_used_differ' not in json.dumps(report)
  assert '|logpi-logmu| replay' in stdout and 'rise/noise' in stdout
  assert pathlib.Path(report['png']).stat().st_size > 10_000


def test_regime_smoke_keeps_raw_values_and_stops_its_spinners(tmp_path):
  """bench.regime --busy 1: the run's per-step values as its metrics.jsonl logged them, the
  regime's means computed from them, and the spinning process gone once the run is."""
  report, stdout = _run_learning_bench('regime', tmp_path, '--preset=tiny', '--busy=1')
  _assert_raw_rewards_give_the_trend(report, tmp_path, ['busy1'])
  (row,) = report['runs']
  raw = report['raw']['busy1/seed0']
  logged = metrics_lib.read_metrics(str(tmp_path / 'runs' / 'busy1' / 'seed0' / 'metrics.jsonl'))
  for key in ('frac_multi_version', 'versions_per_sample_mean', 'ess'):
    assert raw[key] == [r[key] for r in logged], key
  assert row['versions_mean'] == pytest.approx(np.mean(raw['versions_per_sample_mean']))
  assert row['frac_multi_version'] == pytest.approx(np.mean(raw['frac_multi_version']))
  assert row['busy'] == 1 and len(report['busy_pids']) == 1
  assert not _running(report['busy_pids'][0])
  assert 'multi_version' in stdout and 'rise/noise' in stdout


def test_regime_spinners_die_with_a_bench_killed_by_sigkill(tmp_path):
  """A bench killed with -9 runs no `finally`: its spinners end by the kernel's parent-death
  signal, which they ask for themselves."""
  proc = subprocess.Popen(
      [sys.executable, '-c', 'import time\nfrom pipelinerl_jax.bench import regime\n'
       'with regime.busy_cores(2) as pids:\n  print(*pids, flush=True)\n  time.sleep(120)\n'],
      cwd=ROOT, stdout=subprocess.PIPE, text=True)
  pids = [int(p) for p in proc.stdout.readline().split()]
  assert len(pids) == 2 and all(_running(p) for p in pids)
  proc.kill()
  proc.wait()
  deadline = time.monotonic() + 30
  while any(_running(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(_running(p) for p in pids)


def _running(pid: int) -> bool:
  """Whether the process exists and has not exited (an exited one may wait as a zombie for a
  parent that does not reap it)."""
  try:
    stat = pathlib.Path(f'/proc/{pid}/stat').read_text()
  except FileNotFoundError:
    return False
  return stat.rsplit(')', 1)[1].split()[0] != 'Z'


def test_hybrid_smoke_keeps_raw_rewards_and_scores_the_engines_tokens(tmp_path):
  """bench.hybrid --smoke: `tiny` and `tiny_hybrid` (a Qwen3.5 dir) each run 8 steps, their raw
  rewards kept and the trend computed from them; the mismatch part scores the engine's samples
  of both models: in fp32 the trainer gives log mu back, a bf16 engine does not."""
  report, stdout = _run_learning_bench('hybrid', tmp_path, '--scales=3')
  _assert_raw_rewards_give_the_trend(report, tmp_path, ['tiny', 'tiny_hybrid'])
  assert [r['name'] for r in report['runs']] == ['tiny', 'tiny_hybrid']
  hybrid_dir = pathlib.Path(report['model_dirs']['tiny_hybrid'])
  assert json.loads((hybrid_dir / 'config.json').read_text())['architectures'] == [
      'Qwen3_5ForCausalLM']
  rows = {(r['model'], r['engine_dtype']): r for r in report['mismatch']['rows']}
  assert set(rows) == {(m, d) for m in ('dense', 'hybrid') for d in ('float32', 'bfloat16')}
  assert {r['scale'] for r in report['mismatch']['rows']} == {3.0}
  for model in ('dense', 'hybrid'):
    fp32, bf16 = rows[model, 'float32'], rows[model, 'bfloat16']
    assert fp32['tokens'] == bf16['tokens'] == 4 * 8 and fp32['nll'] > 0
    assert fp32['fp32_max'] < 1e-3 and fp32['fp32_ess'] > 0.9999
    assert bf16['fp32_mean'] > 10 * fp32['fp32_mean']
  assert '-log mu' in stdout and 'rise/noise' in stdout
  assert pathlib.Path(report['png']).stat().st_size > 10_000


def test_hybrid_bench_names_a_bad_scales_flag():
  from pipelinerl_jax.bench import hybrid
  assert hybrid.parse_scales('2,3.5') == [2.0, 3.5]
  for bad in ('x', '2,-1', ''):
    with pytest.raises(ValueError, match="^--scales must be comma-separated positive numbers"):
      hybrid.parse_scales(bad)
