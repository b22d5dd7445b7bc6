"""`python -m pipelinerl_jax.bench.gpu`: the kit's command line (runner.py)."""

import sys

from pipelinerl_jax.bench.gpu import runner

if __name__ == '__main__':
  sys.exit(runner.main())
