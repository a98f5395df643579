#!/usr/bin/env bash
# Download the wheels the lent GPU machine's image lacks (nvmath-python for cuBLASLt, a cuda-core with the 1.x
# launch API, the HTTP server's stack) into .whl/, for tools/gpu_session.sh to install there (carry ".whl" with the device call).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info; grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PLATFORM="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download --no-deps $PLATFORM -d .whl nvmath-python==1.0.0 cuda-core==1.2.2
# `xserv serve` and its tests (the server extra + openai/httpx from dev), with every dependency: the image has
# no network. Pinned to the versions the CPU tests ran with. httptools + uvloop: uvicorn uses them when present
# (an SSE chunk costs ~26 us in uvicorn instead of ~160 us with h11, measured on the CPU with a fake engine).
python3 -m pip download $PLATFORM -d .whl fastapi==0.165.0 uvicorn==0.54.0 httptools==0.9.0 uvloop==0.23.0 \
  openai==3.54.0 httpx==0.28.1
# Structured output (a core dependency: one abi3 wheel, no dependencies) and jsonschema for its tests.
python3 -m pip download $PLATFORM -d .whl llguidance==1.9.1 jsonschema==4.26.0
# Tensor parallelism (the multi-gpu extra): nccl4py and cuda-pathfinder; the image's PyTorch brings libnccl.so.2.
python3 -m pip download --no-deps $PLATFORM -d .whl nccl4py==0.6.0 cuda-pathfinder==1.9.1
ls -la .whl
