"""NumPy emulation of moe_sm90.cu's index math: the CTA's weight rows (gate/up: groups of 8 alternating gate and up
rows), wgmma's accumulator layout (d[4 j + 2 r + e] = D[16 w + lane / 4 + 8 r][8 j + 2 (lane % 4) + e], wgmma.cuh)
and the epilogue's output indices, checked against the direct products for every shape's entries: each output
(gate/up column or down row, token) is produced once, by the thread holding its value (gate/up: with its up value).

    python tools/dev/check_moe_wgmma_layout.py
"""
import numpy as np

rng = np.random.default_rng(0)
def run(WG, MB, TILE, GATE_UP, N=136, K=64, row_block=1):
    ROWS = 64 * WG * MB
    row0 = row_block * (ROWS // 2 if GATE_UP else ROWS)
    W = rng.standard_normal((2 * N if GATE_UP else N, K))
    X = rng.standard_normal((TILE, K))
    def weight_row(r):
        if GATE_UP:
            j = row0 + (r >> 4) * 8 + (r & 7)
            return (N + j if r & 8 else j), j < N
        return row0 + r, row0 + r < N
    Wcta = np.zeros((ROWS, K))
    for r in range(ROWS):
        wr, ok = weight_row(r)
        if ok: Wcta[r] = W[wr]
    D = Wcta @ X.T  # ROWS x TILE
    gate_full = W[:N] @ X.T if GATE_UP else None
    up_full = W[N:] @ X.T if GATE_UP else None
    full = W @ X.T
    checked = 0
    for wg in range(WG):
        for wq in range(4):
            for lane in range(32):
                g, t2 = lane >> 2, 2 * (lane & 3)
                for mb in range(MB):
                    block = wg * MB + mb
                    acc = np.zeros(TILE // 2)
                    for j in range(TILE // 8):
                        for r in range(2):
                            for e in range(2):
                                acc[4 * j + 2 * r + e] = D[block * 64 + 16 * wq + g + 8 * r, 8 * j + t2 + e]
                    for j in range(TILE // 8):
                        for e in range(2):
                            n = 8 * j + t2 + e
                            if GATE_UP:
                                col = row0 + block * 32 + 8 * wq + g
                                if col >= N: continue
                                assert np.isclose(acc[4 * j + e], gate_full[col, n]) and np.isclose(acc[4 * j + 2 + e], up_full[col, n])
                                checked += 1
                            else:
                                for r in range(2):
                                    h = row0 + block * 64 + 16 * wq + g + 8 * r
                                    if h < N:
                                        assert np.isclose(acc[4 * j + 2 * r + e], full[h, n]); checked += 1
    # every output (col/h in this CTA's range, n) covered exactly
    want = (min(N, row0 + ROWS // 2) - row0 if GATE_UP else min(N, row0 + ROWS) - row0) * TILE
    assert checked == want, (checked, want)
    return checked
for args in [(wg, mb, tile, gate_up) for wg, mb, tile in ((1, 2, 64), (2, 1, 128))
             for gate_up in (True, False)]:
    for rb in (0, 1):
        print(args, rb, run(*args, N=300 if not args[3] else 136, row_block=rb))
