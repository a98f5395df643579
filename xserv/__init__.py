"""xserv: a Qwen3 inference engine with its own CUDA kernels."""
__version__ = "0.1.0"
