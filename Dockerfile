# syntax=docker/dockerfile:1
# hype images for Ray clusters. Two targets:
#   docker build -t hype:gpu --target gpu .   # NVIDIA GPU nodes (CUDA 13 torch wheels from PyPI)
#   docker build -t hype:cpu --target cpu .   # CPU-only nodes and laptops (CPU torch, no CUDA wheels)
# The project is installed as README says (`pip install '.[...]'`: pip builds the wheel, presets inside,
# and installs it; not editable), without the dev extra and with the cluster extra, every package pinned
# by docker/constraints.txt. No weights or data are baked in: mount them
# (`docker run -v /data:/data hype:gpu score --pool /data/...`).

# ---------------------------------------------------------------------------------------------------
# GPU. torch 2.15 on PyPI bundles the CUDA 13.2 runtime, cuDNN and NCCL as pip wheels, so the base only
# supplies the NVIDIA container environment (driver >= 580 on the host); Python is Ubuntu 24.04's 3.12.
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04 AS gpu-builder
# Distribution packages follow the pinned base tag's archive (DL3008: apt pins break on every update).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY docker/constraints.txt docker/constraints.txt
COPY pyproject.toml README.md ./
COPY hype hype
COPY pipelines pipelines
COPY filters filters
COPY configs configs
# faiss: PyPI's GPU builds (faiss-gpu 1.15.1, faiss-gpu-cu12 1.14.1; checked 2026-11-27) are CUDA 12
# (a 135 MB wheel plus the nvidia-*-cu12 runtime beside torch's CUDA 13), so the image keeps faiss-cpu and
# c_IN's k-means runs on the GPU through torch: `clusters.backend=torch` (clusters.gpu stays false).
RUN pip install -c docker/constraints.txt '.[s3,cluster]'

# ---------------------------------------------------------------------------------------------------
# CPU. torch and torchvision come from PyTorch's CPU index (same versions as the constraints: a `+cpu`
# build satisfies `torch==X`), everything else from PyPI.
FROM python:3.12-slim-bookworm AS cpu-builder
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY docker/constraints.txt docker/constraints.txt
# Only the two wheels from the CPU index (--no-deps): their dependencies, at the pinned versions, come
# from PyPI in the next step, which finds torch already satisfied and keeps the CPU build.
RUN pip install --no-deps --index-url https://download.pytorch.org/whl/cpu -c docker/constraints.txt \
    torch torchvision
COPY pyproject.toml README.md ./
COPY hype hype
COPY pipelines pipelines
COPY filters filters
COPY configs configs
RUN pip install -c docker/constraints.txt '.[s3,cluster]'

# ---------------------------------------------------------------------------------------------------
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04 AS gpu
# rsync: Ray's cluster launcher copies its bootstrap files into the container with `rsync -e docker exec`.
# Distribution packages follow the pinned base tag's archive (DL3008: apt pins break on every update).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 rsync \
    && rm -rf /var/lib/apt/lists/*
# Ubuntu 24.04 images ship a user `ubuntu` with uid 1000; hype takes that uid (files written to shared
# storage are then owned by the usual first user of the hosts).
RUN if id -u ubuntu >/dev/null 2>&1; then userdel ubuntu && rm -rf /home/ubuntu; fi \
    && useradd --create-home --uid 1000 --shell /bin/bash hype
COPY --from=gpu-builder /opt/venv /opt/venv
# Login shells (Ray runs its commands with `bash --login`) rebuild PATH from /etc/profile; keep the venv
# ($PATH must stay unexpanded: SC2016 is the point).
# hadolint ignore=SC2016
RUN echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/hype-venv.sh
# HOME must be in the image's environment: Ray reads it from `docker inspect` to place its files.
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/hype \
    PYTHONUNBUFFERED=1
# Numeric, so runtimes that check runAsNonRoot can verify it (DL3066): the user hype.
USER 1000:1000
WORKDIR /work
ENTRYPOINT ["hype"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------------
FROM python:3.12-slim-bookworm AS cpu
# Distribution packages follow the pinned base tag's archive (DL3008: apt pins break on every update).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends rsync \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 --shell /bin/bash hype
COPY --from=cpu-builder /opt/venv /opt/venv
# Debian's /etc/profile resets PATH in login shells (Ray's `bash --login`); keep the venv first
# ($PATH must stay unexpanded: SC2016 is the point).
# hadolint ignore=SC2016
RUN echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/hype-venv.sh
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/hype \
    PYTHONUNBUFFERED=1
# Numeric, so runtimes that check runAsNonRoot can verify it (DL3066): the user hype.
USER 1000:1000
WORKDIR /work
ENTRYPOINT ["hype"]
CMD ["--help"]
