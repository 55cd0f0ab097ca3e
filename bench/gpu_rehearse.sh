#!/usr/bin/env bash
# Rehearse the GPU machine's run here, on the CPU, before a device is lent: a virtual environment with the
# GPU image's Python and the versions it holds of what hype imports (/work/.library/device/KINDS.md), a
# copy of this checkout as the device gets it (tracked files and .whl/), then `bench/gpu_run.sh OUT --smoke`
# in it. A version the image holds that hype breaks on (torch 2.11 against the 2.15 developed on, pandas 3,
# transformers 5.17) then fails here, not in the device's few minutes. Needs PyPI (about 5 GiB, once).
#
#   bash bench/gpu_rehearse.sh [OUT]        # default /tmp/gpu-rehearsal; env VENV, PY312 override
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/gpu-rehearsal}
venv=${VENV:-/tmp/gpu-image-venv}
py=${PY312:-$(PYENV_VERSION=3.12.1 command -v python3.12 || true)}
[ -n "$py" ] || { echo "no python3.12 here (the GPU image's Python): set PY312" >&2; exit 2; }
ls .whl/hype-*.whl >/dev/null 2>&1 || { echo "no .whl/: run 'bash bench/gpu_wheels.sh' first" >&2; exit 2; }
if [ ! -x "$venv/bin/python3" ]; then
  PYENV_VERSION=3.12.1 "$py" -m venv "$venv"
  # the image's versions where KINDS.md gives them; the others as PyPI has them today
  "$venv/bin/pip" install -q torch==2.11.0 torchvision==0.26.0 numpy==2.5.2 transformers==5.17.0 \
    huggingface_hub==1.33.0 safetensors==0.8.0 timm pandas pyarrow pillow click pyyaml fsspec regex tqdm \
    requests pytest tokenizers sentencepiece scipy scikit-learn psutil
fi
repo=$(mktemp -d /tmp/gpu-rehearsal-repo.XXXXXX)
trap 'rm -rf "$repo"' EXIT
# what the device gets: tracked files and untracked ones git does not ignore, as they are in the work tree
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - | tar -x -C "$repo"
cp -r .whl "$repo"/
rm -rf /tmp/site  # gpu_run.sh installs the wheels there, as on the device
cd "$repo"
PATH="$venv/bin:$PATH" bash bench/gpu_run.sh "$out" --smoke
