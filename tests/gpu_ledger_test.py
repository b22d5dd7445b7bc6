"""docs/dev/gpu-ledger.md against the kit and the tools it calls: every command parses with the kit's
own flags and names registered sections, every carried path is made by a prepare step the page
documents (and kept out of git), each call fits its timeout and one command, each planned window
fits the device time, and the staging rows are the calls tools/gpu_stage.py prints."""

import importlib.util
import pathlib
import re
import shlex
import subprocess

import pytest

from pipelinerl_jax import accelerators
from pipelinerl_jax.bench.gpu import presets
from pipelinerl_jax.bench.gpu import registry
from pipelinerl_jax.bench.gpu import runner
from pipelinerl_jax.bench.gpu import time_budget

ROOT = pathlib.Path(__file__).resolve().parent.parent
LEDGER = ROOT / 'docs' / 'dev' / 'gpu-ledger.md'
_spec = importlib.util.spec_from_file_location('gpu_stage', ROOT / 'tools' / 'gpu_stage.py')
stage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stage)

WINDOW_S = 900          # device time of a window, the machine's start and idle time included
COMMAND_S = 600         # one command's limit
IDLE_AFTER_S = 30       # held after a window's last call before the machine goes back
KIT_OVERHEAD_S = 10     # tools/gpu_kit.sh: the wheels' install and Python's start
VLLM_INSTALL_S = 40     # the last staging call: unpack and install vLLM
PAYLOAD_BYTES = 89_671_628  # tools/gpu_stage.py's packed payload (tests/gpu_stage_test.py)
KIT = 'bash tools/gpu_kit.sh'


def table(heading: str) -> list[dict[str, str]]:
  """The rows of the first table under `## heading`, as {column: cell} (backticks kept)."""
  text = LEDGER.read_text()
  start = text.index(f'\n## {heading}\n')
  end = text.find('\n## ', start + 1)
  lines = [l for l in text[start:end if end > 0 else None].splitlines() if l.startswith('|')]
  split = lambda line: [c.strip() for c in line.strip('|').split(' | ')]
  header = split(lines[0])
  rows = [dict(zip(header, split(line), strict=True)) for line in lines[2:]]
  assert rows, f'no rows under "## {heading}"'
  return rows


def code(cell: str) -> list[str]:
  """The `code spans` of a cell."""
  return re.findall(r'`([^`]+)`', cell)


OWED = table('Owed checks')
PREPARE = table('Prepare (here, on CPU, before a window)')
RUNNABLE = [r for r in OWED if r['command'] != 'to come']


def kit_args(row) -> list[str]:
  (command,) = code(row['command'])
  assert command.startswith(f'{KIT} '), command
  return shlex.split(command)[2:]


def kit_budget_s(args: list[str]) -> float:
  parsed = runner.build_parser().parse_args(args)
  return parsed.budget_s or presets.PRESETS[parsed.preset].budget_s


def staging_call(row) -> int | None:
  m = re.fullmatch(r'`tools/gpu_stage\.py` call (\d+)', row['command'])
  return int(m.group(1)) if m else None


def test_rows_are_numbered_in_priority_order():
  assert [int(r['row']) for r in OWED] == list(range(1, len(OWED) + 1))
  priorities = [int(r['priority']) for r in OWED]
  assert priorities == sorted(priorities) and priorities[0] == 1


@pytest.mark.parametrize('row', [r for r in RUNNABLE if staging_call(r) is None],
                         ids=lambda r: f"row{r['row']}")
def test_kit_commands_parse_and_name_registered_sections(row):
  args = kit_args(row)
  parsed = runner.build_parser().parse_args(args)  # a flag the kit lacks exits here
  sections = (parsed.sections.split(',') if parsed.sections
              else presets.PRESETS[parsed.preset].sections or registry.DEFAULT_SECTIONS)
  assert set(sections) <= set(registry.SECTIONS), sections
  assert parsed.budget_s > 0, 'a ledger command sets its budget'


def test_the_stage_run_names_registered_sections():
  """The vllm section that staging call 2 runs, through the kit's own parser."""
  kit = stage.DEFAULT_RUN.split('python3 -m pipelinerl_jax.bench.gpu ')[1].split(' 2>&1')[0]
  parsed = runner.build_parser().parse_args(shlex.split(kit))
  assert parsed.sections == 'vllm' and 'vllm' in registry.OPTIONAL_SECTIONS
  assert (VLLM_INSTALL_S + parsed.budget_s + time_budget.KILL_GRACE_S + KIT_OVERHEAD_S
          <= stage.LAST_CALL_TIMEOUT_S)


def test_staging_rows_are_the_calls_gpu_stage_prints():
  sizes = stage.piece_sizes(PAYLOAD_BYTES, stage.project_bytes())
  plan = stage.calls([f'.stage/call{k}' for k in range(1, len(sizes) + 1)], sizes, 'a' * 64,
                     stage.DEFAULT_RUN, last_carry=(stage.KIT_CARRY,))
  rows = [r for r in OWED if staging_call(r) is not None]
  assert [staging_call(r) for r in rows] == list(range(1, len(plan) + 1))
  for row, call in zip(rows, plan):
    assert code(row['carry']) == call['carry'], row['row']
    assert int(row['timeout_s']) == call['timeout_s'], row['row']
  assert [int(r['row']) for r in rows] == [1, 2]  # vLLM on CUDA first


def test_carried_paths_are_made_by_a_prepare_step_and_kept_out_of_git():
  made = {p.rstrip('/') for row in PREPARE for p in code(row['makes'])}
  for row in RUNNABLE:
    for path in code(row['carry']):
      assert path in made, f"row {row['row']} carries {path}, which no prepare step makes"
  for path in made:
    ignored = subprocess.run(['git', 'check-ignore', '-q', f'{path}/'], cwd=ROOT)
    assert ignored.returncode == 0, f'{path}/ would travel with every call: git-ignore it'


def test_prepare_steps_make_what_the_page_says():
  steps = {row['step']: row for row in PREPARE}
  # tools/gpu_wheels.sh writes .whl/ by default, which tools/gpu_kit.sh installs from.
  (wheels,) = code(steps['wheels']['command'])
  assert wheels == 'tools/gpu_wheels.sh'
  assert 'DEST=${1:-.whl}' in (ROOT / wheels).read_text()
  assert '.whl/*.whl' in (ROOT / 'tools/gpu_kit.sh').read_text()
  assert code(steps['wheels']['makes'])[0] == '.whl/'
  # The warm starts: where the kit's e2e runs (gpu_kit.sh) and the staged vllm run read them.
  (warm,) = code(steps['warm starts']['command'])
  cache = re.search(r'--prepare_models=(\S+)', warm).group(1)
  assert f'--model_cache={cache}' in (ROOT / 'tools/gpu_kit.sh').read_text()
  assert f'--model_cache={cache}' in stage.DEFAULT_RUN
  assert code(steps['warm starts']['makes'])[0] == f'{stage.KIT_CARRY}/'
  assert cache.startswith(f'{stage.KIT_CARRY}/')
  # tools/gpu_stage.py: its pieces, under its default --out.
  (vllm,) = code(steps['vLLM']['command'])
  assert vllm.endswith('tools/gpu_stage.py')
  assert "'--out', default='.stage'" in (ROOT / 'tools/gpu_stage.py').read_text()
  n = len(stage.piece_sizes(PAYLOAD_BYTES, stage.project_bytes()))
  assert code(steps['vLLM']['makes']) == [f'.stage/call{k}/' for k in range(1, n + 1)]


@pytest.mark.parametrize('row', RUNNABLE, ids=lambda r: f"row{r['row']}")
def test_each_call_fits_its_timeout_and_one_command(row):
  timeout, predicted = int(row['timeout_s']), int(row['predicted s'])
  assert 0 < timeout <= COMMAND_S
  if staging_call(row) is None:
    budget = kit_budget_s(kit_args(row))
    assert budget + time_budget.KILL_GRACE_S + KIT_OVERHEAD_S <= timeout
    assert predicted >= budget + time_budget.KILL_GRACE_S  # the prediction counts the run


def test_each_window_fits_the_device_time_and_priority_1_leaves_a_margin():
  windows: dict[str, int] = {}
  for row in RUNNABLE:
    if row['window'] != '—':
      windows[row['window']] = windows.get(row['window'], 0) + int(row['predicted s'])
  assert set(windows) == {'1', '2'}
  for window, seconds in windows.items():
    assert seconds + IDLE_AFTER_S <= WINDOW_S, (window, seconds)
  first = sum(int(r['predicted s']) for r in OWED if r['priority'] == '1')
  assert first <= WINDOW_S * 2 / 3, first  # a first run of vLLM may well take longer
  # Window 1 starts with priority 1.
  assert [r['window'] for r in OWED if r['priority'] == '1'] == ['1'] * 2


def test_last_runs_name_a_date_and_a_known_card():
  for row in OWED:
    if row['last run'] == 'never':
      assert row['result'] == '—', row['row']
      continue
    date, card = row['last run'].split(', ')
    assert re.fullmatch(r'\d{4}-\d\d-\d\d', date), row['row']
    assert accelerators.card_of(card) is not None, card
    assert row['result'] != '—', row['row']
