"""The library entry point: `LLM(model).generate(prompts, SamplingParams(...))`, chat, streaming and logits."""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Iterator

import numpy as np

from .engine.config import CPU_KV_BYTES, EngineConfig
from .engine.kv_cache import KVCache, KVCacheSpec
from .engine.llm_engine import LLMEngine, RequestOutput
from .engine.model_runner import ModelRunner


def pick_device(device: str | None, notice=True) -> str:
    from .runtime import cuda_available

    if device is None:
        if cuda_available():
            return "cuda"
        if notice:
            print("xserv: no CUDA GPU found; running on the CPU (NumPy backend, float32, slow)", file=sys.stderr)
        return "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not cuda_available():
        raise ValueError("device='cuda' asked for, but no CUDA GPU was found; use device='cpu'")
    return device


def model_context_length(config) -> int:
    """max_position_embeddings, or with YaRN rope scaling factor x the original length when that is longer."""
    yarn = config.yarn_parameters()
    if yarn is None:
        return config.max_position_embeddings
    return max(config.max_position_embeddings, int(yarn["factor"] * yarn["original_max_position_embeddings"]))


class LLM:
    """A Qwen3 model ready to generate.

    model: a local Hugging Face folder or a hub id. device: "cuda", "cpu", or None (cuda when a GPU exists).
    max_model_len: the longest sequence (prompt + output); default the model's max_position_embeddings, capped
    by the KV cache. kv_cache_tokens: the KV pool size in tokens; default from free device memory
    (gpu_memory_fraction of it) on CUDA, about 1 GiB on CPU. seed: the default sampling seed of requests that
    give none.
    """

    def __init__(self, model: str, device: str | None = None, config: EngineConfig | None = None, *,
                 progress: bool = True, **overrides):
        from .models.checkpoint import CheckpointReader, resolve_model_source
        from .models.config import Qwen3Config
        from .models.qwen3 import Qwen3Model
        from .tokenizer import Tokenizer

        unknown = set(overrides) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise TypeError(f"LLM() got unknown engine option(s) {sorted(unknown)}")
        cfg = (config or EngineConfig()).replace(**overrides)
        self.engine_config = cfg
        max_model_len, kv_cache_tokens, max_num_seqs = cfg.max_model_len, cfg.kv_cache_tokens, cfg.max_num_seqs
        block_size, seed = cfg.block_size, cfg.seed
        self.device = pick_device(device)
        self.folder = resolve_model_source(model)
        self.config = config = Qwen3Config.from_pretrained(self.folder)
        context = model_context_length(config)
        if max_model_len is not None and max_model_len > context:
            raise ValueError(f"max_model_len {max_model_len} is longer than the model's context of {context} tokens "
                             f"(max_position_embeddings, or YaRN's factor x original length)")
        max_len = max_model_len or context
        self.tokenizer = Tokenizer.from_folder(self.folder)
        if self.device == "cuda":
            from .runtime import get_device
            from .runtime.compiler import ensure_compiled

            start = time.perf_counter()
            ensure_compiled(get_device().arch, progress=progress)
            self.kernel_compile_s = time.perf_counter() - start
        reader = CheckpointReader(self.folder)
        start = time.perf_counter()
        self.model = Qwen3Model.from_checkpoint(config, reader, self.device, progress=progress, max_positions=max_len)
        del reader
        self.timings = {"weights_s": time.perf_counter() - start}

        max_num_batched_tokens = cfg.batched_tokens(self.device)
        workspace = self.model.make_workspace(max_num_batched_tokens, max_num_seqs)
        spec = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, block_size)
        if kv_cache_tokens is None and self.device == "cpu":
            per_token = spec.bytes_per_token(self.model.dtype)
            kv_cache_tokens = min(4 * max_len, max(CPU_KV_BYTES // per_token, 2048))
        self.kv_cache = KVCache.create(spec, self.device, num_tokens=kv_cache_tokens,
                                        memory_fraction=cfg.gpu_memory_fraction, dtype=self.model.dtype)
        self.max_model_len = min(max_len, self.kv_cache.num_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, workspace=workspace)
        eos = set(config.eos_token_id) | set(self.tokenizer.eos_token_ids)
        self.engine = LLMEngine(self.runner, self.tokenizer, max_model_len=self.max_model_len, eos_token_ids=eos,
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, seed=seed)
        if self.device == "cuda" and cfg.cuda_graphs:
            start = time.perf_counter()
            self.runner.capture_decode_graphs()
            self.timings["cuda_graphs_s"] = time.perf_counter() - start

    # ---- prompts ------------------------------------------------------------------------------------------
    def _encode(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt)), prompt
        ids = [int(t) for t in prompt]
        return ids, None

    def _normalize_prompts(self, prompts) -> list:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    @staticmethod
    def _params_list(params, n: int) -> list:
        from .sampling import SamplingParams

        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, (list, tuple)):
            if len(params) != n:
                raise ValueError(f"{len(params)} sampling params for {n} prompts")
            return list(params)
        return [params] * n

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, prompts, params=None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists. One output per prompt, in order."""
        prompts = self._normalize_prompts(prompts)
        encoded = [self._encode(p) for p in prompts]
        params_list = self._params_list(params, len(prompts))
        for ids, _ in encoded:
            self.engine.check_prompt(ids)
        return self.engine.generate([e[0] for e in encoded], params_list, [e[1] for e in encoded])

    def chat_prompt(self, messages, enable_thinking: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking)

    def chat(self, messages, params=None, enable_thinking: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations."""
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)
        prompts = [self.chat_prompt(c, enable_thinking) for c in conversations]
        return self.generate(prompts, params)

    def stream(self, prompt, params=None) -> Iterator[str]:
        """Text deltas as tokens come (never past a stop string). Closing the iterator early ends the request."""
        ids, text = self._encode(prompt)
        params = self._params_list(params, 1)[0]
        return self.engine.stream(ids, params, text)

    def logits(self, token_ids) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the next-token logits at every position."""
        return self.engine.logits(list(token_ids))
