#!/usr/bin/env bash
# CI: the lowest dependency versions pyproject.toml allows. A fresh venv gets every direct dependency (core, server
# and dev extras) at its floor (uv's --resolution lowest-direct; the packages they pull in at their newest), the
# script checks that each floor was really installed (a floor no install can reach says nothing), then runs the
# part of the suite that touches those packages on the CPU: the library, structured output, the server and its
# clients, the tokenizer, model load, the kernel compiler (NVRTC, nvJitLink, cuda-core). Then the same structured-
# output tests with llguidance 1.6.1, what pip installs on a glibc 2.28 system (llguidance 1.7+ ship only
# manylinux_2_31 wheels). Needs Python 3.11+ and PyPI; exits non-zero on any failure.
#   PYTHON=python3.11 bash .ci/lowest_versions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
# uv pinned: the resolution is deterministic only for one resolver.
uv_version=0.13.10
tests=(tests/engine/test_llm.py tests/engine/test_structured.py tests/server/test_server.py tests/server/test_server_structured.py
       tests/server/test_server_tools.py tests/test_tokenizer.py tests/models/test_checkpoint.py tests/runtime/test_compile_all.py
       tests/test_progress.py)
glibc_228_llguidance=1.6.1

work=$(mktemp -d "${TMPDIR:-/tmp}/xserv-lowest.XXXXXX")
trap 'rm -rf "$work"' EXIT
t0=$SECONDS

"$python" -m venv "$work/uv"
"$work/uv/bin/python" -m pip install -q --disable-pip-version-check "uv==$uv_version"
uv=("$work/uv/bin/uv")
"${uv[@]}" venv -q --python "$python" "$work/venv"
py="$work/venv/bin/python"
"${uv[@]}" pip install -q --python "$py" --resolution lowest-direct -e ".[dev]"
echo "lowest: installed in $((SECONDS - t0)) s:"
"${uv[@]}" pip freeze -q --python "$py" | grep -v '^-e ' | tr '\n' ' '
echo

"$py" - <<'EOF'
import sys
import tomllib
from importlib.metadata import version

from packaging.requirements import Requirement
from packaging.version import Version

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
wrong = []
for line in project["dependencies"] + extras["server"] + extras["dev"]:
    req = Requirement(line)
    if req.name == "xserv" or (req.marker is not None and not req.marker.evaluate()):
        continue
    floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
    if not floors:
        wrong.append(f"{line}: no >= floor")
        continue
    floor, got = floors[0], Version(version(req.name))
    n = len(floor.release)  # ">=13.0" is met by 13.0.48: the installed release begins with the floor's
    if (got.release + (0,) * n)[:n] != floor.release:
        wrong.append(f"{req.name}: floor {floor}, installed {got} (raise the floor to what installs)")
if wrong:
    sys.exit("lowest: floors not installed:\n  " + "\n  ".join(wrong))
print("lowest: every floor installed")
EOF

pytest=("$py" -m pytest -q -p no:cacheprovider -n auto --dist loadfile --no-loadscope-reorder)
"${pytest[@]}" "${tests[@]}"
"${uv[@]}" pip install -q --python "$py" "llguidance==$glibc_228_llguidance"
echo "lowest: structured output with llguidance $glibc_228_llguidance"
"${pytest[@]}" tests/engine/test_structured.py tests/server/test_server_structured.py
echo "lowest: passed in $((SECONDS - t0)) s"
