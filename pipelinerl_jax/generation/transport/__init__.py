"""Weights from the trainer to generators: HF-named tensor views, shared memory, collectives."""
