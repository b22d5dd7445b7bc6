"""Throughput simulator for choosing a PipelineRL configuration (paper, Appendix A).

`throughput` holds the formulas and the search; `python -m pipelinerl_jax.sim` (cli.py) prints
and plots them for a cluster, from a built-in illustrative curve or from this repo's benchmarks.
"""
