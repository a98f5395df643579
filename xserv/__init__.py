"""xserv: a Qwen3 inference engine with its own CUDA kernels."""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]


def __getattr__(name):  # lazy, so that `import xserv.runtime` stays light
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from .engine.llm_engine import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'xserv' has no attribute {name!r}")
