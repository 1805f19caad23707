#!/usr/bin/env bash
# The compilers' caches of a device call, kept for the next call: triton's kernels (~/.triton/cache) and inductor's
# (/tmp/torchinductor_<user>), which a fresh machine otherwise rebuilds first (most of a cuda test file's time there).
#   bash benchmarks/device_caches.sh save      # on the device, at the end of a call: $OUT/caches.tar.xz.part-* (15 MB
#                                               # parts, as a call returns at most 16 MB a file)
#   bash benchmarks/device_caches.sh restore   # on the device, first: unpacks .gpu_cache/caches.tar.xz.part-* if
#                                               # carried (put the returned parts in .gpu_cache/, carry it)
# The caches key every entry by its source, versions and device, so a stale one is not used, only recompiled.
set -euo pipefail
inductor=torchinductor_$(whoami)
case "${1:-}" in
  save)
    dirs=()
    [ -d "$HOME/.triton/cache" ] && dirs+=("$HOME/.triton/cache")
    [ -d "/tmp/$inductor" ] && dirs+=("/tmp/$inductor")
    [ ${#dirs[@]} -gt 0 ] || { echo "device_caches: nothing to save"; exit 0; }
    tar -cJf - --absolute-names "${dirs[@]}" | split -b 15M - "$OUT/caches.tar.xz.part-"
    ls -la "$OUT"/caches.tar.xz.part-* ;;
  restore)
    if ls .gpu_cache/caches.tar.xz.part-* > /dev/null 2>&1; then
      cat .gpu_cache/caches.tar.xz.part-* | tar -xJf - --absolute-names && echo "device_caches: restored"
    else
      echo "device_caches: none carried"
    fi ;;
  *) echo "usage: device_caches.sh save|restore" >&2; exit 2 ;;
esac
