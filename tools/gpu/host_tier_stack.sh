#!/usr/bin/env bash
# The host tier on one GPU (issue 19), in one call of the device machine: first D's move and P's mapped pull
# through kvferry's own classes without engines (tools/gpu/host_tier_copies.py), then the whole stack with a host
# pool on the decode engine and the host arm beside reuse and off (tools/gpu/stack_conversation.py):
#   bash .gpu-carry/device.sh run tools/gpu/host_tier_stack.sh $OUT [stack_conversation.py args...]
# Environment as the GPU stack's (KVFERRY_* settings of kvferry up), plus the pool: KVFERRY_HOST_POOL_BLOCKS
# (default 8192 slots, 18 GiB of Qwen3-8B KV: room for every arm's last turns, so no move waits for an
# eviction's grace) and KVFERRY_DEMOTE_AFTER_SECONDS (default 3, shorter than the host arm's --host-gap-s).
# ARGS after the defaults (a later --arms wins). OUT gets copies.json and what tools/gpu/gpu_stack.sh writes
# (8 files in all).
set -uo pipefail
out=${1:?usage: tools/gpu/host_tier_stack.sh OUT [ARGS...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export KVFERRY_HOST_POOL_BLOCKS=${KVFERRY_HOST_POOL_BLOCKS:-8192}
export KVFERRY_DEMOTE_AFTER_SECONDS=${KVFERRY_DEMOTE_AFTER_SECONDS:-3}
timeout "${COPIES_LIMIT_S:-120}" python3 tools/gpu/host_tier_copies.py --out "$out/copies.json"
bash tools/gpu/gpu_stack.sh "$out" --arms reuse off host "$@"
