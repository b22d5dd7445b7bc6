"""The README and docs/ pages: every relative link resolves (file and heading), the README stays an
entry page, and the docs and code comments speak of the project and its users, not of how it was
made (no session or issue numbers, leases or borrowed machines). The user pages (README and
docs/, not docs/dev/, the contributors' pages) hold no working notes either: no windows of device
time, carried folders, numbered rounds, uncommitted trials or work-log labels."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
USER_PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
PAGES = [*USER_PAGES, *sorted((ROOT / 'docs' / 'dev').glob('*.md'))]
README_MAX_LINES = 250

LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'^```.*?^```', re.M | re.S)


def slugs(markdown: str) -> set[str]:
  """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-', a
  repeated heading suffixed -1, -2, ..."""
  seen: dict[str, int] = {}
  for heading in re.findall(r'^#{1,6} +(.+?) *#*$', FENCE.sub('', markdown), re.M):
    slug = re.sub(r'[^\w\- ]', '', heading.lower()).replace(' ', '-')
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    yield slug if n == 0 else f'{slug}-{n}'


def broken_links(page: pathlib.Path) -> list[str]:
  """Relative links of `page` whose file or heading does not exist (web links are not
  followed)."""
  broken = []
  for target in LINK.findall(FENCE.sub('', page.read_text())):
    if re.match(r'[a-z]+:', target):
      continue
    path, _, anchor = target.partition('#')
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
      broken.append(f'{target}: no such file')
    elif anchor and dest.suffix == '.md' and anchor not in set(slugs(dest.read_text())):
      broken.append(f'{target}: no heading #{anchor} in {dest.name}')
  return broken


@pytest.mark.parametrize('page', PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
  assert broken_links(page) == []


def test_a_broken_file_or_heading_is_found(tmp_path):
  (tmp_path / 'other.md').write_text('# A heading (with `code`)\n\n## A heading (with `code`)\n')
  page = tmp_path / 'page.md'
  page.write_text('[ok](other.md#a-heading-with-code) [ok](other.md#a-heading-with-code-1) '
                  '[gone](missing.md) [bad](other.md#nope) ![img](none.png) [web](https://x.org)\n'
                  '```\n[in a code block](ignored.md)\n```\n')
  assert broken_links(page) == ['missing.md: no such file',
                                'other.md#nope: no heading #nope in other.md',
                                'none.png: no such file']


def test_readme_is_an_entry_page():
  lines = (ROOT / 'README.md').read_text().count('\n')
  assert lines <= README_MAX_LINES, f'README.md has {lines} lines; move detail to docs/'


# How the project was made, not what a user reads: session / issue numbers, machines lent to it.
WORKING_NOTES = re.compile(r'\b(session \d+|issue[ #]*\d+|leases?|lent|borrowed|device tool)\b',
                           re.I)
# What belongs to the contributors' pages (docs/dev/) and not to a user's: the GPU machine's
# windows of device time and the folders a call carries, numbered rounds and what changed
# "this round", trials left uncommitted, and the labels of a work log.
CONTRIBUTOR_NOTES = re.compile(
    r'\b(windows? of [^.|]*device time|device windows?|window \d+|round \d+|(?:this|that|'
    r'next|previous) round|not committed|this commit|today\b|today\'s plan|for the next run)'
    r'|`carry`|\bcarried (?:folders?|paths?)\b', re.I)


def working_notes(paths, pattern=WORKING_NOTES) -> list[str]:
  found = []
  for path in paths:
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for n, line in enumerate(path.read_text().splitlines(), 1):
      found += [f'{name}:{n}: {m[0]!r}' for m in pattern.finditer(line)]
  return found


def test_docs_and_code_comments_hold_no_working_notes():
  code = [*(ROOT / 'pipelinerl_jax').rglob('*.py'), *(ROOT / 'configs').glob('*.py'),
          *(ROOT / 'tools').glob('*.py'), *(ROOT / 'tools').glob('*.sh')]
  assert working_notes(PAGES + code) == []


def test_user_pages_hold_no_contributor_notes():
  assert working_notes(USER_PAGES, CONTRIBUTOR_NOTES) == []


def test_a_contributor_note_is_found_and_dev_pages_may_hold_them(tmp_path):
  page = tmp_path / 'p.md'
  page.write_text('Window 1 runs rows 1-3 in 15 minutes of device time: each carries `.whl` as its\n'
                  '`carry`. Round 3 (not committed) beat this round; 16.8k today.\n'
                  'Every carry written out; a round of tests; the window of a context.\n')
  assert working_notes([page], CONTRIBUTOR_NOTES) == [
      "p.md:1: 'Window 1'", "p.md:2: '`carry`'", "p.md:2: 'Round 3'",
      "p.md:2: 'not committed'", "p.md:2: 'this round'", "p.md:2: 'today'"]
  assert all(p.parent.name == 'dev' for p in set(PAGES) - set(USER_PAGES))
  assert (ROOT / 'docs' / 'dev' / 'gpu-ledger.md') in PAGES
  assert working_notes([ROOT / 'docs' / 'dev' / 'gpu-ledger.md'], CONTRIBUTOR_NOTES)


def test_a_working_note_is_found(tmp_path):
  page = tmp_path / 'p.md'
  page.write_text('Measured in Session 10 on the lent GPU (issue #25; a second lease).\n'
                  'It was released; a pleasant, relentless problem.\n')
  assert working_notes([page]) == ["p.md:1: 'Session 10'", "p.md:1: 'lent'",
                                   "p.md:1: 'issue #25'", "p.md:1: 'lease'"]


def test_the_readme_preset_table_is_what_the_tool_prints():
  from pipelinerl_jax.sim import presets  # imports JAX: only this test needs it
  table = presets.markdown(presets.rows(presets.read_measured(presets.DEFAULT_MEASURED)))
  assert table in (ROOT / 'README.md').read_text(), (
      f'README.md: the preset table is not what `{presets.COMMAND}` prints now; paste its output')


def test_the_readme_names_every_preset_and_model_config():
  from pipelinerl_jax import config as config_lib
  readme = (ROOT / 'README.md').read_text()
  experiment = config_lib.load_experiment()
  assert [p for p in experiment.PRESETS if f'`{p}`' not in readme] == []
  models = sorted(d.name for d in (config_lib.CONFIGS_DIR / 'models').iterdir()
                  if (d / 'config.json').is_file())
  assert models and [m for m in models if m not in readme] == []
  planned = {h['model'] for h in experiment.HARDWARE.values() if 'model' in h}
  assert planned <= set(models), planned - set(models)
