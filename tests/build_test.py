"""BUILD stays in sync with the code: every module and test has a target, deps match imports."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_build():
  targets = {}

  def rule(kind):
    def add(name, srcs, deps=(), **_):
      assert name not in targets, f'BUILD: duplicate target {name}'
      targets[name] = dict(kind=kind, srcs=list(srcs), deps=[d.lstrip(':') for d in deps])
    return add

  env = {k: rule(k) for k in ('py_library', 'py_test', 'py_binary')}
  exec(compile((ROOT / 'BUILD').read_text(), 'BUILD', 'exec'), env)
  return targets


def project_imports(path: pathlib.Path) -> set[str]:
  """Module files (relative paths) of pipelinerl_jax that `path` imports."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f'{node.module}.{a.name}' for a in node.names]
    for name in names:
      if not name.startswith('pipelinerl_jax'):
        continue
      base = ROOT / name.replace('.', '/')
      for candidate in (base.with_suffix('.py'), base / '__init__.py'):
        if candidate.exists() and candidate.name != '__init__.py':
          found.add(str(candidate.relative_to(ROOT)))
  return found


def test_every_module_and_test_has_a_target():
  targets = load_build()
  listed = {s for t in targets.values() for s in t['srcs']}
  modules = {str(p.relative_to(ROOT)) for p in (ROOT / 'pipelinerl_jax').rglob('*.py')
             if p.name != '__init__.py'}
  tests = {str(p.relative_to(ROOT)) for p in (ROOT / 'tests').glob('*_test.py')}
  missing = sorted((modules | tests) - listed)
  assert not missing, f'BUILD has no target for: {missing}'
  stale = sorted(s for s in listed if not (ROOT / s).exists())
  assert not stale, f'BUILD lists files that do not exist: {stale}'
  for name, t in targets.items():
    want = 'py_test' if t['srcs'][0].startswith('tests/') else ('py_library', 'py_binary')
    assert t['kind'] in want, f'BUILD: {name} is a {t["kind"]}'


def test_deps_cover_project_imports():
  targets = load_build()
  owner = {s: name for name, t in targets.items() for s in t['srcs']}
  for name, t in targets.items():
    for src in t['srcs']:
      needed = {owner[m] for m in project_imports(ROOT / src)} - {name}
      missing = sorted(needed - set(t['deps']))
      assert not missing, f'BUILD: {name} imports {missing} but does not list them in deps'
      unused = sorted(d for d in t['deps'] if d in targets and d not in needed)
      assert not unused, f'BUILD: {name} lists deps {unused} it does not import'
