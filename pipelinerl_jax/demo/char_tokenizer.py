"""A character-level tokenizer built with `tokenizers`, saved as a Hugging Face tokenizer dir.

One token per character of `alphabet` plus three specials; no normalizer and a decoder that
concatenates, so decode(encode(s)) == s for every string over the alphabet (spaces included).
The saved dir (tokenizer.json + tokenizer_config.json) loads with
`transformers.AutoTokenizer.from_pretrained` as a `PreTrainedTokenizerFast`, which is how
vLLM and the actor read it. No BOS: a prompt is exactly its characters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

PAD, EOS, UNK = '<pad>', '<eos>', '<unk>'
SPECIAL_TOKENS = (PAD, EOS, UNK)  # ids 0, 1, 2
DEFAULT_ALPHABET = ''.join(chr(c) for c in range(32, 127)) + '\n\t'  # printable ASCII


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> tokenizers.Tokenizer:
  chars = list(dict.fromkeys(alphabet))  # dedupe, keep order
  if any(len(c) != 1 for c in chars) or not chars:
    raise ValueError('alphabet must be a non-empty string of characters')
  vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
  for c in chars:
    vocab[c] = len(vocab)
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  # Every character (newline included: [\s\S], not '.') is its own pre-token, so WordLevel maps
  # it to its id; characters outside the alphabet become <unk>.
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r'[\s\S]'), behavior='isolated')
  tok.decoder = decoders.Fuse()  # join with '' (WordLevel's default would insert spaces)
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in SPECIAL_TOKENS])
  return tok


def save_tokenizer(tok: tokenizers.Tokenizer, out_dir: str | os.PathLike,
                   model_max_length: int = 1024) -> list[Path]:
  """Writes tokenizer.json and tokenizer_config.json into out_dir; returns the files."""
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  tok.save(str(out_dir / 'tokenizer.json'))
  config = {
      'tokenizer_class': 'PreTrainedTokenizerFast',
      'eos_token': EOS,
      'pad_token': PAD,
      'unk_token': UNK,
      'bos_token': None,
      'add_bos_token': False,
      'add_eos_token': False,
      'model_max_length': model_max_length,
      # transformers would otherwise "clean up" ' .' into '.' when decoding.
      'clean_up_tokenization_spaces': False,
  }
  (out_dir / 'tokenizer_config.json').write_text(json.dumps(config, indent=2) + '\n')
  return [out_dir / 'tokenizer.json', out_dir / 'tokenizer_config.json']


def special_token_ids(tok: tokenizers.Tokenizer) -> dict[str, int]:
  """{'pad_token_id', 'eos_token_id'}: what config.json / generation_config.json carry."""
  return {'pad_token_id': tok.token_to_id(PAD), 'eos_token_id': tok.token_to_id(EOS)}


def load_tokenizer(model_dir: str | os.PathLike):
  """The HF tokenizer of a model dir (imports transformers, which takes a few seconds)."""
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.AutoTokenizer.from_pretrained(str(model_dir))
