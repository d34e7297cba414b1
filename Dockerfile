# syntax=docker/dockerfile:1.7
# The image the Helm chart runs: one image for the router and both pools (`cbserve router|prefill|decode`).
#   docker build -t ghcr.io/cbserve/cbserve:0.1.0 .
# The built-in `tiny` and `small` presets need no volume: their weights are generated into
# $CBSERVE_CACHE_DIR on first start, with no download.
#
# CUDA comes from the torch wheel's own nvidia-* packages; the CUDA base supplies a driver-
# compatible userland and matches what the NVIDIA container toolkit expects. Triton compiles its
# launcher stubs at run time, so the runtime stage keeps gcc and the Python headers.
#
# BASE_IMAGE may be any Debian or Ubuntu image with apt (CI builds on a debootstrapped Debian 12,
# `.ci/build_image.py`, with no registry and no daemon). Builds that must use the host's package
# sources and certificate authorities mount a pip configuration read-only and name it with
# --build-arg PIP_CONFIG_FILE=<path inside the build> (see docs/deploy.md); nothing of it stays in
# the image.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# What both stages need, installed once (one apt run, and the runtime stage starts from it):
# python3 (the interpreter the venv is built with), gcc + headers for Triton's JIT launcher,
# tini as PID 1 so SIGTERM reaches cbserve and compiler children are reaped.
FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc tini ca-certificates \
 && rm -rf /var/lib/apt/lists/*

FROM base AS build
# Pin torch to the version the project is tested with; set an index for another CUDA build
# (e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128). Empty: pip's own
# configuration decides (PyPI by default), so a mounted configuration's sources apply to torch too.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
# Unset unless given: pip then reads only its defaults.
ARG PIP_CONFIG_FILE
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/cbserve
ENV PATH=/opt/cbserve/bin:${PATH}
# torch first, in its own layer: it is most of the image and changes least often.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY wire/ wire/
COPY pod/ pod/
COPY cbserve/ cbserve/
COPY engine/ engine/
COPY kernels/ kernels/
COPY kvtransfer/ kvtransfer/
COPY prefill_pod/ prefill_pod/
COPY decode_pod/ decode_pod/
COPY router/ router/
COPY proto/ proto/
RUN pip install . && cbserve --help >/dev/null

FROM base AS runtime
# uid/gid 10001 match the chart's podSecurityContext (runAsUser/runAsGroup/fsGroup).
RUN groupadd --gid 10001 cbserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cbserve \
 && mkdir -p /var/cache/cbserve /models \
 && chown 10001:10001 /var/cache/cbserve
COPY --from=build /opt/cbserve /opt/cbserve
ENV PATH=/opt/cbserve/bin:${PATH} \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    CBSERVE_CACHE_DIR=/var/cache/cbserve \
    TRITON_CACHE_DIR=/var/cache/cbserve/triton
USER 10001:10001
# router HTTP, pod gRPC, pod metrics, KV TCPStore (nccl transport)
EXPOSE 8000 50051 9400 50061
ENTRYPOINT ["/usr/bin/tini", "--", "cbserve"]
CMD ["--help"]
