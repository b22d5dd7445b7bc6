"""Generation: the engine interface (`api`), the embedded JAX engine and sampling rules."""

from pipelinerl_jax.generation.api import Completion, Engine, Request, SamplingParams, generate
from pipelinerl_jax.generation.jax_engine import EngineConfig, JaxEngine
from pipelinerl_jax.generation.sampling import sample
