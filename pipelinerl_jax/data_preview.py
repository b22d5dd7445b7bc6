"""See the data before a run: how each file is read, how many problems it holds, and the first few
prompts exactly as the model will receive them (chat template applied), with their token counts
and reference answers.

  pipelinerl-data --model_dir=/models/Qwen3-1.7B /data/dapo-math-17k.parquet [/data/math500.jsonl]
  pipelinerl-data --config=configs/math.py:qwen3_1p7b_1xgpu --config.model.path=... \\
      --config.task.train_files="('/data/dapo-math-17k.parquet',)" [--num=3]

Without files, the config's task.train_files and task.test_files are shown. The task settings
(problem_field, answer_field, answer_rule, system_prompt, chat_template_kwargs, answer_format)
come from --config (default: the math task's defaults), the tokenizer from --model_dir or
config.model.path. Token counts are over the first --count_limit problems of each file, and with
--config against its generation.max_prompt_len (a longer training prompt would stop the run when
drawn).
"""

from __future__ import annotations

import sys
from typing import Sequence, TextIO

import numpy as np
import transformers
from absl import app
from absl import flags
from ml_collections import config_flags

from pipelinerl_jax import command_line
from pipelinerl_jax import config as config_lib
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.hf import tokenizer as hf_tokenizer
from pipelinerl_jax.tasks import data


def preview(paths: Sequence[str], model_dir: str, config: config_lib.Config, *, num: int = 3,
            count_limit: int = 2000, max_prompt_len: int | None = None,
            out: TextIO = sys.stdout) -> list[data.Source]:
  """Prints what the module doc says for each path; returns the sources read. `max_prompt_len`:
  the run's limit the prompts are checked against (None: not checked)."""
  t = config.task
  tokenizer = hf_tokenizer.load_tokenizer(hf_schema.check_model_dir(model_dir, '--model_dir'))
  render = data.PromptRenderer.from_config(t, tokenizer)
  template = 'chat template' if render.templated else 'no chat template: plain text'
  print(f'model dir {model_dir} ({template}); system prompt for {t.system_prompt_for} prompts: '
        f'{t.system_prompt!r}; completions answer as {t.answer_format}'
        + (f', scored by {t.score_fn}' if t.score_fn else ''), file=out)
  sources = []
  for path in paths:
    source = data.load(path, t.problem_field, t.answer_field, t.answer_rule)
    sources.append(source)
    records = source.records
    files = f'{len(source.files)} file' + ('s' if len(source.files) > 1 else '')
    print(f'\n{path}\n  layout: {source.layout} ({files}); {len(records)} problems, '
          f'{len({r.messages for r in records})} distinct prompts', file=out)
    if source.columns:
      print(f'  columns: {", ".join(source.columns)}', file=out)
    kind = 'chat messages' if records[0].chat else 'text'
    print(f'  prompt: field {source.prompt_field!r} ({kind}); answer: field '
          f'{source.answer_field!r}, rule {t.answer_rule!r}', file=out)
    counts: dict[str, int] = {}
    for r in records:
      counts[r.dataset] = counts.get(r.dataset, 0) + 1
    print('  datasets: ' + ', '.join(f'{name} ({n})' for name, n in counts.items()), file=out)
    lengths = [len(tokenizer.encode(render(r), add_special_tokens=False))
               for r in records[:count_limit]]
    scope = 'all' if len(lengths) == len(records) else f'the first {len(lengths)}'
    limit = ('' if max_prompt_len is None else f'; {sum(n > max_prompt_len for n in lengths)} '
             f'over generation.max_prompt_len={max_prompt_len}')
    print(f'  prompt tokens ({scope}): min {min(lengths)}, mean {np.mean(lengths):.1f}, max '
          f'{max(lengths)}{limit}', file=out)
    hint = _format_hint(render(records[0]), t.answer_format, t.score_fn)
    if hint:
      print(f'  note: {hint}', file=out)
    for r, n in zip(records[:num], lengths):
      print(f'\n  --- {r.id} (dataset {r.dataset}): {n} prompt tokens, reference answer '
            f'{r.answer!r}', file=out)
      prompt = render(r)
      print(prompt, file=out)
      print(f'  --- end of prompt (its last characters: {prompt[-12:]!r})', file=out)
  return sources


def _format_hint(prompt: str, answer_format: str, score_fn: str) -> str:
  """A prompt that asks for one answer format while the task reads the other."""
  if score_fn:
    return ''
  asks_box, asks_line = '\\boxed' in prompt, 'Answer:' in prompt
  if answer_format == 'boxed' and asks_line and not asks_box:
    return ("the prompts ask for an 'Answer:' line but task.answer_format is 'boxed': set "
            "--config.task.answer_format=answer_line")
  if answer_format == 'answer_line' and asks_box and not asks_line:
    return "the prompts ask for \\boxed{} but task.answer_format is 'answer_line'"
  return ''


def main(argv):
  f = flags.FLAGS
  try:
    config = (config_lib.validate(f.config, runnable=False) if f.config is not None else
              config_lib.Config(task=config_lib.TaskConfig(name='math')))
    paths = list(argv[1:]) or [*config.task.train_files, *config.task.test_files]
    if not paths:
      raise ValueError('no data: give files, or a --config with task.train_files / test_files')
    model_dir = f.model_dir or config.model.path
    if not model_dir:
      raise ValueError('no tokenizer: give --model_dir (or config.model.path)')
    transformers.logging.set_verbosity_error()  # (its "longer than the model's" warnings)
    preview(paths, model_dir, config, num=f.num, count_limit=f.count_limit,
            max_prompt_len=config.generation.max_prompt_len if f.config is not None else None)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'error: {command_line.one_line(e)}')


def cli():
  """The `pipelinerl-data` console script (and `python -m pipelinerl_jax.data_preview`)."""
  config_flags.DEFINE_config_file('config', None, 'Experiment config, e.g. '
                                  'configs/math.py:qwen3_1p7b_1xgpu (default: the math task).',
                                  lock_config=True)
  flags.DEFINE_string('model_dir', '', "The model dir whose tokenizer renders the prompts ('' = "
                      'config.model.path).')
  flags.DEFINE_integer('num', 3, 'Prompts shown per file.')
  flags.DEFINE_integer('count_limit', 2000, 'Problems per file whose tokens are counted.')
  app.run(main, flags_parser=command_line.parse_flags)


if __name__ == '__main__':
  cli()
