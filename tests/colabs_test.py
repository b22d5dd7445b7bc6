"""Every notebook in colabs/ runs headless, top to bottom, in smoke mode: no cell errors, a
figure is drawn, and its RESULTS hold finite numbers under the expected keys."""

import json
import math
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

import xla_env  # tests/ is on sys.path

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLABS = ROOT / 'colabs'
SUMMARY_KEYS = ('name', 'steps', 'samples', 'ess', 'lag_min', 'lag_mean', 'lag_max',
                'reward_final', 'to_target')


@pytest.fixture(scope='module')
def cache_dir(built_once):
  """The demo models' cache of every notebook on every pytest-xdist worker: each preset's
  untrained model is built by the first notebook that needs it and reused by the others (a
  build appears whole, by a rename, so two at once cannot clash)."""
  return str(built_once('colab_models', lambda _: None))


def execute(name: str, cache_dir: str, monkeypatch) -> tuple[dict, list]:
  """Runs colabs/<name> as a user would, with SMOKE=True injected right after the parameters
  cell (as papermill does) and a last cell printing RESULTS; returns (RESULTS, all outputs)."""
  nb = nbformat.read(COLABS / name, as_version=4)
  params = [i for i, c in enumerate(nb.cells) if 'parameters' in c.metadata.get('tags', [])]
  assert len(params) == 1, f'{name}: needs exactly one cell tagged "parameters"'
  nb.cells.insert(params[0] + 1, nbformat.v4.new_code_cell(
      f'SMOKE = True\nCACHE_DIR = {cache_dir!r}'))
  nb.cells.append(nbformat.v4.new_code_cell(
      'import json\nprint("RESULTS=" + json.dumps(RESULTS, default=float))'))
  # One simulated device, as on a user's machine (conftest's 8 only slow the kernel down).
  monkeypatch.setenv('XLA_FLAGS', xla_env.FAST_COMPILE)
  NotebookClient(nb, timeout=240, kernel_name='python3',
                 resources={'metadata': {'path': str(COLABS)}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == 'code' for o in c.outputs]
  assert not [o for o in outputs if o.output_type == 'error']
  text = [o.text for o in nb.cells[-1].outputs if o.output_type == 'stream']
  line = next(l for t in text for l in t.splitlines() if l.startswith('RESULTS='))
  return json.loads(line[len('RESULTS='):]), outputs


def figures(outputs) -> int:
  return sum('image/png' in o.get('data', {}) for o in outputs
             if o.output_type in ('display_data', 'execute_result'))


def check_summaries(summaries, names):
  assert [s['name'] for s in summaries] == names
  for s in summaries:
    assert set(SUMMARY_KEYS) <= s.keys()
    assert s['steps'] >= 1 and s['samples'] > 0
    assert all(math.isfinite(s['ess'][k]) and 0 < s['ess'][k] <= 1 + 1e-6
               for k in ('mean', 'min', 'max'))
    assert 0 <= s['lag_min'] <= s['lag_mean'] <= s['lag_max']
    assert math.isfinite(s['reward_final'])


def test_in_flight_vs_conventional(cache_dir, monkeypatch):
  results, outputs = execute('in_flight_vs_conventional.ipynb', cache_dir, monkeypatch)
  check_summaries(results['summaries'], ['pipeline', 'conv1', 'conv4'])
  assert {'value', 'lower_bound', 'note', 'target'} <= results['speedup'].keys()
  assert figures(outputs) >= 1


def test_max_lag_and_slots(cache_dir, monkeypatch):
  results, outputs = execute('max_lag_and_slots.ipynb', cache_dir, monkeypatch)
  check_summaries(results['summaries'], ['max_lag=0 H=16', 'max_lag=4 H=64'])
  assert results['summaries'][0]['lag_max'] == 0   # max_lag 0: every sample on-policy
  assert figures(outputs) >= 2


def test_stale_vs_recomputed_kv(cache_dir, monkeypatch):
  results, outputs = execute('stale_vs_recomputed_kv.ipynb', cache_dir, monkeypatch)
  rows = results['rows']
  assert [(r['lag'], r['update_after']) for r in rows] == [(1, 2), (2, 2)]
  for r in rows:
    for variant in ('no_update', 'stale_kv', 'recompute_kv'):
      for metric in ('kl', 'k3', 'ess', 'kl_after', 'k3_after'):
        assert math.isfinite(r[f'{variant}_{metric}']), (variant, metric, r)
      assert r[f'{variant}_k3'] >= 0
    assert r['tokens_after'] > 0
  assert figures(outputs) >= 1


def test_is_truncation(cache_dir, monkeypatch):
  results, outputs = execute('is_truncation.ipynb', cache_dir, monkeypatch)
  summaries = results['summaries']
  check_summaries(summaries, ['c=1', 'c=inf'])  # smoke mode's two values of c
  assert [s['is_cap'] for s in summaries] == [1.0, math.inf]
  assert figures(outputs) >= 2
