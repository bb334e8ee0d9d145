# syntax=docker/dockerfile:1
# Two images from one file (compose.yaml builds both):
#   --target api     the API, ingest worker, beat and migrate: everything but the model stack (no torch)
#   --target worker  a model worker: torch's CUDA wheels from PyPI bring their own CUDA runtime, so the host
#                    needs only the NVIDIA driver and the container toolkit
# Dependencies are built in throwaway stages into /opt/vlmq (a venv) and copied into a slim runtime that runs
# as an unprivileged user. Base images are pinned to exact releases; rebuild to take their security fixes.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build-api
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY docker/requirements.py docker/requirements.py
# Requirements first, code second: a code change does not reinstall the dependencies.
RUN python -m venv /opt/vlmq \
 && python docker/requirements.py api > /tmp/requirements.txt \
 && /opt/vlmq/bin/pip install -r /tmp/requirements.txt
COPY api api
COPY cli cli
COPY common common
COPY worker worker
COPY migrations migrations
RUN /opt/vlmq/bin/pip install --no-deps . && /opt/vlmq/bin/vlmq --help > /dev/null

FROM ${PYTHON_IMAGE} AS build-worker
ARG TORCH_VERSION=2.13.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY docker/requirements.py docker/requirements.py
RUN python -m venv /opt/vlmq \
 && /opt/vlmq/bin/pip install "torch==${TORCH_VERSION}" \
 && python docker/requirements.py worker > /tmp/requirements.txt \
 && /opt/vlmq/bin/pip install -r /tmp/requirements.txt
COPY api api
COPY cli cli
COPY common common
COPY worker worker
COPY migrations migrations
RUN /opt/vlmq/bin/pip install --no-deps . && /opt/vlmq/bin/vlmq --help > /dev/null

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 10001 vlmq && useradd --uid 10001 --gid vlmq --create-home --shell /usr/sbin/nologin vlmq
ENV PATH=/opt/vlmq/bin:$PATH PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
WORKDIR /home/vlmq

FROM runtime AS api
COPY --from=build-api /opt/vlmq /opt/vlmq
USER vlmq
EXPOSE 8000
CMD ["vlmq", "api", "--host", "0.0.0.0", "--port", "8000"]

FROM runtime AS worker
COPY --from=build-worker /opt/vlmq /opt/vlmq
ENV HF_HOME=/home/vlmq/.cache/huggingface
# Created here, owned by vlmq, so a fresh named volume mounted on it is writable by the worker.
RUN install -d -o vlmq -g vlmq /home/vlmq/.cache /home/vlmq/.cache/huggingface
USER vlmq
EXPOSE 9100
CMD ["vlmq", "worker", "--no-ingest"]
