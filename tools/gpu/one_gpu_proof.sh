#!/usr/bin/env bash
# The pull proof with both engines on one GPU (tools/gpu/vllm_pull_proof.py --gpus 1), with what it needs
# recorded beside it. Run from the repository root with vLLM 0.25 + nixl-cu13 (+ grpcio) on PYTHONPATH
# (tools/gpu/device_carry.sh run does that on the device machine):
#   tools/gpu/one_gpu_proof.sh OUT [vllm_pull_proof.py args...]
# OUT gets at most 8 files, no folders (what the device machine sends back): env.txt, proof.md, proof.json,
# the engines' logs (gzip) and their kvferry events.
set -uo pipefail
out=${1:?usage: tools/gpu/one_gpu_proof.sh OUT [ARGS...]}
shift
mkdir -p "$out"
work=/tmp/kvferry-proof
rm -rf "$work"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import torch, vllm, nixl, grpc; print("torch", torch.__version__, "vllm", vllm.__version__,
    "grpcio", grpc.__version__, "gpus", torch.cuda.device_count())'
  env | grep -E '^(UCX_|NIXL_)' || true
  echo "args: --gpus 1 $*"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
timeout "${PROOF_LIMIT_S:-540}" python3 tools/gpu/vllm_pull_proof.py --device cuda --gpus 1 --out "$work" "$@"
status=$?
for f in proof.md proof.json; do [ -f "$work/$f" ] && cp "$work/$f" "$out/"; done
for role in prefill decode; do
  [ -f "$work/$role.log" ] || continue
  grep -F '"kv pull"' "$work/$role.log" >"$out/$role-kvferry-events.jsonl" || true
  gzip -c "$work/$role.log" >"$out/$role.log.gz"
done
[ -f "$work/proof.md" ] || { [ -f "$work/proof.jsonl" ] && cp "$work/proof.jsonl" "$out/"; }
exit $status
