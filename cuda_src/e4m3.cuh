// e4m3 (float8_e4m3fn) conversions for the FP8 KV cache (kv_cache.cu's write_kv_fp8 / dequantize_kv_blocks_fp8,
// attention_decode_fp8.cu) and the FP8 GEMV (gemv_fp8.cu). Both directions have a hardware form from sm_89
// (cvt ... e4m3x2) and a bit-manipulation form below it (sm_80 has no FP8 conversion); the two give the same bits, which tests/ops/test_attention_fp8_kv.py
// checks (the soft forms re-implemented in NumPy, xserv/ops/attention/fp8_kv.py, against ml_dtypes; on a GPU the
// XSERV_ARCH=sm_80 run against the native one).
//
// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; normals 2^-6 .. 448, subnormals m * 2^-9 (m = 1..7), no
// infinities, NaN = S.1111.111. Encoding rounds to nearest even and saturates: |x| > 448 -> 448 (the cvt's
// .satfinite), so a value past the range costs accuracy, never a NaN in the cache. NaN stays NaN (0x7f).
//
// The decode direction (e4m3x4_to_half2x2_soft: exact, every e4m3 value is an f16 normal) is also the FP8 GEMV's
// (gemv_fp8.cu includes this header).
#pragma once
#include <cuda_fp16.h>

namespace xserv {
namespace e4m3 {

// ---- float -> e4m3 ----------------------------------------------------------------------------------------------
// Soft: one float -> its e4m3 code (low byte), round to nearest even, saturating.
//   |x| >= 2^-6 (normal range): round the 23-bit float mantissa to 3 bits in the integer domain (add 2^19 - 1 plus
//   the kept lsb, the classic RNE trick: a carry out of the mantissa bumps the exponent, which is what rounding up
//   to the next binade means), then rebias the exponent (127 -> 7): code = (bits >> 20) - (120 << 3).
//   |x| < 2^-6 (subnormal range): m = rint(|x| * 2^9) (exact scaling by a power of two, then __float2int_rn: RNE);
//   m = 8 is the code of 2^-6, the smallest normal, so the same byte is right at the boundary.
__device__ __forceinline__ unsigned float_to_e4m3_soft(float x) {
    const unsigned bits = __float_as_uint(x);
    const unsigned sign = (bits >> 24) & 0x80u;
    const unsigned mag = bits & 0x7fffffffu;
    if (mag > 0x7f800000u) return 0x7fu;             // NaN
    if (mag > 0x43e00000u) return sign | 0x7eu;      // |x| > 448 (inf included): saturate to 448
    if (mag < 0x3c800000u) {                         // |x| < 2^-6
        const int m = __float2int_rn(__uint_as_float(mag) * 512.f);
        return sign | (unsigned)m;
    }
    const unsigned rounded = mag + 0x7ffffu + ((mag >> 20) & 1u);
    return sign | ((rounded >> 20) - (120u << 3));  // <= 0x7e: 448 * (1 + 2^-4) rounds to 448 at most (checked above)
}

// Two floats -> two codes in the low 16 bits (a in byte 0, b in byte 1).
__device__ __forceinline__ unsigned float2_to_e4m3x2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    // cvt packs its first source into the upper byte: b there, a in the lower one.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(b), "f"(a));
    return r;
#else
    return float_to_e4m3_soft(a) | (float_to_e4m3_soft(b) << 8);
#endif
}

// Eight floats -> eight codes (byte i = f[i]).
__device__ __forceinline__ uint2 float8_to_e4m3x8(const float (&f)[8]) {
    uint2 r;
    r.x = float2_to_e4m3x2(f[0], f[1]) | (float2_to_e4m3x2(f[2], f[3]) << 16);
    r.y = float2_to_e4m3x2(f[4], f[5]) | (float2_to_e4m3x2(f[6], f[7]) << 16);
    return r;
}

// ---- e4m3 -> float ----------------------------------------------------------------------------------------------
// Soft: four codes (bytes 0..3 of v) -> f16x2 words (lo: codes 0, 1; hi: 2, 3), exact. Each byte goes to the high
// byte of a 16-bit lane, f16 bits = sign | (eeeemmm << 7) = the value times 2^-8 (the biases 15 and 7; a subnormal
// lands on the f16 subnormal of the same scaling), times 256 in f16 (exact). NaN codes get an f16 NaN.
__device__ __forceinline__ void e4m3x4_to_half2x2_soft(unsigned v, unsigned& lo, unsigned& hi) {
    // byte b -> the high byte of a 16-bit lane (the low byte zero): lo = [b1 00 b0 00], hi = [b3 00 b2 00]
    const unsigned a = __byte_perm(v, 0u, 0x1404), b = __byte_perm(v, 0u, 0x3424);
    // f16 bits = sign | (eeeemmm << 7): the code's 7 low bits moved down one place, the sign kept (value * 2^-8)
    lo = ((a >> 1) & 0x3f803f80u) | (a & 0x80008000u);
    hi = ((b >> 1) & 0x3f803f80u) | (b & 0x80008000u);
    // NaN codes (7 low bits all ones): adding 1 to each byte's 7 low bits carries into its bit 7 only for 0x7f.
    const unsigned nan = ((v & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
    if (nan) {
        const unsigned na = __byte_perm(nan, 0u, 0x1404), nb = __byte_perm(nan, 0u, 0x3424);  // bit 15 of a lane
        lo |= na - (na >> 6);  // 0x8000 - 0x0200 = 0x7e00: exponent 31, mantissa nonzero -> NaN
        hi |= nb - (nb >> 6);
    }
    const __half2 k256 = __half2(__half2_raw{0x5c00, 0x5c00});  // 256.0 in f16
    __half2_raw rl, rh;
    rl.x = static_cast<unsigned short>(lo & 0xffffu); rl.y = static_cast<unsigned short>(lo >> 16);
    rh.x = static_cast<unsigned short>(hi & 0xffffu); rh.y = static_cast<unsigned short>(hi >> 16);
    const __half2 ml = __hmul2(__half2(rl), k256), mh = __hmul2(__half2(rh), k256);
    lo = *reinterpret_cast<const unsigned*>(&ml);
    hi = *reinterpret_cast<const unsigned*>(&mh);
}

__device__ __forceinline__ float2 half2_bits_to_float2(unsigned h) {
    __half2_raw r;
    r.x = static_cast<unsigned short>(h & 0xffffu);
    r.y = static_cast<unsigned short>(h >> 16);
    return __half22float2(__half2(r));
}

// Four codes -> four exact floats (code i -> f[i]): the hardware conversion on sm_89+ unless HW is false (the FP8
// GEMV's _soft entries, which its GPU test compares with the hardware ones bit for bit), the soft one below sm_89.
// Four codes -> two f16x2 words, exact (lo: codes 0, 1; hi: codes 2, 3; the lower code in the low half).
template <bool HW = true>
__device__ __forceinline__ void e4m3x4_to_half2x2(unsigned v, unsigned& lo, unsigned& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if (HW) {
        // the low byte of each 16-bit source goes to the low half (cuda_fp8.hpp's __nv_cvt_fp8x2_to_halfraw2)
        asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
            : "=r"(lo), "=r"(hi)
            : "r"(v));
    } else {
        e4m3x4_to_half2x2_soft(v, lo, hi);
    }
#else
    e4m3x4_to_half2x2_soft(v, lo, hi);
#endif
}

template <bool HW = true>
__device__ __forceinline__ void e4m3x4_to_float4(unsigned v, float* f) {
    unsigned lo, hi;
    e4m3x4_to_half2x2<HW>(v, lo, hi);
    const float2 a = half2_bits_to_float2(lo), b = half2_bits_to_float2(hi);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}

// Eight codes (an 8-byte load) -> eight floats.
__device__ __forceinline__ void e4m3x8_to_float(const uint2& v, float (&f)[8]) {
    e4m3x4_to_float4(v.x, f);
    e4m3x4_to_float4(v.y, f + 4);
}

}  // namespace e4m3
}  // namespace xserv
