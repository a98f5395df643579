#!/usr/bin/env bash
# Structured output under load, one call (issue 29): `xserv bench serve` (256 streaming clients, the standard
# workload) against one `xserv serve`, unconstrained and then every request constrained by one JSON schema
# (response_format json_schema), same workload, same server: the constrained / unconstrained output tok/s ratio.
#   bash tools/gpu_bench_structured.sh [MODEL_DIR] [SCHEMA_FILE]
set -u
source "$(dirname "$0")/gpu_env.sh"
m=${1:-/tmp/model-0.6b}
[ -d $m ] || python3 -m tools.make_test_model --preset 0.6b --out $m --no-progress >/dev/null
schema=${2:-$OUT/schema.json}
# an answer string the random model never closes: every request runs to its max_tokens, as unconstrained ones do
[ -f "$schema" ] || echo '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}' > "$schema"
python3 -m xserv serve --model $m --port 8012 --max-model-len 2048 --log-level warning > $OUT/serve.log 2>&1 &
sp=$!
python3 - <<'PY'
import time, httpx
for _ in range(300):
    try:
        if httpx.get("http://127.0.0.1:8012/health").status_code == 200:
            break
    except Exception:
        pass
    time.sleep(1)
PY
echo "=== unconstrained"; python3 -m xserv bench serve --url http://127.0.0.1:8012 --json $OUT/free.json 2>&1 | tail -4
echo "=== every request constrained by $(cat $schema)"
python3 -m xserv bench serve --url http://127.0.0.1:8012 --json-schema $schema --json $OUT/constrained.json 2>&1 | tail -5
kill -TERM $sp; wait $sp
python3 - "$OUT" <<'PY'
import json, sys
f = json.load(open(f"{sys.argv[1]}/free.json")); c = json.load(open(f"{sys.argv[1]}/constrained.json"))
print(f"constrained / unconstrained output tok/s: {c['output_tokens_per_s']:,.0f} / {f['output_tokens_per_s']:,.0f}"
      f" = {c['output_tokens_per_s'] / f['output_tokens_per_s']:.0%}")
PY
