#!/usr/bin/env bash
# System packages the integration tests use: Debian's `prometheus` server (the metrics test starts
# one on 127.0.0.1). Installs only what is missing; needs root and apt.
set -euo pipefail
command -v prometheus >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "prometheus is missing: install Debian's 'prometheus' package (needs root and apt)" >&2
  exit 1
fi
echo "== installing Debian's prometheus package"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package may start a system service; the tests start their own server on their own port.
command -v systemctl >/dev/null 2>&1 && systemctl disable --now prometheus >/dev/null 2>&1 || true
prometheus --version 2>&1 | head -1
