"""Problem files as they ship (tasks/data.py): every layout of the same problems loads into the
same prompts and answers; GSM8K's '####' rule; dataset names; bad records refused in one line
naming the file, the row and the field; prompts rendered through the chat template."""

import json
import pathlib
import re

import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.tasks import data
from pipelinerl_jax.tasks import math as math_task

# (problem, reference answer, a worked solution ending in a boxed answer, GSM8K's form of it)
PROBLEMS = [
    ('What is $2^{10} - 24$?', '1000', 'We have $2^{10} = 1024$, so \\boxed{1000}.',
     '2^10 = <<2**10=1024>>1024\n1024 - 24 = <<1024-24=1000>>1000\n#### 1000'),
    ('Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in '
     'May. How many clips did Natalia sell altogether in April and May?', '72',
     'Natalia sold 48/2 = 24 clips in May, so 48+24 = \\boxed{72}.',
     'Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 '
     'clips altogether in April and May.\n#### 72'),
    ('Compute $\\frac{1}{2} + \\frac{1}{4}$.', '\\frac{3}{4}',
     'Over 4: $\\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.',
     'Over 4 this is 2/4 + 1/4 = 3/4.\n#### \\frac{3}{4}'),
    ('Solve $x^2 = 4$ for $x > 0$.', '2', 'Since $x > 0$, $x = \\boxed{2}$.',
     'x = 2 or x = -2, and x > 0.\n#### 2'),
]
INSTRUCTION = ' Let\'s think step by step and output the final answer within \\boxed{}.'


def verl_rows(source='openai/gsm8k', split='test'):
  """verl's RL layout (DAPO-Math-17k's): the instruction inside the user message."""
  return [dict(data_source=source, prompt=[{'role': 'user', 'content': q}], ability='math',
               reward_model={'style': 'rule', 'ground_truth': a},
               extra_info={'split': split, 'index': i})
          for i, (q, a, _, _) in enumerate(PROBLEMS)]


def write_jsonl(path, rows):
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return path


def write_parquet(path, rows):
  import pyarrow as pa
  import pyarrow.parquet as pq
  path.parent.mkdir(parents=True, exist_ok=True)
  pq.write_table(pa.Table.from_pylist(rows), path)
  return path


@pytest.fixture(scope='module')
def layouts(tmp_path_factory):
  """{name: (path spec, fields)}: the same four problems in every layout."""
  import datasets
  d = tmp_path_factory.mktemp('layouts')
  out = {}
  out['jsonl'] = (write_jsonl(d / 'plain.jsonl', [{'problem': q, 'answer': a}
                                                    for q, a, _, _ in PROBLEMS]), {})
  (d / 'solutions.json').write_text(json.dumps([{'question': q, 'solution': s}
                                                for q, _, s, _ in PROBLEMS]))
  out['json'] = (d / 'solutions.json', {})
  out['gsm8k'] = (write_jsonl(d / 'gsm8k.jsonl', [{'question': q, 'answer': g}
                                                   for q, _, _, g in PROBLEMS]), {})
  out['verl parquet'] = (write_parquet(d / 'verl.parquet', verl_rows()), {})
  hub = d / 'hub'  # a Hub snapshot: two shards under data/, a card beside them
  write_parquet(hub / 'data' / 'test-00000-of-00002.parquet', verl_rows()[:3])
  write_parquet(hub / 'data' / 'test-00001-of-00002.parquet', verl_rows()[3:])
  (hub / 'README.md').write_text('---\nconfigs: []\n---\n')
  out['shards'] = (hub, {})
  saved = d / 'saved'
  datasets.Dataset.from_list(verl_rows()).save_to_disk(str(saved))
  out['datasets'] = (saved, {})
  # Open-Reasoner-Zero's layout: a JSON array of [human turn, assistant turn with ground_truth].
  (d / 'orz.json').write_text(json.dumps([[{'from': 'human', 'value': q},
                                           {'from': 'assistant', 'ground_truth': {'value': a}}]
                                          for q, a, _, _ in PROBLEMS]))
  out['orz'] = (d / 'orz.json', dict(prompt_field='0.value', answer_field='1.ground_truth.value'))
  return out


@pytest.mark.parametrize('layout', ['jsonl', 'json', 'gsm8k', 'verl parquet', 'shards',
                                    'datasets', 'orz'])
def test_every_layout_loads_the_same_problems_and_answers(layouts, layout):
  path, fields = layouts[layout]
  source = data.load(str(path), **fields)
  assert [(r.text, r.answer) for r in source.records] == [(q, a) for q, a, _, _ in PROBLEMS]
  assert len({r.id for r in source.records}) == len(PROBLEMS)
  chat = layout in ('verl parquet', 'shards', 'datasets')
  assert all(r.chat == chat and len(r.messages) == 1 for r in source.records)
  expected = {'jsonl': 'jsonl', 'json': 'json', 'gsm8k': 'jsonl', 'verl parquet': 'parquet',
              'shards': 'shards', 'datasets': 'datasets', 'orz': 'json'}
  assert source.layout == expected[layout]
  if layout == 'shards':
    assert [pathlib.Path(f).name for f in source.files] == ['test-00000-of-00002.parquet',
                                                            'test-00001-of-00002.parquet']
  # The dataset is the rows' data_source where they have one, else the file's (or dir's) name.
  names = {'jsonl': 'plain', 'json': 'solutions', 'gsm8k': 'gsm8k', 'orz': 'orz'}
  assert {r.dataset for r in source.records} == {names.get(layout, 'openai/gsm8k')}


def test_raw_gsm8k_gives_the_number_after_the_marks_never_the_solution(layouts):
  path, _ = layouts['gsm8k']
  answers = [r.answer for r in data.load(str(path)).records]
  assert answers[:2] == ['1000', '72']  # not 'Natalia sold 48/2 = ...'
  assert [r.answer for r in data.load(str(path), answer_rule='gsm8k').records] == answers
  with pytest.raises(ValueError, match=r"row 0: field 'answer': holds no \\boxed"):
    data.load(str(path), answer_rule='boxed')
  # A worked solution with neither a box nor '####' is no reference answer under 'auto'.
  bare = write_jsonl(path.parent / 'bare.jsonl',
                     [{'question': 'q', 'answer': PROBLEMS[1][3].replace('\n#### 72', '')}])
  with pytest.raises(ValueError, match=r"bare.jsonl: row 0: field 'answer': is a worked "
                                       r"solution .*answer_rule='verbatim'") as e:
    data.load(str(bare))
  assert '\n' not in str(e.value)
  assert data.load(str(bare), answer_rule='verbatim').records[0].answer.endswith('April and May.')
  with pytest.raises(ValueError, match=r"row 0: field 'answer': holds no '####'"):
    data.load(str(bare), answer_rule='gsm8k')


def test_names_patterns_and_splits(layouts, tmp_path):
  path, _ = layouts['jsonl']
  assert {r.dataset for r in data.load(f'math500={path}').records} == {'math500'}
  assert data.split_name(str(path)) == (None, str(path))
  # A directory holding the shards of two splits is refused with a pattern that picks one.
  hub = tmp_path / 'gsm8k'
  write_parquet(hub / 'main' / 'train-00000-of-00001.parquet', verl_rows(split='train'))
  write_parquet(hub / 'main' / 'test-00000-of-00001.parquet', verl_rows()[:2])
  with pytest.raises(ValueError, match=r'several splits \(test, train\); give one as a pattern'):
    data.load(str(hub))
  source = data.load(str(hub / 'main' / 'test-*.parquet'))
  assert source.layout == 'shards' and len(source.records) == 2
  # A shard given as a file is named without its -00000-of-00001.
  plain = write_parquet(tmp_path / 'x' / 'test-00000-of-00001.parquet',
                        [{'problem': q, 'answer': a} for q, a, _, _ in PROBLEMS])
  assert {r.dataset for r in data.load(str(plain)).records} == {'test'}
  assert {r.dataset for r in data.load(str(plain.parent)).records} == {'x'}
  # A DatasetDict directory names its splits.
  import datasets
  datasets.DatasetDict({'train': datasets.Dataset.from_list(verl_rows()),
                        'test': datasets.Dataset.from_list(verl_rows())}).save_to_disk(
                            str(tmp_path / 'dd'))
  with pytest.raises(ValueError, match=r'a datasets DatasetDict with splits test, train; give '
                                       r'one of them'):
    data.load(str(tmp_path / 'dd'))
  assert len(data.load(str(tmp_path / 'dd' / 'test')).records) == 4


@pytest.mark.parametrize('rows,fields,message', [
    ([{'problem': 'a', 'answer': '1'}, {'problem': 'b'}], {},
     r"rows.jsonl: row 1: field 'answer': no 'answer' \(keys there: problem\)"),
    ([{'prompt': [{'role': 'user', 'content': 'a'}], 'reward_model': {'style': 'rule'}}], {},
     r"row 0: field 'reward_model.ground_truth': no 'reward_model.ground_truth' \(keys there: "
     r"style\)"),
    ([{'prompt': [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}],
       'answer': '1'}], {}, r"row 0: field 'prompt': the last message must be a non-empty user"),
    ([{'prompt': [{'speaker': 'me', 'text': 'a'}], 'answer': '1'}], {},
     r"row 0: field 'prompt': message 0 is not a chat message"),
    ([{'problem': '  ', 'answer': '1'}], {}, r"row 0: field 'problem' is empty"),
    ([{'problem': 'a', 'answer': {'x': 1}}], {}, r"row 0: field 'answer': is not text"),
    ([{'problem': 'a', 'answer': '1'}], dict(answer_field='reward_model.ground_truth'),
     r"rows.jsonl: no answer field 'reward_model.ground_truth' \(columns: problem, answer\)"),
    ([{'text': 'a', 'answer': '1'}], {},
     r'no problem field \(looked for problem, question, prompt; columns: text, answer\)'),
    ([['a', '1']], {}, r"records are lists, not objects: name the problem field"),
    ([{'problem': 'a', 'answer': ['1', '2']}], {}, r"row 0: field 'answer': is not text"),
])
def test_bad_records_are_refused_in_one_line_naming_file_row_and_field(tmp_path, rows, fields,
                                                                        message):
  path = write_jsonl(tmp_path / 'rows.jsonl', rows)
  with pytest.raises(ValueError, match=message) as e:
    data.load(str(path), **fields)
  assert '\n' not in str(e.value) and str(path) in str(e.value)
  where = re.match(r"(rows.jsonl: )?(row \d: field '[^']+')", message)
  if where and isinstance(rows[0], dict):  # the same record in a parquet file: the same place
    parquet = write_parquet(tmp_path / 'rows.parquet', rows)
    with pytest.raises(ValueError, match=re.escape(f'rows.parquet: {where[2]}')) as e:
      data.load(str(parquet), **fields)
    assert '\n' not in str(e.value)


def test_unreadable_files_name_the_file_and_line(tmp_path):
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"problem": "a", "answer": "1"}\n{"problem": \n')
  with pytest.raises(ValueError, match=r'bad.jsonl: line 2: not valid JSON'):
    data.load(str(bad))
  (tmp_path / 'empty.jsonl').write_text('\n')
  with pytest.raises(ValueError, match='empty.jsonl: holds no problems'):
    data.load(str(tmp_path / 'empty.jsonl'))
  (tmp_path / 'x.parquet').write_text('not parquet')
  with pytest.raises(ValueError, match=r'x.parquet: cannot read as parquet'):
    data.load(str(tmp_path / 'x.parquet'))
  with pytest.raises(FileNotFoundError, match='missing.parquet'):
    data.load(str(tmp_path / 'missing.parquet'))
  with pytest.raises(ValueError, match=r'x.csv: unknown format'):
    data.load(str(tmp_path / 'x.csv'))
  (tmp_path / 'nothing').mkdir()
  with pytest.raises(ValueError, match=r'nothing: a directory with neither .parquet files'):
    data.load(str(tmp_path / 'nothing'))


def test_test_sets_are_named_by_data_source_and_a_name_from_two_files_is_refused(tmp_path):
  rows = verl_rows('aime24') + [dict(r, data_source='amc23') for r in verl_rows()]
  for i, r in enumerate(rows):
    r['prompt'] = [{'role': 'user', 'content': f'{i}: {r["prompt"][0]["content"]}'}]
  mixed = write_parquet(tmp_path / 'mixed.parquet', rows)
  _, test = math_task.load_splits([str(mixed)], test_files=[str(mixed)])
  assert {name: len(v) for name, v in test.items()} == {'aime24': 4, 'amc23': 4}
  other = write_parquet(tmp_path / 'other.parquet', verl_rows('aime24'))
  with pytest.raises(ValueError, match=r"both give dataset 'aime24'; name them apart"):
    math_task.load_splits([str(mixed)], test_files=[str(mixed), str(other)])
  _, test = math_task.load_splits([str(mixed)], test_files=[str(mixed), f'aime24b={other}'])
  assert set(test) == {'aime24', 'amc23', 'aime24b'}


def _chat_tokenizer():
  import transformers
  from pipelinerl_jax.demo import char_tokenizer
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=char_tokenizer.build_char_tokenizer(), eos_token='<eos>')
  tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                       "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
  return tok


def test_prompts_render_through_the_chat_template_with_a_system_turn_only_when_configured(
    layouts):
  text = data.load(str(layouts['jsonl'][0])).records[0]
  chat = data.load(str(layouts['verl parquet'][0])).records[0]
  question = PROBLEMS[0][0]
  plain = data.PromptRenderer()  # no tokenizer: plain text
  assert plain(text) == f'{data.SYSTEM_PROMPT}\n\nProblem: {question}\n\nSolution:'
  assert plain(chat) == f'{question}\n\nSolution:'  # its instruction is its own
  tok = _chat_tokenizer()
  render = data.PromptRenderer(tok)
  assert render(text) == f'<|system|>{data.SYSTEM_PROMPT}\n<|user|>{question}\n<|assistant|>'
  assert render(chat) == f'<|user|>{question}\n<|assistant|>'
  everywhere = data.PromptRenderer(tok, 'Be brief.', 'all')
  assert everywhere(chat) == f'<|system|>Be brief.\n<|user|>{question}\n<|assistant|>'
  own = data.Record('x', 'd', (('system', 'Mine.'), ('user', 'q')), '1', chat=True)
  assert everywhere(own) == '<|system|>Mine.\n<|user|>q\n<|assistant|>'  # never a second one
  assert data.PromptRenderer(tok, '')(text) == f'<|user|>{question}\n<|assistant|>'
  config = config_lib.TaskConfig(name='math', system_prompt='S.', system_prompt_for='all')
  assert data.PromptRenderer.from_config(config, tok)(chat).startswith('<|system|>S.\n')


QWEN_LIKE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant"
                      "\n{% endif %}")


@pytest.fixture(scope='module')
def chat_model_dir(model_dir, tmp_path_factory):
  """The tests' demo model dir with a chat template of Qwen's shape (its tokenizer has none)."""
  import shutil
  out = tmp_path_factory.mktemp('chat') / 'model'
  shutil.copytree(model_dir, out)
  (out / 'chat_template.jinja').write_text(QWEN_LIKE_TEMPLATE)
  return str(out)


def test_preview_shows_layout_count_and_the_exact_prompts(layouts, chat_model_dir):
  import io
  from pipelinerl_jax import data_preview
  from pipelinerl_jax.models.hf import tokenizer as hf_tokenizer
  tokenizer = hf_tokenizer.load_tokenizer(chat_model_dir)
  assert tokenizer.chat_template == QWEN_LIKE_TEMPLATE
  config = config_lib.Config(task=config_lib.TaskConfig(name='math'))
  out = io.StringIO()
  paths = [str(layouts['verl parquet'][0]), str(layouts['gsm8k'][0])]
  sources = data_preview.preview(paths, chat_model_dir, config, num=2, max_prompt_len=200,
                                 out=out)
  text = out.getvalue()
  assert 'layout: parquet (1 file); 4 problems, 4 distinct prompts' in text
  assert 'layout: jsonl (1 file); 4 problems' in text
  assert "prompt: field 'prompt' (chat messages); answer: field 'reward_model.ground_truth'" in text
  assert 'datasets: openai/gsm8k (4)' in text and 'datasets: gsm8k (4)' in text
  # The first two prompts of each file, exactly as rendered for the model, with their counts.
  for source in sources:
    for r in source.records[:2]:
      turns = ([] if r.chat else [{'role': 'system', 'content': data.SYSTEM_PROMPT}]) + [
          {'role': 'user', 'content': r.text}]
      prompt = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
      assert prompt.startswith('<|im_start|>') and prompt.endswith('<|im_start|>assistant\n')
      n = len(tokenizer.encode(prompt, add_special_tokens=False))
      assert f'{r.id} (dataset {r.dataset}): {n} prompt tokens, reference answer ' \
             f'{r.answer!r}\n{prompt}\n' in text
    assert f'{source.records[2].id} (' not in text  # only --num of them
  lengths = [len(tokenizer.encode(data.PromptRenderer(tokenizer)(r), add_special_tokens=False))
             for r in sources[1].records]
  assert f'max {max(lengths)}; {sum(n > 200 for n in lengths)} over generation.max_prompt_len=200' \
         in text
  # DAPO's prompts ask for an 'Answer:' line: the preview says the task reads boxes.
  dapo = write_parquet(pathlib.Path(chat_model_dir).parent / 'dapo.parquet', [dict(
      verl_rows('math_dapo')[0], prompt=[{'role': 'user', 'content': 'Solve. The last line of '
                                          'your response should be of the form Answer: $Answer'
                                          '\n\nWhat is 1+1?'}])])
  out = io.StringIO()
  data_preview.preview([str(dapo)], chat_model_dir, config, out=out)
  assert "note: the prompts ask for an 'Answer:' line but task.answer_format is 'boxed'" in \
      out.getvalue()
