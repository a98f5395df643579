"""The library entry point: `LLM(model).generate(prompts, SamplingParams(...))`, chat, streaming and logits."""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Iterator

import numpy as np

from .engine.config import EngineConfig
from .engine.llm_engine import LLMEngine, RequestOutput


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


class LLM:
    """A model (Qwen3 or Llama 3, see xserv.models.registry) ready to generate.

    model: a local Hugging Face folder or a hub id. device: "cuda", "cpu", or None (cuda when a GPU exists).
    max_model_len: the longest sequence (prompt + output); default the model's max_position_embeddings, capped
    by the KV cache. kv_cache_tokens: the KV pool size in tokens; default from free device memory
    (gpu_memory_fraction of it) on CUDA, about 1 GiB on CPU. seed: the default sampling seed of requests that
    give none.
    """

    def __init__(self, model: str, device: str | None = None, config: EngineConfig | None = None, *,
                 progress: bool = True, **overrides):
        from .models.checkpoint import CheckpointReader, resolve_model_source
        from .models.registry import config_from_pretrained, model_class
        from .tokenizer import Tokenizer

        unknown = set(overrides) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise TypeError(f"LLM() got unknown engine option(s) {sorted(unknown)}")
        cfg = (config or EngineConfig()).replace(**overrides)
        self.engine_config = cfg
        max_model_len = cfg.max_model_len
        self.folder = resolve_model_source(model)  # a bad path is reported before any device notice
        self.device = pick_device(device)
        self.config = config = config_from_pretrained(self.folder)
        context = config.context_length
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
        self.model = model_class(config).from_checkpoint(config, reader, self.device, progress=progress, max_positions=max_len)
        del reader
        self.timings = {"weights_s": time.perf_counter() - start}

        start = time.perf_counter()
        eos = set(config.eos_token_id) | set(self.tokenizer.eos_token_ids)
        self.engine = LLMEngine.from_model(self.model, self.tokenizer, cfg, context_len=max_len, eos_token_ids=eos)
        self.timings["engine_s"] = time.perf_counter() - start
        self.runner = self.engine.runner
        self.kv_cache = self.engine.kv_cache
        self.max_model_len = self.engine.max_model_len

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
    def generate(self, prompts, params=None, on_step=None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists. One output per prompt, in order
        (params.n > 1: n outputs per prompt, one after the other). `on_step(results)` runs after every engine
        step."""
        prompts = self._normalize_prompts(prompts)
        encoded = [self._encode(p) for p in prompts]
        params_list = self._params_list(params, len(prompts))
        for ids, _ in encoded:
            self.engine.check_prompt(ids)
        return self.engine.generate([e[0] for e in encoded], params_list, [e[1] for e in encoded], on_step=on_step)

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
