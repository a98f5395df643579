#!/usr/bin/env bash
# Download the wheels the lent GPU machine's image lacks (nvmath-python for cuBLASLt, a cuda-core with the 1.x
# launch API) into .whl/, for tools/gpu_session.sh to install there (carry ".whl" with the device call).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info; grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl nvmath-python==1.0.0 cuda-core==1.2.2
ls -la .whl
