"""A minimal tensor: shape and dtype on the host, data either in device memory (CUDA backend) or in a NumPy
array (CPU backend). Always contiguous (row-major); views share storage. Arithmetic goes through xserv.ops."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from cuda.bindings import driver

from . import runtime as _rt
from .runtime import check_driver, get_device, get_runtime

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)
uint8 = np.dtype(np.uint8)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)  # FP8 weights (xserv/models/fp8.py); storage and copies only

DTYPES = {"bfloat16": bfloat16, "float16": float16, "float32": float32, "int32": int32, "int64": int64, "uint8": uint8,
          "float8_e4m3fn": float8_e4m3fn}
DEVICES = ("cpu", "cuda")
_new = object.__new__


_DTYPE_OF: dict = {}  # what as_dtype accepted before (a dtype, a scalar type, a name) -> the dtype: no re-validation


def as_dtype(dtype) -> np.dtype:
    try:
        return _DTYPE_OF[dtype]
    except (KeyError, TypeError):  # TypeError: an unhashable argument
        pass
    dt = _as_dtype(dtype)
    try:
        _DTYPE_OF[dtype] = dt
    except TypeError:
        pass
    return dt


def _as_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    dt = np.dtype(dtype)
    if dt not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dt}; expected one of {sorted(DTYPES)}")
    return dt


def _shape(shape) -> tuple[int, ...]:
    if type(shape) is tuple:  # the common case, checked without building a new tuple
        for s in shape:
            if type(s) is not int or s < 0:
                break
        else:
            return shape
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


def _check_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected 'cpu' or 'cuda'")
    return device


class Tensor:
    """`shape`, `dtype`, `device`, `numel`, `nbytes` and (CUDA tensors) `ptr` are plain attributes, set once: launchers
    read them on every call. A tensor never changes shape; a view is a new Tensor over the same storage."""

    __slots__ = ("shape", "dtype", "device", "numel", "nbytes", "ptr", "_buffer", "_offset", "_array")

    def __init__(self, shape, dtype, *, array: np.ndarray | None = None, buffer=None, offset: int = 0):
        self._init(_shape(shape), as_dtype(dtype), array, buffer, offset)

    def _init(self, shape: tuple, dtype: np.dtype, array, buffer, offset: int) -> None:
        numel = 1
        for s in shape:
            numel *= s
        self.shape = shape
        self.dtype = dtype
        self.numel = numel
        self.nbytes = numel * dtype.itemsize
        self._array = array
        self._buffer = buffer
        self._offset = offset  # bytes into buffer
        if array is not None:
            self.device = "cpu"  # `ptr` stays unset: reading it goes to __getattr__, which says why
        else:
            self.device = "cuda"
            self.ptr = buffer.ptr + offset  # device address of the first element

    @classmethod
    def _make(cls, shape: tuple, dtype: np.dtype, array=None, buffer=None, offset: int = 0) -> "Tensor":
        """A Tensor from an already validated shape (tuple of ints >= 0) and dtype (one of DTYPES): views, outputs."""
        t = object.__new__(cls)
        t._init(shape, dtype, array, buffer, offset)
        return t

    def __getattr__(self, name):  # only reached for an unset slot
        if name == "ptr":
            raise ValueError("a CPU tensor has no device pointer")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def empty(cls, shape, dtype, device: str = "cuda") -> "Tensor":
        if device == "cuda" and type(shape) is tuple:
            # An eager op's output (a shape tuple of ints, a dtype as_dtype has seen): the slots written out, no
            # re-validation. Anything else takes the checked path below, which raises the usual errors.
            try:
                dt = _DTYPE_OF[dtype]
            except (KeyError, TypeError):
                dt = None
            if dt is not None:
                nbytes = numel = 1
                for s in shape:
                    if type(s) is not int or s < 0:
                        break
                    numel *= s
                else:
                    nbytes = numel * dt.itemsize
                    buf = (_rt._runtime or get_runtime()).allocator.allocate(nbytes)
                    t = _new(cls)
                    t.shape, t.dtype, t.device, t.numel, t.nbytes = shape, dt, "cuda", numel, nbytes
                    t.ptr, t._buffer, t._offset, t._array = buf.ptr, buf, 0, None
                    return t
        shape, dtype = _shape(shape), as_dtype(dtype)
        if device == "cuda":
            nbytes = dtype.itemsize
            for s in shape:
                nbytes *= s
            return cls._make(shape, dtype, buffer=get_runtime().allocator.allocate(nbytes))
        if _check_device(device) == "cpu":
            return cls._make(shape, dtype, array=np.empty(shape, dtype))

    def empty_like(self) -> "Tensor":
        """A new uninitialised tensor of this one's shape, dtype and device (an eager op's output: for a CUDA tensor
        the shape, dtype and sizes are copied, nothing is re-validated)."""
        if self._array is not None:
            return Tensor.empty(self.shape, self.dtype, "cpu")
        nbytes = self.nbytes
        buf = (_rt._runtime or get_runtime()).allocator.allocate(nbytes)
        t = _new(Tensor)
        t.shape, t.dtype, t.device, t.numel, t.nbytes = self.shape, self.dtype, "cuda", self.numel, nbytes
        t.ptr, t._buffer, t._offset, t._array = buf.ptr, buf, 0, None
        return t

    @classmethod
    def zeros(cls, shape, dtype, device: str = "cuda") -> "Tensor":
        if _check_device(device) == "cpu":  # np.zeros maps zero pages lazily instead of writing every byte
            return cls(_shape(shape), as_dtype(dtype), array=np.zeros(_shape(shape), as_dtype(dtype)))
        return cls.empty(shape, dtype, device).zero_()

    def zero_(self) -> "Tensor":
        """Set every element to 0 in place (a memset on the stream for CUDA tensors; capturable in a graph)."""
        if self.device == "cpu":
            self._array[...] = 0
        elif self.nbytes:
            check_driver(driver.cuMemsetD8Async(self.ptr, 0, self.nbytes, get_device().stream_handle), "cuMemsetD8Async")
        return self

    @classmethod
    def full(cls, shape, value, dtype, device: str = "cuda") -> "Tensor":
        return cls.from_numpy(np.full(_shape(shape), value, as_dtype(dtype)), device)

    @classmethod
    def from_numpy(cls, array, device: str = "cuda", dtype=None) -> "Tensor":
        array = np.asarray(array)
        dtype = as_dtype(dtype if dtype is not None else array.dtype)
        array = np.ascontiguousarray(array, dtype=dtype)
        if _check_device(device) == "cpu":
            return cls(array.shape, dtype, array=array)
        t = cls.empty(array.shape, dtype, "cuda")
        t._upload(array)
        return t

    # ---- properties ---------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements (always the contiguous ones)."""
        strides, acc = [], 1
        for s in reversed(self.shape):
            strides.append(acc)
            acc *= s
        return tuple(reversed(strides))

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def array(self) -> np.ndarray:
        """The NumPy array behind a CPU tensor (shares memory)."""
        if self._array is None:
            raise ValueError("a CUDA tensor has no host array; use .numpy() to copy it to the host")
        return self._array

    # ---- views --------------------------------------------------------------------------------------------
    def view(self, *shape) -> "Tensor":
        if len(shape) == 1 and type(shape[0]) in (tuple, list):
            shape = tuple(shape[0])
        numel, known, infer = self.numel, 1, -1
        for i, s in enumerate(shape):  # the common case (ints, at most one -1) without building lists
            if type(s) is not int or s < -1 or (s == -1 and infer >= 0):
                return self._view_checked(shape)
            if s == -1:
                infer = i
            else:
                known *= s
        if infer >= 0:
            if known == 0 or numel % known:
                raise ValueError(f"view: cannot infer -1 in {tuple(shape)} for {numel} elements")
            shape = shape[:infer] + (numel // known,) + shape[infer + 1:]
        elif known != numel:
            raise ValueError(f"view: shape {tuple(shape)} has {known} elements, tensor has {numel}")
        if self._array is not None:
            return Tensor._make(shape, self.dtype, array=self._array.reshape(shape))
        t = object.__new__(Tensor)  # same storage, dtype and size: copied, not recomputed
        t.shape, t.dtype, t.device, t.numel, t.nbytes = shape, self.dtype, "cuda", numel, self.nbytes
        t.ptr, t._buffer, t._offset, t._array = self.ptr, self._buffer, self._offset, None
        return t

    def _view_checked(self, shape) -> "Tensor":
        """view() for shapes given as NumPy integers or with errors in them: the full checks and messages."""
        shape = list(shape)
        if shape.count(-1) > 1:
            raise ValueError("view: at most one dimension may be -1")
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            if known == 0 or self.numel % known:
                raise ValueError(f"view: cannot infer -1 in {tuple(shape)} for {self.numel} elements")
            shape[shape.index(-1)] = self.numel // known
        shape = _shape(shape)
        if math.prod(shape) != self.numel:
            raise ValueError(f"view: shape {shape} has {math.prod(shape)} elements, tensor has {self.numel}")
        return self.view(shape)

    reshape = view

    def __getitem__(self, index) -> "Tensor":
        """Index or slice along the first dimension, without a copy (step 1 only)."""
        shape = self.shape
        if not shape:
            raise ValueError("cannot index a 0-d tensor")
        n = shape[0]
        if type(index) is slice:
            start, stop, step = index.indices(n)
            if step != 1:
                raise ValueError("only step-1 slices are supported (views stay contiguous)")
            if stop < start:
                stop = start
            new_shape = (stop - start,) + shape[1:]
        elif isinstance(index, (int, np.integer)):
            i = int(index) + (n if index < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {index} out of range for dimension of size {n}")
            start, stop, new_shape = i, i + 1, shape[1:]
        else:
            raise TypeError(f"tensors are indexed along the first dimension by int or slice, not {type(index).__name__}")
        if self._array is not None:
            return Tensor._make(new_shape, self.dtype, array=self._array[start:stop].reshape(new_shape))
        row = (self.nbytes // n) if n else 0
        return Tensor._make(new_shape, self.dtype, buffer=self._buffer, offset=self._offset + start * row)

    # ---- data movement ------------------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A host copy for a CUDA tensor (synchronises the stream); the array itself for a CPU tensor."""
        if self._array is not None:
            return self._array
        out = np.empty(self.shape, self.dtype)
        if self.nbytes:
            dev = get_device()
            check_driver(driver.cuMemcpyDtoHAsync(out.ctypes.data, self.ptr, self.nbytes, dev.stream_handle), "cuMemcpyDtoHAsync")
            dev.synchronize()
        return out

    def _upload(self, array: np.ndarray) -> None:
        if array.nbytes:
            # From pageable memory the call returns once the bytes are staged, so `array` may be dropped after.
            check_driver(
                driver.cuMemcpyHtoDAsync(self.ptr, array.ctypes.data, array.nbytes, get_device().stream_handle),
                "cuMemcpyHtoDAsync",
            )

    def copy_(self, src: "Tensor | np.ndarray") -> "Tensor":
        """Copy `src` (same shape and dtype; any device) into this tensor."""
        if isinstance(src, np.ndarray):
            src = Tensor(src.shape, src.dtype, array=np.ascontiguousarray(src))
        if src.shape != self.shape or src.dtype != self.dtype:
            raise ValueError(f"copy_: source {src.shape} {src.dtype} does not match destination {self.shape} {self.dtype}")
        if self.device == "cpu":
            self._array[...] = src.numpy()
        elif src.device == "cpu":
            self._upload(np.ascontiguousarray(src._array))
        elif self.nbytes:
            check_driver(driver.cuMemcpyDtoDAsync(self.ptr, src.ptr, self.nbytes, get_device().stream_handle), "cuMemcpyDtoDAsync")
        return self

    def to(self, device: str) -> "Tensor":
        """This tensor on `device` (itself if already there)."""
        if _check_device(device) == self.device:
            return self
        if device == "cpu":
            return Tensor.from_numpy(self.numpy(), "cpu")
        return Tensor.from_numpy(self._array, "cuda")

    def clone(self) -> "Tensor":
        return Tensor.empty(self.shape, self.dtype, self.device).copy_(self)

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device={self.device})"


def empty(shape, dtype, device="cuda") -> Tensor:
    return Tensor.empty(shape, dtype, device)


def zeros(shape, dtype, device="cuda") -> Tensor:
    return Tensor.zeros(shape, dtype, device)


def full(shape, value, dtype, device="cuda") -> Tensor:
    return Tensor.full(shape, value, dtype, device)


def from_numpy(array, device="cuda", dtype=None) -> Tensor:
    return Tensor.from_numpy(array, device, dtype)
