#!/usr/bin/env bash
# Downloads the wheels that `python -m pipelinerl_jax.bench.gpu` needs and a bare GPU image
# lacks, for that image's Python (3.12, manylinux x86-64), into .whl/ (git-ignored), to carry to
# the GPU host with the project. Versions are the ones requirements.txt pins.
#
#   tools/gpu_wheels.sh [DEST]        # DEST defaults to .whl
#
# The image (see docs/gpu-kit.md) has JAX 0.11.2 on CUDA, flax, optax, orbax,
# torch, transformers, tokenizers, safetensors, absl-py, PyYAML, matplotlib and numpy; the kit's
# path imports nothing else but ml_collections (config.py, checkpoint.py). ml-collections needs
# absl-py and PyYAML, both on the image, so nothing else travels.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PACKAGES=(ml-collections)
LIMIT_BYTES=$((64 * 1024 * 1024))  # at most 64 MiB travels with the project per call

specs=()
for name in "${PACKAGES[@]}"; do
  spec=$(grep -i -E "^${name}==" requirements.txt | head -n 1 || true)
  if [[ -z "$spec" ]]; then
    echo "tools/gpu_wheels.sh: $name is not pinned in requirements.txt" >&2
    exit 1
  fi
  specs+=("$spec")
done

rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DEST" "${specs[@]}"

bytes=$(du -sb "$DEST" | cut -f1)
ls -l "$DEST"
echo "$DEST: $(ls "$DEST" | wc -l) wheels, $bytes bytes (carry limit $LIMIT_BYTES)"
if (( bytes > LIMIT_BYTES )); then
  echo "tools/gpu_wheels.sh: $DEST is over the 64 MiB that travels with a call" >&2
  exit 1
fi
