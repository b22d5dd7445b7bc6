"""A character-level tokenizer built with `tokenizers`, saved as a Hugging Face tokenizer dir.

One token per character of `alphabet` (ASCII) plus three specials, so decode(encode(s)) == s
for every string over the alphabet (whitespace included). No BOS: a prompt is exactly its
characters.

Each character's vocabulary entry is its byte-level form (GPT-2's byte-to-unicode map: ' ' is
'Ġ', newline 'Ċ', tab 'ĉ'; other printable ASCII is itself). Why: `AutoTokenizer` (what vLLM, the
actor and the evaluator call) does not always read the pipeline of tokenizer.json. Next to a
Qwen2 config.json, transformers >= 5 builds its own Qwen2 tokenizer from the vocabulary alone
(byte-level pre-tokenizer, BPE with no merges, no unknown token), which silently dropped every
whitespace character of the plain character vocabulary this module used to write (dirs saved
before still load: only the entries of ' ', newline and tab differ, same ids). With byte-level
entries both readings give the same ids over the alphabet: tokenizer.json's own pipeline (one
pre-token per character, byte-level, word-level lookup) and the Qwen2 one (its regex,
byte-level, single-character BPE). Outside the alphabet ours gives <unk>, the Qwen2 one drops.
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


_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def byte_level(char: str) -> str:
  """The vocabulary entry of an ASCII character (see the module docstring)."""
  return _BYTE_LEVEL.pre_tokenize_str(char)[0][0]


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> tokenizers.Tokenizer:
  chars = list(dict.fromkeys(alphabet))  # dedupe, keep order
  if not chars:
    raise ValueError('alphabet must be a non-empty string of characters')
  if not all(c.isascii() for c in chars):
    # One byte per character keeps the two readings of the vocabulary equal (module docstring).
    raise ValueError(f'alphabet: only ASCII characters, got {[c for c in chars if not c.isascii()]}')
  vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
  for c in chars:
    vocab[byte_level(c)] = len(vocab)
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  # Every character (newline included: [\s\S], not '.') is its own pre-token, then takes its
  # byte-level form, which WordLevel maps to its id; characters outside the alphabet become <unk>.
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(r'[\s\S]'), behavior='isolated'), _BYTE_LEVEL])
  tok.decoder = decoders.ByteLevel()  # back from byte-level forms, joined with ''
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
