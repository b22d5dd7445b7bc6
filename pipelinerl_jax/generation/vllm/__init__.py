"""vLLM as a generation backend: the engine, in the process that runs it (the trainer's, or a
generator actor's)."""
