"""What the benchmarks share: parsing MIN:MAX ranges, naming the device, writing the JSON result."""
from __future__ import annotations

import json
import platform
import sys

import numpy as np


def length_range(text: str) -> tuple[int, int]:
    """'100:1024' -> (100, 1024); '512' -> (512, 512)."""
    import argparse

    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def add_workload_arguments(g) -> None:
    """The standard workload's options, shared by `bench throughput` and `bench serve` (the request count is
    each benchmark's own)."""
    g.add_argument("--input-len", type=length_range, default=(100, 1024), metavar="MIN:MAX",
                   help="prompt length range, uniform (default 100:1024)")
    g.add_argument("--output-len", type=length_range, default=(100, 1024), metavar="MIN:MAX",
                   help="output length range, uniform; EOS is ignored (default 100:1024)")
    g.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (default 0.6)")
    g.add_argument("--top-p", type=float, default=1.0, help="(default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="(default 0 = off)")
    g.add_argument("--seed", type=int, default=0, help="seeds the workload and the sampling (default 0)")
    g.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")


def device_name(device: str) -> str:
    if device == "cuda":
        from ..runtime import get_device

        return get_device().name
    return f"cpu ({platform.processor() or platform.machine()})"


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}", file=sys.stderr)


def measure_ceilings() -> dict:
    """The device's copy bandwidth (bytes read + written per second, 1 GiB device-to-device copies) and bf16 GEMM
    rate (8192^3 through the same cuBLASLt path the model uses), measured now. The driver's copy is used rather
    than the harness's copy kernel (tools/_bench_util.py): on the H200 it reads 4.27 TB/s against 3.94, the
    stricter ceiling for a limit."""
    from cuda.bindings import driver

    from ..ops.linear import linear
    from ..runtime import check_driver, get_device
    from ..runtime.timing import EventTimer
    from ..tensor import Tensor, bfloat16

    nbytes = 1 << 30
    src, dst = Tensor.empty((nbytes,), "uint8", "cuda"), Tensor.empty((nbytes,), "uint8", "cuda")
    stream = get_device().stream_handle
    timer = EventTimer()

    def copy():
        check_driver(driver.cuMemcpyDtoDAsync(dst.ptr, src.ptr, nbytes, stream), "cuMemcpyDtoDAsync")

    copy()
    copy_s = min(timer.time_ms(copy, 5) for _ in range(3)) / 1e3
    n = 8192
    a, w = Tensor.zeros((n, n), bfloat16, "cuda"), Tensor.zeros((n, n), bfloat16, "cuda")
    out = Tensor.empty((n, n), bfloat16, "cuda")
    linear(a, w, out=out)
    gemm_s = min(timer.time_ms(lambda: linear(a, w, out=out), 5) for _ in range(3)) / 1e3
    return {"copy_bytes_per_s": 2 * nbytes / copy_s, "gemm_flops_per_s": 2 * n**3 / gemm_s}


def workload_limit(model, prompt_lens, output_lens, ceilings: dict) -> dict:
    """The physical limit of generating `output_lens[i]` tokens after prompts of `prompt_lens[i]` tokens, all
    batched together: every decode step reads the weights once and every live sequence's K/V at the copy
    bandwidth; prefill runs its GEMM and attention FLOPs at the measured GEMM rate."""
    c = model.config
    weight_bytes = sum(t.nbytes for t in model.weight_tensors())
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2  # bf16 K and V
    embed = c.vocab_size * c.hidden_size
    params = weight_bytes // 2
    layer_params = params - embed * (1 if c.tie_word_embeddings else 2)
    prompts = np.asarray(prompt_lens, np.float64)
    outs = np.asarray(output_lens, np.int64)
    attn_flops = 2 * 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * np.sum(prompts**2) / 2
    prefill_flops = 2 * layer_params * prompts.sum() + 2 * embed * len(prompts) + attn_flops
    prefill_s = prefill_flops / ceilings["gemm_flops_per_s"]
    # decode step s (1..max-1) runs every sequence that still wants a token; it reads the cached K/V of
    # prompt + s tokens for each
    order = np.sort(outs)
    decode_bytes = 0.0
    for s in range(1, int(order[-1])):
        live = outs > s
        decode_bytes += weight_bytes + kv_per_token * float(np.sum(prompts[live] + s))
    decode_s = decode_bytes / ceilings["copy_bytes_per_s"]
    total = prefill_s + decode_s
    return {"limit_s": total, "prefill_s": prefill_s, "decode_s": decode_s,
            "limit_output_tokens_per_s": float(outs.sum()) / total}
