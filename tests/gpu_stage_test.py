"""tools/gpu_stage.py: pieces that fit the per-call transfer limits, split and reassembly byte-exact,
the trimmed wheel, and the printed calls run in order on a stand-in for the device (a temporary
repository and stage folder): they assemble, check, install and run; a machine that went back
between calls, or a corrupted piece, stops them with a clear message."""

import hashlib
import importlib.util
import io
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location('gpu_stage', ROOT / 'tools' / 'gpu_stage.py')
stage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stage)
MIB = stage.MIB


@pytest.mark.parametrize('payload', [1, 56 * MIB, 89_671_628, 200 * MIB + 7])
@pytest.mark.parametrize('project', [0, 4_500_000, 20 * MIB])
def test_pieces_are_fewest_that_fit_a_call(payload, project):
  sizes = stage.piece_sizes(payload, project)
  room = min(stage.MAX_PIECE_BYTES, stage.CALL_LIMIT_BYTES - project - stage.SLACK_BYTES)
  assert sum(sizes) == payload and len(sizes) == -(-payload // room)
  assert max(sizes) - min(sizes) <= 1
  assert all(s + project + stage.SLACK_BYTES <= stage.CALL_LIMIT_BYTES for s in sizes)


def test_a_project_that_fills_the_call_is_refused():
  with pytest.raises(SystemExit, match='leaves no room'):
    stage.piece_sizes(10, stage.CALL_LIMIT_BYTES)


def test_split_and_join_are_byte_exact(tmp_path):
  data = os.urandom(3 * 4096 + 13)
  payload = tmp_path / 'payload'
  payload.write_bytes(data)
  sizes = stage.piece_sizes(len(data), 0, limit=4096 + stage.SLACK_BYTES, max_piece=4096)
  dirs = stage.split(payload, tmp_path / 'out', sizes)
  assert [d.name for d in dirs] == ['call1', 'call2', 'call3', 'call4']
  assert stage.join(dirs) == data
  for d in dirs:
    digest, name = (d / 'SHA256').read_text().split()
    assert name == 'part' and digest == hashlib.sha256((d / 'part').read_bytes()).hexdigest()
  with pytest.raises(SystemExit, match='longer'):
    stage.split(payload, tmp_path / 'out', sizes[:-1])
  with pytest.raises(SystemExit, match='shorter'):
    stage.split(payload, tmp_path / 'out', sizes + [1])


def test_sha256_mismatch_names_the_file(tmp_path):
  f = tmp_path / 'x.whl'
  f.write_bytes(b'abc')
  stage.check_sha256(f, hashlib.sha256(b'abc').hexdigest())
  with pytest.raises(SystemExit, match='x.whl: sha256'):
    stage.check_sha256(f, '0' * 64)


def make_wheel(path: pathlib.Path, name: str, files: dict[str, bytes]) -> pathlib.Path:
  """A minimal valid wheel with `files` (paths inside it) and its dist-info."""
  info = f'{name}-0.1.dist-info'
  files = dict(files)
  files[f'{info}/METADATA'] = f'Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n'.encode()
  files[f'{info}/WHEEL'] = b'Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n'
  record = ''.join(f'{n},sha256=x,{len(b)}\n' for n, b in files.items()) + f'{info}/RECORD,,\n'
  files[f'{info}/RECORD'] = record.encode()
  wheel = path / f'{name}-0.1-py3-none-any.whl'
  with zipfile.ZipFile(wheel, 'w', zipfile.ZIP_DEFLATED) as z:
    for n, b in files.items():
      zi = zipfile.ZipInfo(n)
      zi.external_attr = (0o755 if n.endswith('.so') else 0o644) << 16
      z.writestr(zi, b)
  return wheel


def test_trim_drops_entries_and_their_record_lines(tmp_path):
  src = make_wheel(tmp_path, 'pjxtrim', {'pjxtrim/__init__.py': b'X = 1\n',
                                         'pjxtrim/big_C.so': b'\0' * 1000,
                                         'pjxtrim/third/a.h': b'int a;',
                                         'pjxtrim/keep_C.so': b'\1' * 10})
  dst = tmp_path / 'out.whl'
  got = stage.trim_wheel(src, dst, drop=('pjxtrim/big_C.so', 'pjxtrim/third/'))
  assert got == dict(dropped=2, dropped_bytes=1006)
  with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst) as b:
    names = b.namelist()
    assert 'pjxtrim/big_C.so' not in names and 'pjxtrim/third/a.h' not in names
    assert all(i.compress_type == zipfile.ZIP_STORED for i in b.infolist())
    assert b.read('pjxtrim/keep_C.so') == a.read('pjxtrim/keep_C.so')
    assert b.getinfo('pjxtrim/keep_C.so').external_attr >> 16 == 0o755
    record = b.read('pjxtrim-0.1.dist-info/RECORD').decode()
    assert 'big_C' not in record and 'third/' not in record and 'keep_C.so' in record


@pytest.fixture
def device(tmp_path):
  """A repository with the pieces of a packed fake wheel in .stage/call1..3, the calls, and a
  runner that runs call k there as the device would (bash, in the repository root)."""
  repo, wheels = tmp_path / 'repo', tmp_path / 'wheels'
  wheels.mkdir()
  wheel = make_wheel(wheels, 'pjxdummy', {'pjxdummy/__init__.py': b'VALUE = 42\n' + b'#' * 5000})
  payload = tmp_path / stage.PAYLOAD
  stage.pack([wheel], payload)
  sizes = stage.piece_sizes(payload.stat().st_size, 0, limit=payload.stat().st_size // 3 + 1
                            + stage.SLACK_BYTES)
  assert len(sizes) == 3
  stage.split(payload, repo / '.stage', sizes)
  plan = stage.calls([f'.stage/call{k}' for k in (1, 2, 3)], sizes, stage.sha256(payload),
                     run='python3 -c "import pjxdummy; print(\'value\', pjxdummy.VALUE)"',
                     stage=str(tmp_path / 'stage'), site=str(tmp_path / 'site'))
  bin_dir = tmp_path / 'bin'  # `python3` there is this interpreter, which has pip
  bin_dir.mkdir()
  (bin_dir / 'python3').symlink_to(sys.executable)
  env = {**os.environ, 'PATH': f'{bin_dir}{os.pathsep}{os.environ["PATH"]}'}
  env.pop('PYTHONPATH', None)

  def run(k):
    return subprocess.run(['bash', '-c', plan[k - 1]['command']], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
  return plan, run, repo, tmp_path / 'stage'


def test_calls_assemble_check_install_and_run(device):
  plan, run, _, _ = device
  assert [c['carry'] for c in plan] == [['.stage/call1'], ['.stage/call2'], ['.stage/call3']]
  for k in (1, 2):
    proc = run(k)
    assert proc.returncode == 0 and f'call {k}/3' in proc.stdout, proc.stderr
  proc = run(3)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'installed in' in proc.stdout and 'value 42' in proc.stdout


def test_a_machine_that_went_back_is_named(device):
  _, run, _, stage_dir = device
  assert run(1).returncode == 0
  (stage_dir / 'payload').unlink()  # a fresh machine: /tmp is empty
  proc = run(2)
  assert proc.returncode == 3 and 'went back between calls' in proc.stdout
  assert 'start again at call 1' in proc.stdout


def test_a_corrupted_piece_stops_the_calls(device):
  _, run, repo, stage_dir = device
  part = repo / '.stage' / 'call2' / 'part'
  part.write_bytes(b'x' + part.read_bytes()[1:])
  assert run(1).returncode == 0
  proc = run(2)
  assert proc.returncode != 0 and 'FAILED' in proc.stdout + proc.stderr
  assert run(3).returncode == 3  # call 2 appended nothing


def test_the_real_calls_stay_within_the_limits():
  sizes = stage.piece_sizes(89_671_628, stage.project_bytes())
  plan = stage.calls([f'.stage/call{k}' for k in range(1, len(sizes) + 1)], sizes, 'a' * 64,
                     stage.DEFAULT_RUN, last_carry=(stage.KIT_CARRY,))
  # The warm starts the last call carries are two demo models of under 1 MB each.
  stage.check_limits(plan, sizes, stage.project_bytes(), last_extra=4 * MIB)
  assert len(plan) == 2 and all(len(c['command']) <= stage.COMMAND_LIMIT for c in plan)
  assert 'pipelinerl_jax.bench.gpu --sections=vllm' in plan[-1]['command']
  assert [c['carry'] for c in plan] == [['.stage/call1'], ['.stage/call2', '.gpu_carry']]
  assert f'--model_cache={stage.KIT_CARRY}/model_cache' in plan[-1]['command']
  assert [c['timeout_s'] for c in plan] == [stage.CALL_TIMEOUT_S, stage.LAST_CALL_TIMEOUT_S]
  with pytest.raises(SystemExit, match='call 2 would carry'):  # the last call's carry counts
    stage.check_limits(plan, sizes, stage.project_bytes(), last_extra=stage.CALL_LIMIT_BYTES)
  with pytest.raises(SystemExit, match='characters'):
    stage.check_limits(stage.calls(['.stage/call1'], [1], 'a' * 64, 'x' * 2000), [1], 0)
