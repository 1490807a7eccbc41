// The CUDA Adam/AdamW step functors (torch.optim.Adam's and AdamW's update
// with g = grad_scale * buffer, then buffer = 0, one chunk each): AdamFunctor
// for fp32 and bf16 state, Adam8Functor for 8-bit state. adam.cu launches
// them for its ops; bench/cuda_variants.cu builds them apart, to time them
// under other launch bounds.
#pragma once

#include "accumkernels/formulas.h"
#include "multi_tensor.cuh"
#include "step.cuh"

namespace accumkernels::cuda {

// Lists: 0 param, 1 master, 2 buffer, 3 exp_avg, 4 exp_avg_sq, 5 max_exp_avg_sq, 6 step.
constexpr int kAdamLists = 7;

template <Dtype P, WeightsKind K, Dtype S, Dtype G>
struct AdamFunctor {
  __device__ void operator()(const Meta<kAdamLists>& meta, int t, int64_t start, int64_t n, int,
                             AdamHyper h, StepScale scale, bool zero_buffers, uint32_t seed) {
    constexpr int N = kStepVec<P, S>;
    auto* buffer = chunk_grads<G>(meta, t, start);
    if (scale.skip()) {
      if (zero_buffers) zero_chunk(buffer, n);
      return;
    }
    const auto w = chunk_weights<P, K>(meta, t, start);
    const auto exp_avg = chunk_state<S, 1>(meta, 3, t, start);
    const auto exp_avg_sq = chunk_state<S, 2>(meta, 4, t, start);
    const auto max_sq = chunk_state<S, 3>(meta, 5, t, start);
    const SrChunk sr = chunk_draws(meta, t, start, seed);
    const float step = *static_cast<const float*>(meta.addresses[6][t]);
    const AdamStepScalars s = adam_bias_corrections(h, step);
    const float gs = scale.scale();
    const AdamFlags flags = adam_flags(h);
    const bool vector_ok = aligned_for_packs<N>(w) && aligned<typename Storage<G>::type, N>(buffer) &&
                           aligned_for_packs<N>(exp_avg) && aligned_for_packs<N>(exp_avg_sq) &&
                           (!h.amsgrad || aligned_for_packs<N>(max_sq));
    for_chunk<N>(
        n, vector_ok,
        [&](int64_t i) {
          float g[N], m[N], v[N], vm[N] = {}, p[N];
          load_grads<N, G>(g, buffer, i);
          load_state<N>(exp_avg, m, i);
          load_state<N>(exp_avg_sq, v, i);
          if (h.amsgrad) load_state<N>(max_sq, vm, i);
          load_weights<N>(w, p, i);
#pragma unroll
          for (int k = 0; k < N; ++k) p[k] = adam_update(p[k], gs * g[k], m[k], v[k], vm[k], h, s, flags);
          store_weights<N>(w, i, p, sr);
          store_state<N>(exp_avg, i, m, sr);
          store_state<N>(exp_avg_sq, i, v, sr);
          if (h.amsgrad) store_state<N>(max_sq, i, vm, sr);
          if (zero_buffers) zero_pack<N>(buffer, i);
        },
        [&](int64_t i) {
          float m = exp_avg.load(i), v = exp_avg_sq.load(i), vm = h.amsgrad ? max_sq.load(i) : 0.0f;
          w.store(i, adam_update(w.load(i), gs * Storage<G>::load(buffer[i]), m, v, vm, h, s, flags), sr);
          exp_avg.store(i, m, sr);
          exp_avg_sq.store(i, v, sr);
          if (h.amsgrad) max_sq.store(i, vm, sr);
          if (zero_buffers) buffer[i] = {};
        });
  }
};

// 8-bit state (formulas.h's decode_/encode_exp_avg and _exp_avg_sq). Lists as
// AdamFunctor's, then 7 exp_avg scales, 8 exp_avg_sq scales (one fp32 per
// block of kState8Block). A warp per block, kPerLane adjacent elements a lane
// (step.cuh's Lane): decode, update and store the param, keep the new moments
// (exp_avg_sq as r = sqrt(v)) in registers, take the block's new scales across
// the warp, then encode.
constexpr int kAdam8Lists = 9;

template <Dtype P, WeightsKind K, Dtype G>
struct Adam8Functor {
  __device__ void operator()(const Meta<kAdam8Lists>& meta, int t, int64_t start, int64_t n, int,
                             AdamHyper h, StepScale scale, bool zero_buffers, uint32_t seed) {
    auto* buffer = chunk_grads<G>(meta, t, start);
    if (scale.skip()) {
      if (zero_buffers) zero_chunk(buffer, n);
      return;
    }
    const auto w = chunk_weights<P, K>(meta, t, start);
    uint8_t* m_codes = static_cast<uint8_t*>(meta.addresses[3][t]) + start;
    uint8_t* v_codes = static_cast<uint8_t*>(meta.addresses[4][t]) + start;
    float* m_scales = chunk_floats(meta, 7, t, start / kState8Block);
    float* v_scales = chunk_floats(meta, 8, t, start / kState8Block);
    const SrChunk sr = chunk_draws(meta, t, start, seed);
    const float step = *static_cast<const float*>(meta.addresses[6][t]);
    const AdamStepScalars s = adam_bias_corrections(h, step);
    const float gs = scale.scale();
    const AdamFlags flags = adam_flags(h);
    const bool vector_ok = aligned_for_lanes<P, K, G>(w, buffer, m_codes, v_codes);
    const int lane = static_cast<int>(threadIdx.x) % kWarp;
    const int warps = static_cast<int>(blockDim.x) / kWarp;
    const int64_t blocks = (n + kState8Block - 1) / kState8Block;
    for (int64_t b = threadIdx.x / kWarp; b < blocks; b += warps) {
      const Lane l(b, lane, n, vector_ok);
      const float m_scale = m_scales[b];
      const float v_scale = v_scales[b];
      float p[kPerLane], g[kPerLane], m_new[kPerLane], r_new[kPerLane];
      uint8_t mc[kPerLane], vc[kPerLane];
      lane_load_update_inputs<P, K, G>(l, w, buffer, p, g);
      lane_load_codes(l, m_codes, mc);
      lane_load_codes(l, v_codes, vc);
      float m_max = 0.0f, r_max = 0.0f;
      bool m_nan = false, r_nan = false;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        m_new[k] = 0.0f;
        r_new[k] = 0.0f;
        if (k >= l.count) continue;
        float m = decode_exp_avg(mc[k], m_scale);
        float v = decode_exp_avg_sq(vc[k], v_scale);
        float v_max = 0.0f;
        p[k] = adam_update(p[k], gs * g[k], m, v, v_max, h, s, flags);
        const float r = sqrtf(v);
        m_new[k] = m;
        r_new[k] = r;
        m_max = m_max > fabsf(m) ? m_max : fabsf(m);
        r_max = r_max > r ? r_max : r;
        m_nan |= m != m;
        r_nan |= r != r;
      }
      lane_store_weights(l, w, p, sr, buffer, zero_buffers);
      const float m_scale_new = warp_block_scale(m_max, m_nan);
      const float r_scale_new = warp_block_scale(r_max, r_nan);
      const float m_divisor = state8_divisor(m_scale_new);
      const float r_divisor = state8_divisor(r_scale_new);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const uint32_t draws = sr_draws_1_2(sr, l.first + k);
        mc[k] = encode_exp_avg(m_new[k], m_divisor, draws);
        vc[k] = encode_exp_avg_sq(r_new[k], r_divisor, draws >> sr_slot_shift(2));
      }
      lane_store_codes(l, m_codes, mc);
      lane_store_codes(l, v_codes, vc);
      if (lane == 0) {
        m_scales[b] = m_scale_new;
        v_scales[b] = r_scale_new;
      }
    }
  }
};

}  // namespace accumkernels::cuda
