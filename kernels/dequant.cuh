// Storage decoding for table rows: the CUDA C twin of ngram_cupy/dequant.py, bit for bit.
//
// A stored value (float32, float16, bfloat16 or float8 e4m3fn, as raw bits; or one E2M1 code of
// an NVFP4 row, with its E4M3 block scale) is decoded to float32, multiplied by its block scale
// (exact) and the table's float32 scale and rounded once, to nearest even, to the output format. NaNs come out as one canonical quiet NaN so that every backend gives the same
// bits. Plain integer arithmetic only: no CUDA headers needed, and the host test suite compiles
// this file with a C++ compiler too (NGRAM_HOST_TEST).
#pragma once

#ifdef NGRAM_HOST_TEST
#include <cstring>
#define NGRAM_DEVICE inline
static inline float __uint_as_float(unsigned int b) { float f; std::memcpy(&f, &b, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int b; std::memcpy(&b, &f, 4); return b; }
#else
#define NGRAM_DEVICE __device__ __forceinline__
#endif

namespace ngram {

// Format codes, the same numbers as dequant.py.
enum : int { FLOAT32 = 0, FLOAT16 = 1, BFLOAT16 = 2, FLOAT8_E4M3 = 3, NVFP4 = 4, MXFP8 = 5 };

// The unsigned type of one stored element (NVFP4: a byte of two codes).
template <int CODE> struct Raw { using type = unsigned short; };
template <> struct Raw<FLOAT32> { using type = unsigned int; };
template <> struct Raw<FLOAT8_E4M3> { using type = unsigned char; };
template <> struct Raw<NVFP4> { using type = unsigned char; };
template <> struct Raw<MXFP8> { using type = unsigned char; };

// Block-scaled formats: values per stored element, values per block scale byte (formats.py).
template <int CODE> struct Blocks { static constexpr int PACK = 1, BLOCK = 0; };
template <> struct Blocks<NVFP4> { static constexpr int PACK = 2, BLOCK = 16; };
template <> struct Blocks<MXFP8> { static constexpr int PACK = 1, BLOCK = 32; };

// Stored bits -> float32 (exact: every format widens).
template <int CODE>
NGRAM_DEVICE float decode(unsigned int b) {
    if constexpr (CODE == FLOAT32) {
        return __uint_as_float(b);
    } else if constexpr (CODE == BFLOAT16) {
        return __uint_as_float(b << 16);
    } else if constexpr (CODE == FLOAT16) {
        if ((b & 0x7C00u) == 0x7C00u) {  // infinity or NaN
            return __uint_as_float(((b & 0x8000u) << 16) | 0x7F800000u | ((b & 0x3FFu) << 13));
        }
        // Exponent and mantissa shifted into place read as 2**-112 times the value (subnormals
        // included); multiplying by 2**112 is exact.
        return __uint_as_float(((b & 0x8000u) << 16) | ((b & 0x7FFFu) << 13)) * 0x1p112f;
    } else if constexpr (CODE == NVFP4) {  // one E2M1 code S.EE.M: [0, .5, 1, 1.5, 2, 3, 4, 6]
        const unsigned int magnitude = b & 7u, sign = (b & 8u) << 28;
        if (magnitude < 2u) return __uint_as_float(sign | (magnitude ? 0x3F000000u : 0u));
        return __uint_as_float(sign | ((magnitude + 252u) << 22));
    } else {  // FLOAT8_E4M3 ("fn": no infinities, NaN only at S.1111.111); the same with 2**120
        if ((b & 0x7Fu) == 0x7Fu) return __uint_as_float(0x7FC00000u);
        return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20)) * 0x1p120f;
    }
}

// IEEE half bits of non-NaN float32 bits, rounded to nearest even.
NGRAM_DEVICE unsigned int float16_bits(unsigned int b) {
    const unsigned int sign = (b >> 16) & 0x8000u;
    const unsigned int magnitude = b & 0x7FFFFFFFu;
    if (magnitude >= 0x477FF000u) return sign | 0x7C00u;  // 65520 and up round to infinity
    if (magnitude >= 0x38800000u) {  // normal half: rebias, round off 13 mantissa bits
        const unsigned int rebiased = magnitude - 0x38000000u;
        return sign | ((rebiased + 0xFFFu + ((rebiased >> 13) & 1u)) >> 13);
    }
    const unsigned int exponent = magnitude >> 23;
    if (exponent < 102u) return sign;  // below 2**-25: rounds to zero
    const unsigned int significand = (magnitude & 0x7FFFFFu) | 0x800000u;
    const unsigned int shift = 126u - exponent;  // units of the smallest subnormal, 2**-24
    unsigned int quotient = significand >> shift;
    const unsigned int remainder = significand & ((1u << shift) - 1u);
    const unsigned int half = 1u << (shift - 1u);
    if (remainder > half || (remainder == half && (quotient & 1u))) quotient += 1u;
    return sign | quotient;
}

// float32 -> output bits, rounded to nearest even; NaN -> the canonical quiet NaN.
template <int OUT_CODE>
NGRAM_DEVICE unsigned int encode(float value) {
    const unsigned int b = __float_as_uint(value);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
        return OUT_CODE == FLOAT32 ? 0x7FC00000u : (OUT_CODE == BFLOAT16 ? 0x7FC0u : 0x7E00u);
    }
    if constexpr (OUT_CODE == FLOAT32) {
        return b;
    } else if constexpr (OUT_CODE == BFLOAT16) {
        return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    } else {
        return float16_bits(b);
    }
}

// One stored value to output bits: decode, scale in float32, round once.
template <int CODE, int OUT_CODE>
NGRAM_DEVICE unsigned int convert(unsigned int bits, float scale) {
    return encode<OUT_CODE>(decode<CODE>(bits) * scale);
}

// A block scale byte of a block-scaled format as float32: NVFP4's E4M3; MXFP8's UE8M0 as the
// float32 of bits b << 23 (0.0 for byte 0, +inf for 255, as vLLM reads it).
template <int CODE>
NGRAM_DEVICE float block_value(unsigned int b) {
    if constexpr (CODE == MXFP8) return __uint_as_float(b << 23);
    return decode<FLOAT8_E4M3>(b);
}

// One value of a block-scaled format: (value * block) * scale in float32, rounded once.
template <int CODE, int OUT_CODE>
NGRAM_DEVICE unsigned int convert_blocked(unsigned int bits, float block, float scale) {
    return encode<OUT_CODE>((decode<CODE>(bits) * block) * scale);
}

}  // namespace ngram
