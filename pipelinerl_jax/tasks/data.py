"""Problem files as they ship, read into records (what the model is asked, the reference answer),
and a record rendered into the text the model continues.

Layouts, told apart by the path (no conversion step):
  jsonl      one JSON value per line: an object, or a list (a record's fields are then indexed
             by number: Open-Reasoner-Zero's [human turn, assistant turn])
  json       one JSON array of such records
  parquet    one .parquet file (verl / DAPO's layout among others)
  shards     a directory of .parquet files, searched below it (a Hub snapshot's
             data/train-00000-of-00002.parquet, ...), or a glob pattern ('gsm8k/main/test-*')
  datasets   a directory `datasets.Dataset.save_to_disk` wrote (state.json and .arrow files)

A path may be given as 'NAME=PATH' to name its dataset; otherwise a record's dataset is its
`data_source` field when it has one (the verl layout), else the file's stem (a Hub shard's
'-00000-of-00002' dropped), the directory's name (above a Hub `data/` folder), or a pattern's
directory's. Every per-dataset metric carries this name.

Fields are a name or a dotted path ('reward_model.ground_truth'; a number indexes a list:
'0.value'). The prompt is text, or chat messages ([{role, content}, ...], also ShareGPT's
{from, value}) ending with a user turn, kept as messages and rendered through the tokenizer's
chat template. The reference answer is read by a named rule (`answer_of`): 'boxed' (the last
\\boxed{} of a solution), 'gsm8k' (what follows GSM8K's '####'), 'verbatim', or 'auto' (boxed if
the text has a box, gsm8k if it has '####', else verbatim; a multi-line text with neither is
refused: a whole worked solution as the reference would score every right answer 0).

A file that cannot be read as records is refused in one line naming the file, the row and the
field. Nothing here scores a completion (tasks/math.py does).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from typing import Any, Mapping, Sequence

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.tasks.base import extract_boxed

PROMPT_FIELDS = ('problem', 'question', 'prompt')
ANSWER_FIELDS = ('answer', 'final_answer', 'solution', 'reward_model.ground_truth')  # in order
NAME_FIELD = 'data_source'
ANSWER_RULES = ('auto', 'boxed', 'gsm8k', 'verbatim')
SYSTEM_PROMPT = config_lib.DEFAULT_SYSTEM_PROMPT
_HUB_SHARD = re.compile(r'-\d{5}-of-\d{5}$')  # train-00000-of-00002
_ROLES = {'system': 'system', 'user': 'user', 'assistant': 'assistant', 'human': 'user',
          'gpt': 'assistant'}
_SOLUTION_CHARS = 100  # 'auto': a multi-line reference longer than this is a worked solution


@dataclasses.dataclass(frozen=True)
class Record:
  """One problem. `messages`: (role, content) turns, the last a user turn; a problem given as
  text is one user turn and `chat` False."""
  id: str
  dataset: str
  messages: tuple[tuple[str, str], ...]
  answer: str
  chat: bool = False

  @property
  def text(self) -> str:
    """The last user turn: the problem as written."""
    return self.messages[-1][1]


@dataclasses.dataclass(frozen=True)
class Source:
  """What one path gave: how it was read, and its records in file order."""
  path: str
  layout: str
  files: tuple[str, ...]
  columns: tuple[str, ...]
  prompt_field: str
  answer_field: str
  records: tuple[Record, ...]


# --- reading ---------------------------------------------------------------------------------

def load(spec: str, prompt_field: str = '', answer_field: str = '',
         answer_rule: str = 'auto') -> Source:
  """The records of one path ('NAME=PATH' names the dataset); raises a one-line ValueError (or
  FileNotFoundError) naming the file, the row and the field of the first bad record."""
  if answer_rule not in ANSWER_RULES:
    raise ValueError(f'answer_rule={answer_rule!r}: expected one of {", ".join(ANSWER_RULES)}')
  name, path = split_name(spec)
  layout, files = find_files(path)
  stem = name or default_name(path, layout)
  reader = _Reader(layout, files, path)
  columns = reader.columns
  pf = _pick(path, columns, prompt_field, PROMPT_FIELDS, 'problem', reader.first())
  af = _pick(path, columns, answer_field, ANSWER_FIELDS, 'answer', reader.first())
  named = name is None and NAME_FIELD in columns
  rows = reader.rows([pf, af] + ([NAME_FIELD] if named else []))
  records = []
  for i, (file, row_in_file, row) in enumerate(rows):
    where = f'{file}: row {row_in_file}'
    messages, chat = _prompt_of(_field(row, pf, where), pf, where)
    try:
      answer = answer_of(_field(row, af, where), answer_rule, af)
    except ValueError as e:
      raise ValueError(f'{where}: field {af!r}: {e}') from None
    dataset = stem
    if named:
      source = row.get(NAME_FIELD) if isinstance(row, dict) else None
      if not isinstance(source, str) or not source.strip():
        raise ValueError(f'{where}: field {NAME_FIELD!r} is empty or not text: {source!r:.80}')
      dataset = source.strip()
    records.append(Record(id=f'{stem}-{i}', dataset=dataset, messages=messages, answer=answer,
                          chat=chat))
  if not records:
    raise ValueError(f'{path}: holds no problems')
  return Source(path=path, layout=layout, files=tuple(files), columns=tuple(columns),
                prompt_field=pf, answer_field=af, records=tuple(records))


def split_name(spec: str) -> tuple[str | None, str]:
  """('NAME', 'PATH') of 'NAME=PATH', else (None, spec). A name has no '/'; a path that exists
  as given is never split."""
  spec = os.fspath(spec)
  head, sep, tail = spec.partition('=')
  if sep and head and '/' not in head and tail and not os.path.exists(spec):
    return head, tail
  return None, spec


def find_files(path: str) -> tuple[str, list[str]]:
  """(layout, the files to read in order) of a path; see the module doc."""
  if any(c in path for c in '*?['):
    files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
    if not files:
      raise FileNotFoundError(f'{path}: the pattern matches no file')
    kinds = {_kind(f) for f in files}
    if len(kinds) != 1 or None in kinds:
      raise ValueError(f'{path}: the pattern matches files of several or unknown formats '
                       f'({", ".join(sorted(os.path.basename(f) for f in files[:5]))})')
    kind = kinds.pop()
    return ('shards' if kind == 'parquet' else kind), files  # (jsonl / json: read in turn)
  if os.path.isdir(path):
    if os.path.isfile(os.path.join(path, 'dataset_dict.json')):
      splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
      raise ValueError(f'{path}: a datasets DatasetDict with splits {", ".join(splits)}; give '
                       f'one of them, e.g. {os.path.join(path, splits[0] if splits else "train")}')
    if os.path.isfile(os.path.join(path, 'state.json')):
      return 'datasets', [path]
    files = sorted(glob.glob(os.path.join(path, '**', '*.parquet'), recursive=True))
    if not files:
      raise ValueError(f'{path}: a directory with neither .parquet files nor a datasets '
                       'save_to_disk layout (state.json)')
    splits = sorted({_HUB_SHARD.sub('', os.path.splitext(os.path.basename(f))[0])
                     for f in files if _HUB_SHARD.search(os.path.splitext(f)[0])})
    if len(splits) > 1:
      raise ValueError(f'{path}: holds the shards of several splits ({", ".join(splits)}); give '
                       f"one as a pattern, e.g. '{os.path.join(path, '**', splits[0])}-*.parquet'")
    return 'shards', files
  kind = _kind(path)
  if kind is None:
    raise ValueError(f'{path}: unknown format (expected .jsonl, .json or .parquet, a directory of '
                     '.parquet shards or of a datasets save_to_disk)')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such file')
  return kind, [path]


def default_name(path: str, layout: str) -> str:
  """A dataset's name when its records carry none: see the module doc."""
  path = path.rstrip(os.sep)
  if layout in ('shards', 'jsonl', 'json') and any(c in path for c in '*?['):
    path = os.path.dirname(path.split('*')[0].split('?')[0].split('[')[0]) or '.'
  elif os.path.isfile(path):
    return _HUB_SHARD.sub('', os.path.splitext(os.path.basename(path))[0])
  path = os.path.abspath(path)
  while os.path.basename(path) == 'data' and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return os.path.basename(path) or path


def _kind(path: str) -> str | None:
  return {'.jsonl': 'jsonl', '.json': 'json', '.parquet': 'parquet'}.get(
      os.path.splitext(path)[1].lower())


class _Reader:
  """The records of a layout's files: `columns` first (cheap for parquet and datasets), then
  `rows(fields)`, reading only the top-level columns those fields start with."""

  def __init__(self, layout: str, files: Sequence[str], path: str):
    self.layout, self.files, self.path = layout, list(files), path
    self._parsed = None
    if layout in ('parquet', 'shards'):
      import pyarrow.parquet as pq  # imported here: only parquet files need it
      self._pq = pq
      self.columns = list(dict.fromkeys(n for f in self.files for n in self._schema(f)))
    elif layout == 'datasets':
      import datasets  # imported here: slow, and only this layout needs it
      try:
        self._ds = datasets.load_from_disk(path)
      except Exception as e:
        raise ValueError(f'{path}: cannot read as a datasets save_to_disk directory: '
                         f'{type(e).__name__}: {_first_line(e)}') from None
      self.columns = list(self._ds.column_names)
    else:
      read = _jsonl if layout == 'jsonl' else _json
      self._parsed = [(f, i, r) for f in self.files for i, r in enumerate(read(f))]
      first = self._parsed[0][2] if self._parsed else None
      self.columns = (list(dict.fromkeys(k for _, _, r in self._parsed[:1000]
                                         if isinstance(r, dict) for k in r))
                      if isinstance(first, dict) else [])

  def _schema(self, f: str) -> list[str]:
    try:
      return list(self._pq.read_schema(f).names)
    except Exception as e:
      raise ValueError(f'{f}: cannot read as parquet: {type(e).__name__}: {_first_line(e)}'
                       ) from None

  def first(self) -> Any:
    return self._parsed[0][2] if self._parsed else None

  def rows(self, fields: Sequence[str]) -> list[tuple[str, int, Any]]:
    """[(file, row in the file, record), ...] in file order."""
    heads = list(dict.fromkeys(f.split('.')[0] for f in fields if f))
    if self._parsed is not None:
      rows = self._parsed
    elif self.layout == 'datasets':
      keep = [c for c in heads if c in self.columns]
      rows = [(self.path, i, r) for i, r in enumerate(self._ds.select_columns(keep).to_list())]
    else:
      rows = []
      for f in self.files:
        keep = [c for c in heads if c in self._schema(f)]
        try:
          table = self._pq.read_table(f, columns=keep)
        except Exception as e:
          raise ValueError(f'{f}: cannot read as parquet: {type(e).__name__}: {_first_line(e)}'
                           ) from None
        rows += [(f, i, r) for i, r in enumerate(table.to_pylist())]
    if not rows:
      raise ValueError(f'{self.path}: holds no problems (no records)')
    for file, i, r in rows:
      if not isinstance(r, (dict, list)):
        raise ValueError(f'{file}: row {i}: a record must be a JSON object or list, got '
                         f'{type(r).__name__}: {str(r)[:80]}')
    return rows


def _jsonl(path: str) -> list:
  out = []
  with open(path, encoding='utf-8', errors='replace') as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}: line {lineno}: not valid JSON ({e.msg} at column {e.colno})'
                         ) from None
  if not out:
    raise ValueError(f'{path}: holds no problems (the file is empty)')
  return out


def _json(path: str) -> list:
  try:
    with open(path, encoding='utf-8', errors='replace') as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f'{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); a '
                     'file of one object per line is .jsonl') from None
  if not isinstance(data, list):
    raise ValueError(f'{path}: expected a JSON array of records, got a {type(data).__name__}')
  return data


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [''])[0]


def _pick(path, columns, given, candidates, what, first) -> str:
  """The field to read: `given`, or the first candidate whose top-level name is a column."""
  if given:
    head = given.split('.')[0]
    if columns and head not in columns:
      raise ValueError(f'{path}: no {what} field {given!r} (columns: {", ".join(columns)})')
    return given
  if not columns:
    raise ValueError(f'{path}: records are lists, not objects: name the {what} field as a path '
                     f"into them (task.{'problem' if what == 'problem' else 'answer'}_field, "
                     f"e.g. '0.value'); first record: {json.dumps(first)[:120]}")
  for name in candidates:
    if name.split('.')[0] in columns:
      return name
  raise ValueError(f'{path}: no {what} field (looked for {", ".join(candidates)}; '
                   f'columns: {", ".join(columns)})')


def _field(row: Any, path: str, where: str) -> Any:
  """The value at a dotted path of a record; errors name it."""
  node = row
  for depth, part in enumerate(path.split('.')):
    at = '.'.join(path.split('.')[:depth + 1])
    if isinstance(node, dict):
      if part not in node:
        keys = ', '.join(map(str, node)) or 'none'
        raise ValueError(f'{where}: field {path!r}: no {at!r} (keys there: {keys})')
      node = node[part]
    elif isinstance(node, (list, tuple)) and part.lstrip('-').isdigit():
      if not -len(node) <= int(part) < len(node):
        raise ValueError(f'{where}: field {path!r}: {at!r} is past the end of a list of '
                         f'{len(node)}')
      node = node[int(part)]
    else:
      raise ValueError(f'{where}: field {path!r}: {at!r} cannot be read in a '
                       f'{type(node).__name__}: {str(node)[:80]}')
  return node


def _prompt_of(value: Any, field: str, where: str
               ) -> tuple[tuple[tuple[str, str], ...], bool]:
  """(messages, chat) of a prompt field: text, or a list of chat messages."""
  if isinstance(value, str):
    if not value.strip():
      raise ValueError(f'{where}: field {field!r} is empty')
    return (('user', value),), False
  if isinstance(value, (list, tuple)) and value:
    turns = []
    for j, m in enumerate(value):
      role = content = None
      if isinstance(m, dict):
        role = _ROLES.get(str(m.get('role', m.get('from', ''))).lower())
        content = m.get('content', m.get('value'))
      if role is None or not isinstance(content, str):
        raise ValueError(f'{where}: field {field!r}: message {j} is not a chat message with a '
                         f'role (system / user / assistant) and text content: {str(m)[:80]}')
      turns.append((role, content))
    if turns[-1][0] != 'user' or not turns[-1][1].strip():
      raise ValueError(f'{where}: field {field!r}: the last message must be a non-empty user '
                       f'turn, got {turns[-1][0]!r}')
    return tuple(turns), True
  raise ValueError(f'{where}: field {field!r} is neither text nor a list of chat messages: '
                   f'{str(value)[:80]!r}')


def answer_of(value: Any, rule: str = 'auto', field: str = 'answer') -> str:
  """The reference answer in a field's value, by `rule` (module doc). Raises ValueError saying
  what is wrong (the caller names the row)."""
  if isinstance(value, (list, tuple)) and len(value) == 1:
    value = value[0]  # a one-answer list (some verl files hold ground_truth as ["72"])
  if value is None:
    raise ValueError('is empty (null)')
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise ValueError(f'is not text or a number: {str(value)[:80]!r}')
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  text = str(value).strip()
  boxed = extract_boxed(text) if rule in ('auto', 'boxed') else None
  if boxed is not None:
    answer = boxed.strip()
  elif rule == 'boxed' or (rule == 'auto' and field.split('.')[-1] == 'solution'
                           and '####' not in text):
    raise ValueError('holds no \\boxed{} answer')
  elif rule == 'gsm8k' or (rule == 'auto' and '####' in text):
    if '####' not in text:
      raise ValueError("holds no '####' line (answer_rule 'gsm8k')")
    answer = text.rsplit('####', 1)[1].strip()
  else:
    answer = text
    if rule == 'auto' and '\n' in text and len(text) > _SOLUTION_CHARS:
      raise ValueError(f'is a worked solution of {len(text)} characters with neither \\boxed{{}} '
                       "nor '####': no reference answer (set task.answer_rule='verbatim' to use "
                       'it whole)')
  if not answer:
    raise ValueError('is empty')
  return answer


# --- what the model sees ---------------------------------------------------------------------

def check_chat_template_kwargs(tokenizer, chat_template_kwargs: Mapping[str, Any]) -> None:
  """A kwarg the template cannot read would be dropped without a word by Jinja: refused here,
  naming the config key."""
  if not chat_template_kwargs:
    return
  template = getattr(tokenizer, 'chat_template', None) if tokenizer is not None else None
  if not isinstance(template, str) or not template:
    raise ValueError(f'config.task.chat_template_kwargs: {dict(chat_template_kwargs)} given, but '
                     'the tokenizer has no chat template (prompts are plain text)')
  unread = sorted(name for name in chat_template_kwargs if name not in template)
  if unread:
    raise ValueError(f'config.task.chat_template_kwargs: the chat template never mentions '
                     f'{unread}')


class PromptRenderer:
  """Record -> the text the model continues: the tokenizer's chat template when it has one
  (with `chat_template_kwargs`, e.g. Qwen3's enable_thinking), else plain text
  ('<system>\\n\\nProblem: <text>\\n\\nSolution:'). `system_prompt` ('' = none) is a system turn
  before problems given as text, or before every prompt without a system turn of its own with
  `system_for='all'`."""

  def __init__(self, tokenizer=None, system_prompt: str = SYSTEM_PROMPT,
               system_for: str = 'text', chat_template_kwargs: Mapping[str, Any] | None = None):
    if system_for not in ('text', 'all'):
      raise ValueError(f"system_for={system_for!r}: expected 'text' or 'all'")
    check_chat_template_kwargs(tokenizer, chat_template_kwargs or {})
    self.tokenizer, self.system_prompt, self.system_for = tokenizer, system_prompt, system_for
    self.chat_template_kwargs = dict(chat_template_kwargs or {})

  @classmethod
  def from_config(cls, config: config_lib.TaskConfig, tokenizer=None) -> 'PromptRenderer':
    return cls(tokenizer, config.system_prompt, config.system_prompt_for,
               config.chat_template_kwargs)

  @property
  def templated(self) -> bool:
    return bool(self.tokenizer is not None and getattr(self.tokenizer, 'chat_template', None))

  def messages(self, record: Record) -> list[tuple[str, str]]:
    """The turns sent, the system turn included."""
    turns = list(record.messages)
    wants = self.system_prompt and (self.system_for == 'all' or not record.chat)
    if wants and turns[0][0] != 'system':
      turns.insert(0, ('system', self.system_prompt))
    return turns

  def __call__(self, record: Record) -> str:
    turns = self.messages(record)
    if self.templated:
      return self.tokenizer.apply_chat_template(
          [{'role': r, 'content': c} for r, c in turns], add_generation_prompt=True,
          tokenize=False, **self.chat_template_kwargs)
    parts = [c if (r != 'user' or record.chat) else f'Problem: {c}' for r, c in turns]
    return '\n\n'.join(parts + ['Solution:'])
