"""Tensor Memory Accelerator descriptors (CUtensorMap, sm_90+), encoded by the driver and kept in device memory
for kernels that take them by address (the sm_90a prefill kernels)."""
from __future__ import annotations

import ctypes

from cuda.bindings import driver

from .errors import check_driver

DESCRIPTOR_BYTES = 128  # sizeof(CUtensorMap); the driver wants it 64-byte aligned (allocations are)
_PANEL_COLUMNS = 64  # bf16 columns of one 128-byte swizzled panel

_maps: dict[tuple, object] = {}  # (address, shape, rows) -> DeviceBuffer holding the descriptor, kept for the process


def release_descriptors() -> None:
    """Drop every kept descriptor (no CUDA graph may still use one: the last LLM has gone)."""
    _maps.clear()


def kv_cache_tensor_map(runtime, address: int, shape: tuple[int, int, int, int], rows: int) -> int:
    """Device address of a TMA descriptor for one K or V cache (bf16 [num_blocks, block_size, Hkv, D] at `address`),
    seen as the 3-D tensor (D, Hkv, slot) with boxes of 64 x 1 x `rows`: one 128-byte swizzled panel of `rows`
    keys, the unit the prefill kernels copy. Encoded once per (buffer, shape, rows); 128 bytes each, kept (a CUDA
    graph may hold the address)."""
    num_blocks, block_size, num_kv_heads, head_dim = shape
    if head_dim % _PANEL_COLUMNS or not 1 <= rows <= 256:
        raise ValueError(f"TMA box: head_dim {head_dim} must be a multiple of {_PANEL_COLUMNS}, rows {rows} in 1..256")
    return _descriptor(runtime, address, [head_dim, num_kv_heads, num_blocks * block_size],
                       [head_dim * 2, num_kv_heads * head_dim * 2], [_PANEL_COLUMNS, 1, rows])


def matrix_tensor_map(runtime, address: int, rows: int, cols: int, box_rows: int) -> int:
    """Device address of a TMA descriptor for a row-major bf16 matrix [rows, cols] at `address` (cols a multiple of
    8: 16-byte row pitch) with boxes of 64 columns x `box_rows` rows, 128-byte swizzled: the cp.async rings' panel
    layout (the MoE wgmma GEMMs' weight rows). Boxes past the last row or column are filled with zeros. Encoded once
    per (address, shape, box), kept as kv_cache_tensor_map's."""
    if cols % 8 or not 1 <= box_rows <= 256:
        raise ValueError(f"TMA box: cols {cols} must be a multiple of 8, box rows {box_rows} in 1..256")
    return _descriptor(runtime, address, [cols, rows], [cols * 2], [_PANEL_COLUMNS, box_rows])


def gate_up_tensor_map(runtime, address: int, experts: int, inter: int, cols: int, groups: int) -> int:
    """Device address of a TMA descriptor for stacked gate/up weights (bf16 [experts, 2 x inter, cols] at `address`:
    each expert's `inter` gate rows, then its `inter` up rows) seen as the 5-D tensor (cols, 8 rows, gate / up, inter /
    8 groups, experts), boxes of (64, 8, 2, `groups`, 1): 8 gate rows, then the same 8 up rows, `groups` times, the
    rows of a MoE wgmma gate/up CTA (moe_sm90.cu). inter and cols multiples of 8."""
    if cols % 8 or inter % 8 or not 1 <= groups <= 256:
        raise ValueError(f"TMA box: cols {cols} and inter {inter} must be multiples of 8, groups {groups} in 1..256")
    row = cols * 2
    return _descriptor(runtime, address, [cols, 8, 2, inter // 8, experts],
                       [row, inter * row, 8 * row, 2 * inter * row], [_PANEL_COLUMNS, 8, 2, groups, 1])


def _descriptor(runtime, address: int, dims: list[int], strides: list[int], box: list[int]) -> int:
    """A bf16 tensor map with 128-byte swizzle (dims and box innermost first, byte strides of the outer dims),
    encoded and copied to device memory once per (address, dims, strides, box)."""
    key = (address, tuple(dims), tuple(strides), tuple(box))
    buf = _maps.get(key)
    if buf is None:
        u64, u32 = driver.cuuint64_t, driver.cuuint32_t
        err, tmap = driver.cuTensorMapEncodeTiled(
            driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, len(dims), address,
            [u64(d) for d in dims], [u64(s) for s in strides], [u32(b) for b in box], [u32(1)] * len(dims),
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        check_driver((err,), "cuTensorMapEncodeTiled")
        raw = ctypes.create_string_buffer(ctypes.string_at(tmap.getPtr(), DESCRIPTOR_BYTES), DESCRIPTOR_BYTES)
        buf = runtime.allocator.allocate(DESCRIPTOR_BYTES)
        # On the runtime's stream, so it is ordered before the kernels that read it; from pageable memory the call
        # returns once the bytes are staged.
        check_driver(driver.cuMemcpyHtoDAsync(buf.ptr, ctypes.addressof(raw), DESCRIPTOR_BYTES, runtime.device.stream_handle),
                     "cuMemcpyHtoDAsync")
        _maps[key] = buf
    return buf.ptr
