"""Regenerates BUILD from the project's imports (run from the repository root)."""
import re
import pathlib
import sys

ROOT = pathlib.Path.cwd()
sys.path.insert(0, str(ROOT / 'tests'))
from build_test import project_imports  # noqa: E402


def target_name(rel: str) -> str:
  p = pathlib.PurePosixPath(rel)
  if p.parts[0] == 'tests':
    return p.stem
  return '_'.join(p.with_suffix('').parts[1:])


def kind(rel: str) -> str:
  if rel.startswith('tests/'):
    return 'py_test'
  text = (ROOT / rel).read_text()
  return 'py_binary' if re.search(r"^if __name__ == '__main__':", text, re.M) else 'py_library'


files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / 'pipelinerl_jax').rglob('*.py')
               if p.name != '__init__.py')
tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / 'tests').glob('*_test.py'))
owner = {f: target_name(f) for f in files + tests}
out = ['# Bazel-style targets, one per module and test. tests/build_test.py fails when a module or',
       '# test is missing here, or when deps disagree with what a file imports.',
       '# Regenerate with tools/gen_build.py.', '']
for f in files + tests:
  deps = sorted({owner[m] for m in project_imports(ROOT / f)} - {owner[f]})
  out.append(f'{kind(f)}(')
  out.append(f'    name = "{owner[f]}",')
  out.append(f'    srcs = ["{f}"],')
  if deps:
    out.append('    deps = [')
    out += [f'        ":{d}",' for d in deps]
    out.append('    ],')
  out.append(')')
  out.append('')
(ROOT / 'BUILD').write_text('\n'.join(out))
print(f'BUILD: {len(files) + len(tests)} targets')
