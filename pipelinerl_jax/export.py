"""Exports a checkpoint's params as a Hugging Face model directory.

  python -m pipelinerl_jax.export --checkpoint=WORKDIR/checkpoints --out=DIR [--step=N]
      [--format=hf|peft]

writes config.json + model.safetensors (models/hf/checkpoint.py: save_params) and the tokenizer
files of the run's model dir, so transformers, vLLM and `load_params` all load DIR. The model dir
is the one the run recorded in the checkpoint (override with --model_dir when it has moved).

A LoRA run's checkpoint (config.model.lora) holds adapters: `--format=hf` (the default) writes
the merged model, W + (alpha / r) A B computed in fp32 from the base and saved in the base's
dtype (its config.json's, unless --dtype); `--format=peft` writes the adapters alone as a PEFT
adapter dir (adapter_config.json + adapter_model.safetensors), which
`peft.PeftModel.from_pretrained(<the base model>, DIR)` and vLLM's LoRA loader read.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from absl import app
from absl import flags
from absl import logging

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax.generation import budget
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import peft as hf_peft
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import lora as lora_lib

FORMATS = ('hf', 'peft')

# Files of a model dir that are not carried over: the weights (written anew), config.json
# (likewise), and the warm-start stamp (its accuracies describe the untrained-by-RL model).
_WEIGHT_SUFFIXES = ('.safetensors', '.bin', '.pt', '.pth', '.msgpack', '.h5', '.ckpt')
_NOT_COPIED = (hf_schema.CONFIG_FILE, hf_checkpoint.INDEX_FILE, 'pytorch_model.bin.index.json',
               'warmstart.json')


def export_hf(checkpoint_dir: str | os.PathLike, model_dir: str | os.PathLike | None,
              out_dir: str | os.PathLike, step: int | None = None,
              dtype: str | None = None, format: str = 'hf') -> list[Path]:
  """Writes the params of `checkpoint_dir` (latest step, or `step`) to `out_dir` as an HF model
  (`format` 'hf'), or a LoRA run's adapters as a PEFT adapter dir ('peft').

  `model_dir`: the run's model dir, for its config.json and tokenizer (None: the one recorded
  in the checkpoint). `dtype`: of the saved tensors (None: the run's param dtype, so the export
  holds exactly the trained values; a LoRA run's merged model: the base's dtype). Returns the
  files written.
  """
  if format not in FORMATS:
    raise ValueError(f'format={format!r}: expected one of {", ".join(FORMATS)}')
  meta = checkpoint_lib.read_meta(checkpoint_dir, step)
  model_dir = Path(model_dir or meta['model_dir'])
  if not (model_dir / hf_schema.CONFIG_FILE).is_file():
    raise FileNotFoundError(f'{model_dir}: no {hf_schema.CONFIG_FILE} (the run\'s model dir; '
                            'pass model_dir / --model_dir where it is now)')
  lora = checkpoint_lib.saved_lora(meta)
  if format == 'peft' and lora is None:
    raise ValueError(f'{checkpoint_dir}: format peft needs a LoRA run\'s checkpoint; this run '
                     'trained every weight (export it with format hf)')
  param_dtype = meta['config']['model']['param_dtype']
  original = json.loads((model_dir / hf_schema.CONFIG_FILE).read_text())
  out_dir = Path(out_dir)
  if out_dir.resolve() == model_dir.resolve():
    raise ValueError(f'{out_dir}: is the run\'s model dir; export elsewhere')
  if lora is None:
    model_config = hf_schema.load_config(model_dir, param_dtype=param_dtype)
    params = checkpoint_lib.load_params(checkpoint_dir, model_config, step=step)
    dtype = dtype or param_dtype
  else:
    # The base in fp32 (compute dtype float32): the merge is made in fp32 from it.
    model_config = hf_schema.load_config(model_dir, param_dtype=param_dtype, dtype='float32')
    adapted = checkpoint_lib.load_params(checkpoint_dir, model_config, step=step,
                                         model_dir=str(model_dir))
    if format == 'peft':
      return hf_peft.save_peft(adapted.adapters, model_config, lora, out_dir,
                             base_model=str(model_dir.resolve()), dtype=dtype)
    params = lora_lib.merge(adapted.base, adapted.adapters, scale=adapted.scale)
    dtype = dtype or budget.serving_dtype(original) or param_dtype
  written = hf_checkpoint.save_params(params, model_config, out_dir, dtype=dtype,
                                      extra_config=original, carry_from=model_dir)
  for f in sorted(model_dir.iterdir()):
    if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHT_SUFFIXES):
      shutil.copy2(f, out_dir / f.name)
      written.append(out_dir / f.name)
  return written


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
  f = flags.FLAGS
  try:
    written = export_hf(f.checkpoint, f.model_dir or None, f.out,
                        step=None if f.step < 0 else f.step, dtype=f.dtype or None,
                        format=f.format)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'error: {e}')
  print(f'exported {len(written)} files to {f.out}')


def cli():
  """The `pipelinerl-export` console script (and `python -m pipelinerl_jax.export`); flags are
  defined here so that importing this module defines none."""
  flags.DEFINE_string('checkpoint', None, "A run's checkpoints dir (latest step) or one step dir.")
  flags.DEFINE_string('out', None, 'Output HF model directory.')
  flags.DEFINE_string('model_dir', '', "The run's model dir ('' = as recorded in the checkpoint).")
  flags.DEFINE_integer('step', -1, 'Step to export (-1 = the latest).')
  flags.DEFINE_string('dtype', '', "bfloat16 | float32 | float16 ('' = the run's param dtype; a "
                      "LoRA run's merged model: the base's).")
  flags.DEFINE_enum('format', 'hf', list(FORMATS), "hf: an HF model dir (a LoRA run's merged "
                    'model); peft: a LoRA run\'s adapters as a PEFT adapter dir.')
  flags.mark_flags_as_required(['checkpoint', 'out'])
  app.run(main)


if __name__ == '__main__':
  cli()
