"""Which FP8 GEMM configurations this machine's cuBLASLt takes (runtime/cublas.py's block-scaled plan): the library
version and file, then cuBLASLt's heuristic for tensor-wise FP8 (the control) and each pairing of the block-scale
modes, in both operand orders, at one shape. Run with CUBLASLT_LOG_MASK=5 for cuBLASLt's own error messages.
    python -m tools.dev.probe_fp8_gemm [M N K]"""
import sys

from xserv.runtime import get_device, get_runtime
from xserv.runtime.cublas import _CUDA_R_8F_E4M3, WORKSPACE_BYTES, _lt, _Plan
from xserv.runtime.errors import CublasError


def main(argv):
    m, n, k = (int(a) for a in argv[:3]) if len(argv) >= 3 else (256, 4096, 4096)
    cublas = get_runtime().cublas
    L = _lt()
    print(f"device {get_device().name} ({get_device().arch}); cuBLASLt {cublas.version()}")
    print("loaded:", sorted({line.split()[-1] for line in open("/proc/self/maps") if "cublas" in line.lower()}))
    S = L.MatmulMatrixScale
    fp8 = (_CUDA_R_8F_E4M3, _CUDA_R_8F_E4M3)
    for out_type, out_name in ((14, "bf16"), (0, "f32")):
        for modes in (None, (S.BLK128x128_32F, S.VEC128_32F), (S.VEC128_32F, S.BLK128x128_32F),
                      (S.VEC128_32F, S.VEC128_32F), (S.OUTER_VEC_32F, S.OUTER_VEC_32F)):
            for swap in (False, True):
                name = "scalar" if modes is None else f"{S(modes[0]).name}x{S(modes[1]).name}"
                try:
                    plan = _Plan(cublas.handle, m, n, k, 1, fp8, out_type, 0, 0, 0, WORKSPACE_BYTES, 8,
                                 scale_modes=None if modes is None else (int(modes[0]), int(modes[1])), swap=swap,
                                 scale_ptr_hint=cublas.workspace.ptr)
                    result = f"{len(plan.results)} algorithms"
                except CublasError as exc:
                    result = f"refused: {str(exc)[:110]}"
                print(f"  {out_name} {name:34s} {'x@W row-D' if swap else 'W@x col-D'}: {result}")
    from xserv.tensor import bfloat16

    plan = cublas.fp8_block_scaled_plan(m, n, k, bfloat16)
    print("fp8_block_scaled_plan:", "swap" if plan is not None and plan.swap else plan,
          cublas.fp8_refusals.get(("fp8_block", m, n, k, bfloat16), ""))


if __name__ == "__main__":
    main(sys.argv[1:])
