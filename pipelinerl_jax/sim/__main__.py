"""`python -m pipelinerl_jax.sim`: see cli.py."""

from pipelinerl_jax.sim import cli

if __name__ == '__main__':
  cli.main()
