"""Tasks: problem streams and scorers for RL (see base.py for the interface)."""

from pipelinerl_jax.tasks.arithmetic import ArithmeticTask
from pipelinerl_jax.tasks.base import STATUSES, Problem, Score, Task, extract_boxed
from pipelinerl_jax.tasks.reasoning import ReasoningTask
