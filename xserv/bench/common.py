"""What the benchmarks share: parsing MIN:MAX ranges, naming the device, progress lines off a terminal, writing the
JSON result."""
from __future__ import annotations

import json
import platform
import sys
import time

import numpy as np

from ..ops.moe import expected_touched_experts


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


def add_workload_arguments(g, cpu_lengths: str | None = None) -> None:
    """The standard workload's options, shared by `bench throughput` and `bench serve` (the request count is
    each benchmark's own). cpu_lengths: the length ranges' default on the CPU, for a benchmark that scales its
    workload to the device (the options then default to None, which it resolves once the device is known)."""
    on_cpu = f" on a GPU, {cpu_lengths} on the CPU" if cpu_lengths else ""
    default = None if cpu_lengths else (100, 1024)
    g.add_argument("--input-len", type=length_range, default=default, metavar="MIN:MAX",
                   help=f"prompt length range, uniform (default 100:1024{on_cpu})")
    g.add_argument("--output-len", type=length_range, default=default, metavar="MIN:MAX",
                   help=f"output length range, uniform; EOS is ignored (default 100:1024{on_cpu})")
    g.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (default 0.6)")
    g.add_argument("--top-p", type=float, default=1.0, help="(default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="(default 0 = off)")
    g.add_argument("--seed", type=int, default=0, help="seeds the workload and the sampling (default 0)")
    g.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")


PROGRESS_FIRST_S = 2.0  # the first line soon: its rate and time left are the run's expected length
PROGRESS_EVERY_S = 10.0


class ProgressLines:
    """Progress where a tqdm bar would not do: on a stderr that is not a terminal (a log file, a pipe), whose
    carriage returns would pile up as half lines. A whole line (count, rate, time left) PROGRESS_FIRST_S seconds
    in, then every PROGRESS_EVERY_S seconds, and one at the end; update(n) and close() as a tqdm bar."""

    def __init__(self, total: int, label: str, unit: str):
        self.total, self.label, self.unit = total, label, unit
        self.done = self.shown = 0
        self.start = time.perf_counter()
        self.next_line = self.start + PROGRESS_FIRST_S

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now >= self.next_line:
            self._line(now)
            self.next_line = now + PROGRESS_EVERY_S

    def close(self) -> None:
        if self.done != self.shown:
            self._line(time.perf_counter())

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = self.total - self.done
        eta = f", about {_duration(left / rate)} left" if left > 0 and rate > 0 else ""
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        print(f"{self.label}: {self.done}/{self.total} {self.unit}{share} in {_duration(elapsed)}, {rate:,.1f} "
              f"tok/s{eta}", file=sys.stderr, flush=True)
        self.shown = self.done


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


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


# ---- what a step reads and computes (dense and mixture-of-experts models) --------------------------------------------
def moe_experts(model) -> tuple[int, int] | None:
    """(num_experts, num_experts_per_tok) of a mixture-of-experts model (its config has experts and the model counts
    what a step touches: `step_weight_bytes`), else None: a dense model, whose every step reads every weight."""
    c = model.config
    num, k = getattr(c, "num_experts", 0) or 0, getattr(c, "num_experts_per_tok", 0) or 0
    if num > 0 and k > 0 and callable(getattr(model, "step_weight_bytes", None)):
        return int(num), int(k)
    return None


UNIFORM_ROUTING_NOTE = ("experts touched by B tokens per sparse layer: E(1 - (1 - k/E)^B), uniform routing assumed "
                        "(random-weight routers route close to uniformly; a trained router's skew touches fewer, "
                        "for which this limit is lenient)")


def all_weight_bytes(model) -> int:
    """Every weight tensor's bytes (what a dense decode step reads)."""
    if hasattr(model, "weight_tensors"):
        return sum(t.nbytes for t in model.weight_tensors())
    return int(model.weight_bytes())


def step_weight_bytes(model, num_tokens: int, weight_bytes: int | None = None):
    """Weight bytes a forward of num_tokens tokens reads: all of them for a dense model; for a mixture-of-experts
    model the non-expert weights and the experts num_tokens tokens touch (expected_touched_experts)."""
    moe = moe_experts(model)
    if moe is None:
        return all_weight_bytes(model) if weight_bytes is None else weight_bytes
    return float(model.step_weight_bytes(expected_touched_experts(*moe, num_tokens)))


def embedding_table_bytes(model) -> int:
    """Bytes of the input embedding table a decode step leaves unread (it reads one row per sequence), for a
    mixture-of-experts model or a model with FP8 weights (its roofline: FP8 weight bytes + bf16 lm_head + KV),
    when its lm_head is untied; 0 otherwise: a bf16 dense model's limits count every weight, the table included (the
    standing figures' convention, kept), and a tied table is the lm_head, which every step reads."""
    c = model.config
    counted = moe_experts(model) is None and not getattr(model, "has_fp8_weights", False) and not state_bytes(model)
    if counted or c.tie_word_embeddings:
        return 0
    return 2 * c.vocab_size * c.hidden_size  # bf16, as prefill_flops counts parameters


def decode_weight_bytes(model, num_seqs: int, weight_bytes: int | None = None):
    """Weight bytes a decode step of num_seqs sequences reads: a dense model's every weight; a mixture-of-experts
    model's attention and router weights, the experts its sequences touch (uniform routing), norms and lm_head (the
    embedding table left out: a step reads one row of it a token; embedding_table_bytes)."""
    return step_weight_bytes(model, num_seqs, weight_bytes) - embedding_table_bytes(model)


def active_weight_bytes(model, weight_bytes: int | None = None) -> int:
    """Bytes of the weights one token computes with: all of them for a dense model; a mixture-of-experts model's less
    the experts a token skips (E - k per sparse layer, priced by the model's own step_weight_bytes)."""
    weight_bytes = all_weight_bytes(model) if weight_bytes is None else weight_bytes
    moe = moe_experts(model)
    if moe is None:
        return weight_bytes
    num, k = moe
    return int(round(weight_bytes - (model.step_weight_bytes(num) - model.step_weight_bytes(k))))


def active_parameters(model, weight_bytes: int | None = None) -> int:
    """Parameters one token computes with: active_weight_bytes at 2 bytes a parameter (bf16), or for a model that
    counts its parameters (num_parameters: FP8 weights take 1 byte, their scales none) that count less the experts a
    token skips (E - k per sparse layer, counted in parameters: FP8 experts' bytes are not 2 a parameter)."""
    if not callable(getattr(model, "num_parameters", None)):
        return active_weight_bytes(model, weight_bytes) // 2
    moe = moe_experts(model)
    if moe is None:
        return int(model.num_parameters())
    (num, k), c = moe, model.config
    return int(model.num_parameters()) - (num - k) * len(c.sparse_layers) * 3 * c.moe_intermediate_size * c.hidden_size


def kv_bytes_per_token(config, element_bytes: int = 2) -> int:
    """K and V of one token in every attention layer (a hybrid model's GDN layers keep none): element_bytes 2 for
    the bf16 cache, 1 for kv_cache_dtype fp8_e4m3 (its per-head scales are a few bytes a layer, left out)."""
    layers = len(getattr(config, "attention_layers", range(config.num_hidden_layers)))
    return 2 * layers * config.num_key_value_heads * config.head_dim * element_bytes


def state_bytes(model) -> int:
    """One sequence's recurrent state (a hybrid model's conv windows and SSM states; 0 for others), which a decode
    step reads and writes once."""
    from ..engine.state_cache import slot_bytes

    return slot_bytes(getattr(model, "state_layout", ()))


def kv_element_bytes(llm) -> int:
    """Bytes per cached K or V element of this LLM's KV cache (2 bf16, 1 fp8_e4m3)."""
    return int(llm.engine.runner.kv_cache.dtype.itemsize)


def prefill_flops(model, prompt_lens, weight_bytes: int | None = None) -> float:
    """FLOPs of prefilling these prompts: 2 per active parameter per token (the LM head once per prompt: only the
    last position's logits are computed) plus causal attention (QK^T and PV over half the square)."""
    c = model.config
    embed = c.vocab_size * c.hidden_size
    params = active_parameters(model, weight_bytes)
    layer_params = params - embed * (1 if c.tie_word_embeddings else 2)
    prompts = np.asarray(prompt_lens, np.float64)
    attention_layers = len(getattr(c, "attention_layers", range(c.num_hidden_layers)))
    attn_flops = 2 * 2 * attention_layers * c.num_attention_heads * c.head_dim * np.sum(prompts**2) / 2
    return 2 * layer_params * prompts.sum() + 2 * embed * len(prompts) + attn_flops + gdn_flops(c, prompts.sum())


def gdn_flops(c, tokens: float, chunk: int = 64) -> float:
    """FLOPs of the chunked gated delta rule over `tokens` (0 for a model without GDN layers): per token, value head
    and GDN layer, the chunk-local products (q k^T and its product with the values, 2 chunk (dk + dv) multiply-adds)
    and the state products (W S, q S, the state update: 3 dk dv; the triangular solve is of lower order)."""
    layers = len(getattr(c, "gdn_layers", ()))
    if not layers:
        return 0.0
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    return 2.0 * tokens * layers * c.linear_num_value_heads * (chunk * (dk + dv) + 3 * dk * dv)


def moe_summary(model, weight_bytes: int | None = None) -> dict | None:
    """What a mixture-of-experts limit assumed (None for a dense model): the experts touched and bytes read per
    decode step at a few batch sizes, and the active weight bytes."""
    moe = moe_experts(model)
    if moe is None:
        return None
    weight_bytes = all_weight_bytes(model) if weight_bytes is None else weight_bytes
    num, k = moe
    sizes = (1, 8, 64, 256)
    return {"num_experts": num, "top_k": k, "routing": "uniform (assumed)", "weight_bytes": weight_bytes,
            "active_weight_bytes": active_weight_bytes(model, weight_bytes),
            "touched_experts": {b: expected_touched_experts(num, k, b) for b in sizes},
            "decode_weight_bytes": {b: decode_weight_bytes(model, b, weight_bytes) for b in sizes}}


def moe_summary_line(summary: dict) -> str:
    t, b = summary["touched_experts"], summary["decode_weight_bytes"]
    return (f"  MoE ({summary['top_k']} of {summary['num_experts']} experts per token; {UNIFORM_ROUTING_NOTE}): "
            + ", ".join(f"B={n}: {t[n]:.1f} experts, {b[n] / 1e9:.2f} GB" for n in t)
            + f" of weights per decode step (the input embedding table left out: a step reads one row of it); all "
            f"weights {summary['weight_bytes'] / 1e9:.2f} GB, active per token "
            f"{summary['active_weight_bytes'] / 1e9:.2f} GB (the prefill FLOPs count these)")


def workload_limit(model, prompt_lens, output_lens, ceilings: dict, kv_element_bytes: int = 2) -> dict:
    """The physical limit of generating `output_lens[i]` tokens after prompts of `prompt_lens[i]` tokens, all
    batched together: every decode step reads the weights once (a mixture-of-experts model: the non-expert weights
    but the embedding table, and the experts its B live sequences touch under uniform routing; decode_weight_bytes)
    and every live sequence's K/V (kv_element_bytes an element) at the copy bandwidth; prefill runs its GEMM and attention FLOPs (active
    parameters) at the measured GEMM rate."""
    c = model.config
    weight_bytes = all_weight_bytes(model)
    kv_per_token = kv_bytes_per_token(c, kv_element_bytes)
    prompts = np.asarray(prompt_lens, np.float64)
    outs = np.asarray(output_lens, np.int64)
    prefill_s = prefill_flops(model, prompt_lens, weight_bytes) / ceilings["gemm_flops_per_s"]
    step_bytes: dict[int, float] = {}
    # decode step s (1..max-1) runs every sequence that still wants a token; it reads the cached K/V of
    # prompt + s tokens for each
    order = np.sort(outs)
    decode_bytes = 0.0
    for s in range(1, int(order[-1])):
        live = outs > s
        b = int(np.count_nonzero(live))
        if b not in step_bytes:
            step_bytes[b] = decode_weight_bytes(model, b, weight_bytes)
        decode_bytes += step_bytes[b] + kv_per_token * float(np.sum(prompts[live] + s))
    decode_s = decode_bytes / ceilings["copy_bytes_per_s"]
    total = prefill_s + decode_s
    result = {"limit_s": total, "prefill_s": prefill_s, "decode_s": decode_s,
              "limit_output_tokens_per_s": float(outs.sum()) / total}
    moe = moe_summary(model, weight_bytes)
    if moe is not None:
        result["moe"] = moe
    return result


def batch1_limits(model, prompt_len: int, output_len: int, ceilings: dict, kv_element_bytes: int = 2) -> dict:
    """Batch-1 rooflines of one request: its decode steps (weights a one-token step reads + the K/V of the context,
    at the copy bandwidth), averaged over the output_len - 1 steps after the first token, and its time to first
    token at the prompt's FLOPs (active parameters) at the GEMM rate, with the weights a prompt of that many tokens
    reads at the copy bandwidth beside it (a MoE prompt touches nearly every expert).

    A bf16 dense model's step counts every weight tensor, the input embedding table included (the standing figures'
    convention, kept); a model with FP8 weights leaves the table out as below. A mixture-of-experts step reads the attention and router weights, its k routed experts per
    sparse layer, the norms and lm_head, and one row of the embedding table: the table is left out
    (decode_weight_bytes), and the roofline counting it as the dense ones do is reported beside
    (decode_limit_tokens_per_s_with_embedding). A hybrid model's step also reads and writes its recurrent state once
    (state_bytes), and leaves its untied embedding table out like the MoE models."""
    c = model.config
    weight_bytes = all_weight_bytes(model)
    kv = kv_bytes_per_token(c, kv_element_bytes)
    steps = max(output_len - 1, 1)
    mean_context = prompt_len + (steps + 1) / 2  # step j (1..steps) reads the K/V of prompt + j tokens
    step_bytes = decode_weight_bytes(model, 1, weight_bytes) + kv * mean_context + 2 * state_bytes(model)
    extra = {}
    embed_bytes = embedding_table_bytes(model)
    if embed_bytes:
        extra = {"decode_limit_tokens_per_s_with_embedding": ceilings["copy_bytes_per_s"] / (step_bytes + embed_bytes),
                 "embedding_bytes_left_out": embed_bytes}
    decode_step_s = step_bytes / ceilings["copy_bytes_per_s"]
    ttft_flops_s = prefill_flops(model, [prompt_len], weight_bytes) / ceilings["gemm_flops_per_s"]
    ttft_bytes_s = decode_weight_bytes(model, prompt_len, weight_bytes) / ceilings["copy_bytes_per_s"]
    result = {"decode_step_bytes": step_bytes, "decode_mean_context": mean_context,
              "decode_limit_tokens_per_s": 1.0 / decode_step_s, "ttft_flop_limit_s": ttft_flops_s,
              "ttft_weight_read_s": ttft_bytes_s, **extra}
    moe = moe_summary(model, weight_bytes)
    if moe is not None:
        result["moe"] = moe
    return result
