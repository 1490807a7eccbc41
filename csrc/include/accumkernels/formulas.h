// The one definition of every accumkernels formula.
//
// Everything here is plain scalar C++ on fp32 values, usable from the CPU
// kernels (csrc/cpu) and from CUDA device code (AK_HD expands to
// __host__ __device__ under nvcc). Kernels only load, call these and store.
// The pure-PyTorch reference (accumkernels/backends/reference.py) states the
// same formulas with tensor ops and is the test oracle for both.
#pragma once

#include <cstdint>
#include <cstring>

// Every function here is force-inlined: the CPU kernels are compiled once per
// ISA (csrc/cpu/kernels_*.cpp) and must inline these into each variant rather
// than share one out-of-line copy built for whichever ISA the linker keeps.
#if defined(__CUDACC__)
#define AK_HD __host__ __device__ __forceinline__
#else
#define AK_HD inline __attribute__((always_inline))
#endif
#define AK_RESTRICT __restrict__

namespace accumkernels {

// Storage dtypes of gradients and parameters. Math is always fp32.
enum class Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

AK_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

AK_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// ---- conversions ---------------------------------------------------------
// Written with integer and fp32 operations only (no branches, no lookup
// tables) so that the compiler vectorizes them on every ISA.

AK_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays a quiet NaN (rounding could turn a NaN
// with only low mantissa bits into inf).
AK_HD uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? ((u >> 16) | 0x0040u) : rounded);
}

// IEEE half -> float, exact for normals, subnormals, inf and NaN.
// Normals: shift exponent+mantissa into place and rescale by 2^-112 (the bias
// difference). Subnormals: build 0.5 + m * 2^-24 via the mantissa and subtract.
AK_HD float fp16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t subnormal_mask = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // as in float_to_fp16
  const uint32_t magnitude =
      (subnormal_mask & float_bits(denormalized)) | (~subnormal_mask & float_bits(normalized));
  return bits_float(sign | magnitude);
}

// float -> IEEE half, round to nearest even, overflow to inf, NaN to NaN.
// Scaling by 2^112 then 2^-110 makes fp32 arithmetic do the rounding at the
// half's precision (including into the subnormal range).
AK_HD uint16_t float_to_fp16(float x) {
  const uint32_t w = float_bits(x);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  float base = (bits_float(w & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  // Masks, not ?:, in both conversions: GCC may turn such a select into a
  // branch and then refuses to vectorize the loop.
  const uint32_t nan_mask = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);
  return static_cast<uint16_t>((sign >> 16) | (nan_mask & 0x7E00u) | (~nan_mask & nonsign));
}

// Stochastic rounding to bf16: add 16 random bits below the bf16 mantissa,
// then truncate, so E[result] = x. inf and NaN round to nearest as usual.
// The random bits come from sr_random(seed, stream, index): a murmur3-style
// hash of the seed, the tensor's stream id (its `positions` entry, by default
// its place in the op's list) and the element's index in the tensor's memory
// order, the same in every backend. It is written as sr_finish(low 32 bits of
// the index, sr_key(seed, stream, high 32 bits)), so that a loop over indices
// that share their high bits computes the key once.
AK_HD uint32_t sr_key(uint32_t seed, uint32_t stream, uint32_t index_high) {
  return (index_high * 0x85EBCA77u) ^ (seed * 0xC2B2AE3Du) ^ (stream * 0x27D4EB2Fu);
}

AK_HD uint32_t sr_finish(uint32_t index_low, uint32_t key) {
  uint32_t x = (index_low * 0x9E3779B1u) ^ key;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

AK_HD uint32_t sr_random(uint32_t seed, uint32_t stream, uint64_t index) {
  return sr_finish(static_cast<uint32_t>(index), sr_key(seed, stream, static_cast<uint32_t>(index >> 32)));
}

// Uses the low 16 bits of `random`. inf passes unchanged (its low bits are
// zero); a NaN is kept a quiet NaN, as float_to_bf16 keeps it: its bits with
// the quiet bit set, truncated (no random bits added: a carry could turn it
// into inf or a zero). The choice is made on the 32-bit value before the one
// shift, and NaN is tested as x != x: so written, GCC's AVX-512 loops round a
// value in four instructions, not eight (measured: 7% less arithmetic in the
// bf16-state AdamW step, which rounds three values an element).
AK_HD uint16_t float_to_bf16_stochastic(float x, uint32_t random) {
  const uint32_t u = float_bits(x);
  const uint32_t rounded = x != x ? (u | 0x00400000u) : u + (random & 0xFFFFu);
  return static_cast<uint16_t>(rounded >> 16);
}

// Rounding slots of a step: 0 the param, 1 the momentum buffer or exp_avg,
// 2 exp_avg_sq, 3 max_exp_avg_sq (state tensors stored in bf16). Slot s draws
// its 16 bits as sr_random(sr_slot_seed(seed, s), stream, index) >> sr_slot_shift(s):
// two hashes per element serve all four slots, and no two slots share bits.
AK_HD uint32_t sr_slot_seed(uint32_t seed, uint32_t slot) {
  return slot == 1u || slot == 2u ? seed + 0x9E3779B9u : seed;
}

AK_HD uint32_t sr_slot_shift(uint32_t slot) { return slot >= 2u ? 16u : 0u; }

// The draws of one chunk of one tensor, whose element indices first + i share
// their high 32 bits (the kernels split their chunks so): the two hashes' keys
// are computed once per chunk, and the two slots of one seed share one sr_finish.
struct SrChunk {
  uint32_t first_low;  // low 32 bits of the chunk's first element index
  uint32_t key0;       // slots 0 and 3
  uint32_t key1;       // slots 1 and 2

  // The same draws from element `first` of the chunk on.
  AK_HD SrChunk at(int64_t first) const { return {first_low + static_cast<uint32_t>(first), key0, key1}; }
};

AK_HD SrChunk sr_chunk(uint32_t seed, uint32_t stream, int64_t first) {
  const uint32_t high = static_cast<uint32_t>(static_cast<uint64_t>(first) >> 32);
  return {static_cast<uint32_t>(first), sr_key(sr_slot_seed(seed, 0), stream, high),
          sr_key(sr_slot_seed(seed, 1), stream, high)};
}

// Slot kSlot's bits (in the low 16) for element first + i of the chunk.
template <uint32_t kSlot>
AK_HD uint32_t sr_draw(const SrChunk& c, int64_t i) {
  const uint32_t key = kSlot == 1u || kSlot == 2u ? c.key1 : c.key0;
  return sr_finish(c.first_low + static_cast<uint32_t>(i), key) >> sr_slot_shift(kSlot);
}

// Slots 1 and 2's shared hash for element first + i of the chunk: sr_draw<1>
// is its low 16 bits, sr_draw<2> = this >> sr_slot_shift(2), for a loop that
// keeps the draws of an element to use later.
AK_HD uint32_t sr_draws_1_2(const SrChunk& c, int64_t i) {
  return sr_finish(c.first_low + static_cast<uint32_t>(i), c.key1);
}

// ---- param remainders -----------------------------------------------------
// A bf16 param and an int16 remainder hold an fp32 master weight bit for bit
// (Transformer Engine's store_param_remainders): the remainder is the master's
// low 16 bits, the param its high 16 bits rounded to nearest with ties away
// from zero (up by one where the low bits are >= 0x8000, which makes the
// remainder negative), so join_remainder undoes the rounding exactly. inf and
// NaN keep their own rounding (a NaN stays a NaN).
AK_HD float join_remainder(uint16_t param, uint16_t remainder) {
  const uint32_t high = static_cast<uint32_t>(param) - static_cast<uint32_t>(remainder >> 15);
  return bits_float((high << 16) | remainder);
}

AK_HD uint16_t remainder_param(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t special_mask = 0u - static_cast<uint32_t>((u & 0x7F800000u) == 0x7F800000u);
  const uint32_t rounded = (u >> 16) + ((u >> 15) & 1u);
  return static_cast<uint16_t>((special_mask & float_to_bf16(x)) | (~special_mask & rounded));
}

AK_HD uint16_t remainder_bits(float x) { return static_cast<uint16_t>(float_bits(x) & 0xFFFFu); }

template <Dtype D>
struct Storage;
template <>
struct Storage<Dtype::kFloat32> {
  using type = float;
  static AK_HD float load(float x) { return x; }
  static AK_HD float store(float x) { return x; }
  static AK_HD float rounded(float x) { return x; }
};
template <>
struct Storage<Dtype::kBFloat16> {
  using type = uint16_t;
  static AK_HD float load(uint16_t x) { return bf16_to_float(x); }
  static AK_HD uint16_t store(float x) { return float_to_bf16(x); }
  // load(store(x)) in 32-bit lanes (a NaN stays a NaN, not the same one).
  static AK_HD float rounded(float x) {
    const uint32_t u = float_bits(x);
    const uint32_t nan_mask = 0u - static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
    const uint32_t nearest = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return bits_float((nan_mask & u) | (~nan_mask & nearest));
  }
};
template <>
struct Storage<Dtype::kFloat16> {
  using type = uint16_t;
  static AK_HD float load(uint16_t x) { return fp16_to_float(x); }
  static AK_HD uint16_t store(float x) { return float_to_fp16(x); }
  static AK_HD float rounded(float x) { return load(store(x)); }
};

// A choice between two values computed either way, by a bit mask, not
// whether to compute: a float operation under a condition may trap, and GCC
// vectorizes a loop that holds one only where it can mask it (AVX-512), not
// for AVX2; and a select (?:) of a value computed for it alone lets GCC move
// that computation under the condition again. (The step's flags, weight
// decay and nesterov, and master_or_param choose so.)
AK_HD float select_bits(bool take_first, float first, float second) {
  const uint32_t mask = 0u - static_cast<uint32_t>(take_first);
  return bits_float((float_bits(first) & mask) | (float_bits(second) & ~mask));
}

// The fp32 weight a step with fp32 master weights starts from: the master,
// unless the param no longer holds the master rounded to its dtype (as the
// step left it): then the param's own value. A write through `p.data`
// (`p.data.clamp_(-c, c)`, `p.data.copy_(w)`) bumps no version counter, so
// only the step can see it; torch.optim steps from the param as it is. The
// two are compared as fp32 values (-0 and +0 are one value; a NaN param is
// taken as it is), which keeps the AVX2 loop in 32-bit lanes: comparing the
// 16-bit storage bits cost twice the arithmetic.
template <Dtype P>
AK_HD float master_or_param(float master, typename Storage<P>::type param) {
  const float value = Storage<P>::load(param);
  return select_bits(Storage<P>::rounded(master) == value, master, value);
}

// True for inf and NaN.
AK_HD bool is_nonfinite(float x) { return (float_bits(x) & 0x7F800000u) == 0x7F800000u; }

// torch.maximum: NaN if either operand is NaN (a plain a > b ? a : b drops a NaN in `a`).
// One select on one mask, so that the CPU loops vectorize it.
AK_HD float nan_max(float a, float b) { return (a > b) | (a != a) ? a : b; }

// torch.lerp(start, end, weight) as ATen computes it: two forms, chosen by the
// weight, that round (and treat inf) differently: start + weight * (end - start)
// for weight < 0.5, else end - (end - start) * (1 - weight). Written as one
// form, (start or end) + c * (end - start) with c = weight or -(1 - weight),
// which gives the same bits (negation is exact, and x - y is x + (-y)), and
// the form chosen once per call (LerpWeight, made with the hyperparameters):
// the loops then hold no float operation under a condition. Such an operation
// may trap, so GCC vectorizes a loop that holds one only where it can mask it
// (AVX-512, which then computes both forms: 3% more arithmetic in the
// bf16-state AdamW step), and not at all for AVX2.
struct LerpWeight {
  float c;
  // 1 or 0, not a bool: GCC does not vectorize a loop that reads a bool
  // member (it has no vector type for the load), AVX-512 included.
  uint32_t from_start;
};

AK_HD LerpWeight lerp_weight(float weight) {
  return weight < 0.5f ? LerpWeight{weight, 1u} : LerpWeight{-(1.0f - weight), 0u};
}

AK_HD float lerp(float start, float end, const LerpWeight& weight) {
  return (weight.from_start != 0u ? start : end) + weight.c * (end - start);
}

// ---- weights --------------------------------------------------------------
// Where a step op reads and writes the weights, by WeightsKind:
//   kParam       the param in its storage dtype, rounded to nearest even
//   kStochastic  a bf16 param, rounded stochastically with the bits of slot 0
//   kMaster      an fp32 master copy (the param receives it rounded to nearest
//                even; a param written since is read instead: master_or_param)
//   kRemainder   a bf16 param joined with its int16 remainder (see above)
// store() takes the chunk's draws (SrChunk), shared with its state tensors.
enum class WeightsKind : int { kParam = 0, kStochastic = 1, kMaster = 2, kRemainder = 3 };

template <Dtype P, WeightsKind K>
struct Weights {
  using T = typename Storage<P>::type;
  T* AK_RESTRICT param;
  void* AK_RESTRICT master;  // float* (kMaster) or uint16_t* remainders (kRemainder)

  AK_HD float* masters() const { return static_cast<float*>(master); }
  AK_HD uint16_t* remainders() const { return static_cast<uint16_t*>(master); }

  AK_HD float load(int64_t i) const {
    if constexpr (K == WeightsKind::kMaster) {
      return master_or_param<P>(masters()[i], param[i]);
    } else if constexpr (K == WeightsKind::kRemainder) {
      return join_remainder(param[i], remainders()[i]);
    } else {
      return Storage<P>::load(param[i]);
    }
  }
  // The param's new storage value for weight w (the master copy or the
  // remainder, where there is one, is written here).
  AK_HD T round(int64_t i, float w, const SrChunk& sr) const {
    if constexpr (K == WeightsKind::kMaster) {
      masters()[i] = w;
      return Storage<P>::store(w);
    } else if constexpr (K == WeightsKind::kRemainder) {
      remainders()[i] = remainder_bits(w);
      return remainder_param(w);
    } else if constexpr (K == WeightsKind::kStochastic) {
      return float_to_bf16_stochastic(w, sr_draw<0>(sr, i));
    } else {
      return Storage<P>::store(w);
    }
  }
  AK_HD void store(int64_t i, float w, const SrChunk& sr) const { param[i] = round(i, w, sr); }
  // The same weights from element `first` on.
  AK_HD Weights at(int64_t first) const {
    if constexpr (K == WeightsKind::kMaster) return {param + first, masters() + first};
    if constexpr (K == WeightsKind::kRemainder) return {param + first, remainders() + first};
    return {param + first, master};
  }
};

// ---- optimizer state ------------------------------------------------------
// A state tensor (momentum buffer, exp_avg, exp_avg_sq, max_exp_avg_sq) in fp32
// or bf16; a bf16 one is always rounded stochastically, with the bits of its
// rounding slot kSlot: unbiased, so that updates far below its ulp (a
// (1 - beta2) * g^2 step of exp_avg_sq) are kept on average, not rounded away.
template <Dtype S, uint32_t kSlot>
struct State {
  using T = typename Storage<S>::type;
  T* AK_RESTRICT data;

  AK_HD float load(int64_t i) const { return Storage<S>::load(data[i]); }
  AK_HD T round(int64_t i, float x, const SrChunk& sr) const {
    if constexpr (S == Dtype::kBFloat16) {
      return float_to_bf16_stochastic(x, sr_draw<kSlot>(sr, i));
    } else {
      return x;
    }
  }
  AK_HD void store(int64_t i, float x, const SrChunk& sr) const { data[i] = round(i, x, sr); }
};

// ---- 8-bit state ------------------------------------------------------------
// accumkernels/_state8.py states the format and why; these are its functions,
// by the same names, giving the same bits (encode_magnitude and
// decode_magnitude in exact integer forms of its fp32 formulas). A block is
// kState8Block consecutive elements of a state tensor in memory order, with
// one fp32 scale; the kernels encode a block once all its new values exist.
constexpr int64_t kState8Block = 256;
constexpr int32_t kState8MantissaBits = 3;
constexpr int32_t kEminExpAvg = -14;
constexpr int32_t kEminExpAvgSq = -30;

// 2^k for an int k in [-126, 127], from its bits.
AK_HD float state8_pow2(int32_t k) { return bits_float(static_cast<uint32_t>(k + 127) << 23); }

// Codes from 8 up (u >= 2^emin) are fp32 values cut to 3 mantissa bits: the
// code is u's bits >> 20 (exponent and top 3 mantissa bits) less this offset,
// so that 2^emin, whose bits >> 20 are 8 * (127 + emin), gets code 8.
AK_HD uint32_t state8_bits_offset(int32_t emin) { return static_cast<uint32_t>(8 * (126 + emin)); }

// The code of u in [0, 1]: r = random / 2^16 (the low 16 bits of `random`),
// j = floor(u * 2^(3 - e) + r), code = 8 * (e - emin) + j, e = max(emin,
// floor(log2 u)). Computed in two exact ways, by u's range, with the bits of
// that formula (the tests hold it to _state8.encode_magnitude bit for bit):
// - u >= 2^emin: u * 2^(3 - e) = 8 + m / 2^20 (m: u's 23 mantissa bits) and
//   r = (random << 4) / 2^20, so j = 8 + (m + (random << 4)) >> 20: one
//   integer addition to u's bits, whose carry runs into the exponent exactly
//   as j = 16 moves to the next binade's 8, and one shift;
// - u < 2^emin (e = emin, code = j < 8 but for a carry to 8): the fp32 sum as
//   written, u * 2^(3 - emin) + r >= 0, whose conversion truncates (the floor).
// Why not the one fp32 formula for both: its exponent, 2^(3 - e) and
// 8 * (e - emin) + j cost more instructions (the AVX2 encode loop: 233 -> 204
// per 64 elements; AVX-512 about even, 175 -> 178), and the 8-bit steps are
// bound by their arithmetic on a CPU.
AK_HD uint32_t encode_magnitude(float u, int32_t emin, uint32_t random) {
  const uint32_t bits = float_bits(u);
  const uint32_t low_limit = static_cast<uint32_t>(127 + emin) << 23;  // 2^emin's bits
  // A mask, not ?:, as in the conversions: GCC makes the select a branch and leaves the loop scalar.
  const uint32_t normal_mask = 0u - static_cast<uint32_t>(bits >= low_limit);
  const uint32_t normal = ((bits + ((random & 0xFFFFu) << 4)) >> 20) - state8_bits_offset(emin);
  // The second form from u < 2^emin only (2^emin in place of larger u, which
  // would scale past the int32 range, whose conversion is undefined). An
  // integer min of the bits: with the mask GCC computes the masked u's
  // division twice (AVX-512), with a float select it leaves the loop scalar (AVX2).
  const float u_low = bits_float(bits < low_limit ? bits : low_limit);
  const float r = static_cast<float>(static_cast<int32_t>(random & 0xFFFFu)) * 0x1.0p-16f;
  const uint32_t low = static_cast<uint32_t>(static_cast<int32_t>(u_low * state8_pow2(kState8MantissaBits - emin) + r));
  return (normal_mask & normal) | (~normal_mask & low);
}

// The value in [0, 1] of a code of encode_magnitude: j * 2^(e - 3), exactly,
// from the same two ranges: codes from 8 up are fp32 bits (the encode's
// shift undone), codes under 8 are j * 2^(emin - 3).
AK_HD float decode_magnitude(uint32_t code, int32_t emin) {
  const float normal = bits_float((code + state8_bits_offset(emin)) << 20);
  const float low = static_cast<float>(static_cast<int32_t>(code)) * state8_pow2(emin - kState8MantissaBits);
  const uint32_t normal_mask = 0u - static_cast<uint32_t>(code >= 8u);
  return bits_float((normal_mask & float_bits(normal)) | (~normal_mask & float_bits(low)));
}

// A block's new scale: the maximum of its stored magnitudes (|m|, r), or NaN
// where one of them is NaN (`nan` nonzero), as torch.amax: a max reduction
// alone may drop a NaN, and the block would decode to finite values.
AK_HD float state8_block_scale(float max, uint32_t nan) { return nan != 0 ? bits_float(0x7FC00000u) : max; }

// The same from the largest magnitude's bits, for a loop that takes the
// block's maximum as integers (state8_abs_bits): a non-negative float's bits
// order as its values do, and every NaN's magnitude bits lie above inf's, so
// one integer max finds both the maximum and any NaN.
AK_HD uint32_t state8_abs_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

AK_HD float state8_block_scale_of_bits(uint32_t max_bits) {
  return state8_block_scale(bits_float(max_bits), max_bits > 0x7F800000u ? 1u : 0u);
}

// A block's scale (max |m| of exp_avg, max sqrt(v) of exp_avg_sq) as the
// divisor of its encode: 1 for an all-zero block.
AK_HD float state8_divisor(float scale) { return scale > 0.0f ? scale : 1.0f; }

// A code as its byte. Codes are at most 248, but GCC cannot see that through the
// masks of encode_magnitude: with a plain cast it narrows every operand of
// their select to bytes before selecting (three narrowings of 16 lanes for
// one), where this saturating min leaves one narrowing of the result.
AK_HD uint8_t state8_byte(uint32_t code) { return static_cast<uint8_t>(code < 255u ? code : 255u); }

// exp_avg (and SGD's momentum buffer, stored alike): signed.
AK_HD float decode_exp_avg(uint8_t code, float scale) {
  const float magnitude = decode_magnitude(code & 0x7Fu, kEminExpAvg) * scale;
  // The code's sign bit moved to the fp32 sign: a negation (a NaN's sign flips too).
  return bits_float(float_bits(magnitude) ^ (static_cast<uint32_t>(code & 0x80u) << 24));
}

AK_HD uint8_t encode_exp_avg(float m, float divisor, uint32_t random) {
  const float magnitude = bits_float(state8_abs_bits(m));
  const uint32_t sign = m < 0.0f ? 0x80u : 0u;
  return state8_byte(encode_magnitude(magnitude / divisor, kEminExpAvg, random) | sign);
}

// exp_avg_sq is stored as r = sqrt(v): the kernels take r's block max.
AK_HD float decode_exp_avg_sq(uint8_t code, float scale) {
  const float r = decode_magnitude(code, kEminExpAvgSq) * scale;
  return r * r;
}

AK_HD uint8_t encode_exp_avg_sq(float r, float divisor, uint32_t random) {
  return state8_byte(encode_magnitude(r / divisor, kEminExpAvgSq, random));
}

// ---- per-step scalars -----------------------------------------------------
// g = grad_scale * grad_scale_tensor[0] * buffer, and the update is skipped
// when found_inf[0] != 0. The pointers are host memory on the CPU and device
// memory on CUDA; either may be null (absent). maximize is already folded
// into the sign of grad_scale.
struct StepScale {
  float grad_scale;
  const float* grad_scale_tensor;
  const float* found_inf;

  AK_HD float scale() const {
    return grad_scale_tensor != nullptr ? grad_scale * *grad_scale_tensor : grad_scale;
  }
  AK_HD bool skip() const { return found_inf != nullptr && *found_inf != 0.0f; }
};

// ---- accumulate_ ---------------------------------------------------------
// The formulas of this file are stated once, in the docstrings of
// accumkernels/ops.py (the ops' reference); each function here computes its
// op's, line by line, in the same order as backends/triton/_formulas.py.
template <bool kOverwrite>
AK_HD float accumulate(float buffer, float grad, float scale) {
  return kOverwrite ? scale * grad : buffer + scale * grad;
}

// ---- SGD (torch.optim.SGD): accumkernels.ops.sgd_step_and_zero_ ---------
struct SgdHyper {
  float lr;
  float momentum;
  float one_minus_dampening;  // 1 - dampening, rounded once from double as torch does
  float weight_decay;
  bool nesterov;
  bool has_weight_decay;
};

AK_HD SgdHyper make_sgd_hyper(double lr, double momentum, double dampening, double weight_decay,
                              bool nesterov) {
  return {static_cast<float>(lr),        static_cast<float>(momentum),
          static_cast<float>(1.0 - dampening), static_cast<float>(weight_decay),
          nesterov,                      weight_decay != 0.0};
}

enum class Momentum : int { kNone = 0, kFirstStep = 1, kRunning = 2 };

template <Momentum kMomentum>
AK_HD float sgd_update(float p, float g, float& momentum_buffer, const SgdHyper& h) {
  g = select_bits(h.has_weight_decay, g + h.weight_decay * p, g);
  if (kMomentum != Momentum::kNone) {
    const float b = kMomentum == Momentum::kFirstStep
                        ? g
                        : h.momentum * momentum_buffer + h.one_minus_dampening * g;
    momentum_buffer = b;
    g = select_bits(h.nesterov, g + h.momentum * b, b);
  }
  return p - h.lr * g;
}

// ---- Adam / AdamW: accumkernels.ops.adam_step_and_zero_ / adamw_step_and_zero_
// step_size = lr / (1 - beta1^t) and bias_correction2_sqrt = sqrt(1 - beta2^t)
// for the step count t after this step, computed once per tensor by
// adam_bias_corrections().
struct AdamHyper {
  double lr;  // double: only used on the host-side path into step_size
  double beta1;
  double beta2;
  float eps;
  float weight_decay;
  // Derived in double and rounded once, as torch.optim computes them in Python.
  LerpWeight exp_avg_weight;  // lerp_weight of 1 - beta1 (that rounded from double)
  float one_minus_beta2;
  float beta2_f;
  float adamw_decay;  // 1 - lr * weight_decay
  bool adamw;
  bool amsgrad;
  bool has_weight_decay;
};

AK_HD AdamHyper make_adam_hyper(double lr, double beta1, double beta2, double eps,
                                double weight_decay, bool adamw, bool amsgrad) {
  return {lr,
          beta1,
          beta2,
          static_cast<float>(eps),
          static_cast<float>(weight_decay),
          lerp_weight(static_cast<float>(1.0 - beta1)),
          static_cast<float>(1.0 - beta2),
          static_cast<float>(beta2),
          static_cast<float>(1.0 - lr * weight_decay),
          adamw,
          amsgrad,
          weight_decay != 0.0};
}

struct AdamStepScalars {
  float step_size;
  float bias_correction2_sqrt;
};

AK_HD AdamStepScalars adam_bias_corrections(const AdamHyper& h, double step) {
#if defined(__CUDA_ARCH__)
  const double bc1 = 1.0 - ::pow(h.beta1, step);
  const double bc2 = 1.0 - ::pow(h.beta2, step);
  return {static_cast<float>(h.lr / bc1), static_cast<float>(::sqrt(bc2))};
#else
  const double bc1 = 1.0 - __builtin_pow(h.beta1, step);
  const double bc2 = 1.0 - __builtin_pow(h.beta2, step);
  return {static_cast<float>(h.lr / bc1), static_cast<float>(__builtin_sqrt(bc2))};
#endif
}

// The flags of an update, as run-time values (the GPU kernels) or as
// compile-time constants (the CPU loops: GCC unswitches at most three
// loop-invariant conditions, and with four the Adam loop is not vectorized).
struct AdamFlags {
  bool adamw;
  bool amsgrad;
  bool weight_decay;
};

template <bool kAdamW, bool kAmsgrad, bool kWeightDecay>
struct StaticAdamFlags {
  static constexpr bool adamw = kAdamW;
  static constexpr bool amsgrad = kAmsgrad;
  static constexpr bool weight_decay = kWeightDecay;
};

AK_HD AdamFlags adam_flags(const AdamHyper& h) { return {h.adamw, h.amsgrad, h.has_weight_decay}; }

// v_max is read and written only when f.amsgrad.
template <typename Flags>
AK_HD float adam_update(float p, float g, float& m, float& v, float& v_max, const AdamHyper& h,
                        const AdamStepScalars& s, const Flags& f) {
  if (f.weight_decay) {
    if (f.adamw) {
      p = p * h.adamw_decay;
    } else {
      g = g + h.weight_decay * p;
    }
  }
  m = lerp(m, g, h.exp_avg_weight);
  v = h.beta2_f * v + h.one_minus_beta2 * (g * g);
  float v_hat = v;
  if (f.amsgrad) {
    v_max = nan_max(v_max, v);
    v_hat = v_max;
  }
#if defined(__CUDA_ARCH__)
  const float denom = sqrtf(v_hat) / s.bias_correction2_sqrt + h.eps;
#else
  const float denom = __builtin_sqrtf(v_hat) / s.bias_correction2_sqrt + h.eps;
#endif
  return p - s.step_size * (m / denom);
}

}  // namespace accumkernels
