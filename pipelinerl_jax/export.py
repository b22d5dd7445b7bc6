"""Exports a checkpoint's params as a Hugging Face model directory.

  python -m pipelinerl_jax.export --checkpoint=WORKDIR/checkpoints --out=DIR [--step=N]

writes config.json + model.safetensors (hf_io.save_params) and the tokenizer files of the run's
model dir, so transformers, vLLM and `hf_io.load_params` all load DIR. The model dir is the one
the run recorded in the checkpoint (override with --model_dir when it has moved).
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
from pipelinerl_jax.models import hf_io

# Files of a model dir that are not carried over: the weights (written anew), config.json
# (likewise), and the warm-start stamp (its accuracies describe the untrained-by-RL model).
_WEIGHT_SUFFIXES = ('.safetensors', '.bin', '.pt', '.pth', '.msgpack', '.h5', '.ckpt')
_NOT_COPIED = (hf_io.CONFIG_FILE, hf_io.INDEX_FILE, 'pytorch_model.bin.index.json',
               'warmstart.json')


def export_hf(checkpoint_dir: str | os.PathLike, model_dir: str | os.PathLike | None,
              out_dir: str | os.PathLike, step: int | None = None,
              dtype: str | None = None) -> list[Path]:
  """Writes the params of `checkpoint_dir` (latest step, or `step`) to `out_dir` as an HF model.

  `model_dir`: the run's model dir, for its config.json and tokenizer (None: the one recorded
  in the checkpoint). `dtype`: of the saved tensors (None: the run's param dtype, so the export
  holds exactly the trained values). Returns the files written.
  """
  meta = checkpoint_lib.read_meta(checkpoint_dir, step)
  model_dir = Path(model_dir or meta['model_dir'])
  if not (model_dir / hf_io.CONFIG_FILE).is_file():
    raise FileNotFoundError(f'{model_dir}: no {hf_io.CONFIG_FILE} (the run\'s model dir; '
                            'pass model_dir / --model_dir where it is now)')
  param_dtype = meta['config']['model']['param_dtype']
  model_config = hf_io.load_config(model_dir, param_dtype=param_dtype)
  params = checkpoint_lib.load_params(checkpoint_dir, model_config, step=step)
  out_dir = Path(out_dir)
  if out_dir.resolve() == model_dir.resolve():
    raise ValueError(f'{out_dir}: is the run\'s model dir; export elsewhere')
  original = json.loads((model_dir / hf_io.CONFIG_FILE).read_text())
  written = hf_io.save_params(params, model_config, out_dir, dtype=dtype or param_dtype,
                              extra_config=original)
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
                        step=None if f.step < 0 else f.step, dtype=f.dtype or None)
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
  flags.DEFINE_string('dtype', '', "bfloat16 | float32 | float16 ('' = the run's param dtype).")
  flags.mark_flags_as_required(['checkpoint', 'out'])
  app.run(main)


if __name__ == '__main__':
  cli()
