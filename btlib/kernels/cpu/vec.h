// vec.h: the one SIMD vector type the CPU attention kernels are written against.
//
// One kernel source, four builds, chosen by the compiler flags btlib passes (build.py):
//   AVX-512  W = 16 floats, 32 zmm registers: micro-tiles of kR = 6 rows x kNV = 4 vectors
//   AVX2+FMA W = 8 floats, 16 ymm registers:  kR = 6 rows x kNV = 2 vectors
//   NEON     W = 4 floats, 32 q registers:    kR = 6 rows x kNV = 4 vectors (aarch64, Apple M*)
//   portable W = 8 floats as plain arrays (the compiler vectorises what it can): 4 x 2
// A micro-tile keeps kR * kNV accumulators plus kNV loaded vectors and one broadcast in
// registers: 6 * 4 + 4 + 1 = 29 of 32 (zmm, q); 6 * 2 + 2 + 1 = 15 of 16 ymm (as AVX2 sgemms do).
//
// NaN: vexp2 must return NaN for a NaN input (a NaN score makes its softmax row NaN, as in the
// reference). max instructions drop NaN in one operand, so the clamp puts x second: x86 maxps
// returns its second operand when either is NaN; NEON fmax returns NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define BTLIB_VEC_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BTLIB_VEC_AVX2 1
#elif defined(__aarch64__) || defined(_M_ARM64)
#include <arm_neon.h>
#define BTLIB_VEC_NEON 1
#endif

namespace btlib_vec {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^f on f in [-0.5, 0.5]: Taylor series of exp(f ln 2) to degree 7, error < 1e-8 relative.
constexpr float kExp2Coef[8] = {1.0f, 0.6931471805599453f, 0.2402265069591007f, 0.05550410866482158f,
                                0.009618129107628477f, 0.0013333558146428443f, 0.00015403530393381606f,
                                1.525273380405984e-05f};

#if defined(BTLIB_VEC_AVX512)
constexpr const char* kIsa = "avx512";
constexpr int W = 16, kR = 6, kNV = 4;
using vf = __m512;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
inline float vhsum(vf a) { return _mm512_reduce_add_ps(a); }
// lanes outside [lo, hi) become `fill` (lo, hi may lie outside [0, W])
inline __mmask16 first_lanes(int n) { return n >= W ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); }
inline vf vkeep_range(vf x, int lo, int hi, float fill) {
  return _mm512_mask_blend_ps(__mmask16(first_lanes(hi) & ~first_lanes(lo)), _mm512_set1_ps(fill), x);
}
// test == -inf ? a : b, lane by lane (the online softmax's guard for rows with no finite score yet)
inline vf vselect_neginf(vf test, vf a, vf b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(test, vset1(-INFINITY), _CMP_EQ_OQ), b, a); }
// 2^x for x <= 0: n = round(x), 2^(x - n) by polynomial, then scalef multiplies by 2^n.
// x < -126 (including -inf) gives exact 0, never a denormal: denormal P cost microcode assists in
// scalef and in P V's FMAs, and ALiBi's far keys (bias -slope |d| log2 e, below -126 for |d| > ~175
// at slope 1/2) made v3 2.8x slower than without bias (T 1024, H 12, D 64; 2-core Xeon, AVX-512);
// flushed, 1.1x. What is lost is under 2^-126 of a row sum >= 1. NaN stays NaN (the unordered
// compare keeps its lane).
inline vf vexp2(vf x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);  // x >= -126 or NaN
  x = _mm512_max_ps(_mm512_set1_ps(-126.0f), x);
  const vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = _mm512_sub_ps(x, n);
  vf p = _mm512_set1_ps(kExp2Coef[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Coef[i]));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

#elif defined(BTLIB_VEC_AVX2)
constexpr const char* kIsa = "avx2";
constexpr int W = 8, kR = 6, kNV = 2;
using vf = __m256;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline float vhmax(vf a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline float vhsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline vf vkeep_range(vf x, int lo, int hi, float fill) {
  const vf lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const vf keep = _mm256_and_ps(_mm256_cmp_ps(lane, _mm256_set1_ps(float(lo)), _CMP_GE_OQ),
                                _mm256_cmp_ps(lane, _mm256_set1_ps(float(hi)), _CMP_LT_OQ));
  return _mm256_blendv_ps(_mm256_set1_ps(fill), x, keep);
}
inline vf vselect_neginf(vf test, vf a, vf b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(test, vset1(-INFINITY), _CMP_EQ_OQ)); }
// 2^x for x <= 0; 2^n is built in the exponent bits, so x is clamped at -126 (2^-126 ~ 1e-38,
// which the masks then replace by an exact 0 where a key is not allowed). A NaN x gives a NaN
// polynomial; the exponent bits of the integer-indefinite n do not matter then.
inline vf vexp2(vf x) {
  x = _mm256_max_ps(_mm256_set1_ps(-126.0f), x);
  const vf n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = _mm256_sub_ps(x, n);
  vf p = _mm256_set1_ps(kExp2Coef[7]);
  for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Coef[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#elif defined(BTLIB_VEC_NEON)
constexpr const char* kIsa = "neon";
constexpr int W = 4, kR = 6, kNV = 4;
using vf = float32x4_t;
inline vf vload(const float* p) { return vld1q_f32(p); }
inline void vstore(float* p, vf x) { vst1q_f32(p, x); }
inline vf vset1(float a) { return vdupq_n_f32(a); }
inline vf vzero() { return vdupq_n_f32(0.0f); }
inline vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }  // c + a * b, one rounding
inline vf vmul(vf a, vf b) { return vmulq_f32(a, b); }
inline vf vadd(vf a, vf b) { return vaddq_f32(a, b); }
inline vf vsub(vf a, vf b) { return vsubq_f32(a, b); }
inline vf vmax(vf a, vf b) { return vmaxq_f32(a, b); }
inline vf vdiv(vf a, vf b) { return vdivq_f32(a, b); }
inline vf vabs(vf a) { return vabsq_f32(a); }
inline float vhmax(vf a) { return vmaxvq_f32(a); }
inline float vhsum(vf a) { return vaddvq_f32(a); }
inline vf vkeep_range(vf x, int lo, int hi, float fill) {
  const float lanes[4] = {0, 1, 2, 3};
  const vf lane = vld1q_f32(lanes);
  const uint32x4_t keep = vandq_u32(vcgeq_f32(lane, vdupq_n_f32(float(lo))), vcltq_f32(lane, vdupq_n_f32(float(hi))));
  return vbslq_f32(keep, x, vdupq_n_f32(fill));
}
inline vf vselect_neginf(vf test, vf a, vf b) { return vbslq_f32(vceqq_f32(test, vdupq_n_f32(-INFINITY)), a, b); }
// 2^x for x <= 0, as on AVX2: polynomial times 2^n built in the exponent bits, x clamped at -126.
inline vf vexp2(vf x) {
  x = vmaxq_f32(vdupq_n_f32(-126.0f), x);
  const vf n = vrndnq_f32(x);
  const vf f = vsubq_f32(x, n);
  vf p = vdupq_n_f32(kExp2Coef[7]);
  for (int i = 6; i >= 0; --i) p = vfmaq_f32(vdupq_n_f32(kExp2Coef[i]), p, f);
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

#else
constexpr const char* kIsa = "portable";
constexpr int W = 8, kR = 4, kNV = 2;
struct vf { float v[W]; };
inline vf vload(const float* p) { vf r; for (int i = 0; i < W; ++i) r.v[i] = p[i]; return r; }
inline void vstore(float* p, vf x) { for (int i = 0; i < W; ++i) p[i] = x.v[i]; }
inline vf vset1(float a) { vf r; for (int i = 0; i < W; ++i) r.v[i] = a; return r; }
inline vf vzero() { return vset1(0.0f); }
inline vf vfma(vf a, vf b, vf c) { for (int i = 0; i < W; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
inline vf vmul(vf a, vf b) { for (int i = 0; i < W; ++i) a.v[i] *= b.v[i]; return a; }
inline vf vadd(vf a, vf b) { for (int i = 0; i < W; ++i) a.v[i] += b.v[i]; return a; }
inline vf vsub(vf a, vf b) { for (int i = 0; i < W; ++i) a.v[i] -= b.v[i]; return a; }
inline vf vmax(vf a, vf b) { for (int i = 0; i < W; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return a; }
inline vf vdiv(vf a, vf b) { for (int i = 0; i < W; ++i) a.v[i] /= b.v[i]; return a; }
inline vf vabs(vf a) { for (int i = 0; i < W; ++i) a.v[i] = std::fabs(a.v[i]); return a; }
inline float vhmax(vf a) { float m = a.v[0]; for (int i = 1; i < W; ++i) m = a.v[i] > m ? a.v[i] : m; return m; }
inline float vhsum(vf a) { float s = 0.0f; for (int i = 0; i < W; ++i) s += a.v[i]; return s; }
inline vf vkeep_range(vf x, int lo, int hi, float fill) { for (int i = 0; i < W; ++i) if (i < lo || i >= hi) x.v[i] = fill; return x; }
inline vf vselect_neginf(vf test, vf a, vf b) { for (int i = 0; i < W; ++i) b.v[i] = test.v[i] == -INFINITY ? a.v[i] : b.v[i]; return b; }
inline vf vexp2(vf x) { for (int i = 0; i < W; ++i) x.v[i] = std::exp2(x.v[i]); return x; }
#endif

// GELU(x) = x (1 + erf(x / sqrt 2)) / 2 = max(x, 0) - |x| erfc(|x| / sqrt 2) / 2, with erfc(z) for z >= 0 by
// Abramowitz & Stegun 7.1.26 (t = 1 / (1 + p z), a 5-term polynomial in t, times exp(-z^2); |error| < 1.5e-7),
// the approximation torch's own vectorised erf uses. Written through erfc, a negative x loses no digits to
// 1 + erf(x) ~ 0 (torch's fp32 F.gelu does, by up to ~2.5e-7 at x = -5). NaN stays NaN (x is max's second
// operand); +-inf give NaN (inf * erfc(inf) = inf * 0), as F.gelu does on the CPU.
inline vf vgelu(vf x) {
  const vf ax = vabs(x), z = vmul(ax, vset1(0.70710678118654752f));
  const vf t = vdiv(vset1(1.0f), vfma(vset1(0.3275911f), z, vset1(1.0f)));
  vf poly = vset1(1.061405429f);
  poly = vfma(poly, t, vset1(-1.453152027f));
  poly = vfma(poly, t, vset1(1.421413741f));
  poly = vfma(poly, t, vset1(-0.284496736f));
  poly = vfma(poly, t, vset1(0.254829592f));
  const vf e = vexp2(vmul(vmul(z, z), vset1(-1.4426950408889634f)));  // exp(-z^2) = 2^(-z^2 log2 e)
  return vsub(vmax(vzero(), x), vmul(vmul(vset1(0.5f), ax), vmul(vmul(t, poly), e)));
}

}  // namespace btlib_vec
