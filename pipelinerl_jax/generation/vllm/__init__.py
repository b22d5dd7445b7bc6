"""vLLM as a generation backend: in-process engine, generator processes, their pool and GPUs."""
