"""XLA flags for the test session and for the processes its tests start.

FAST_COMPILE: XLA's CPU backend at -O0 (see conftest): the tests' shapes are tiny, so compiling,
not running, is most of their time. A process a test starts on one device (as a user's run)
gets `one_device(env)`: FAST_COMPILE without the session's 8 simulated devices.
"""

import os

FAST_COMPILE = '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'


def one_device(env: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
  """`env` (default os.environ) with XLA_FLAGS = FAST_COMPILE only, and `extra` set."""
  return {**(os.environ if env is None else env), 'XLA_FLAGS': FAST_COMPILE, **extra}
