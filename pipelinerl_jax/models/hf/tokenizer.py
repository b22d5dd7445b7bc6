"""A model dir's tokenizer and the token ids that end a completion."""

from __future__ import annotations

import json
import os
from pathlib import Path

GENERATION_CONFIG_FILE = 'generation_config.json'
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'vocab.json', 'tokenizer.model')


def load_tokenizer(model_dir: str | os.PathLike):
  """The model dir's tokenizer (transformers' AutoTokenizer), checked: without tokenizer files
  AutoTokenizer builds an empty one from config.json that encodes every prompt to no tokens,
  which would read as "every prompt too long" or "0 tokens" much later."""
  from transformers import AutoTokenizer  # heavy import: only when a tokenizer is needed
  present = [name for name in TOKENIZER_FILES if (Path(model_dir) / name).is_file()]
  if not present:
    raise ValueError(f'{model_dir}: no tokenizer files ({", ".join(TOKENIZER_FILES)}); copy '
                     "them from the model's original directory")
  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  if not tokenizer.encode('1 + 1 = 2', add_special_tokens=False):
    raise ValueError(f'{model_dir}: its tokenizer ({", ".join(present)}) encodes text to no '
                     'tokens')
  if tokenizer.eos_token_id is None:
    raise ValueError(f'{model_dir}: the tokenizer has no eos_token; generation could not stop')
  return tokenizer


def stop_token_ids(model_dir: str | os.PathLike, tokenizer) -> tuple[int, ...]:
  """The ids that end a completion: the tokenizer's EOS and every `eos_token_id` of the model
  dir's generation_config.json (an id or a list: Llama-3 instruct models end a turn on
  <|eot_id|> and the text on <|end_of_text|>, Qwen3's chat models on <|im_end|> and
  <|endoftext|>), sorted."""
  ids = {int(tokenizer.eos_token_id)}
  path = Path(model_dir) / GENERATION_CONFIG_FILE
  if not path.is_file():
    return tuple(sorted(ids))
  try:
    generation = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f'{path}: not valid JSON ({e})') from None
  eos = generation.get('eos_token_id') if isinstance(generation, dict) else None
  listed = eos if isinstance(eos, list) else [] if eos is None else [eos]
  if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in listed):
    raise ValueError(f'{path}: eos_token_id must be a token id or a list of them, got {eos!r}')
  return tuple(sorted(ids | set(listed)))
