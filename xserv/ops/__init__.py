"""One module per kernel family. Each op takes Tensors and dispatches on their device: the CUDA launcher for
CUDA tensors, the NumPy reference (same signature, float32/float64 math) for CPU tensors."""
