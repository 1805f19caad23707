#!/usr/bin/env bash
# Here, from the repository root: packs HEAD's code (the package without its shipped model folders, patches/, every
# test, since a test module may import another, benchmarks/*.sh and the scripts of benchmarks/engine and
# benchmarks/qwen36) into .gpu/snap.tar.xz (ignored), a few hundred kB. A device call carries .gpu and unpacks it beside the shipped
# models of the tree it was sent, so the code it runs is exactly HEAD's whatever the working tree holds, and the tree
# plus the carry stays under the device's 64 MiB:
#   run(carry=[".gpu"], command='bash .gpu/unpack.sh && cd /tmp/snap && bash benchmarks/engine/gpu_token_graph.sh')
# With OLD=<commit>, that commit's psr_hf/ and patches/ also travel (.gpu/old.tar.xz) and unpack into /tmp/snap/_old,
# the build a refactor is compared with (benchmarks/engine/gpu_house_round3.sh).
set -euo pipefail
commit=$(git rev-parse HEAD)
[ $# -eq 0 ] || { echo "device_snapshot: takes no arguments (every test travels, about 240 kB)" >&2; exit 2; }
tests=(tests)
mkdir -p .gpu
files=$( { git ls-tree -r --name-only "$commit" -- psr_hf patches pyproject.toml tests/conftest.py tests/slow_tests.txt \
             "${tests[@]}" | grep -v '^psr_hf/assets/tiny_moe/\|^psr_hf/assets/olmoe_routing/'
           git ls-tree -r --name-only "$commit" -- benchmarks | grep '^benchmarks/[^/]*\.sh$\|^benchmarks/\(engine\|qwen36\)/[^/]*\.\(py\|sh\)$'; } \
         | sort -u)
git archive --format=tar "$commit" $files | xz -6 > .gpu/snap.tar.xz
rm -f .gpu/old.tar.xz
if [ -n "${OLD:-}" ]; then
  git archive --format=tar "$OLD" $(git ls-tree -r --name-only "$OLD" -- psr_hf patches \
      | grep -v '^psr_hf/assets/tiny_moe/\|^psr_hf/assets/olmoe_routing/') | xz -6 > .gpu/old.tar.xz
  git rev-parse "$OLD" > .gpu/old_commit
fi
cat > .gpu/unpack.sh <<'UNPACK'
# On the device, from the sent tree's root: HEAD's code in /tmp/snap, with the shipped models of the sent tree.
set -e
rm -rf /tmp/snap && mkdir -p /tmp/snap && tar xJf .gpu/snap.tar.xz -C /tmp/snap
for d in tiny_moe olmoe_routing; do rm -rf "/tmp/snap/psr_hf/assets/$d"; cp -r "psr_hf/assets/$d" /tmp/snap/psr_hf/assets/; done
if [ -f .gpu/old.tar.xz ]; then
  mkdir -p /tmp/snap/_old && tar xJf .gpu/old.tar.xz -C /tmp/snap/_old
  for d in tiny_moe olmoe_routing; do rm -rf "/tmp/snap/_old/psr_hf/assets/$d"; ln -sfn "/tmp/snap/psr_hf/assets/$d" "/tmp/snap/_old/psr_hf/assets/$d"; done
  ln -sfn ../patches /tmp/snap/_old/psr_hf/patches
fi
UNPACK
echo "$commit" > .gpu/commit
echo "device_snapshot: $(du -h .gpu/snap.tar.xz | cut -f1) of $commit's code in .gpu/snap.tar.xz (carry .gpu; run bash .gpu/unpack.sh there)"
[ -z "${OLD:-}" ] || echo "device_snapshot: $(du -h .gpu/old.tar.xz | cut -f1) of $OLD's psr_hf/ and patches/ in .gpu/old.tar.xz (unpacked to /tmp/snap/_old)"
