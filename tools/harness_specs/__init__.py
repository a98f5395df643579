"""Op specs for the kernel harness. Each module in this package defines `SPECS: list[OpSpec]`; the harness
discovers them, so a new kernel family adds one file here and edits nothing else."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass
class OpSpec:
    name: str  # what `check NAME` / `bench NAME` take
    family: str  # cuda_src/<family>.cu
    kernels: tuple[str, ...]  # the extern "C" kernels this op launches
    # shape -> dict of NumPy inputs (already rounded to their dtypes; mean shifted off 0)
    make_inputs: Callable[[np.random.Generator, tuple], dict]
    # dict of device Tensors -> output Tensor (allocate outputs with xserv.testing.poisoned)
    run: Callable[[dict], object]
    # dict of NumPy inputs -> float64 expected output
    reference: Callable[[dict], np.ndarray]
    tolerance: float
    check_shapes: list[tuple]
    bench_shapes: list[tuple] = field(default_factory=list)
    # shape -> bytes that must move through memory (each input read once, each output written once)
    bytes_moved: Callable[[tuple], int] | None = None
    flops: Callable[[tuple], int] | None = None
    # dict of torch CUDA tensors -> torch output: the PyTorch peer for `bench --vs torch`
    torch_peer: Callable[[dict], object] | None = None
    shape_help: str = ""  # how --shapes is written for this op, e.g. "TOKENSxHIDDEN"
    compare: Callable[[object, np.ndarray, dict], float] | None = None  # custom error measure (e.g. argmax)
    # ops that `check NAME` / `bench NAME` run after this one, each at its own shapes, where neither --shapes nor
    # --variant is given (an op's fused twins: gemv_fp8's one-row entries)
    with_ops: tuple[str, ...] = ()


def all_specs() -> dict[str, OpSpec]:
    specs: dict[str, OpSpec] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for spec in getattr(module, "SPECS", []):
            if spec.name in specs:
                raise RuntimeError(f"two harness specs named {spec.name!r}")
            specs[spec.name] = spec
    return dict(sorted(specs.items()))
