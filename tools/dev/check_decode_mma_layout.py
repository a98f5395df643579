"""NumPy emulation of the FP8 decode _mma stage math's fragment mapping (attention_decode_v4.cuh, MMA branch): which lane
reads which ring chunk into which m16n8k16 register (PTX fragment layouts), and where each accumulator's output
dim lands, for one warp and one 16-key stage, checked against the direct products S = q K^T and O = P V.

    python tools/dev/check_decode_mma_layout.py G        (G = query heads per kv head, 1..8)
"""
import numpy as np
rng = np.random.default_rng(0)
import sys
D, G, U, KPS, LPK = 128, int(sys.argv[1]), 8, 2, 16
KS, QC, NT = D // 16, D // 32, D // 8
q = rng.standard_normal((G, D)).astype(np.float32)
K = rng.standard_normal((16, D)).astype(np.float32)   # stage keys 0..15 (already dequantized values)
V = rng.standard_normal((16, D)).astype(np.float32)
# ring: slot u, lane L = sub*16 + c holds key u*2+sub chunk c (8 values)
def at(slot, key, chunk, which):  # returns the 8 values (K or V) the address names
    u = slot if which == "K" else slot - U
    assert u == key // KPS
    lane = (key % KPS) * LPK + chunk
    src = K if which == "K" else V
    k = u * KPS + lane // LPK
    c = lane % LPK
    return src[k, 8 * c: 8 * c + 8]
A = np.zeros((KS, 16, 16)); B = np.zeros((2, KS, 16, 8))
# Q fragments (a0 = reg0 row g cols 2t..2t+1, a2 = reg2 row g cols 2t+8..)
for lane in range(32):
    gq, tq = lane >> 2, lane & 3
    for i in range(QC):
        cc = tq + 4 * i
        f = q[gq, 8 * cc: 8 * cc + 8] if gq < G else np.zeros(8)
        for h in range(2):
            kk = 2 * i + h
            A[kk, gq, 2 * tq: 2 * tq + 2] = f[4 * h: 4 * h + 2]
            A[kk, gq, 2 * tq + 8: 2 * tq + 10] = f[4 * h + 2: 4 * h + 4]
    for nb in range(2):
        key = 8 * nb + gq
        for i in range(QC):
            kc = at(key // KPS, key, tq + 4 * i, "K")
            for h in range(2):
                kk = 2 * i + h
                B[nb, kk, 2 * tq: 2 * tq + 2, gq] = kc[4 * h: 4 * h + 2]      # b0 = k01 (h=0) / k45 (h=1)
                B[nb, kk, 2 * tq + 8: 2 * tq + 10, gq] = kc[4 * h + 2: 4 * h + 4]  # b1 = k23 / k67
S = np.zeros((2, 16, 8))
for nb in range(2):
    for kk in range(KS):
        S[nb] += A[kk] @ B[nb, kk]
# lane scores: head gq, keys 8nb + 2tq + e
want_S = q @ K.T   # [G, 16]
for lane in range(32):
    gq, tq = lane >> 2, lane & 3
    if gq >= G: continue
    for nb in range(2):
        for e in range(2):
            assert np.isclose(S[nb][gq, 2 * tq + e], want_S[gq, 8 * nb + 2 * tq + e], atol=1e-4), (lane, nb, e)
print("S ok")
P = np.exp(want_S - want_S.max(1, keepdims=True))  # any p
# PV: A = P [16 x 16] (rows heads), B per n-tile from V pairs
Ap = np.zeros((16, 16)); Bv = np.zeros((NT, 16, 8))
for lane in range(32):
    gq, tq = lane >> 2, lane & 3
    p = np.zeros((2, 2))
    if gq < G:
        for nb in range(2):
            for e in range(2):
                p[nb, e] = P[gq, 8 * nb + 2 * tq + e]
    Ap[gq, 2 * tq: 2 * tq + 2] = p[0]
    Ap[gq, 2 * tq + 8: 2 * tq + 10] = p[1]
    for half in range(NT // 8):
        cv = gq + 8 * half
        v = [at(U + key // KPS, key, cv, "V") for key in (2 * tq, 2 * tq + 1, 2 * tq + 8, 2 * tq + 9)]
        for w in range(2):
            for pr in range(2):
                for x in range(2):   # n-tile nt + x: byte e = 4w + 2pr + x
                    e = 4 * w + 2 * pr + x
                    nt = 8 * half + 4 * w + 2 * pr + x
                    Bv[nt, 2 * tq, gq], Bv[nt, 2 * tq + 1, gq] = v[0][e], v[1][e]
                    Bv[nt, 2 * tq + 8, gq], Bv[nt, 2 * tq + 9, gq] = v[2][e], v[3][e]
O = np.zeros((G, D))
want_O = P @ V  # [G, D]
for nt in range(NT):
    C = Ap @ Bv[nt]
    for lane in range(32):
        gq, tq = lane >> 2, lane & 3
        if gq >= G: continue
        for e in range(2):
            O[gq, 8 * (2 * tq + e + 8 * (nt // 8)) + nt % 8] = C[gq, 2 * tq + e]
assert np.allclose(O, want_O, atol=1e-4), np.abs(O - want_O).max()
print("O ok")
