# The detection service with its model repository baked in (models/: objects, faces and shapes, each in a worker of
# its own, each worker inside its cap):
#   docker build -t gpu-share-detect .
#   docker run --gpus all -e DETECT_GPU_MEMORY=4GiB -p 8001:8000 gpu-share-detect
# Every setting comes from DETECT_* variables over config/default.toml; -e DETECT_MODEL=models/shapes serves
# that one model alone; compose.yaml runs two containers.
# The base image carries the pinned TensorFlow (pyproject.toml: tensorflow>=2.21,<2.22) with CUDA. It is an
# argument only so that the tests can build this same file on a local Debian base with TensorFlow on the CPU
# (scripts/docker-test-base: no registry is reachable there); leave it as it is.
ARG BASE_IMAGE=tensorflow/tensorflow:2.21.0-gpu
#checkov:skip=CKV_DOCKER_7:the base image is an ARG whose default is pinned, tensorflow/tensorflow:2.21.0-gpu
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TF_CPP_MIN_LOG_LEVEL=2 \
    MPLCONFIGDIR=/tmp/matplotlib \
    DETECT_HOST=0.0.0.0 \
    DETECT_PORT=8000 \
    DETECT_GRPC_PORT=8001

WORKDIR /srv/detect

# The dependencies alone first, from pyproject.toml, so a code change does not reinstall them; TensorFlow
# is already the base image's. The project needs Python 3.11 or later: fail here rather than at boot.
# PIP_BREAK_SYSTEM_PACKAGES: the image's Python is the system one, and this container is its only user. The
# TensorFlow image's pip installs as root without it; Debian 12's (PEP 668) refuses to without it.
COPY pyproject.toml /tmp/detect/
RUN python3 -c "import sys; sys.exit(0 if sys.version_info >= (3, 11) else 'Python 3.11+ needed, the image has ' + sys.version)" \
    && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/detect/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/detect/requirements.txt \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir -r /tmp/detect/requirements.txt \
    && rm -rf /tmp/detect

COPY app/ app/
COPY config/ config/
COPY models/ models/

RUN groupadd --system --gid 10001 detect \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /srv/detect --shell /usr/sbin/nologin detect
USER 10001:10001

# HTTP, and gRPC (KServe v2, TF Serving, grpc.health.v1, reflection): Triton's pair. The server's own gRPC
# default is off (one host, several instances); a container has a network of its own, so it names 8001 above.
EXPOSE 8000 8001
# Twisted drains on SIGTERM (shutdown_grace_s, 20 s): give `docker stop` more, e.g. -t 30.
STOPSIGNAL SIGTERM
# Liveness only (/readyz says when the models are loaded and warm); Python's stdlib, no curl in the image.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('DETECT_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["python3", "-m", "app"]
CMD ["serve"]
