# torchpool daemon image, CPU build (docs/deploy.md has the CUDA variant).
#
#   docker build -t torchpool:cpu .
#   docker run --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 --shm-size 1g \
#       -v "$PWD/example_repository:/models:ro" torchpool:cpu
#
# Local clients in other containers share the socket directory
# (-v /run/torchpool:/run/torchpool) and run as uid or gid 10001; docs/deploy.md.
#
# PYTHON_IMAGE: any image with python3.11, `python` and `pip` on PATH and apt;
# deploy/image/python.Containerfile makes one from Debian's packages where no
# registry is reachable (scripts/test-image builds and tests the image so).
ARG PYTHON_IMAGE=python:3.11-slim

# --- build: the torchpool wheel with its C extensions (the runtime image has
# no compiler; without them client regions are refused and copies are slower)
FROM ${PYTHON_IMAGE} AS build
# python:3.11-slim has Python's headers; a base on Debian's python3 adds python3-dev
ARG BUILD_PACKAGES="gcc libc6-dev"
RUN apt-get update \
 && apt-get install -y --no-install-recommends ${BUILD_PACKAGES} \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY setup.cfg setup.py pyproject.toml README.md ./
COPY torchpool ./torchpool
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- runtime
FROM ${PYTHON_IMAGE}
# PyTorch's own index: the CPU wheel is ~200 MB where PyPI's default torch
# brings several GB of CUDA libraries. The CUDA variant changes this argument.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, alone, pinned by constraints.txt (the version the suite runs),
# so that [server]'s torch>=2.1,<3 is already satisfied and never resolved
COPY constraints.txt /tmp/constraints.txt
RUN pip install --index-url "${TORCH_INDEX_URL}" -c /tmp/constraints.txt torch
COPY --from=build /wheels /wheels
RUN pip install -c /tmp/constraints.txt "$(ls /wheels/torchpool-*.whl)[server]" \
 && rm -rf /wheels /tmp/constraints.txt

# A fixed numeric uid/gid: Kubernetes' runAsNonRoot can check it, and a client
# container sharing the socket runs as the same uid (the socket is mode 0660).
RUN groupadd --system --gid 10001 torchpool \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
            --shell /usr/sbin/nologin torchpool \
 && install -d -o 10001 -g 10001 -m 0770 /run/torchpool /models
USER 10001:10001

# 8000 HTTP/REST and 8001 gRPC (KServe v2, Triton's ports), 8002 metrics,
# 8555 the ZeroMQ protocol over tcp when it is given with CURVE keys
EXPOSE 8000 8001 8002 8555

# Triton's strict readiness: every model loaded. Slim images have no curl.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=2)"]

# HTTP/gRPC/metrics listen on every address, as in Triton's image (which ones
# the world reaches is the operator's choice of published ports). The ZeroMQ
# protocol, model control included, is not on tcp by default: an
# unauthenticated listener on every interface would be open to anyone who can
# reach it. Add it with CURVE keys (docs/deploy.md); 8555 is its port then.
# SIGTERM drains accepted requests for --grace-period (30 s) before exiting.
ENTRYPOINT ["torchpool", "serve"]
CMD ["--model-repository", "/models", \
     "--listen", "ipc:///run/torchpool/torchpool.sock", \
     "--http-port", "8000", "--http-host", "0.0.0.0", \
     "--grpc-port", "8001", "--grpc-host", "0.0.0.0", \
     "--metrics-port", "8002", "--metrics-host", "0.0.0.0"]
