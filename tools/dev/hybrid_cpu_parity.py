"""The hybrid model on xserv's NumPy backend against transformers float32 and bf16 on the CPU (a machine with torch
and transformers >= 5 but no GPU): tests/models/test_qwen3_5_gpu.py's comparison, on the tiny config with Qwen3.5's
head shapes in the text-only layout, at N positions (default 600): one prefill, chunks with the state carried, and
200 decode steps.

    PYTHONPATH=. python tools/dev/hybrid_cpu_parity.py [N]
"""
import sys, time
sys.path[:0] = ["tests", "tests/models"]
import numpy as np, torch, transformers
from test_qwen3_5_model import TEXT
from qwen3_5_reference import write_random_folder
from qwen3_reference import rel_err_rows
from xserv.engine.batch import SeqChunk, make_batch
from xserv.engine.kv_cache import KVCache, KVCacheSpec
from xserv.engine.state_cache import StateCache
from xserv.models.registry import load_model

N = int(sys.argv[1]) if len(sys.argv) > 1 else 600
import tempfile
folder = write_random_folder(tempfile.mkdtemp() + "/text", TEXT, layout="qwen3_5_text", bf16_values=True)
ids = list(np.random.default_rng(0).integers(0, TEXT["vocab_size"], N))
def hf(dtype):
    m = transformers.Qwen3_5ForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float().numpy().astype(np.float64)
exact = hf(torch.float32); bf = rel_err_rows(hf(torch.bfloat16), exact)
model = load_model(folder, "cpu", progress=False, max_positions=2048)
def ours(pieces):
    kv = KVCache(KVCacheSpec(*model.kv_layout, 16), N // 16 + 2, "cpu", model.dtype); kv.state = StateCache(model.state_layout, 2, "cpu")
    out, s = [], 0
    for n in pieces:
        out.append(model.forward(make_batch([SeqChunk(ids[s:s+n], s, list(range(N // 16 + 1)), "all", 1)], 16, "cpu"), kv).numpy().astype(np.float64)); s += n
    return np.concatenate(out)
print(f"transformers bf16 vs fp32: mean {bf.mean():.2e} max {bf.max():.2e}")
for name, pieces in (("one prefill", [N]), ("chunks", [1, 63, 64, 65, N - 193]), ("token by token (first 200)", [1] * 200)):
    t = time.time(); o = ours(pieces); e = rel_err_rows(o, exact[:len(o)]); r = bf[:len(o)]
    print(f"xserv cpu {name}: mean {e.mean():.2e} max {e.max():.2e} (bf16 run mean {r.mean():.2e} max {r.max():.2e}); "
          f"argmax agree {np.mean(o.argmax(1) == exact[:len(o)].argmax(1)):.3f}  [{time.time()-t:.0f}s]")
