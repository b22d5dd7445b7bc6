"""The CPU demo's model: a character tokenizer and an SFT warm start, built locally."""
