"""From a model folder to a running engine: what `LLM(...)` builds, in the order that makes a failure cheap.

1. `EngineBuilder(model, device, config)` checks everything that reads only files: the folder, the device, the
   model's config (and says when FP8 weights load dequantized), the context length, the tensor-parallel split, the
   checkpoint's headers and the tokenizer. A bad path or a garbage file is reported here, before anything exists
   that would need releasing.
2. `compile_kernels()` compiles (or finds in the disk cache) the kernels of the model's shapes, as its model class
   names them, on CUDA.
3. `load(parts)` loads the weights (a tensor-parallel model's ranks 1..tp-1 in worker processes it starts, while
   this process loads rank 0's) and builds the engine around them (workspace, KV cache, runner, CUDA graphs).
   It puts each thing it makes into `parts` as soon as it exists, so that whoever owns `parts` can release what
   was made whichever step fails.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from .engine.config import EngineConfig
from .engine.llm_engine import LLMEngine

log = logging.getLogger("xserv")


def pick_device(device: str | None, notice=True) -> str:
    from .runtime import cuda_available

    if device is None:
        if cuda_available():
            return "cuda"
        if notice:
            log.warning("no CUDA GPU found; running on the CPU (NumPy backend, float32, slow)")
        return "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not cuda_available():
        raise ValueError("device='cuda' asked for, but no CUDA GPU was found; use device='cpu'")
    return device


class EngineBuilder:
    """The checked plan of one engine (step 1 of the module doc), then its kernels and its loading.

    folder: the resolved model folder. device: "cuda" or "cpu". config: the whole model's config (a rank's is
    `rank_config`). engine_config: the EngineConfig with every override applied. tokenizer: the model's.
    max_len: the longest sequence asked for (max_model_len, else the model's context); the engine may cap it
    further by its KV cache. timings: seconds of "weights_s" and "engine_s" once loaded; kernel_compile_s on CUDA
    once compiled."""

    def __init__(self, model: str, device: str | None = None, config: EngineConfig | None = None):
        from .models.checkpoint import CheckpointReader, resolve_model_source
        from .models.registry import config_from_pretrained, model_class
        from .tokenizer import Tokenizer

        cfg = config or EngineConfig()
        self.engine_config = cfg
        self.folder: Path = resolve_model_source(model)  # a bad path is reported before any device notice
        self.device = pick_device(device)
        self.config = mc = config_from_pretrained(self.folder)
        self.model_class = model_class(mc)
        notice = self.model_class.fp8_load_notice(mc)
        if notice:
            log.warning("%s", notice)
        context = mc.context_length
        if cfg.max_model_len is not None and cfg.max_model_len > context:
            raise ValueError(f"max_model_len {cfg.max_model_len} is longer than the model's context of {context} "
                             f"tokens (max_position_embeddings, or YaRN's factor x original length)")
        self.max_len = cfg.max_model_len or context
        tp = cfg.tensor_parallel_size
        self.rank_config = mc
        if tp > 1:  # the model splits tp ways onto as many GPUs: checked before anything is loaded or started
            from .parallel.sharding import check_tp
            from .parallel.sharding import rank_config as tp_rank_config
            from .runtime import device_count

            check_tp(mc, tp, device_count() if self.device == "cuda" else tp, self.model_class)
            self.rank_config = tp_rank_config(mc, tp, 0).config
        # the checkpoint's headers, before the tokenizer and the kernels: a missing, truncated or garbage file is
        # reported at once
        self._reader = CheckpointReader(self.folder)
        self.tokenizer = Tokenizer.from_folder(self.folder)
        self.timings: dict[str, float] = {}
        self.kernel_compile_s: float | None = None

    def kernel_shapes(self) -> dict[str, int]:
        """The shapes whose kernel pieces a start-up compiles: the model class's for this rank's config, and the
        FP8 KV cache's decode piece (attention_decode_fp8) when the engine keeps its cache in FP8."""
        shapes = self.model_class.kernel_shapes(self.rank_config, self.engine_config.tensor_parallel_size)
        if self.engine_config.fp8_kv_cache:
            shapes["kvfp8"] = 1
        return shapes

    def compile_kernels(self, progress: bool = True) -> None:
        """On CUDA, compile the start-up kernels of this model that the disk cache lacks (a first run: seconds)."""
        if self.device != "cuda":
            return
        from .runtime import get_device
        from .runtime.compiler import ensure_compiled

        start = time.perf_counter()
        ensure_compiled(get_device().arch, progress=progress, shapes=self.kernel_shapes())
        self.kernel_compile_s = time.perf_counter() - start

    def load(self, parts, progress: bool = True) -> None:
        """Load the weights and build the engine into `parts` (an object with `group`, `model` and `engine`
        attributes, set as each comes to exist: the TPGroup of a tensor-parallel model, the loaded model, the
        LLMEngine)."""
        cfg, folder, config, tp = self.engine_config, self.folder, self.config, self.engine_config.tensor_parallel_size
        reader, self._reader = self._reader, None
        start = time.perf_counter()
        try:
            if tp > 1:
                from .parallel.group import TPGroup

                parts.group = TPGroup.start(folder, config, tp, self.device, cfg, max_positions=self.max_len)
                parts.model = parts.group.load_rank0(folder, max_positions=self.max_len, progress=progress)
                parts.group.wait_loaded()
            else:
                parts.model = self.model_class.from_checkpoint(config, reader, self.device, progress=progress,
                                                               max_positions=self.max_len)
            reader = None
            self.timings["weights_s"] = time.perf_counter() - start
            start = time.perf_counter()
            eos = set(config.eos_token_id) | set(self.tokenizer.eos_token_ids)
            parts.engine = LLMEngine.from_model(parts.model, self.tokenizer, cfg, context_len=self.max_len,
                                                eos_token_ids=eos, group=parts.group)
            self.timings["engine_s"] = time.perf_counter() - start
        except BaseException:
            reader = None  # the traceback keeps this frame while the caller handles the error: not its file maps
            raise
