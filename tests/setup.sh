#!/usr/bin/env bash
# Everything the tests need, made ready on a fresh Debian/Ubuntu machine; the README's test command runs it
# before pytest, and .ci/run runs that same command. Safe to run again: each step does only what is missing.
#   - Postgres at 127.0.0.1:5432 and Redis at 127.0.0.1:6379, started when down
#   - chromium (the status page test drives it headless) and docker-compose (validates compose.yaml, no daemon)
#     from apt when missing (as root, or through sudo)
#   - .venv with the CPU build of torch first (so nothing below pulls a CUDA one), then vlmq with its test extra;
#     installed again only when pyproject.toml changed
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else echo "tests/setup.sh: needs root (or sudo) for: $*" >&2; return 1
  fi
}

echo "== services" >&2
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  as_root mkdir -p /var/lib/redis /var/log/redis
  as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
for _ in $(seq 1 60); do
  pg_isready -q -h 127.0.0.1 -p 5432 && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break
  sleep 1
done
pg_isready -h 127.0.0.1 -p 5432 >&2
redis-cli -h 127.0.0.1 -p 6379 ping >&2

echo "== system packages" >&2
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v docker-compose >/dev/null 2>&1 || missing="$missing docker-compose"
if [ -n "$missing" ]; then
  echo "installing$missing" >&2
  as_root apt-get update -q
  # shellcheck disable=SC2086
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing
fi

echo "== python environment" >&2
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# The CPU wheel first, so nothing below can pull a CUDA build of torch.
installed() { .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
installed torch || .venv/bin/pip install -q torch==2.13.0
stamp=.venv/.vlmq-test-extra
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  .venv/bin/pip install -q -e ".[test]"
  echo "$wanted" >"$stamp"
fi
if installed torchvision; then
  echo "torchvision must not be installed" >&2
  exit 1
fi
.venv/bin/python -c "from importlib.metadata import version as v; print('torch', v('torch'), 'transformers', \
v('transformers'))" >&2
