"""Per-file cost of a `make test` run, from its output with `PYTEST_ARGS=--durations=0`.

  make test PYTEST_ARGS="--durations=0 -rs" > test.log 2>&1
  python tools/suite_durations.py test.log [--min_s 15]

Sums each file's setup, call and teardown durations per phase. The parallel phase runs on two
workers that stay busy to its end, so a test there costs the suite about half its duration;
the serial phase costs its full durations. Prints a markdown table, costliest first.
"""

import argparse
import collections
import re

PHASES = ('parallel', 'serial')  # the order `make test` runs them in
LINE = re.compile(r'^([0-9.]+)s (?:call|setup|teardown)\s+tests/([^:]+)::', re.M)


def per_file(text: str) -> dict[str, collections.Counter]:
  """{phase: {file: seconds}} from the durations blocks of a make test log, in phase order."""
  blocks = text.split('slowest durations')[1:]
  if len(blocks) != len(PHASES):
    raise SystemExit(f'expected {len(PHASES)} durations blocks (one per phase), found '
                     f'{len(blocks)}: run make test with PYTEST_ARGS=--durations=0')
  return {phase: _sums(block) for phase, block in zip(PHASES, blocks)}


def _sums(block: str) -> collections.Counter:
  c = collections.Counter()
  for m in LINE.finditer(block):
    c[m.group(2)] += float(m.group(1))
  return c


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('log')
  parser.add_argument('--min_s', type=float, default=15.0, help='leave out files costing less')
  args = parser.parse_args(argv)
  with open(args.log) as f:
    d = per_file(f.read())
  p, s = d['parallel'], d['serial']
  cost = {name: p[name] / 2 + s[name] for name in set(p) | set(s)}
  print('| file | parallel phase: durations (s) | serial phase (s) | cost to the suite, about (s) |')
  print('|---|---|---|---|')
  for name in sorted(cost, key=lambda n: -cost[n]):
    if cost[name] >= args.min_s:
      print(f'| `{name}` | {p[name]:.0f} | {s[name]:.0f} | {cost[name]:.0f} |')
  print(f'| all {len(cost)} files | {sum(p.values()):.0f} | {sum(s.values()):.0f} | '
        f'{sum(cost.values()):.0f} |')


if __name__ == '__main__':
  main()
