#!/usr/bin/env bash
# System packages the integration tests use: Debian's `prometheus` server (the metrics test starts
# one on 127.0.0.1) and `chromium` (the chat page's browser test drives it headless). Installs
# only what is missing; needs root and apt for that.
set -euo pipefail
missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
fc-list 2>/dev/null | grep -qi "noto sans cjk" || missing+=(fonts-noto-cjk)  # Chinese text in the chat page's screenshot
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "missing: ${missing[*]}: install Debian's packages of those names (needs root and apt)" >&2
  exit 1
fi
echo "== installing Debian's ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The prometheus package may start a system service; the tests start their own server on their
# own port.
command -v systemctl >/dev/null 2>&1 && systemctl disable --now prometheus >/dev/null 2>&1 || true
prometheus --version 2>&1 | head -1
chromium --version 2>/dev/null | head -1 || true
