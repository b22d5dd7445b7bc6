"""Stages vLLM 0.26.0 onto a GPU host that has torch 2.11.0+cu130 but no vLLM and no network, in
pieces, where at most 64 MiB reaches that host per command, the project included.

  python tools/gpu_stage.py                 # download, trim, pack, split, print the calls
  python tools/gpu_stage.py --run 'CMD'     # the same, with another command for the last call
  python tools/gpu_stage.py --commands      # only print the calls of what is already built

Steps (everything under --out, default .stage/, which git must ignore: the pieces travel only
as the `carry` of their own call):
  download  the pinned wheels for the image's Python (cp312, manylinux x86-64), each checked
            against its sha256 in WHEELS: vLLM 0.26.0 (the last vLLM whose CUDA wheel pins the
            image's torch 2.11.0) and what vLLM imports on the offline LLM path that the image
            lacks; plus the kit's own (tools/gpu_wheels.sh: ml-collections).
  trim      vLLM's wheel without what one H100 serving a dense model never loads (TRIM), as a
            stored (uncompressed) zip with its RECORD rewritten, so that pip installs it and xz
            sees the raw bytes.
  pack      every wheel into one tar, xz-compressed: the CUDA fat binaries repeat themselves,
            and xz takes the trimmed vLLM to ~70 MiB where the wheel's own zip needs ~100.
  split     into OUT/call1/part, OUT/call2/part, ... (and each piece's SHA256), as few as fit
            one piece plus the project into one command.
  calls     the device `run` calls, printed and written to OUT/calls.json: call k carries
            OUT/callk and appends its piece to /tmp/pjx_stage/payload (the machine keeps /tmp
            while warm, ~30 s after a call: give each call right after the last returns); each
            call first checks that the payload holds exactly what the calls before it left, so
            a machine that went back between calls is said so at once; the last checks the
            whole payload's sha256, unpacks it, installs every wheel with
            `pip install --no-index --no-deps --target /tmp/site` and runs --run (default: the
            GPU kit's vllm section) with PYTHONPATH=/tmp/site; it also carries .gpu_carry/ (the
            kit's e2e warm starts, --prepare_models) where that exists.

What the image lacks was found by importing vLLM 0.26's modules on the offline path (LLM,
LLMEngine, EngineCore, the GPU worker and model runner, Qwen2, FlashAttention, the sampler,
PyNcclCommunicator, the loaders and the layer-wise reload) with only the image's packages
visible (/work/.library/device/KINDS.md) and adding what failed until nothing did. The
structured-output backends are not lazy on Python < 3.14: their dataclasses annotate fields
with llguidance / xgrammar types, evaluated at import, so both travel (xgrammar 0.2.8, 1.3 MB,
needs apache-tvm-ffi >= 0.1.11 where vLLM pins 0.1.10 for FlashInfer and FA4, neither used
here; the xgrammar releases that accept 0.1.10 are 45-48 MB). FlashInfer stays behind: vLLM's
attention selector treats its ImportError as 'not available' and picks FlashAttention 3 on
Hopper; its sampler is never used with processed log-probs (VLLM_USE_FLASHINFER_SAMPLER=0 too).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MIB = 2**20
CALL_LIMIT_BYTES = 64 * MIB      # working tree + carried paths, per call
MAX_PIECE_BYTES = 56 * MIB       # never more in one piece, whatever the project's size
SLACK_BYTES = 1 * MIB            # the SHA256 file, directories, the project growing a little
COMMAND_LIMIT = 2000             # characters of one device command
STAGE_DIR = '/tmp/pjx_stage'     # on the device: the payload being assembled
SITE_DIR = '/tmp/site'           # on the device: where the wheels are installed
PAYLOAD = 'payload.tar.xz'
VLLM_WHEEL = 'vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl'
# The e2e warm starts, made here by `python -m pipelinerl_jax.bench.gpu
# --prepare_models=.gpu_carry/model_cache` and carried by the last call, so that the vllm
# section's `tiny` run finds its model instead of building it in its share of the time.
KIT_CARRY = '.gpu_carry'
DEFAULT_RUN = ('export VLLM_USE_FLASHINFER_SAMPLER=0; set -o pipefail; python3 -m '
               'pipelinerl_jax.bench.gpu --sections=vllm --budget_s=330 --out=$OUT/vllm.json '
               f'--model_cache={KIT_CARRY}/model_cache 2>&1 | tee $OUT/vllm.log')
CALL_TIMEOUT_S = 120             # a call that appends its piece
LAST_CALL_TIMEOUT_S = 540        # the last: append, check, unpack, install, run
PIP_PLATFORMS = ('manylinux_2_31_x86_64', 'manylinux_2_28_x86_64', 'manylinux_2_27_x86_64',
                 'manylinux_2_26_x86_64', 'manylinux_2_24_x86_64', 'manylinux_2_17_x86_64',
                 'manylinux2014_x86_64', 'manylinux1_x86_64')

# name==version -> (file, sha256). vLLM first; then what its offline path imports that the
# image lacks, with their own requirements that the image lacks too.
WHEELS = {
    'vllm==0.26.0': (VLLM_WHEEL,
                     'adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de'),
    'pydantic==2.13.4': ('pydantic-2.13.4-py3-none-any.whl',
                         '45a282cde31d808236fd7ea9d919b128653c8b38b393d1c4ab335c62924d9aba'),
    'pydantic-core==2.46.4': (
        'pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl',
        '926c9541b14b12b1681dca8a0b75feb510b06c6341b70a8e500c2fdcff837cce'),
    'annotated-types==0.7.0': ('annotated_types-0.7.0-py3-none-any.whl',
                               '1f02e8b43a8fbbc3f3e0d4f0f4bfc8131bcb4eebe8849b8e5c773f3a1c582a53'),
    'typing-inspection==0.4.2': (
        'typing_inspection-0.4.2-py3-none-any.whl',
        '4ed1cacbdc298c220f1bd249ed5287caa16f34d44ef4e9c3d0cbad5b521545e7'),
    'msgspec==0.21.1': (
        'msgspec-0.21.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.'
        'manylinux_2_28_x86_64.whl',
        '21995e74b5c598c2e004110ad66ec7f1b8c20bf2bcf3b2de8fd9a3094422d3ff'),
    'pyzmq==27.1.0': ('pyzmq-27.1.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl',
                      '43ad9a73e3da1fab5b0e7e13402f0b2fb934ae1c876c51d0afff0e7c052eca31'),
    'cbor2==6.1.3': ('cbor2-6.1.3-cp312-cp312-manylinux_2_28_x86_64.whl',
                     '2226d32e102e375737656ad5d141ad8c6ae3e705e04e263f24756f0eb379c6c1'),
    'pybase64==1.4.3': (
        'pybase64-1.4.3-cp312-cp312-manylinux1_x86_64.manylinux2014_x86_64.'
        'manylinux_2_17_x86_64.manylinux_2_5_x86_64.whl',
        'bb632edfd132b3eaf90c39c89aa314beec4e946e210099b57d40311f704e11d4'),
    'cachetools==7.1.6': ('cachetools-7.1.6-py3-none-any.whl',
                          '2c12e255780330af28b91bb7fb96cce4c766f04e38396b9a24510190a5827096'),
    'openai==2.48.0': ('openai-2.48.0-py3-none-any.whl',
                       'c98df30aaaf93c51979f64d3e7c5b76464f8be0173368266229eb8fe6bd30f2c'),
    'jiter==0.16.0': ('jiter-0.16.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl',
                      '46add52f4ad47a08bfb1219f3e673da972191489a33016edefdb5ea55bfa8c48'),
    'distro==1.9.0': ('distro-1.9.0-py3-none-any.whl',
                      '7bffd925d65168f85027d8da9af6bddab658135b840670a223589bc0c8ef02b2'),
    'sniffio==1.3.1': ('sniffio-1.3.1-py3-none-any.whl',
                       '2f6da418d1f1e0fddd844478f41680e794e6051915791a034ff65e5f100525a2'),
    'openai-harmony==0.0.8': (
        'openai_harmony-0.0.8-cp38-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl',
        'c007d277218a50db8839e599ed78e0fffe5130f614c3f6d93ae257f282071a29'),
    'fastapi==0.136.3': ('fastapi-0.136.3-py3-none-any.whl',
                         '3d2a69bdf04b7e9f3afa292c3bc7a98816bbfafa10bc9b45f3f3700d2f761620'),
    'starlette==1.3.1': ('starlette-1.3.1-py3-none-any.whl',
                         'c7372aae11c3c3f26a42df7bd626cec2f47d03483d261d369516a615a53714c6'),
    'partial-json-parser==0.2.1.1.post7': (
        'partial_json_parser-0.2.1.1.post7-py3-none-any.whl',
        '145119e5eabcf80cbb13844a6b50a85c68bf99d376f8ed771e2a3c3b03e653ae'),
    'llguidance==1.7.6': ('llguidance-1.7.6-cp39-abi3-manylinux_2_31_x86_64.whl',
                          'ceec951d29a74309984e3be0fe7f5f56c1362434cd937abd517b259a60908b1e'),
    'xgrammar==0.2.8': (
        'xgrammar-0.2.8-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl',
        '4045b096735bb2523e0d874039a55994c1b390620d547c4a0d4f43b9a106177b'),
    # On the image, but of an unread version: pydantic 2.13 imports typing_extensions.Sentinel
    # (4.14 on); a newer typing_extensions serves older users unchanged.
    'typing-extensions==4.15.0': (
        'typing_extensions-4.15.0-py3-none-any.whl',
        'f0fa19c6845758ab08074a0cfa8b7aecb71c999ca73d62883bc25cc018c4e548'),
    'apache-tvm-ffi==0.1.11': (
        'apache_tvm_ffi-0.1.11-cp312-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl',
        '2843f084cdc94dedacd8b257a395a2b71b8a3dc7fc99711b148bf1d161983128'),
}

# Left out of vLLM's wheel (path prefixes), each with why an H100 serving a dense model does
# not load it; every one is imported optionally, if at all, where vLLM 0.26 uses it.
TRIM = (
    # FlashAttention 2, 291 MB unpacked: flash_attn_interface imports it in a try; on compute
    # capability 9.x vLLM picks FA3 (fa_utils.get_flash_attn_version).
    'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so',
    # MoE kernels: Platform.import_kernels imports them under suppress(ImportError).
    'vllm/_moe_C_stable_libtorch.abi3.so',
    # The Rust front end of `vllm serve` (envs.VLLM_RUST_FRONTEND_PATH), an executable.
    'vllm/vllm-rs',
    # DeepGEMM (FP8, found by find_spec) and SM100 (Blackwell) attention sources.
    'vllm/third_party/deep_gemm/',
    'vllm/third_party/fmha_sm100/',
)


def fail(message: str) -> None:
  raise SystemExit(f'tools/gpu_stage.py: {message}')


def sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def check_sha256(path: pathlib.Path, expected: str) -> None:
  got = sha256(path)
  if got != expected:
    fail(f'{path.name}: sha256 {got}, expected {expected} (a different file than the one '
         'pinned; delete it and download again)')


def download(dest: pathlib.Path) -> list[pathlib.Path]:
  """The pinned wheels into `dest` (kept across runs), each checked; then the kit's own."""
  dest.mkdir(parents=True, exist_ok=True)
  missing = [spec for spec, (name, _) in WHEELS.items() if not (dest / name).exists()]
  if missing:
    cmd = [sys.executable, '-m', 'pip', 'download', '-q', '--no-deps', '--only-binary=:all:',
           '--python-version', '3.12', '--implementation', 'cp', '-d', str(dest)]
    for p in PIP_PLATFORMS:
      cmd += ['--platform', p]
    subprocess.run(cmd + missing, check=True)
  out = []
  for spec, (name, digest) in WHEELS.items():
    if not (dest / name).exists():
      fail(f'pip did not save {name} for {spec}')
    check_sha256(dest / name, digest)
    out.append(dest / name)
  kit = dest.parent / 'kit'
  subprocess.run(['bash', str(ROOT / 'tools' / 'gpu_wheels.sh'), str(kit)], check=True,
                 stdout=subprocess.DEVNULL)
  return out + sorted(kit.glob('*.whl'))


def trim_wheel(src: pathlib.Path, dst: pathlib.Path, drop: tuple[str, ...] = TRIM) -> dict:
  """`src` without the entries under `drop`, stored uncompressed, RECORD without their lines.
  Returns {'dropped': n, 'dropped_bytes': unpacked bytes left out}."""
  dropped, dropped_bytes = 0, 0
  with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, 'w', zipfile.ZIP_STORED) as zout:
    for info in zin.infolist():
      if info.filename.startswith(drop):
        dropped += 1
        dropped_bytes += info.file_size
        continue
      data = zin.read(info)
      if info.filename.endswith('.dist-info/RECORD'):
        lines = data.decode().splitlines(keepends=True)
        data = ''.join(l for l in lines if not l.split(',', 1)[0].startswith(drop)).encode()
      out = zipfile.ZipInfo(info.filename, info.date_time)
      out.external_attr = info.external_attr  # keeps the executable bits
      out.compress_type = zipfile.ZIP_STORED
      zout.writestr(out, data)
  return dict(dropped=dropped, dropped_bytes=dropped_bytes)


def pack(wheels: list[pathlib.Path], out: pathlib.Path) -> None:
  """One tar of `wheels/<name>`, xz-compressed (the `xz` program when present: two threads)."""
  raw = out.with_suffix('')  # payload.tar
  with tarfile.open(raw, 'w', format=tarfile.PAX_FORMAT) as tar:
    for w in sorted(wheels, key=lambda p: p.name):
      info = tar.gettarinfo(str(w), arcname=f'wheels/{w.name}')
      info.uid = info.gid = 0
      info.uname = info.gname = ''
      info.mtime = 0
      with open(w, 'rb') as f:
        tar.addfile(info, f)
  if shutil.which('xz'):
    subprocess.run(['xz', '-f', '-T2', '-6', str(raw)], check=True)
    os.replace(raw.with_name(raw.name + '.xz'), out)
  else:
    import lzma
    with open(raw, 'rb') as f, lzma.open(out, 'wb', preset=6) as g:
      shutil.copyfileobj(f, g, 1 << 20)
    raw.unlink()


def piece_sizes(payload_bytes: int, project_bytes: int, limit: int = CALL_LIMIT_BYTES,
                max_piece: int = MAX_PIECE_BYTES, slack: int = SLACK_BYTES) -> list[int]:
  """Sizes of the fewest pieces of a payload such that each, with the project beside it, fits
  one call; as equal as can be."""
  room = min(max_piece, limit - project_bytes - slack)
  if room <= 0:
    fail(f'the project alone ({project_bytes / MIB:.1f} MiB) leaves no room under the '
         f'{limit / MIB:.0f} MiB a call carries')
  n = max(1, math.ceil(payload_bytes / room))
  base, extra = divmod(payload_bytes, n)
  return [base + (i < extra) for i in range(n)]


def split(payload: pathlib.Path, out: pathlib.Path, sizes: list[int]) -> list[pathlib.Path]:
  """OUT/call<k>/part (and SHA256) for each size, in order; old call folders are removed."""
  for old in out.glob('call[0-9]*'):
    if old.is_dir():
      shutil.rmtree(old)
  dirs = []
  with open(payload, 'rb') as f:
    for k, size in enumerate(sizes, 1):
      d = out / f'call{k}'
      d.mkdir(parents=True)
      with open(d / 'part', 'wb') as g:
        left = size
        while left:
          block = f.read(min(left, 1 << 20))
          if not block:
            fail(f'{payload} is shorter than the pieces planned')
          g.write(block)
          left -= len(block)
      (d / 'SHA256').write_text(f'{sha256(d / "part")}  part\n')
      dirs.append(d)
    if f.read(1):
      fail(f'{payload} is longer than the pieces planned')
  return dirs


def join(dirs: list[pathlib.Path]) -> bytes:
  """The pieces put back together (what the device calls do with `cat`)."""
  return b''.join((d / 'part').read_bytes() for d in dirs)


def calls(dirs: list[str], sizes: list[int], payload_sha: str, run: str,
          stage: str = STAGE_DIR, site: str = SITE_DIR,
          last_carry: tuple[str, ...] = ()) -> list[dict]:
  """The device calls, [{'carry': [dir, ...], 'command': text, 'timeout_s': s}], for pieces in
  repo-relative `dirs` of `sizes` bytes: each appends its piece (checked) after checking that
  the payload holds exactly the pieces before it; the last checks the whole, installs and runs
  `run`, carrying `last_carry` too."""
  n, total = len(dirs), sum(sizes)
  out = []
  for k, (d, size) in enumerate(zip(dirs, sizes), 1):
    offset = sum(sizes[:k - 1])
    q = shlex.quote(d)
    if k == 1:
      head = f'S={stage}; rm -rf $S && mkdir -p $S'
    else:
      head = (f'S={stage}; H=$(stat -c%s $S/payload 2>/dev/null || echo 0); '
              f'[ "$H" = {offset} ] || {{ echo "stage: call {k}/{n} found $H bytes in '
              f'$S/payload, not the {offset} calls 1-{k - 1} left: the machine went back '
              f'between calls (idle > 30 s): start again at call 1"; exit 3; }}')
    body = (f'{head} && (cd {q} && sha256sum -c --quiet SHA256) && cat {q}/part >> $S/payload '
            f'&& echo "stage: call {k}/{n}: $(stat -c%s $S/payload) of {total} bytes"')
    if k == n:
      body += (f' && echo "{payload_sha}  $S/payload" | sha256sum -c --quiet && python3 -c '
               f'"import tarfile; tarfile.open(\'$S/payload\').extractall(\'$S/w\', '
               f'filter=\'data\')" && python3 -m pip install -q --no-index --no-deps '
               f'--no-compile --no-cache-dir --upgrade --target {site} $S/w/wheels/*.whl && '
               f'export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} && echo "stage: '
               f'installed in {site}" || exit 4; {run}')
    else:
      body += f' && echo "stage: make call {k + 1} now (the machine keeps /tmp ~30 s)"'
    out.append(dict(carry=[d, *last_carry] if k == n else [d], command=body,
                    timeout_s=LAST_CALL_TIMEOUT_S if k == n else CALL_TIMEOUT_S))
  return out


def project_bytes(root: pathlib.Path = ROOT) -> int:
  """What every call sends beside its carry: tracked and untracked-not-ignored files."""
  names = subprocess.run(['git', 'ls-files', '-co', '--exclude-standard', '-z'], cwd=root,
                         capture_output=True, check=True).stdout.split(b'\0')
  return sum((root / n.decode()).stat().st_size for n in names
             if n and (root / n.decode()).is_file())


def check_limits(plan: list[dict], sizes: list[int], project: int, last_extra: int = 0) -> None:
  """Every call within the per-call transfer limits; `last_extra`: the bytes of the last call's
  carry beside its piece."""
  for k, (c, size) in enumerate(zip(plan, sizes), 1):
    if len(c['command']) > COMMAND_LIMIT:
      fail(f'call {k} is {len(c["command"])} characters, over {COMMAND_LIMIT}: shorten --run')
    if k == len(plan):
      size += last_extra
    if size + project + SLACK_BYTES > CALL_LIMIT_BYTES:
      fail(f'call {k} would carry {(size + project) / MIB:.1f} MiB with the project, over '
           f'{CALL_LIMIT_BYTES / MIB:.0f}')


def estimate_seconds(sizes: list[int], run_s: float) -> dict[str, float]:
  """Device seconds, roughly: the machine's start (~30 s seen), a transfer per call (assumed
  ~4 MiB/s), the gap before each next call (counted while the machine is held), unpacking and
  installing (~40 s), the run."""
  transfer = sum((s + 5 * MIB) / (4 * MIB) for s in sizes)
  parts = dict(start=30.0, transfers=transfer, gaps=15.0 * (len(sizes) - 1), install=40.0,
               run=run_s)
  return dict(parts, total=sum(parts.values()))


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog='tools/gpu_stage.py', description=__doc__.split('\n\n')[0])
  p.add_argument('--out', default='.stage', help='folder for everything, git-ignored, relative '
                                                  'to the repository root')
  p.add_argument('--run', default=DEFAULT_RUN, help='the last call runs this after installing')
  p.add_argument('--run_s', type=float, default=360.0, help="the run's seconds, for the estimate")
  p.add_argument('--commands', action='store_true', help='only print the calls of the pieces '
                                                         'already built')
  args = p.parse_args(argv)
  out = (ROOT / args.out).resolve()
  if ROOT not in out.parents:
    fail(f'--out={args.out}: must lie inside the repository (the calls carry it from there)')
  rel = out.relative_to(ROOT).as_posix()
  if subprocess.run(['git', 'check-ignore', '-q', rel + '/'], cwd=ROOT).returncode != 0:
    fail(f'--out={args.out}: git does not ignore it, so every call would send all the pieces; '
         f'add /{rel}/ to .gitignore')
  manifest = out / 'calls.json'
  if args.commands:
    if not manifest.exists():
      fail(f'{manifest} does not exist: run without --commands first')
    state = json.loads(manifest.read_text())
    sizes, payload_sha = state['sizes'], state['payload_sha256']
  else:
    wheels = download(out / 'wheels')
    trimmed = out / 'trimmed' / VLLM_WHEEL
    trimmed.parent.mkdir(parents=True, exist_ok=True)
    trim = trim_wheel(wheels[0], trimmed)
    print(f'trimmed {VLLM_WHEEL}: {trim["dropped"]} entries, '
          f'{trim["dropped_bytes"] / MIB:.0f} MiB unpacked, left out', flush=True)
    payload = out / PAYLOAD
    pack([trimmed] + wheels[1:], payload)
    payload_sha = sha256(payload)
    sizes = piece_sizes(payload.stat().st_size, project_bytes())
    split(payload, out, sizes)
  dirs = [f'{rel}/call{k}' for k in range(1, len(sizes) + 1)]
  kit_carry = ROOT / KIT_CARRY
  if kit_carry.is_dir():
    last_carry = (KIT_CARRY,)
    last_extra = sum(f.stat().st_size for f in kit_carry.rglob('*') if f.is_file())
  else:
    print(f'note: {KIT_CARRY}/ is missing, so the last call carries no warm starts and the '
          "vllm section's tiny run builds its model on the GPU; make it first with python -m "
          f'pipelinerl_jax.bench.gpu --prepare_models={KIT_CARRY}/model_cache', flush=True)
    last_carry, last_extra = (), 0
  plan = calls(dirs, sizes, payload_sha, args.run, last_carry=last_carry)
  project = project_bytes()
  check_limits(plan, sizes, project, last_extra)
  estimate = estimate_seconds(sizes, args.run_s)
  manifest.write_text(json.dumps(dict(sizes=sizes, payload_sha256=payload_sha, calls=plan,
                                      project_bytes=project, estimate_s=estimate), indent=1))
  print(f'payload {sum(sizes) / MIB:.1f} MiB in {len(sizes)} pieces; project '
        f'{project / MIB:.1f} MiB travels with each call\n')
  for k, (c, size) in enumerate(zip(plan, sizes), 1):
    extra = last_extra if k == len(plan) else 0
    print(f'# call {k}/{len(plan)}: device run, carry={json.dumps(c["carry"])}, '
          f'{(size + extra + project) / MIB:.1f} MiB, {len(c["command"])} characters, '
          f'timeout_s={c["timeout_s"]}')
    print(c['command'] + '\n')
  print('estimated device seconds: ' + ', '.join(f'{k} {v:.0f}' for k, v in estimate.items()))
  print(f'(written to {manifest.relative_to(ROOT)})')
  return 0


if __name__ == '__main__':
  sys.exit(main())
