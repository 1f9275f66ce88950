/* What the x86 layers (simd_avx2.h, simd_avx512.h) share: SSE helpers on the low bytes of a
 * 128-bit register, written once. */
#ifndef TM_SIMD_X86_H
#define TM_SIMD_X86_H
#include <immintrin.h>

/* 3-bit codes' 6-bit scale codes (tm.h scale6_group) of up to 16 blocks, less 32, as int8
 * (vf_scales6): l holds their low nibbles, h their top pairs, spread here to a byte per
 * block (byte k: h's nibble k & 1 of byte k / 2) */
static inline void tm_scales6_bytes(__m128i l, __m128i h, __m128i *c0, __m128i *c1) {
    const __m128i m4 = _mm_set1_epi8(15), m3 = _mm_set1_epi8(3), off = _mm_set1_epi8(32);
    const __m128i dup = _mm_shuffle_epi8(h, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
    const __m128i odd = _mm_setr_epi8(0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1);
    const __m128i t = _mm_blendv_epi8(_mm_and_si128(dup, m4), _mm_and_si128(_mm_srli_epi16(dup, 4), m4), odd);
    *c0 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(l, m4), _mm_slli_epi16(_mm_and_si128(t, m3), 4)), off);
    *c1 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(l, 4), m4),
                                    _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(t, 2), m3), 4)),
                       off);
}

#endif
