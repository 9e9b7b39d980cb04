#!/usr/bin/env bash
# The host tier's transports on one GPU (issue 19), no engines: tools/gpu/host_tier_rates.py (D's copy of a
# retention from GPU memory into a pinned host pool; P's NIXL READ of it from that pool and from D's KV cache,
# two processes on the same GPU as the one-GPU stack runs its engines). Needs torch (CUDA), numpy and nixl
# (+ nixl-cu13). Writes OUT/env.txt, summary.txt, host-tier.json and ucx-info.txt.
# On the device machine: bash .gpu-carry/device.sh run tools/gpu/host_tier.sh $OUT (tools/gpu/device_carry.sh).
set -uo pipefail
out=${1:?usage: host_tier.sh OUT}
export PYTHONUNBUFFERED=1
# As kvferry's GPU engines run (kvferry.stack.engine.GPU_UCX_ENV): two processes on one GPU need it.
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  python3 -c 'import sys, torch, numpy, nixl; print(sys.version.split()[0], torch.__version__, numpy.__version__)'
  python3 -m pip list 2>/dev/null | grep -i -E '^nixl'
} >"$out/env.txt" 2>&1
timeout 300 python3 tools/gpu/host_tier_rates.py --warmup 1 --reps 5 --out "$out/host-tier.json" 2>&1 |
  grep -v 'NIXL INFO' | tee "$out/summary.txt"
# UCX's older protocols (UCX_PROTO_ENABLE=n) for the direct READ from the pool: do they find a faster path?
echo "== UCX_PROTO_ENABLE=n" >>"$out/summary.txt"
UCX_PROTO_ENABLE=n timeout 120 python3 tools/gpu/host_tier_rates.py --tokens 16384 --warmup 1 --reps 2 \
  --out /tmp/host-tier-proto-n.json 2>&1 | grep -E '^pull' >>"$out/summary.txt"
# Which UCX protocols carry each pull (UCX's own report, one short run at 16k tokens).
UCX_PROTO_INFO=y timeout 150 python3 tools/gpu/host_tier_rates.py --tokens 16384 --warmup 0 --reps 1 \
  --out /tmp/host-tier-proto.json >"$out/ucx-info.txt" 2>&1
grep -A4 -E 'remote memory read' "$out/ucx-info.txt" | grep -E 'read|\| 0\.\.' | sort | uniq -c >>"$out/summary.txt"
