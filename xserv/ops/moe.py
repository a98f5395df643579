"""Mixture-of-experts feed-forward (Qwen3-MoE's sparse block): route each token to its top-k experts, run each
expert's SwiGLU MLP on the tokens routed to it, and add the expert outputs weighted by the routing probabilities.

    logits  = x @ router^T                           fp32 [T, E]
    p       = softmax(logits) (fp32); ids = top-k of p (ties: the lower expert id); w = p[ids] (/ sum when
              renormalize, Qwen3's norm_topk_prob)
    y_tj    = bf16( act_tj @ down[e]^T ),  act_tj = bf16(bf16(silu(bf16(g))) * bf16(u)),  [g | u] = x_t @ gate_up[e]^T
    out_t   = bf16( sum_j w_tj * y_tj )  (fp32 sum over j = 0..k-1 in order)      -- or, with an fp32 `out`,
    out_t  += bf16( sum_j w_tj * y_tj )  (the residual stream: the add a dense layer's fused_add_rmsnorm does)

Weights are stacked per expert: gate_up bf16 [E, 2I, H] (each expert's gate rows, then its up rows, the dense MLP's
fused layout), down bf16 [E, H, I]. The rounding points are a dense MLP's (silu_and_mul, linear's bf16 output), so
one expert's MLP rounds exactly as xserv's dense MLP does. FP8 experts (a -FP8 checkpoint's): gate_up and down in
e4m3 with float32 scales per 128 x 128 block, gate_up_scale [E, 2I / 128, H / 128] and down_scale [E, H / 128,
I / 128] (H and I multiples of 128); each weight counts as bf16(float32(e4m3) * scale), fp8_format.py's
dequantize_blockwise, so the results are the bf16 path's on the dequantized weights, bit for bit.

CUDA (cuda_src/moe.cu, docs/kernels/moe.md): the router logits are a linear (the GEMV kernel for one row,
cuBLASLt above); the routing kernels take the top-k, counts the entries per expert and writes the expert-sorted
entry list padded to whole token tiles, all on the GPU (one CTA for decode-sized steps; a top-k grid then
one sorting CTA for prefill); `moe_gemm_gate_up` and `moe_gemm_down` are grouped GEMMs
over that list (mma.sync m16n8k16, the weights as the M operand so a tile of 8..64 tokens streams an expert's
weights once); `moe_combine` sums each token's k expert outputs in order (at one token inside the down GEMM: the
last CTA of each row block to finish does it, `moe_gemm_down_one_*`). Nothing comes back to the host, so a
decode step's forward is graph-captured with the expert ids on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..fp8_format import DEFAULT_BLOCK, dequantize_blockwise
from ..tensor import Tensor, bfloat16, float8_e4m3fn, float32, int32
from ._checks import check_tensor, output, same_device
from ._launch import cdiv

MAX_EXPERTS = 512  # the routing kernels keep a token's router row in registers: E / 32 values per lane
MAX_TOP_K = 32


# ---- NumPy reference ----------------------------------------------------------------------------------------------
def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(bfloat16).astype(np.float32)


def moe_route_reference(logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """fp32 router logits [T, E] -> (expert ids int32 [T, k], weights fp32 [T, k]). Softmax in fp32; the k largest
    probabilities, equal ones taken in expert order (lower id first); renormalised to sum 1 when asked."""
    logits = logits.astype(np.float32)
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = z / z.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top_k].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=1).astype(np.float32)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return ids, w.astype(np.float32)


def expert_mlp_reference(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """One expert's SwiGLU MLP on bf16 rows x [n, H] -> float32 [n, H] holding bf16 values (linear's rounding)."""
    inter = gate_up.shape[0] // 2
    gu = _bf16(x.astype(np.float32) @ gate_up.astype(np.float32).T)
    g, u = gu[:, :inter], gu[:, inter:]
    with np.errstate(over="ignore"):
        act = _bf16(_bf16(g / (np.float32(1) + np.exp(-g))) * u)
    return _bf16(act @ down.astype(np.float32).T)


def moe_experts_reference(x: np.ndarray, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray, top_k: int,
                          renormalize: bool, logits: np.ndarray | None = None) -> np.ndarray:
    """float32 [T, H]: the weighted sum of the routed experts' outputs before its final bf16 rounding. `logits`
    (fp32 [T, E]) may be given to skip the router projection."""
    xf = x.astype(np.float32)
    if logits is None:
        logits = xf @ router.astype(np.float32).T
    ids, w = moe_route_reference(logits, top_k, renormalize)
    y = np.zeros((x.shape[0], top_k, x.shape[1]), np.float32)
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        y[tok, slot] = expert_mlp_reference(x[tok], gate_up[e], down[e])
    acc = np.zeros((x.shape[0], x.shape[1]), np.float32)
    for j in range(top_k):  # the kernel's order
        acc += w[:, j:j + 1] * y[:, j]
    return acc


def expected_touched_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts one sparse layer runs for num_tokens tokens when routing is uniform (each token's top_k
    experts a uniform draw of top_k distinct ones of num_experts, tokens independent): an expert is missed by one
    token with probability 1 - k/E, so E * (1 - (1 - k/E)^B) are touched. One token: exactly k; many: E. The
    benchmarks' rooflines and the harness's byte counts use it."""
    if num_tokens <= 0:
        return 0.0
    if num_tokens == 1:
        return float(top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


# ---- the launcher -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int
    hidden: int
    inter: int  # an expert's intermediate size (moe_intermediate_size)


def _check_shape(x: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, top_k, gate_up_scale: Tensor | None = None,
                 down_scale: Tensor | None = None) -> MoeShape:
    check_tensor("x", x, dtype=bfloat16, ndim=2)
    hidden = x.shape[1]
    check_tensor("router", router, dtype=bfloat16, ndim=2)
    num_experts = router.shape[0]
    if router.shape[1] != hidden:
        raise ValueError(f"router: shape {list(router.shape)}, expected [num_experts, {hidden}] (x's hidden size)")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"router: {num_experts} experts, expected 1..{MAX_EXPERTS}")
    fp8 = gate_up.dtype == float8_e4m3fn
    weight_dtype = float8_e4m3fn if fp8 else bfloat16
    check_tensor("gate_up", gate_up, dtype=weight_dtype, ndim=3)
    if gate_up.shape[0] != num_experts or gate_up.shape[2] != hidden or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: shape {list(gate_up.shape)}, expected [{num_experts}, 2 * intermediate, {hidden}]")
    inter = gate_up.shape[1] // 2
    check_tensor("down", down, dtype=weight_dtype, shape=(num_experts, hidden, inter))
    if fp8:
        bo, bi = DEFAULT_BLOCK
        if hidden % bo or inter % bo:
            raise ValueError(f"FP8 experts need hidden ({hidden}) and intermediate ({inter}) sizes that are multiples "
                             f"of the {bo} x {bi} scale block")
        for name, scale, rows, cols in (("gate_up_scale", gate_up_scale, 2 * inter, hidden),
                                        ("down_scale", down_scale, hidden, inter)):
            if scale is None:
                raise ValueError(f"{name}: FP8 (float8_e4m3fn) experts need their block scales")
            check_tensor(name, scale, dtype=float32, shape=(num_experts, rows // bo, cols // bi))
    elif gate_up_scale is not None or down_scale is not None:
        raise ValueError("gate_up_scale / down_scale: given for bfloat16 experts (scales go with float8_e4m3fn ones)")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= min(num_experts,
                                                                                                     MAX_TOP_K):
        raise ValueError(f"top_k must be an integer in 1..{min(num_experts, MAX_TOP_K)}, got {top_k!r}")
    if hidden % 8 or inter % 8:
        raise ValueError(f"hidden ({hidden}) and intermediate ({inter}) sizes must be multiples of 8")
    return MoeShape(num_experts, int(top_k), hidden, inter)


class MoeWorkspace:
    """The buffers of moe_experts for up to `max_tokens` tokens (allocated once: a forward that fits allocates
    nothing, as CUDA graphs need). CPU: none needed."""

    def __init__(self, shape: MoeShape, max_tokens: int, device: str):
        self.shape, self.max_tokens, self.device = shape, max_tokens, device
        if device != "cuda":
            return
        e, k = shape.num_experts, shape.top_k
        entries = max_tokens * k
        # a smaller step may take the other tile size: room for the padded list of either
        rows = max(_max_tiles(entries, e, tile) * tile for tile in _TILES.values())
        self.logits = Tensor.empty((max_tokens, e), float32, "cuda")
        self.ids = Tensor.empty((entries,), int32, "cuda")
        self.weights = Tensor.empty((entries,), float32, "cuda")
        self.sorted = Tensor.empty((max(rows, 1),), int32, "cuda")  # entry (token * k + slot) per row, -1: padding
        # [0]: the tile count; the smallest tile needs the most tiles
        self.tile_expert = Tensor.empty((_max_tiles(entries, e, min(_TILES.values())) + 1,), int32, "cuda")
        self.act = Tensor.empty((max(rows, 1), shape.inter), bfloat16, "cuda")
        self.y = Tensor.empty((entries, shape.hidden), bfloat16, "cuda")  # expert outputs in entry order
        # the one-token down GEMM's fused combine: a counter per row block, zero between launches (the last CTA of
        # a block resets it, so graph replays and every layer sharing this workspace find it zero)
        self.counters = Tensor.zeros((cdiv(shape.hidden, _GEMM["small"].rows),), int32, "cuda")

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens


def moe_workspace(num_experts: int, top_k: int, hidden: int, inter: int, max_tokens: int,
                  device: str) -> MoeWorkspace:
    return MoeWorkspace(MoeShape(num_experts, top_k, hidden, inter), max_tokens, device)


def moe_experts(x: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, top_k: int, renormalize: bool,
                out: Tensor | None = None, workspace: MoeWorkspace | None = None,
                gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> Tensor:
    """x bf16 [T, H] (normalised hidden states) -> out [T, H]: bf16 (stored), or fp32 (the residual stream: the
    bf16-rounded result is added to it). See the module docstring for the arithmetic; FP8 experts: gate_up and down
    float8_e4m3fn with their block scales."""
    shape = _check_shape(x, router, gate_up, down, top_k, gate_up_scale, down_scale)
    scales = (gate_up_scale, down_scale) if gate_up.dtype == float8_e4m3fn else None
    t = x.shape[0]
    device = same_device(x=x, router=router, gate_up=gate_up, down=down, out=out, gate_up_scale=gate_up_scale,
                         down_scale=down_scale)
    out = output("out", out, (t, shape.hidden), out.dtype if out is not None else bfloat16, device)
    if out.dtype not in (bfloat16, float32):
        raise ValueError(f"out: dtype {out.dtype}, expected bfloat16 (store) or float32 (add to the residual)")
    if t == 0:
        return out
    if device == "cpu":
        gu, dn = (gate_up.array, down.array) if scales is None else (
            dequantize_experts(gate_up.array, scales[0].array), dequantize_experts(down.array, scales[1].array))
        acc = moe_experts_reference(x.array, router.array, gu, dn, shape.top_k, renormalize)
        if out.dtype == float32:
            out.array[...] += _bf16(acc)
        else:
            out.array[...] = acc.astype(bfloat16)
        return out
    if workspace is None or not workspace.fits(t) or workspace.shape != shape:
        workspace = MoeWorkspace(shape, t, "cuda")
    _moe_cuda(x, router, gate_up, down, shape, bool(renormalize), out, workspace, t, scales)
    return out


def dequantize_experts(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Stacked FP8 experts q e4m3 [E, rows, cols] with scale [E, rows / 128, cols / 128] -> bf16 [E, rows, cols],
    each expert as fp8_format.py's dequantize_blockwise rounds it (the CPU path; the GPU kernels' weights)."""
    return np.stack([dequantize_blockwise(q[e], scale[e]) for e in range(q.shape[0])])


# ---- CUDA -------------------------------------------------------------------------------------------------------
# Token tiles of the grouped GEMMs (rows of one expert a CTA multiplies): 8 for decode-sized steps (an expert is
# picked by a few tokens; 8 is one mma n-tile), 64 or 128 for prefill. Chosen from the entry count (tokens x k) so
# that the average expert fills its tiles.
_TILES = {"small": 8, "mid": 64, "large": 128}
_LARGE_FROM_ENTRIES = 2048  # below: the small tiles (< 16 entries per expert on average with 128 experts)


def _tile_for(entries: int, num_experts: int = 128) -> str:
    if entries < _LARGE_FROM_ENTRIES:
        return "small"
    # H100, 30B-A3B shapes (docs/kernels/moe.md): at 16 entries per expert the 64-token tiles take 498 us against
    # 697, at 128 the 128-token tiles 1,100 against 1,222
    return "large" if entries >= 96 * num_experts else "mid"


# Up to this many tokens one CTA routes and sorts (a launch less); above, a warp per token over a grid and then a
# sorting CTA (H100, 30B-A3B shapes: 4.9 us one CTA at 1 token, 20.5 us at 64 tokens, where the pair takes ~11).
_ONE_CTA_ROUTE_MAX_TOKENS = 16


# The one-token step's combine runs inside its down GEMM (moe_gemm_down_one_*: the last CTA of each row block
# combines it; a launch less than the down GEMM and moe_combine_*, the same bits). Its grid lets the next launch
# begin only when it ends, as moe_combine_add does (an earlier release let the next GEMV's prefetch crowd its loads).
# Its ring: 128-wide K chunks in 4 stages, 2 dependent load rounds for a CTA's K = 768 (64-wide chunks took 4, the
# whole K in 3 stages of 256 fewer CTAs per SM; both measured slower: docs/kernels/moe.md).
_DOWN_ONE_STAGES, _DOWN_ONE_BK = 4, 128


def _max_tiles(entries: int, num_experts: int, tile: int) -> int:
    """Tiles the padded expert-sorted list can need: sum over experts of ceil(n_e / tile) <= entries / tile +
    (experts with any entry)."""
    return entries // tile + min(num_experts, entries)


def _moe_cuda(x, router, gate_up, down, shape: MoeShape, renormalize: bool, out, ws: MoeWorkspace, t: int,
              scales=None) -> None:
    for _, launch in moe_stages(x, router, gate_up, down, shape, renormalize, out, ws, t, scales=scales):
        launch()


@dataclass(frozen=True)
class _WgmmaTile:
    rows: int  # weight rows per CTA
    threads: int
    stages: int  # of the ring, 64 bf16 of K a stage

    def smem(self, tile: int) -> int:
        """The ring: stages x (weight rows + token rows) x 128 bytes, and 1 KB for its 1024-byte alignment."""
        return self.stages * (self.rows + tile) * 128 + 1024


# Must match moe_sm90.cu's instantiations (XSERV_MOE_WG_GEMM); the token tiles are _TILES'.
_WGMMA_TILES = {"mid": _WgmmaTile(128, 128, 3), "large": _WgmmaTile(128, 256, 3)}


def uses_wgmma() -> bool:
    """Do the mid and large tiles of bf16 experts run moe_sm90.cu's wgmma entries here (the hopper kernel path)?"""
    from ..runtime import get_device
    from ..runtime.arch import KernelPath, arch_path

    return arch_path(get_device().arch) is KernelPath.HOPPER


def moe_stages(x, router, gate_up, down, shape: MoeShape, renormalize: bool, out, ws: MoeWorkspace, t: int,
               size: str | None = None, scales: tuple[Tensor, Tensor] | None = None,
               portable_tiles: bool = False) -> list[tuple[str, object]]:
    """The launches of one moe_experts call in order, as (name, no-argument callable): what _moe_cuda runs, and
    what tools/dev/bench_moe.py times one by one. `size` forces the GEMM tile shape ("small" / "mid" / "large");
    portable_tiles: moe.cu's mma.sync mid and large tiles even on the hopper path (the wgmma tiles' reference in
    tests and benchmarks). scales: FP8 experts' (gate_up_scale, down_scale): the GEMMs' _fp8 entries (the piece moe:e1_x1), the scales
    after the weights."""
    from ..runtime import kernel
    from ..runtime.compiler import piece
    from .gemv import linear_gemv, prefer_gemv
    from .linear import linear

    e, k, h, inter = shape.num_experts, shape.top_k, shape.hidden, shape.inter
    entries = t * k
    logits = ws.logits[:t]
    size = size or _tile_for(entries, e)
    tile = _TILES[size]
    max_tiles = _max_tiles(entries, e, tile)
    fp8 = scales is not None
    family = piece("moe", moe=1, moe_fp8=int(fp8))
    cfg = (_GEMM_FP8 if fp8 else _GEMM)[size]
    sfx = "_fp8" if fp8 else ""
    gate_up_w = (gate_up, scales[0]) if fp8 else (gate_up,)  # the GEMM entries' weight arguments
    down_w = (down, scales[1]) if fp8 else (down,)
    # the mid and large tiles of bf16 experts on the hopper path: moe_sm90.cu's wgmma twins (same token tiles), the
    # weights' tensor maps after the weights (one box a stage: a CTA's rows)
    if size != "small" and not fp8 and not portable_tiles and uses_wgmma():
        from ..runtime import get_runtime
        from ..runtime.tma import gate_up_tensor_map, matrix_tensor_map

        wg = _WGMMA_TILES[size]
        gemm_family, gemm_entry = piece("moe_sm90", moe=1), f"moe_wg_{{}}_{size}_tma"
        gemm_rows, gemm_threads, gemm_smem = wg.rows, wg.threads, wg.smem(tile)
        rt = get_runtime()
        gate_up_w = (gate_up, gate_up_tensor_map(rt, gate_up.ptr, e, inter, h, wg.rows // 16))
        down_w = (down, matrix_tensor_map(rt, down.ptr, e * h, inter, wg.rows))
    else:
        gemm_family, gemm_entry, gemm_smem = family, f"moe_gemm_{{}}_{size}{sfx}", cfg.smem
        gemm_rows, gemm_threads = cfg.rows, cfg.threads
    gate_up_gemm = (gemm_family, gemm_entry.format("gate_up"))  # (family, entry) of the tile GEMMs
    down_gemm = (gemm_family, gemm_entry.format("down"))
    mode = "add" if out.dtype == float32 else "store"  # into the fp32 residual, or a bf16 output
    one_token = t == 1 and size == "small" and e <= 128
    gemv = prefer_gemv(t, e, h)  # (checks gemv_supported itself)
    per_lane = 4 if e <= 128 else 16  # the router row in registers: experts per lane
    flag = np.int32(1 if renormalize else 0)
    if t <= _ONE_CTA_ROUTE_MAX_TOKENS:  # routing and the sorted list in one CTA
        route = [("route", lambda: kernel(family, f"moe_route_p{per_lane}")(
            1, 256, logits, ws.ids, ws.weights, ws.sorted, ws.tile_expert, np.int32(t), np.int32(e), np.int32(k),
            flag, np.int32(tile), np.int32(max_tiles), smem=3 * e * 4, pdl=True))]
    else:  # a warp per token over a grid, then one CTA sorts
        route = [("topk", lambda: kernel(family, f"moe_topk_p{per_lane}")(
                     cdiv(t, 8), 256, logits, ws.ids, ws.weights, np.int32(t), np.int32(e), np.int32(k), flag, pdl=True)),
                 ("sort", lambda: kernel(family, "moe_sort")(
                     1, 1024, ws.ids, ws.sorted, ws.tile_expert, np.int32(entries), np.int32(e), np.int32(tile),
                     np.int32(max_tiles), smem=3 * e * 4, pdl=True))]
    return [
        ("router", (lambda: linear_gemv(x, router, out=logits)) if gemv else (lambda: linear(x, router, out=logits))),
        # gate/up: a CTA's rows are `rows // 2` gate rows and the matching up rows (its epilogue pairs them)
        *([("gate_up+route", lambda: kernel(family, f"moe_gemm_gate_up_one{sfx}")(
            (cdiv(inter, cfg.rows // 2), k), cfg.threads, x, *gate_up_w, logits, ws.ids, ws.weights, ws.sorted,
            ws.tile_expert, ws.act, np.int32(k), np.int32(h), np.int32(inter), np.int32(e), flag, smem=cfg.smem,
            pdl=True))] if one_token else [*route, ("gate_up", lambda: kernel(*gate_up_gemm)(
                (cdiv(inter, gemm_rows // 2), max_tiles), gemm_threads, x, *gate_up_w, ws.sorted, ws.tile_expert,
                ws.act, np.int32(k), np.int32(h), np.int32(inter), smem=gemm_smem, pdl=True))]),
        # one token: the combine inside the down GEMM (the last CTA of each row block; same grid, same bits)
        *([("down+combine", lambda: kernel(family, f"moe_gemm_down_one_{mode}_k128{sfx}")(
            (cdiv(h, cfg.rows), max_tiles), cfg.threads, ws.act, *down_w, ws.sorted, ws.tile_expert, ws.y,
            np.int32(k), np.int32(inter), np.int32(h), ws.weights, out, ws.counters,
            smem=_gemm_config(1, 1, 4, _TILES["small"], _DOWN_ONE_STAGES, _DOWN_ONE_BK, fp8).smem, pdl=True))]
          if one_token else [
            ("down", lambda: kernel(*down_gemm)(
                (cdiv(h, gemm_rows), max_tiles), gemm_threads, ws.act, *down_w, ws.sorted, ws.tile_expert, ws.y,
                np.int32(k), np.int32(inter), np.int32(h), smem=gemm_smem, pdl=True)),
            ("combine", lambda: kernel(family, f"moe_combine_{mode}")(
                cdiv(t * (h // 8), 256), 256, ws.y, ws.weights, out, np.int32(t), np.int32(k), np.int32(h),
                pdl=True))]),
    ]


@dataclass(frozen=True)
class _GemmConfig:
    rows: int  # weight rows per CTA
    threads: int
    smem: int  # dynamic shared memory bytes (the cp.async ring)


# Must match the instantiations in cuda_src/moe.cu (XSERV_MOE_GEMM): rows = 32 x warps_m, the ring stages x
# (rows + tile) x bk bf16 of K; FP8 (the _fp8 entries): stages x (rows e4m3 + tile bf16) x bk.
def _gemm_config(warps_m: int, warps_n: int, warps_k: int, tile: int, stages: int, bk: int,
                 fp8: bool = False) -> _GemmConfig:
    rows = 32 * warps_m
    smem = stages * (rows + 2 * tile) * bk if fp8 else stages * (rows + tile) * bk * 2
    return _GemmConfig(rows, 32 * warps_m * warps_n * warps_k, smem)


_GEMM_SHAPES = {"small": dict(warps_m=1, warps_n=1, warps_k=4, tile=8, stages=4, bk=64),
                "mid": dict(warps_m=4, warps_n=1, warps_k=1, tile=64, stages=3, bk=64),
                "large": dict(warps_m=4, warps_n=2, warps_k=1, tile=128, stages=3, bk=64)}
_GEMM = {size: _gemm_config(**shape) for size, shape in _GEMM_SHAPES.items()}
_GEMM_FP8 = {size: _gemm_config(**shape, fp8=True) for size, shape in _GEMM_SHAPES.items()}
