# syntax=docker/dockerfile:1
# metrale-worker image: one model on one GPU, served over gRPC.
#
#   docker build -t metrale-worker:0.1.0 .
#   docker run --gpus all -p 50051:50051 -p 9090:9090 -v /srv/models/Llama-3.2-1B:/model:ro \
#       metrale-worker:0.1.0 --model /model --metrics-port 9090
#
# The model is mounted at run time (never baked in). Two stages: `build` (CUDA devel image: nvcc
# and a C++ compiler) installs the package, generates the gRPC stubs and compiles the kernels to
# fatbins; `runtime` (CUDA runtime image: libraries only, no compiler) gets the virtualenv and the
# source tree with the compiled artefacts, and runs as uid 10001.
#
# The versions below are the ones the README's and bench/RESULTS.md's figures were measured with on the
# H200 (torch 2.11 + CUDA 13.0, cuda-bindings 13.3, grpcio 1.84, protobuf 7.36); override with --build-arg.
# WITH_TRANSFORMERS=1 adds transformers (the benchmarks' comparison and the tests' oracle; the worker does
# not import it).
ARG CUDA_VERSION=13.0.1
ARG UBUNTU_VERSION=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU_VERSION} AS build
# torch comes from the PyTorch index of the matching CUDA version.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG CUDA_PYTHON_VERSION=13.3.1
ARG GRPCIO_VERSION=1.84.0
ARG PROTOBUF_VERSION=7.36.2
ARG TRANSFORMERS_VERSION=5.17.0
ARG WITH_TRANSFORMERS=0
ARG XGRAMMAR_VERSION=0.2.9
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app

# Dependencies first, in a layer that survives source edits.
# The pins are constraints: pyproject.toml's dependencies stay the list of what is installed.
COPY pyproject.toml ./
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}" \
 && printf '%s\n' "torch==${TORCH_VERSION}" "cuda-python==${CUDA_PYTHON_VERSION}" \
        "cuda-bindings==${CUDA_PYTHON_VERSION}" "grpcio==${GRPCIO_VERSION}" \
        "grpcio-reflection==${GRPCIO_VERSION}" "grpcio-health-checking==${GRPCIO_VERSION}" \
        "protobuf==${PROTOBUF_VERSION}" > /tmp/constraints.txt \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install -c /tmp/constraints.txt -r /tmp/requirements.txt "setuptools>=69" "grpcio-tools==1.84.0" \
        "xgrammar==${XGRAMMAR_VERSION}" \
 && if [ "$WITH_TRANSFORMERS" = 1 ]; then pip install -c /tmp/constraints.txt "transformers==${TRANSFORMERS_VERSION}"; fi

COPY . .
# Editable install: the package runs from /app, beside kernels_cu/ and its compiled fatbins.
RUN python protos/generate.py \
 && pip install --no-deps --no-build-isolation -e . \
 && if [ -f engine/cuda/build.py ]; then python -m engine.cuda.build; fi \
 && pip uninstall -y grpcio-tools \
 && python -m compileall -q /app/worker /app/engine /app/metrale

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU_VERSION} AS runtime
LABEL org.opencontainers.image.title="metrale-worker" \
      org.opencontainers.image.description="gRPC model worker: one LLM on one GPU" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# The same python3 as the build stage (same Ubuntu release), so the copied virtualenv's links hold.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 metrale \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin metrale \
 && mkdir -p /var/cache/metrale \
 && chown 10001:10001 /var/cache/metrale
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
# No compiler reaches the runtime image.
RUN for c in gcc g++ cc c++ clang nvcc; do \
      if command -v "$c" >/dev/null; then echo "compiler $c found in the runtime image" >&2; exit 1; fi; \
    done
# METRALE_CACHE_DIR: built-in default model and run-time (NVRTC) kernels; Kubernetes mounts an emptyDir here.
ENV PATH=/opt/venv/bin:$PATH \
    METRALE_CACHE_DIR=/var/cache/metrale \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /app
# 50051: gRPC (--port); 9090: Prometheus metrics (--metrics-port).
EXPOSE 50051 9090
ENTRYPOINT ["metrale-worker", "serve"]
CMD ["--metrics-port", "9090"]
