"""Throughput simulator (paper Appendix A): formulas on hand-computed cases, the search against
brute force, the benchmark readers, the CLI end to end, and the presets' predicted speeds."""

import fractions
import json
import math
import pathlib
import subprocess
import sys

import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.sim import cli
from pipelinerl_jax.sim import presets
from pipelinerl_jax.sim import throughput as tp

ROOT = pathlib.Path(__file__).resolve().parent.parent

# U(h) = 50 h up to h = 4, then flat at 200 tokens/s per accelerator.
LINEAR_FLAT = [(2, 100), (4, 200)]


def test_utilization_interpolates_from_zero_and_is_flat_past_the_last_point():
  points = [(4, 300), (2, 100)]  # unsorted on purpose
  assert tp.utilization(points, 0) == 0
  assert tp.utilization(points, 1) == pytest.approx(50)    # on the segment (0,0)-(2,100)
  assert tp.utilization(points, 2) == pytest.approx(100)
  assert tp.utilization(points, 3) == pytest.approx(200)   # halfway from 100 to 300
  assert tp.utilization(points, 4) == pytest.approx(300)
  assert tp.utilization(points, 100) == pytest.approx(300)
  assert list(tp.utilization(points, [1, 3])) == pytest.approx([50, 200])
  for bad in ([], [(2, 1), (2, 3)], [(0, 5)], [(1, -1)]):
    with pytest.raises(ValueError):
      tp.utilization(bad, 1)


def test_conventional_hand_computed():
  # N = 4, B = 8, tau = 1/100 s/token: r_train = 4 / (1/100) = 400 tokens/s.
  c1 = tp.conventional(N=4, B=8, G=1, points=LINEAR_FLAT, tau=0.01)
  # h = 8/4 = 2, U = 100, r_gen = 400; r_conv = 1 / (1/400 + 1/400) = 200.
  assert (c1.h, c1.lag) == (2, 0)
  assert (c1.r_gen, c1.r_train, c1.r_conv) == pytest.approx((400, 400, 200))
  # G = 2: h = 4, U = 200, r_gen = 800; r_conv = 1 / (1/800 + 1/400) = 800/3.
  c2 = tp.conventional(4, 8, 2, LINEAR_FLAT, 0.01)
  assert (c2.h, c2.r_gen, c2.r_conv, c2.lag) == pytest.approx((4, 800, 800 / 3, 1))
  # G = 4: h = 8 is past the flat end, same rate as G = 2, more lag.
  c4 = tp.conventional(4, 8, 4, LINEAR_FLAT, 0.01)
  assert (c4.r_conv, c4.lag) == (pytest.approx(800 / 3), 3)
  # Memory cap 3: h = 3, U = 150, r_gen = 600; r_conv = 1 / (1/600 + 1/400) = 240.
  capped = tp.conventional(4, 8, 4, LINEAR_FLAT, 0.01, max_h=3)
  assert (capped.h, capped.r_conv) == (3, pytest.approx(240))


@pytest.mark.parametrize('I, H, r_gen, r_train, r_pipe, g_max', [
    # N = 4, B = 8, tau = 1/100, L̄ = 4, L = 8: g_max = ceil(H·I·8 / (4·8)) = ceil(H·I / 4).
    (1, 4, 200, 300, 200, 1),   # generation-bound; H·I/4 = 1 exactly
    (2, 4, 400, 200, 200, 2),   # training-bound
    (1, 3, 150, 300, 150, 1),   # ceil(0.75)
    (2, 3, 300, 200, 200, 2),   # ceil(1.5)
    (3, 2, 300, 100, 100, 2),   # ceil(1.5)
])
def test_pipeline_hand_computed(I, H, r_gen, r_train, r_pipe, g_max):
  c = tp.pipeline(N=4, I=I, H=H, points=LINEAR_FLAT, tau=0.01, B=8,
                  lengths=tp.Lengths(mean=4, max=8))
  assert (c.I, c.H, c.g_max) == (I, H, g_max)
  assert (c.r_gen, c.r_train, c.r_pipe) == pytest.approx((r_gen, r_train, r_pipe))


def test_lag_bound_ceiling():
  L = tp.Lengths(mean=4, max=8)
  assert tp.lag_bound(H=4, I=2, B=8, lengths=L) == 2    # 64/32 = 2 exactly: not rounded up
  assert tp.lag_bound(H=5, I=2, B=8, lengths=L) == 3    # 80/32 = 2.5
  assert tp.lag_bound(H=1, I=1, B=8, lengths=L) == 1    # 8/32 = 0.25
  # Sample lengths [2, 4, 6]: L̄ = 4, L = 6; 3·2·6 / (4·3) = 3.
  assert tp.lag_bound(H=3, I=2, B=3, lengths=[2, 4, 6]) == 3
  # 3·0.30000000000000004 / 0.3 = 3.0000000000000004 in floats: still 3 steps.
  assert tp.lag_bound(H=3, I=1, B=1, lengths=tp.Lengths(mean=0.3, max=0.1 * 3)) == 3
  with pytest.raises(ValueError):
    tp.Lengths(mean=9, max=8)


def test_h_grid_is_measured_points_and_powers_of_two():
  points = [(3, 1), (6, 2), (12, 3)]
  assert tp.h_grid(points) == [1, 2, 3, 4, 6, 8, 12]
  assert tp.h_grid(points, max_h=5) == [1, 2, 3, 4]
  assert tp.h_grid(points, max_h=20) == [1, 2, 3, 4, 6, 8, 12, 16]


def test_best_config_hand_computed_with_and_without_lag_limit():
  # N = 4, B = 8, tau = 1/100, grid H in {1, 2, 4}. r_pipe = min(U(H)·I, (4 − I)·100):
  #         H=1   H=2   H=4
  #   I=1    50   100   200
  #   I=2   100   200   200
  #   I=3   100   100   100
  # L̄ = 2, L = 8: g_max = ceil(H·I / 2). r = 200 at (1,4), (2,2) with g = 2 and (2,4) with g = 4:
  # the tie goes to the lower lag, then to the smaller H: (2, 2).
  L = tp.Lengths(mean=2, max=8)
  best, table = tp.best_config(N=4, B=8, points=LINEAR_FLAT, tau=0.01, lengths=L)
  assert (best.I, best.H, best.g_max) == (2, 2, 2)
  assert best.r_pipe == pytest.approx(200)
  assert len(table) == 3 * 3 and table[0] == best
  # max_lag = 1 allows H·I <= 2 only: (1,1) 50, (1,2) 100, (2,1) 100 -> (2, 1), the smaller H.
  best1, table1 = tp.best_config(4, 8, LINEAR_FLAT, 0.01, L, max_lag=1)
  assert (best1.I, best1.H, best1.g_max) == (2, 1, 1)
  assert best1.r_pipe == pytest.approx(100)
  assert table1 == table  # the table is every configuration, the limit not applied
  with pytest.raises(ValueError, match='max_lag=0'):
    tp.best_config(4, 8, LINEAR_FLAT, 0.01, L, max_lag=0)


def _brute_force(N, B, points, tau, mean_len, max_len, grid, max_lag):
  """Independent of the module: own interpolation, exact ceil with fractions, plain loops."""
  pts = [(0, 0)] + sorted(points)

  def U(h):
    if h >= pts[-1][0]:
      return pts[-1][1]
    for (h0, u0), (h1, u1) in zip(pts, pts[1:]):
      if h0 <= h <= h1:
        return u0 + (u1 - u0) * (h - h0) / (h1 - h0)

  best = None
  for I in range(1, N):
    for H in grid:
      r = min(U(H) * I, (N - I) / tau)
      g = math.ceil(fractions.Fraction(H * I * max_len, mean_len * B))
      if max_lag is not None and g > max_lag:
        continue
      key = (-r, g, H, I)
      if best is None or key < best[0]:
        best = (key, (I, H, r, g))
  return best[1]


@pytest.mark.parametrize('max_lag', [None, 3, 8, 40])
def test_best_config_equals_brute_force(max_lag):
  # Integer points and tau = 1/64 keep every rate exact, so ties compare exactly on both sides.
  points = [(1, 30), (3, 80), (8, 150), (20, 260), (48, 300)]
  N, B, tau, mean_len, max_len = 24, 16, 1 / 64, 5, 17
  grid = tp.h_grid(points)
  assert grid == [1, 2, 3, 4, 8, 16, 20, 32, 48]
  best, table = tp.best_config(N, B, points, tau, tp.Lengths(mean_len, max_len), max_lag)
  I, H, r, g = _brute_force(N, B, points, tau, mean_len, max_len, grid, max_lag)
  assert (best.I, best.H, best.g_max) == (I, H, g)
  assert best.r_pipe == pytest.approx(r, rel=1e-12)
  assert len(table) == (N - 1) * len(grid)
  if max_lag is not None:
    assert best.g_max <= max_lag
    assert all(c.r_pipe <= best.r_pipe for c in table if c.g_max <= max_lag)
  # The limit binds at 3 and 8: something faster exists past it.
  if max_lag in (3, 8):
    assert table[0].r_pipe > best.r_pipe and table[0].g_max > max_lag


def test_paper_case_study_shape_with_a_calibrated_curve():
  """N = B = 128. The paper's U(h) is not published: this curve is CONSTRUCTED so that the
  formulas land on the paper's numbers, to check the search finds them, not to reproduce data.
  tau = 1; U flat from h = 192 at 84/44, so I = 44 generators exactly feed 128 − 44 = 84
  trainers; U(32) is set so that conventional G = 32 (h = 32) gives r_pipe / r_conv = 16.9/10.7."""
  N = B = 128
  r_pipe = 84.0
  r_conv = r_pipe * 10.7 / 16.9
  u32 = 1 / (1 / r_conv - 1 / N) / N        # r_conv = 1 / (1/(N·U(32)) + tau/N)
  points = [(32, u32), (192, 84 / 44)]
  best, _ = tp.best_config(N, B, points, 1.0, tp.Lengths(mean=1000, max=4000))
  assert (best.I, best.H) == (44, 192)
  assert best.r_pipe == pytest.approx(r_pipe)
  # ceil(192·44·4000 / (1000·128)) = ceil(264) = 264.
  assert best.g_max == 264
  convs = [tp.conventional(N, B, g, points, 1.0) for g in (1, 2, 4, 8, 16, 32)]
  best_conv = max(convs, key=lambda c: c.r_conv)
  assert best_conv.G == 32
  assert best.r_pipe / best_conv.r_conv == pytest.approx(16.9 / 10.7)


def test_illustrative_curve_pipeline_beats_every_conventional_g():
  points, tau = tp.ILLUSTRATIVE_POINTS, tp.ILLUSTRATIVE_TAU
  best, _ = tp.best_config(128, 128, points, tau, tp.Lengths(2048, 8192))
  convs = [tp.conventional(128, 128, g, points, tau) for g in (1, 2, 4, 8, 16, 32)]
  assert best.r_pipe > max(c.r_conv for c in convs)
  # At the optimum the two sides are balanced to within one accelerator's worth.
  assert abs(best.r_gen - best.r_train) <= max(tp.utilization(points, best.H), 1 / tau)


def _write_gen_bench(path, model=None):
  """Shaped like bench/generation.py output (only the fields the reader needs are real)."""
  rows = [dict(slots=h, mode=m, tokens_per_s=v, mean_busy=h, steps=10)
          for h, m, v in [(1, 'none', 100.0), (1, 'update', 90.0), (1, 'update+recompute', 70.0),
                          (8, 'none', 600.0), (8, 'update', 550.0),
                          (8, 'update+recompute', 400.0), (4, 'none', 350.0)]]
  path.write_text(json.dumps(dict(device='cpu:0', backend='cpu', model=model or {}, args={},
                                  rows=rows)))


def _write_train_bench(path, results):
  path.write_text(json.dumps(dict(config={}, jax_version='x', platform='cpu', results=results)))


def test_utilization_from_bench_json(tmp_path):
  path = tmp_path / 'gen.json'
  _write_gen_bench(path)
  assert tp.utilization_from_bench_json(path) == [(1, 100.0), (4, 350.0), (8, 600.0)]
  assert tp.utilization_from_bench_json(path, 'update') == [(1, 90.0), (8, 550.0)]
  with pytest.raises(ValueError, match='no rows'):
    tp.utilization_from_bench_json(path, 'fast')


def test_tau_from_train_bench_json(tmp_path):
  # tokens_per_s is for the whole mesh: 2000 tokens/s on 4 devices is 500 per device.
  one = tmp_path / 'one.json'
  _write_train_bench(one, [dict(model='tiny', devices=4, tokens_per_s=2000.0)])
  assert tp.tau_from_train_bench_json(one) == pytest.approx(1 / 500)
  two = tmp_path / 'two.json'
  _write_train_bench(two, [dict(model='tiny', devices=4, tokens_per_s=2000.0),
                           dict(model='50m', devices=1, tokens_per_s=250.0)])
  assert tp.tau_from_train_bench_json(two, model='50m') == pytest.approx(1 / 250)
  with pytest.raises(ValueError, match='50m'):
    tp.tau_from_train_bench_json(two)


def test_cli_with_bench_files_writes_json_and_png(tmp_path, capsys):
  gen, train = tmp_path / 'gen.json', tmp_path / 'train.json'
  _write_gen_bench(gen)
  _write_train_bench(train, [dict(model='tiny', devices=1, tokens_per_s=1000.0)])
  out, png = tmp_path / 'sim.json', tmp_path / 'sim.png'
  report = cli.main(['--N=8', '--B=4', f'--gen_bench={gen}', f'--train_bench={train}',
                     '--mean_len=100', '--max_len=400', '--max_lag=20', '--G=1,2,4',
                     f'--out={out}', f'--plot={png}'])
  printed = capsys.readouterr().out
  assert 'speedup' in printed and 'r_pipe' in printed
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  saved = json.loads(out.read_text())
  assert saved['best'] == json.loads(json.dumps(report['best']))
  # Same answer as the library on the same inputs.
  best, _ = tp.best_config(8, 4, tp.utilization_from_bench_json(gen), 1 / 1000,
                           tp.Lengths(100, 400), max_lag=20)
  assert (saved['best']['I'], saved['best']['H']) == (best.I, best.H)
  assert [c['G'] for c in saved['conventional']] == [1, 2, 4]
  assert all(c['g_max'] <= 20 for c in saved['top'])
  assert saved['curve']['illustrative'] is False


def test_cli_notes_benches_of_different_models(tmp_path, capsys):
  gen, train = tmp_path / 'gen.json', tmp_path / 'train.json'
  _write_gen_bench(gen, model=dict(hidden_size=128, num_layers=4))
  result = dict(model='tiny', devices=1, tokens_per_s=1000.0)
  args = ['--N=8', '--B=4', f'--gen_bench={gen}', f'--train_bench={train}',
          f'--out={tmp_path / "sim.json"}']
  _write_train_bench(train, [result | dict(model_config=dict(hidden_size=64, num_layers=4))])
  assert cli.main(args)['notes'] == [
      'the generation and train benches ran different models (hidden_size 128 vs 64): the '
      'rates they give do not describe one model']
  assert 'note: the generation and train benches' in capsys.readouterr().out
  _write_train_bench(train, [result | dict(model_config=dict(hidden_size=128, num_layers=4))])
  assert cli.main(args)['notes'] == []


def test_cli_rejects_a_measured_curve_without_tau(tmp_path):
  gen = tmp_path / 'gen.json'
  _write_gen_bench(gen)
  with pytest.raises(SystemExit) as e:
    cli.main([f'--gen_bench={gen}', f'--out={tmp_path / "x.json"}'])
  assert e.value.code == 2


def test_python_m_sim_illustrative(tmp_path):
  out, png = tmp_path / 'sim.json', tmp_path / 'sim.png'
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.sim', '--N=128', '--B=128', '--max_lag=400',
       f'--out={out}', f'--plot={png}'], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'ILLUSTRATIVE' in proc.stdout
  saved = json.loads(out.read_text())
  assert saved['curve']['illustrative'] and saved['best']['g_max'] <= 400
  assert saved['speedup'] > 1
  assert png.stat().st_size > 1000


# --- the preset table (sim/presets.py) ------------------------------------------------------

@pytest.fixture(scope='module')
def measured():
  return presets.read_measured(presets.DEFAULT_MEASURED)


def test_a_generation_bound_preset_speeds_up_with_its_generators(measured):
  """paper_7b decodes slower than it trains: twice the generator GPUs, at the same H each,
  predict twice the tokens/s; the step is B x the mean length over that rate."""
  hardware = config_lib.load_experiment().HARDWARE['paper_7b']
  base = presets.predict('paper_7b', hardware, config_lib.load_preset('paper_7b'), measured)
  assert base['fits'] and base['generator_devices'] == 4
  gen = base['decode_tokens_per_s_per_gpu'] * base['generator_devices']
  train = base['train_tokens_per_s_per_gpu'] * base['trainer_devices']
  assert gen < train and base['tokens_per_s'] == pytest.approx(gen)
  assert base['step_s'] == pytest.approx(1024 * base['mean_tokens'] / base['tokens_per_s'])
  wider = config_lib.load_preset('paper_7b')
  wider.generation.num_generators = 8
  more = presets.predict('paper_7b', dict(hardware, devices=12), wider, measured)
  assert more['tokens_per_s'] == pytest.approx(2 * base['tokens_per_s'])


def test_a_shared_device_takes_turns(measured):
  """The one-GPU preset's trainer and engine share the device: slower than either alone."""
  hardware = config_lib.load_experiment().HARDWARE['qwen3_1p7b_1xgpu']
  r = presets.predict('qwen3_1p7b_1xgpu', hardware,
                      config_lib.load_preset('qwen3_1p7b_1xgpu'), measured)
  gen, train = r['decode_tokens_per_s_per_gpu'], r['train_tokens_per_s_per_gpu']
  assert r['shares_device'] and r['tokens_per_s'] == pytest.approx(1 / (1 / gen + 1 / train))


def test_every_preset_needs_a_hardware_entry(tmp_path, measured):
  experiment = tmp_path / 'exp.py'
  experiment.write_text('from pipelinerl_jax import config as c\n'
                        'def get_config(arg=None):\n  return c.base_config()\n'
                        "PRESETS = {'a': get_config, 'b': get_config}\n"
                        "HARDWARE = {'a': dict(runs_on='a CPU', about='x')}\n")
  with pytest.raises(ValueError, match=r'HARDWARE has no entry for b$'):
    presets.rows(measured, experiment)


def test_measurements_without_a_train_step_are_refused(tmp_path):
  run = tmp_path / 'kit.json'
  run.write_text(json.dumps({'sections': {'env': {'items': [
      {'device_kind': 'NVIDIA H100 80GB HBM3'}]}}}))
  with pytest.raises(ValueError, match='need the kit'):
    presets.read_measured([run])
