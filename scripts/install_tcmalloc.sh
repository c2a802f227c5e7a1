#!/usr/bin/env bash
# Best effort: Debian's libtcmalloc-minimal4, which `quantgate` preloads when present (quantgate/allocator.py).
# Never fails the setup: without it quantgate runs on glibc's malloc (slower prefill on some VMs).
set -u
ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
    || echo "install_tcmalloc: could not install libtcmalloc-minimal4; quantgate uses glibc's malloc" >&2
else
  echo "install_tcmalloc: libtcmalloc-minimal4 missing (apt-get install libtcmalloc-minimal4 makes prefill faster)" >&2
fi
exit 0
