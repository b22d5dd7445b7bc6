"""The character tokenizer read as the pipeline reads it: AutoTokenizer on a model dir whose
config.json says Qwen2 (transformers then builds its own Qwen2 tokenizer from the vocabulary)."""

import json

import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers

from pipelinerl_jax.demo import char_tokenizer

TEXTS = ['a\nb', ' x  y ', "it's\n\t{x}", '4728+395=\n8+5+0=13;472+39;1;3\n\\boxed{5123}',
         'Problem: what is 2 + 2?\n\nSolution:', char_tokenizer.DEFAULT_ALPHABET]


def _model_dir(path, tok):
  char_tokenizer.save_tokenizer(tok, path)
  (path / 'config.json').write_text(json.dumps(
      {'model_type': 'qwen2', 'architectures': ['Qwen2ForCausalLM']}))
  return transformers.AutoTokenizer.from_pretrained(path)


def test_a_qwen2_model_dir_reads_every_character(tmp_path):
  tok = char_tokenizer.build_char_tokenizer()
  hf = _model_dir(tmp_path, tok)
  for text in TEXTS:
    ids = tok.encode(text).ids
    assert len(ids) == len(text)
    assert hf.encode(text, add_special_tokens=False) == ids, repr(text)
    assert hf.decode(ids) == text == tok.decode(ids)
  assert hf.decode([tok.token_to_id('7'), hf.eos_token_id, hf.pad_token_id],
                   skip_special_tokens=True) == '7'
  assert (hf.pad_token_id, hf.eos_token_id) == (0, 1)


def test_old_plain_vocabularies_still_load_with_the_same_ids(tmp_path):
  """A dir written before the byte-level entries: same ids for every non-whitespace character."""
  vocab = {t: i for i, t in enumerate(char_tokenizer.SPECIAL_TOKENS)}
  for c in char_tokenizer.DEFAULT_ALPHABET:
    vocab[c] = len(vocab)
  old = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=char_tokenizer.UNK))
  old.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r'[\s\S]'), behavior='isolated')
  old.decoder = decoders.Fuse()
  old.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in char_tokenizer.SPECIAL_TOKENS])
  hf = _model_dir(tmp_path, old)
  new = char_tokenizer.build_char_tokenizer()
  text = '37+45=\\boxed{82}'
  assert hf.encode(text, add_special_tokens=False) == new.encode(text).ids == old.encode(text).ids
  assert hf.decode(new.encode(text).ids) == text


def test_alphabet_must_be_ascii():
  with pytest.raises(ValueError, match='only ASCII'):
    char_tokenizer.build_char_tokenizer('abé')
  tok = char_tokenizer.build_char_tokenizer('ab\n')
  assert tok.get_vocab_size() == 6 and tok.decode(tok.encode('b\na').ids) == 'b\na'
