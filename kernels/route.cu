// kernels/route.cu — top-k routing (docs/numerics.md, "Routing methods") on the GPU, the same numerics as
// reference/routing.cpp (ids identical; weights equal up to the order of the softmax sum over E).
//
// Every method but DeepSeekV3: one warp per token (route_kernel); expert e = 32*i + lane sits in
// register slot i of its lane (E <= 512).
//   1. Load the logits (fp32, or bf16 widened); the choice score is the raw logit s.
//   2. k rounds of a warp argmax over the candidates: the score is mapped to an order-preserving
//      uint32 (NaN lowest, -0 == +0), redux.sync max picks the best value, redux.sync min the lowest
//      expert id among equal values. Lane j keeps the id of slot j.
//   3. Lane j computes the weight of slot j from the logit of its expert (transcendentals in double,
//      slot sums in slot order by shuffles, the softmax sum over E by a warp tree) and writes it.
// DeepSeekV3 (sigmoid + bias choice scores, group selection): route_deepseek_block_kernel, one CTA per
// token and one thread per expert.
// With RouteArgs::quant_out (scalar w4a4) each token's row of hidden is also written fake-quantized to
// NVFP4, once, by extra blocks of the routing launch (a thread per 16-element block, in parallel with
// the routing warps or CTAs: quantize_row_blocks).
// launch_route_permute (few entries, route_permute_fits): one block of permute_block::kThreads routes
// every token (a warp per token, or the one DeepSeekV3 token), then permutes the ids it wrote with the
// permute launch's one-block code (kernels/permute_block.cuh): one launch, and one dependent-launch
// boundary of the forward, fewer.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/dependent_launch.cuh"
#include "kernels/launch.hpp"
#include "kernels/nvfp4/codec.cuh"
#include "kernels/permute_block.cuh"

namespace fp4moe::kernels {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxExperts = permute_block::kMaxExperts;
constexpr int kMaxTopK = 32;
constexpr int kMaxGroups = kMaxRoutingGroups;  // fp4moe/problem.hpp
constexpr unsigned kFull = 0xFFFFFFFFu;

constexpr uint32_t kKeyNone = 0;  // not a candidate
constexpr uint32_t kKeyNan = 1;   // NaN: below every number

// Order-preserving map of a float to uint32: larger value -> larger key; -0 and +0 map together;
// NaN maps to kKeyNan; every number (-inf included) maps to >= 0x007FFFFF.
__device__ __forceinline__ uint32_t order_key(float x) {
  if (isnan(x)) return kKeyNan;
  const uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t key) {
  if (key <= kKeyNan) return __uint_as_float(0x7FC00000u);
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

__device__ __forceinline__ double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

__device__ __forceinline__ float load_logit(const void* logits, bool bf16, int64_t index) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(logits)[index])
              : static_cast<const float*>(logits)[index];
}

// Sum over the first k lanes in lane order (the CPU's slot order); every lane gets the sum.
__device__ __forceinline__ double slot_sum(double v, int k) {
  double sum = 0.0;
  for (int j = 0; j < k; ++j) sum += __shfl_sync(kFull, v, j);
  return sum;
}

// Warp argmax over (key, id): the largest key, ties to the lowest id. Lanes without a candidate pass
// kKeyNone. Returns the winner's id (every lane), or -1 when no lane has a candidate.
__device__ __forceinline__ int warp_argmax(uint32_t key, uint32_t id) {
  const uint32_t best = __reduce_max_sync(kFull, key);
  const uint32_t win = __reduce_min_sync(kFull, (key == best) ? id : 0xFFFFFFFFu);
  return best == kKeyNone ? -1 : static_cast<int>(win);
}

// RouteArgs::quant_out: 16-element block b of token t's row of hidden, fake-quantized with the scalar
// input scale (the arithmetic of gather_quantize). It saves the forward a gather_quantize launch.
__device__ __forceinline__ void quantize_hidden_block(const RouteArgs& a, int64_t t, int b, float gs, float inv_gs) {
  const int64_t at = t * a.hidden_size + static_cast<int64_t>(b) * nvfp4::kBlock;
  float x[nvfp4::kBlock];
  nvfp4::load_bf16x16(a.hidden + at, x);
  nvfp4::fake_quantize_block16(x, gs, inv_gs);
  nvfp4::store_bf16x16(a.quant_out + at, x);
}
// The quantizing blocks of a routing launch: block `qb` (counted from the first block past the routing
// ones) quantizes the 16-element blocks [qb * blockDim, +blockDim) of hidden, a thread each.
// NOTE: in blocks of their own the rows are quantized while the routing blocks route. In the token's
// own CTA after its routing (DeepSeekV3, before), the quantization lengthened the route stage by ~2 us
// at deepseek-r1 T = 8 (10.0 against 7.8 us in w4a16); one warp
// quantizing its token's row after routing it took longer than a gather launch.
__device__ __forceinline__ void quantize_row_blocks(const RouteArgs& a, int64_t qb) {
  const int64_t i = qb * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int per_row = a.hidden_size / nvfp4::kBlock;
  if (i >= static_cast<int64_t>(a.num_tokens) * per_row) return;
  const float gs = nvfp4::global_inv_scale(a.input_scale[0]);
  quantize_hidden_block(a, i / per_row, static_cast<int>(i % per_row), gs, __fdiv_rn(1.0f, gs));
}
// Blocks of `threads` threads that quantize_row_blocks needs for every row (0 without quant_out).
int64_t quantize_block_count(const RouteArgs& a, int threads) {
  if (a.quant_out == nullptr) return 0;
  return (static_cast<int64_t>(a.num_tokens) * (a.hidden_size / nvfp4::kBlock) + threads - 1) / threads;
}

// Token t's routing by one warp (the steps in the file header). Every lane of the warp calls it.
// ids_shared (the route launch that permutes, or nullptr): the ids are also written there, by entry.
template <int VPT>  // values per lane: E <= 32 * VPT
__device__ __forceinline__ void route_token(const RouteArgs& args, int64_t t, int lane, int32_t* ids_shared) {
  const int E = args.num_experts;
  const RoutingParams& p = args.params;
  const int k = p.top_k;
  const int64_t row = t * E;

  // 1. choice scores as order keys
  // NOTE (loads first): the lane's VPT logits are loaded before any is used; with the dtype branch
  // inside the loop, each load waited for the previous one's key (SASS: VPT dependent round trips per
  // token before the first argmax).
  float v[VPT];
  if (args.logits_bf16) {
    const __nv_bfloat16* logits = static_cast<const __nv_bfloat16*>(args.logits) + row;
#pragma unroll
    for (int i = 0; i < VPT; ++i) v[i] = 32 * i + lane < E ? __bfloat162float(logits[32 * i + lane]) : 0.0f;
  } else {
    const float* logits = static_cast<const float*>(args.logits) + row;
#pragma unroll
    for (int i = 0; i < VPT; ++i) v[i] = 32 * i + lane < E ? logits[32 * i + lane] : 0.0f;
  }
  uint32_t key[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) key[i] = 32 * i + lane < E ? order_key(v[i]) : kKeyNone;

  // 2. top-k: slot j's id is kept by lane j
  int my_id = -1;
  for (int j = 0; j < k; ++j) {
    uint32_t best = kKeyNone, best_id = 0xFFFFFFFFu;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (key[i] > best) {  // strict: the lowest id (lowest i) wins within the lane
        best = key[i];
        best_id = 32 * i + lane;
      }
    }
    const int win = warp_argmax(best, best_id);
    // NOTE: the winner's key is cleared by a mask on every slot, not by a store at a computed index:
    // that store put key[] in local memory (SASS: STL and LDL.128 in every round).
    const int clear = (win >= 0 && (win & 31) == lane) ? (win >> 5) : -1;
#pragma unroll
    for (int i = 0; i < VPT; ++i) key[i] &= i == clear ? kKeyNone : 0xFFFFFFFFu;
    if (lane == j) my_id = win;
  }

  // 3. weights
  const bool active = lane < k;
  const float s = active && my_id >= 0 ? load_logit(args.logits, args.logits_bf16, row + my_id) : 0.0f;
  double w = 0.0;
  switch (p.method) {
    case RoutingMethod::Default:
    case RoutingMethod::RenormalizeNaive: {
      const double m = static_cast<double>(__shfl_sync(kFull, s, 0));  // the largest logit
      double part = 0.0;
      // The logits of step 1, kept in registers up to 4 per lane (E <= 128); with 16 they spilled.
      constexpr bool kKept = VPT <= 4;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int e = 32 * i + lane;
        if (e < E) part += exp(static_cast<double>(kKept ? v[i] : load_logit(args.logits, args.logits_bf16, row + e)) - m);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(kFull, part, off);
      const double sum = part;
      const double pj = exp(static_cast<double>(s) - m) / sum;
      if (p.method == RoutingMethod::Default) {
        w = pj;
      } else {
        const double psum = slot_sum(active ? pj : 0.0, k);
        w = pj / psum;
      }
      break;
    }
    case RoutingMethod::Renormalize: {
      const double m = static_cast<double>(__shfl_sync(kFull, s, 0));
      const double ej = exp(static_cast<double>(s) - m);
      w = ej / slot_sum(active ? ej : 0.0, k);
      break;
    }
    case RoutingMethod::TopK:
      w = static_cast<double>(s);
      break;
    case RoutingMethod::Sigmoid:
    case RoutingMethod::TopKSigmoid:
    case RoutingMethod::Llama4:
      w = sigmoid(static_cast<double>(s));
      break;
    case RoutingMethod::SigmoidRenorm: {
      const double sg = sigmoid(static_cast<double>(s));
      const double sum = slot_sum(active ? sg : 0.0, k);
      const double denom = isnan(sum) ? sum : fmax(sum, 1e-20);
      w = sg / denom;
      break;
    }
    case RoutingMethod::DeepSeekV3:   // route_deepseek_block_kernel
    case RoutingMethod::Precomputed:  // refused by the launcher
      break;
  }
  if (active) {
    args.topk_ids[t * k + lane] = my_id;
    args.topk_weights[t * k + lane] = __double2float_rn(w);
    if (ids_shared != nullptr) ids_shared[t * k + lane] = my_id;
  }
}

// launch_route_permute: the launch's one block permutes the ids it routed (permute_small_block, the
// permute launch's arithmetic), after the barrier that makes every warp's ids visible to the block.
// Every thread of the block calls it; `permute.expert_offsets == nullptr` (launch_route) does nothing.
// ids_shared: the routed ids in shared memory (entry order), which the block wrote before the barrier.
__device__ __forceinline__ void permute_in_block(const PermuteArgs& permute, const int32_t* ids_shared) {
  if (permute.expert_offsets == nullptr) return;  // block-uniform
  __shared__ permute_block::SmallShared sh;
  __syncthreads();
  permute_block::permute_small_block(permute, sh, ids_shared);
}

// Warp w of block b routes tokens b * warps + w, + route_blocks * warps, ... (one token per warp,
// except in the one block of launch_route_permute). Blocks past the routing ones (quant_out only):
// thread i of them quantizes block i % (H / 16) of token i / (H / 16).
// NOTE: one warp quantizing its token's row after routing it took longer than the gather_quantize
// launch this saves (qwen3 presets, T = 1: route 6 -> 11-15 us); in
// blocks of their own the rows are quantized while the warps route.
template <int VPT>
__global__ void __launch_bounds__(permute_block::kThreads)
    route_kernel(const RouteArgs args, const PermuteArgs permute) {
  dependent_launch_prologue();
  const int warps = blockDim.x / 32;
  const int64_t route_blocks = permute.expert_offsets != nullptr
                                   ? 1
                                   : (static_cast<int64_t>(args.num_tokens) + warps - 1) / warps;
  if (blockIdx.x >= route_blocks) {
    quantize_row_blocks(args, blockIdx.x - route_blocks);
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // NOTE: with the permutation in this block, the ids also go to shared memory, so that the
  // permutation does not read them back through L2 (a round trip after the barrier).
  __shared__ int32_t s_ids[permute_block::kSmallEntries];
  int32_t* const ids_shared = permute.expert_offsets != nullptr ? s_ids : nullptr;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < args.num_tokens; t += route_blocks * warps)
    route_token<VPT>(args, t, lane, ids_shared);  // warp-uniform
  permute_in_block(permute, ids_shared);
}

// DeepSeekV3 with one CTA per token and one thread per expert (blockDim = E rounded up to 32), the
// choice and weights of reference/routing.cpp: the sigmoids, the group scan and the top-k rounds run
// across the CTA (a one-warp version issued ~5000 dependent instructions per token: ~17 us at T = 1,
// against 9 us for the whole route stage with this kernel on the H200).
//   1. thread e: sig = fp32(sigmoid(double s)), c = sig + bias[e], its order key; sig and c to shared memory
//   2. n_group > 1: thread g < n_group scans its group's c in order for the top-2 keys; group score =
//      value(k1) + value(k2) (fp32); thread 0 keeps the topk_group best groups (ties: lower group)
//   3. k rounds of a CTA argmax (warp redux, then the warps' winners in shared memory; ties: lower id),
//      one CTA barrier per round
//   4. thread j < k (warp 0): the weight of slot j from sig, the slot sum in slot order (double), as
//      route_kernel
// Blocks past the T token CTAs (RouteArgs::quant_out): quantize_row_blocks, while the token CTAs route.
__global__ void __launch_bounds__(kMaxExperts) route_deepseek_block_kernel(const RouteArgs args, const PermuteArgs permute) {
  __shared__ float c_sh[kMaxExperts];
  __shared__ uint32_t gkey_sh[kMaxGroups];
  __shared__ uint32_t kept_sh;
  __shared__ float sig_sh[kMaxExperts];
  __shared__ uint32_t wkey_sh[2][kMaxExperts / 32], wid_sh[2][kMaxExperts / 32];  // by round parity
  __shared__ int32_t ids_sh[kMaxTopK];
  dependent_launch_prologue();
  if (static_cast<int64_t>(blockIdx.x) >= args.num_tokens) {  // block-uniform, before any barrier
    quantize_row_blocks(args, blockIdx.x - args.num_tokens);
    return;
  }
  const int E = args.num_experts, e = threadIdx.x, lane = e % 32, warp = e / 32, nwarps = blockDim.x / 32;
  const RoutingParams& p = args.params;
  const int k = p.top_k;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * E;

  // 1. choice score
  uint32_t key = kKeyNone;
  if (e < E) {
    // NOTE: the bias is loaded with the logit: loaded after the sigmoid, it waited for it (SASS).
    const float s = load_logit(args.logits, args.logits_bf16, row + e);
    const float bias = args.bias != nullptr ? args.bias[e] : 0.0f;
    const float sig = static_cast<float>(sigmoid(static_cast<double>(s)));
    const float c = __fadd_rn(sig, bias);
    c_sh[e] = c;
    sig_sh[e] = sig;
    key = order_key(c);
  }

  // 2. group selection
  if (p.n_group > 1) {
    const int ng = p.n_group, gsize = E / ng;
    if (gsize == 32) {
      // NOTE (a warp per group): with groups of 32 experts (DeepSeek-R1: 8 x 32) warp g holds group g's
      // keys in registers: its top-2 (a multiset: k2 = k1 when the maximum appears twice, as the scan)
      // by two warp reductions, where one thread's scan of 32 keys in shared memory was a chain of
      // ~300 dependent instructions, and without the barrier for c_sh.
      if (warp < ng) {
        const uint32_t k1 = __reduce_max_sync(kFull, key);
        const bool twice = __popc(__ballot_sync(kFull, key == k1)) >= 2;
        const uint32_t k2 = twice ? k1 : __reduce_max_sync(kFull, key == k1 ? kKeyNone : key);
        if (lane == 0) gkey_sh[warp] = order_key(__fadd_rn(key_value(k1), key_value(k2)));
      }
    } else {
      __syncthreads();  // c_sh complete
      if (e < ng) {
        uint32_t k1 = kKeyNone, k2 = kKeyNone;  // top-2 keys of group e, k1 >= k2
        for (int i = 0; i < gsize; ++i) {
          const uint32_t kc = order_key(c_sh[e * gsize + i]);
          if (kc > k1) {
            k2 = k1;
            k1 = kc;
          } else if (kc > k2) {
            k2 = kc;
          }
        }
        gkey_sh[e] = order_key(__fadd_rn(key_value(k1), key_value(k2)));
      }
    }
    __syncthreads();
    // The topk_group best groups by warp 0, lane g holding group g (ng <= 16): rounds of a warp argmax,
    // ties to the lower group.
    if (warp == 0) {
      uint32_t gk = lane < ng ? gkey_sh[lane] : kKeyNone;
      uint32_t kept = 0;
      for (int r = 0; r < p.topk_group; ++r) {
        const int win = warp_argmax(gk, static_cast<uint32_t>(lane));
        if (win < 0) break;
        kept |= 1u << win;
        if (lane == win) gk = kKeyNone;
      }
      if (lane == 0) kept_sh = kept;
    }
    __syncthreads();
    if (e < E && !((kept_sh >> (e / gsize)) & 1u)) key = kKeyNone;
  }

  // 3. top-k: k rounds of a CTA argmax; the winner leaves the candidates. Every thread computes every
  // round's winner; thread j keeps slot j's.
  // NOTE (one barrier per round): round j writes the warps' winners to buffer j % 2; round j + 2
  // writes that buffer again only after every thread passed round j + 1's barrier, so after it read
  // round j's winners (the second barrier per round before: 2k CTA barriers per token).
  int my_id = -1;
  for (int j = 0; j < k; ++j) {
    const int buf = j & 1;
    const uint32_t wbest = __reduce_max_sync(kFull, key);
    const uint32_t wid = __reduce_min_sync(kFull, key == wbest ? static_cast<uint32_t>(e) : 0xFFFFFFFFu);
    if (lane == 0) {
      wkey_sh[buf][warp] = wbest;
      wid_sh[buf][warp] = wid;
    }
    __syncthreads();
    // Lane w < nwarps reads warp w's winner; two warp reductions pick the round's winner (the largest
    // key, ties to the lowest id, as warp_argmax).
    // NOTE: every thread scanning the nwarps winners compiled to a 228-instruction loop (48 LDS) per
    // round; this form is ~30 instructions per round (SASS). The kernel is instruction-bound at large T
    // (ncu, deepseek-r1 T = 16384: issued IPC 3.59, 161 us).
    const bool reader = lane < nwarps;
    const int win = warp_argmax(reader ? wkey_sh[buf][lane] : kKeyNone, reader ? wid_sh[buf][lane] : 0xFFFFFFFFu);
    if (win == e) key = kKeyNone;
    if (e == j) my_id = win;
    if (e == 0) ids_sh[j] = win;  // for permute_in_block, after its barrier
  }

  // 4. weights, by warp 0 (k <= 32): thread j's slot from sig of step 1 (the value the reference
  // computes from the logit again), the slot sum in slot order by shuffles, as route_kernel.
  // NOTE: step 1's sig_sh instead of the logit loaded again: a load and a CTA barrier fewer.
  if (warp == 0) {
    const bool active = e < k;
    const double sg = static_cast<double>(my_id >= 0 ? sig_sh[my_id] : static_cast<float>(sigmoid(0.0)));
    const double sum = slot_sum(active ? sg : 0.0, k);
    if (active) {
      const double w = sg / (sum + 1e-20) * static_cast<double>(p.routed_scaling_factor);
      args.topk_ids[blockIdx.x * static_cast<int64_t>(k) + e] = my_id;
      args.topk_weights[blockIdx.x * static_cast<int64_t>(k) + e] = __double2float_rn(w);
    }
  }
  permute_in_block(permute, ids_sh);  // launch_route_permute: T = 1, one block of permute_block::kThreads
}

bool aligned16(const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; }

bool route_args_valid(const RouteArgs& a) {
  const RoutingParams& p = a.params;
  if (p.method == RoutingMethod::Precomputed) return false;
  if (a.quant_out != nullptr && (a.hidden == nullptr || a.input_scale == nullptr || a.hidden_size <= 0 ||
                                 a.hidden_size % 16 != 0 || !aligned16(a.hidden) || !aligned16(a.quant_out)))
    return false;
  if (a.num_tokens < 0 || a.num_experts < 1 || a.num_experts > kMaxExperts) return false;
  if (p.top_k < 1 || p.top_k > kMaxTopK || p.top_k > a.num_experts) return false;
  if (a.num_tokens > 0 && (a.logits == nullptr || a.topk_ids == nullptr || a.topk_weights == nullptr))
    return false;
  if (p.method == RoutingMethod::Llama4 && p.top_k != 1) return false;
  if (p.method == RoutingMethod::DeepSeekV3) {
    const int ng = p.n_group;
    if (ng < 1 || ng > kMaxGroups || a.num_experts % ng != 0) return false;
    if (p.topk_group < 1 || p.topk_group > ng) return false;
    const int gsize = a.num_experts / ng;
    if (ng > 1 && gsize < 2) return false;
    if (p.top_k > p.topk_group * gsize) return false;
  }
  return true;
}

static_assert(permute_block::kThreads <= kMaxExperts, "the one-block DeepSeekV3 launch fits its launch bound");

// Both launchers: the routing kernel of the method, with `permute` run by its one block when
// permute.expert_offsets is set (launch_route_permute; the caller checked route_permute_fits).
cudaError_t launch_route_kernel(const RouteArgs& args, const PermuteArgs& permute, cudaStream_t stream) {
  const bool one_block = permute.expert_offsets != nullptr;
  if (args.params.method == RoutingMethod::DeepSeekV3) {
    if (args.num_tokens > 0x7FFFFFFF) return cudaErrorInvalidValue;
    // NOTE: one thread per expert; the permutation needs the whole permute_block::kThreads block.
    const dim3 block(one_block ? permute_block::kThreads : static_cast<unsigned>((args.num_experts + 31) / 32 * 32));
    const int64_t grid = args.num_tokens + quantize_block_count(args, static_cast<int>(block.x));
    if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
    return launch_dependent(route_deepseek_block_kernel, dim3(static_cast<unsigned>(grid)), block, 0, stream, args,
                            permute);
  }
  const dim3 block(one_block ? permute_block::kThreads : kWarpsPerBlock * 32);
  const int64_t warps = block.x / 32;
  int64_t grid = one_block ? 1 : (static_cast<int64_t>(args.num_tokens) + warps - 1) / warps;
  grid += quantize_block_count(args, static_cast<int>(block.x));  // + the quantizing blocks
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const dim3 g(static_cast<unsigned>(grid));
  if (args.num_experts <= 32) return launch_dependent(route_kernel<1>, g, block, 0, stream, args, permute);
  if (args.num_experts <= 128) return launch_dependent(route_kernel<4>, g, block, 0, stream, args, permute);
  return launch_dependent(route_kernel<16>, g, block, 0, stream, args, permute);
}

}  // namespace

cudaError_t launch_route(const RouteArgs& args, cudaStream_t stream) {
  if (!route_args_valid(args)) return cudaErrorInvalidValue;
  if (args.num_tokens == 0) return cudaSuccess;
  return launch_route_kernel(args, PermuteArgs{}, stream);
}

bool route_permute_fits(const RoutingParams& params, int64_t num_tokens) {
  if (num_tokens < 1 || num_tokens * params.top_k > permute_block::kSmallEntries) return false;
  // NOTE: at most one token per warp of the one block: a warp routing several tokens serialises them,
  // and with two per warp (T = 17..32) the fused stage took longer than routing and permuting in two
  // launches (15.3 us against ~6 us of routing alone at qwen3-235b-a22b T = 32).
  if (num_tokens > permute_block::kWarps) return false;
  // DeepSeekV3 routes a token per block: one block routes one token.
  return params.method != RoutingMethod::DeepSeekV3 || num_tokens == 1;
}

cudaError_t launch_route_permute(const RouteArgs& route, const PermuteArgs& permute, cudaStream_t stream) {
  if (!route_args_valid(route) || !permute_block::permute_args_valid(permute)) return cudaErrorInvalidValue;
  if (!route_permute_fits(route.params, route.num_tokens)) return cudaErrorInvalidValue;
  if (permute.topk_ids != route.topk_ids || permute.num_tokens != route.num_tokens ||
      permute.top_k != route.params.top_k || permute.num_experts != route.num_experts)
    return cudaErrorInvalidValue;
  return launch_route_kernel(route, permute, stream);
}

}  // namespace fp4moe::kernels
