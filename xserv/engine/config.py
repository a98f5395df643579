"""EngineConfig: every engine setting with its default, stated once and read by `LLM`, the CLI and the engine."""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

# Defaults that depend on the device (the NumPy backend is for tiny models).
# On CUDA a step with prefill tokens runs eagerly, and its ~450 launches cost ~40 ms of host time on a 0.6B model
# whatever the token count up to ~16k: fewer, larger prefill steps finish a batch of prompts sooner.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")  # engine/kv_cache.py's kv_cache_dtype() maps them to dtypes
_BATCHED_TOKENS = {"cuda": 16384, "cpu": 2048}
CPU_KV_BYTES = 1 << 30  # CPU KV pool: about this much, at least 2,048 tokens, at most 4 x max_model_len


@dataclass(frozen=True)
class EngineConfig:
    """max_model_len: the longest sequence (prompt + output); None = the model's context, capped by the KV cache.
    kv_cache_tokens: the KV pool size in tokens; None = from free memory on CUDA (gpu_memory_fraction of it), about
    1 GiB on CPU. max_num_seqs: sequences decoded together. max_num_batched_tokens: tokens in one forward (prefill
    chunks + decodes); None = 16384 on CUDA, 2048 on CPU. enable_prefix_caching: share full KV blocks between
    requests with the same prefix. overlap_steps: launch a decode step before the previous one's tokens are back on
    the host (the GPU never waits for the host between decode steps). prefill_graph_tokens: with cuda_graphs, a
    step that is one sequence's prompt chunk of at most this many tokens and nothing else replays a captured prefill
    graph (0: prefill always runs eagerly). seed: the sampling seed of requests that give none (each such request
    gets seed * 1,000,003 + its id); None, the default: each of them gets a fresh seed from the OS's entropy, so
    unseeded sampling differs from run to run, as in every other engine. tensor_parallel_size: GPUs (ranks) one
    model is sharded over, one process each (xserv/parallel; on the CPU backend, processes); 1: no sharding, no
    extra process. kv_cache_dtype: the KV cache's element type: "auto" (the model's, bf16), "bfloat16", or "fp8_e4m3"
    (e4m3 with a float32 scale per layer and kv head: half the bytes a token, about twice the tokens; engine/kv_cache.py
    says how the scales are chosen, docs/kernels/attention.md "FP8 KV cache" what it costs)."""

    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_fraction: float = 0.85
    cuda_graphs: bool = True
    prefill_graph_tokens: int = 512
    enable_prefix_caching: bool = True
    overlap_steps: bool = True
    seed: int | None = None
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        for name in ("max_model_len", "kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "kv_cache_tokens", "max_num_batched_tokens"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        p = self.prefill_graph_tokens
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"prefill_graph_tokens must be an integer >= 0, got {p!r}")
        f = self.gpu_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f):
            raise ValueError(f"gpu_memory_fraction must be a finite number, got {f!r}")
        if not 0 < f <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {f!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype == "fp8_e4m3"

    def batched_tokens(self, device: str) -> int:
        """The per-forward token budget on `device` (never below max_num_seqs: a decode step must fit)."""
        return max(self.max_num_batched_tokens or _BATCHED_TOKENS[device], self.max_num_seqs)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    # ---- command line -------------------------------------------------------------------------------------------
    @staticmethod
    def add_cli_arguments(p: argparse.ArgumentParser, *, max_num_seqs: int | None = None) -> None:
        """The engine options of every `xserv` command that loads a model (`max_num_seqs` overrides its default)."""
        d = EngineConfig()
        g = p.add_argument_group("engine")
        g.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                       help="longest sequence, prompt + output (default: the model's context, capped by the KV cache)")
        g.add_argument("--kv-cache-tokens", type=_positive_int, default=None, metavar="N",
                       help="KV cache size in tokens (default: from free memory)")
        g.add_argument("--max-num-seqs", type=_positive_int, default=max_num_seqs, metavar="N",
                       help=f"sequences decoded together (default {max_num_seqs or d.max_num_seqs})")
        g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None, metavar="N",
                       help="tokens in one forward pass (default 16384 on a GPU, 2048 on the CPU)")
        g.add_argument("--gpu-memory-fraction", type=_fraction, default=d.gpu_memory_fraction, metavar="F",
                       help=f"share of free GPU memory for the KV cache, in (0, 1] (default {d.gpu_memory_fraction})")
        g.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks between requests")
        g.add_argument("--no-cuda-graphs", action="store_true",
                       help="run every step eagerly (no CUDA graphs for decode or short prefills)")
        g.add_argument("--prefill-graph-tokens", type=_non_negative_int, default=d.prefill_graph_tokens, metavar="N",
                       help="prompt chunks of up to N tokens alone in a step replay a CUDA graph "
                            f"(default {d.prefill_graph_tokens}; 0: prefill always eager)")
        g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                       help="KV cache element type: auto (the model's, bf16), bfloat16, or fp8_e4m3 (half the bytes a "
                            "token, about twice the tokens; per-head scales 1.0)")
        g.add_argument("--tensor-parallel-size", "--tp", type=_positive_int, default=d.tensor_parallel_size,
                       metavar="N", help="shard the model over N GPUs, one process each (default 1)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config of the parsed options (argparse has already refused zero or negative sizes, naming the
        option; an option left out, None, takes the field's default)."""
        max_num_seqs = cls.max_num_seqs if args.max_num_seqs is None else args.max_num_seqs
        return cls(max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens,
                   max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   gpu_memory_fraction=args.gpu_memory_fraction, cuda_graphs=not args.no_cuda_graphs,
                   prefill_graph_tokens=getattr(args, "prefill_graph_tokens", cls.prefill_graph_tokens),
                   enable_prefix_caching=not args.no_prefix_caching,
                   tensor_parallel_size=getattr(args, "tensor_parallel_size", cls.tensor_parallel_size),
                   kv_cache_dtype=getattr(args, "kv_cache_dtype", cls.kv_cache_dtype))


# argparse types: a bad value is a usage error naming the option ("argument --max-num-seqs: must be ..."), exit 2
def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value
