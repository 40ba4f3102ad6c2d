"""FlashInfer's NVFP4 fused-MoE calls (release v0.6.17) on Hopper, running fp4moe's kernels.

An engine that calls `flashinfer.fused_moe.trtllm_fp4_block_scale_moe`, `trtllm_fp4_block_scale_routed_moe`
or `cutlass_fused_moe` with NVFP4 weights (which FlashInfer runs on SM 10.x/12.x only) imports these
names from `fp4moe.flashinfer` instead: the same parameters in the same order with the same defaults,
the same weight layouts, enums, return values and errors. docs/flashinfer.md maps each argument and
lists what is refused (`NotImplementedError` naming the argument; nothing is silently ignored).

Weights are converted from FlashInfer's layouts to fp4moe's once, at the first call that uses them,
and kept in a cache keyed by the weight tensors (their storage, shape and version counter) and the
per-expert scalars; a re-call with the same tensors converts nothing. `clear_weight_cache()` drops
every converted layer (its device memory is freed when no call uses it any more).

CUDA torch tensors only; the computation runs on the current torch stream.
"""
from enum import IntEnum

import torch

from . import MoeLayer, Problem, Router

__all__ = ["ActivationType", "RoutingMethodType", "block_scale_interleave", "clear_weight_cache", "cutlass_fused_moe",
           "fp4_quantize", "nvfp4_block_scale_interleave", "reorder_rows_for_gated_act_gemm", "shuffle_matrix_a",
           "shuffle_matrix_sf_a", "trtllm_fp4_block_scale_moe", "trtllm_fp4_block_scale_routed_moe"]


# ---- enums (flashinfer/tllm_enums.py at v0.6.17) ---------------------------------------------------------

class RoutingMethodType(IntEnum):
    Default = 0
    Renormalize = 1
    DeepSeekV3 = 2
    Llama4 = 3
    RenormalizeNaive = 4
    TopK = 5
    SigmoidRenorm = 6
    MiniMax2 = 7
    Sigmoid = 8
    Unspecified = 9

    def __repr__(self):
        return f"RoutingMethodType.{self.name}"


class ActivationType(IntEnum):
    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10
    InvalidType = 11

    @property
    def is_gated(self):
        return self in (ActivationType.Swiglu, ActivationType.Geglu, ActivationType.SwigluBias,
                        ActivationType.SwigluStep, ActivationType.GegluTanh, ActivationType.Situ)

    def __repr__(self):
        return f"ActivationType.{self.name}"


# ---- NVFP4 quantization and scale layouts (flashinfer/quantization/fp4_quantization.py) ----------------------

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _round_up(x, m):
    return (x + m - 1) // m * m


def _e2m1_codes(y):
    """e2m1 codes (uint8, sign in bit 3) of fp32 y: round to nearest even on the e2m1 grid, saturating at
    +-6; NaN encodes as +6 (docs/numerics.md, "Formats and block quantization")."""
    a = y.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    mag = torch.where(torch.isnan(y), torch.full_like(mag, 7), mag.to(torch.uint8))
    sign = torch.where(torch.signbit(y) & ~torch.isnan(y), 8, 0).to(torch.uint8)
    return mag | sign


def _swizzle_128x4(linear):
    """[..., R, C] uint8 scale matrices -> the 128x4 layout of each, flat (rows padded to 128, columns to 4,
    padding zero): byte (r // 128) * 128 * Cp + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4."""
    *batch, R, C = linear.shape
    Rp, Cp = _round_up(R, 128), _round_up(C, 4)
    padded = torch.zeros((*batch, Rp, Cp), dtype=torch.uint8, device=linear.device)
    padded[..., :R, :C] = linear
    tiles = padded.reshape(*batch, Rp // 128, 4, 32, Cp // 4, 4)  # [m128, r4, r32, c4, cc]
    n = len(batch)
    order = list(range(n)) + [n, n + 3, n + 2, n + 1, n + 4]      # [m128, c4, r32, r4, cc]
    return tiles.permute(order).contiguous().reshape(-1)


def _unswizzle_128x4(swizzled, batch, R, C):
    """The inverse of _swizzle_128x4: flat bytes of `batch` matrices -> [batch, R, C] linear."""
    Rp, Cp = _round_up(R, 128), _round_up(C, 4)
    tiles = swizzled.reshape(batch, Rp // 128, Cp // 4, 32, 4, 4)  # [b, m128, c4, r32, r4, cc]
    linear = tiles.permute(0, 1, 4, 3, 2, 5).reshape(batch, Rp, Cp)
    return linear[:, :R, :C].contiguous()


def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True,
                 is_sf_8x4_layout=False, is_global_scale_inversed=False, enable_pdl=None, backend="cuda"):
    """NVFP4 quantization of input [..., K] (bf16 / fp16 / fp32) with the quantize-direction global scale
    (448 * 6 / amax; its reciprocal with is_global_scale_inversed): (packed uint8 [M, K/2], element 2i in
    the low nibble; scales uint8, linear [M, K/16] or the 128x4-swizzled bytes shaped [round_up(M, 128),
    round_up(K/16, 4)]). Per block of 16: sf = e4m3(gs * (amax * (1/6))), q = e2m1(x * (1 / (sf / gs)))
    with exact fp32 divisions (fp4moe's contract; FlashInfer's default uses an approximate reciprocal)."""
    if sf_vec_size not in (16, 32):
        raise NotImplementedError(f"fp4_quantize: sf_vec_size must be 16 or 32, got {sf_vec_size}")
    if sf_use_ue8m0 or sf_vec_size != 16:
        raise NotImplementedError("fp4_quantize: sf_use_ue8m0 / sf_vec_size=32 (MXFP4 activations) are not built in "
                                  "fp4moe.flashinfer; NVFP4 (sf_vec_size=16, e4m3 scales) is")
    if is_sf_8x4_layout:
        raise NotImplementedError("fp4_quantize: is_sf_8x4_layout: fp4moe has the linear and 128x4 scale layouts only")
    if backend != "cuda":
        raise NotImplementedError(f"fp4_quantize: backend {backend!r}: fp4moe.flashinfer quantizes with torch ops")
    if enable_pdl is False:
        raise NotImplementedError("fp4_quantize: enable_pdl=False: fp4moe.flashinfer's quantization has no PDL switch")
    if global_scale is None:
        raise ValueError("fp4_quantize: global_scale is required for NVFP4 (sf_use_ue8m0=False)")
    if input.shape[-1] % 16 != 0:
        raise ValueError(f"fp4_quantize: the last dimension must be a multiple of 16, got {input.shape[-1]}")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=input.device).reshape(-1)
    if gs.numel() != 1:
        raise NotImplementedError(f"fp4_quantize: row-wise global scales ({gs.numel()} values): fp4moe.flashinfer "
                                  "takes one global scale")
    if is_global_scale_inversed:
        gs = torch.reciprocal(gs)
    K = input.shape[-1]
    x = input.reshape(-1, K).float()
    M = x.shape[0]
    blocks = x.reshape(M, K // 16, 16)
    amax = blocks.abs().amax(dim=-1)  # NOTE: torch's amax propagates NaN, as the contract's amax does
    sf_value = (amax * (1.0 / 6.0)) * gs
    sf = torch.clamp(sf_value, max=448.0).to(torch.float8_e4m3fn)
    sf_bits = torch.where(torch.isnan(sf_value), torch.full_like(sf.view(torch.uint8), 0x7F), sf.view(torch.uint8))
    sf_float = sf.float()
    osc = torch.where(sf_float == 0, torch.zeros_like(sf_float), 1.0 / (sf_float * (1.0 / gs)))
    codes = _e2m1_codes(blocks * osc.unsqueeze(-1)).reshape(M, K)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    if not is_sf_swizzled_layout:
        return packed, sf_bits
    return packed, _swizzle_128x4(sf_bits).reshape(_round_up(M, 128), _round_up(K // 16, 4))


def block_scale_interleave(unswizzled_sf):
    """[rows, cols] or [E, rows, cols] linear scales (uint8 / e4m3) -> the 128x4-swizzled bytes, flat."""
    if unswizzled_sf.dim() not in (2, 3):
        raise ValueError(f"block_scale_interleave: expected a 2-D or 3-D tensor, got shape {list(unswizzled_sf.shape)}")
    x = unswizzled_sf.view(torch.uint8) if unswizzled_sf.dtype == torch.float8_e4m3fn else unswizzled_sf
    return _swizzle_128x4(x.contiguous())


nvfp4_block_scale_interleave = block_scale_interleave


def _gated_reorder_rows(M, device):
    """FlashInfer's reorder_rows_for_gated_act_gemm indices: out[2j] = in[j], out[2j + 1] = in[M/2 + j]."""
    rows = torch.arange(M, device=device)
    idx = torch.empty_like(rows)
    idx[0::2] = rows[:(M + 1) // 2]
    idx[1::2] = rows[(M + 1) // 2:]
    return idx


def _shuffle_rows(M, epilogue_tile_m, device):
    """FlashInfer's shuffle_matrix_a row indices (out = in[idx]): blocks of 32 rows (16 unless
    epilogue_tile_m % 128 == 0), out[32b + d] = in[32b + 4 * (d % 8) + d // 8]."""
    block = 32 if epilogue_tile_m % 128 == 0 else 16
    if M % block != 0:
        raise ValueError(f"shuffle: the row count {M} must be a multiple of {block}")
    d = torch.arange(M, device=device)
    base, r = d // block * block, d % block
    return base + (block // 8) * (r % 8) + r // 8


def reorder_rows_for_gated_act_gemm(x):
    return x[_gated_reorder_rows(x.shape[0], x.device)]


def shuffle_matrix_a(input_tensor, epilogue_tile_m):
    return input_tensor[_shuffle_rows(input_tensor.shape[0], epilogue_tile_m, input_tensor.device)]


def shuffle_matrix_sf_a(input_tensor, epilogue_tile_m, num_elts_per_sf=16):
    """Linear [M, K/16] scales: rows shuffled as shuffle_matrix_a, then block_scale_interleave (flat)."""
    return block_scale_interleave(shuffle_matrix_a(input_tensor, epilogue_tile_m))


# ---- weight conversion, cached per weight tensor ---------------------------------------------------------

_CACHE = {}


def clear_weight_cache():
    """Drops every converted layer (the next call converts its weights again)."""
    _CACHE.clear()


def _tensor_key(t):
    if t is None:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), str(t.dtype), t._version)


def _per_expert(name, t, E):
    """A float32 [E] parameter (a scalar broadcasts) as a host tensor."""
    v = torch.as_tensor(t, dtype=torch.float32).detach().reshape(-1).cpu()
    if v.numel() == 1:
        v = v.expand(E).contiguous()
    if v.numel() != E:
        raise ValueError(f"{name}: expected {E} values (one per local expert), got {v.numel()}")
    return v


def _uniform(name, t, E):
    """One float for a per-expert parameter whose experts must agree (fp4moe's activation has one value
    per layer), or NotImplementedError naming it."""
    v = _per_expert(name, t, E)
    if not bool((v == v[0]).all()):
        raise NotImplementedError(f"{name}: different values per expert; fp4moe's activation takes one value per layer")
    return float(v[0])


def _activation(where, activation_type, alpha, beta, limit, E):
    """(fp4moe activation, swiglu_alpha, swiglu_beta, swiglu_limit, gated)."""
    act = ActivationType(int(activation_type))
    if act == ActivationType.Swiglu:
        if alpha is None and beta is None and limit is None:
            return "swiglu", 1.702, 1.0, 7.0, True
        # gpt-oss: gate = min(x1, limit), up = clamp(x0, -limit, limit), gate * sigmoid(alpha * gate) * (up + beta)
        a = 1.0 if alpha is None else _uniform(f"{where}: alpha", alpha, E)
        b = 0.0 if beta is None else _uniform(f"{where}: beta", beta, E)
        lim = torch.finfo(torch.float32).max if limit is None else _uniform(f"{where}: limit", limit, E)
        return "swiglu_oai", a, b, lim, True
    if alpha is not None or beta is not None or limit is not None:
        raise NotImplementedError(f"{where}: alpha / beta / clamp limit with activation {act.name}: fp4moe takes them "
                                  "with Swiglu only")
    if act == ActivationType.Geglu:
        return "geglu", 1.702, 1.0, 7.0, True
    if act == ActivationType.Relu2:
        return "relu2", 1.702, 1.0, 7.0, False
    raise NotImplementedError(f"{where}: activation_type {act.name} ({int(act)}): fp4moe builds Swiglu (with the "
                              "gpt-oss alpha / beta / limit), Geglu and Relu2")


def _routing(where, routing_method_type, n_group, topk_group, routed_scaling_factor, norm_topk_prob, top_k):
    """fp4moe's routing keywords for FlashInfer's routing method (docs/flashinfer.md, "Routing")."""
    method = RoutingMethodType(int(routing_method_type))
    scale = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)
    groups = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}
    if method == RoutingMethodType.Default:
        return dict(routing_method="default", **groups)
    if method in (RoutingMethodType.Renormalize, RoutingMethodType.RenormalizeNaive):
        return dict(routing_method="renormalize", **groups)
    if method == RoutingMethodType.TopK:
        return dict(routing_method="topk", **groups)
    if method == RoutingMethodType.Sigmoid:
        return dict(routing_method="sigmoid", **groups)
    if method == RoutingMethodType.SigmoidRenorm:
        return dict(routing_method="sigmoid_renorm" if norm_topk_prob else "sigmoid", **groups)
    if method == RoutingMethodType.Llama4:
        if top_k != 1:
            raise ValueError(f"{where}: Llama4 routing needs top_k == 1, got {top_k}")
        return dict(routing_method="llama4", **groups)
    if method in (RoutingMethodType.DeepSeekV3, RoutingMethodType.MiniMax2):
        ng = int(n_group or 0)
        tg = int(topk_group or 0)
        if method == RoutingMethodType.MiniMax2 or ng <= 1:
            ng, tg = 1, 1
        return dict(routing_method="deepseek_v3", n_group=ng, topk_group=tg, routed_scaling_factor=scale)
    raise NotImplementedError(f"{where}: routing_method_type {method.name} ({int(method)}) has no routing")


def _unshuffle_rows(t, gated, epilogue_tile_m=128):
    """The rows of one expert's FlashInfer trtllm-gen matrix back in their logical order ([up; gate] when
    gated): final row i holds logical row P[i], so logical = final[argsort(P)]."""
    M = t.shape[0]
    P = _shuffle_rows(M, epilogue_tile_m, t.device)
    if gated:
        P = _gated_reorder_rows(M, t.device)[P]
    inverse = torch.empty_like(P)
    inverse[P] = torch.arange(M, device=t.device)
    return t[inverse]


def _layer_for(key, build, T, tune_max_num_tokens):
    """The converted layer of `key`, built by build(max_tokens) at first use; built again (the weights
    converted again) for a call of more tokens than its max_tokens."""
    entry = _CACHE.get(key)
    if entry is None or entry.layer.max_tokens < T:
        entry = build(max(int(tune_max_num_tokens), int(T), 1 if entry is None else 2 * entry.layer.max_tokens))
        _CACHE[key] = entry
    return entry


def _check_cuda(where, **tensors):
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise ValueError(f"{where}: {name} must be a CUDA tensor, got one on {t.device}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{where}: {name} is on {t.device} but the other tensors are on {device}")
    return device


class _Converted:
    """An fp4moe layer of converted weights, the Router of the whole layer's routing, and what the call
    needs to map global expert ids to the layer's."""

    def __init__(self, layer, router, expert_offset, local_experts, num_experts, w2_bias):
        self.layer = layer
        self.router = router
        self.expert_offset = expert_offset
        self.local_experts = local_experts
        self.num_experts = num_experts
        self.w2_bias = w2_bias  # [E_l, H] float32 on the device, or None (do_finalize=False adds it)
        self.input_scale = None  # cutlass_fused_moe: quant_scales[0], the input's quantize-direction scale


def _local_ids(conv, ids):
    """Global ids -> the layer's: id - offset, or -1 for another rank's expert (no GEMM row)."""
    if conv.expert_offset == 0 and conv.local_experts == conv.num_experts:
        return ids
    local = ids - conv.expert_offset
    return torch.where((local >= 0) & (local < conv.local_experts), local, torch.full_like(local, -1))


def _run_stages(where, conv, values, scales, ids, weights, do_finalize, output, H):
    """experts -> finalize (or the unfinalized triple) on per-token NVFP4 or bf16 rows."""
    layer = conv.layer
    T, k = ids.shape
    local = _local_ids(conv, ids).to(torch.int32).contiguous()
    y = layer.experts(values, scales, local)
    if not do_finalize:
        out = y
        if conv.w2_bias is not None:
            safe = torch.where(local >= 0, local, torch.zeros_like(local)).reshape(-1).long()
            out = y + conv.w2_bias[safe]
        permuted = torch.arange(T * k, dtype=torch.int32, device=ids.device)
        permuted = torch.where(local.reshape(-1) >= 0, permuted, torch.full_like(permuted, -1))
        return [out.to(torch.bfloat16), weights.to(torch.bfloat16), permuted]
    w = weights.float().contiguous()
    if output is not None:
        if output.dtype != torch.bfloat16 or output.device != ids.device or output.dim() != 2 or \
                output.shape[0] != T or output.shape[1] > H:
            raise ValueError(f"{where}: output must be a bfloat16 [{T}, <= {H}] tensor on {ids.device}, got "
                             f"{output.dtype} {list(output.shape)} on {output.device}")
        if output.shape[1] == H and output.is_contiguous():
            layer.finalize(y, local, w, output=output)
            return [output]
        full = layer.finalize(y, local, w)
        output.copy_(full[:, :output.shape[1]])
        return [output]
    return [layer.finalize(y, local, w)]


# ---- trtllm_fp4_block_scale_moe / _routed_moe -------------------------------------------------------------

def _trtllm_layer(where, hidden_states, gemm1_weights, gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta,
                  gemm1_clamp_limit, gemm2_weights, gemm2_weights_scale, gemm2_bias, output1_scale_scalar,
                  output1_scale_gate_scalar, output2_scale_scalar, num_experts, top_k, routing, intermediate_size,
                  local_expert_offset, local_num_experts, activation_type, tune_max_num_tokens):
    E, I = int(local_num_experts), int(intermediate_size)
    if hidden_states.dtype != torch.uint8:
        raise NotImplementedError(f"{where}: hidden_states of dtype {hidden_states.dtype}: with NVFP4 weights "
                                  "FlashInfer (and fp4moe.flashinfer) take NVFP4 hidden states (uint8 [T, H/2] with "
                                  "hidden_states_scale)")
    H = hidden_states.shape[-1] * 2
    if not (0 < top_k <= num_experts and 0 < E <= num_experts and local_expert_offset >= 0
            and local_expert_offset + E <= num_experts):
        raise ValueError(f"{where}: expected 0 < top_k <= num_experts, 0 < local_num_experts <= num_experts and "
                         f"0 <= local_expert_offset <= num_experts - local_num_experts, got top_k={top_k}, "
                         f"num_experts={num_experts}, local_expert_offset={local_expert_offset}, "
                         f"local_num_experts={E}")
    for name, t in (("output1_scale_scalar", output1_scale_scalar), ("output1_scale_gate_scalar",
                    output1_scale_gate_scalar), ("output2_scale_scalar", output2_scale_scalar)):
        if t is None:
            raise ValueError(f"{where}: {name} is required with NVFP4 hidden states")
    act, alpha, beta, limit, gated = _activation(where, activation_type, gemm1_alpha, gemm1_beta, gemm1_clamp_limit, E)
    N13 = 2 * I if gated else I
    for name, t, shape in (("gemm1_weights", gemm1_weights, (E, N13, H // 2)), ("gemm2_weights", gemm2_weights,
                           (E, H, I // 2))):
        if t.dtype != torch.uint8 or tuple(t.shape) != shape:
            raise ValueError(f"{where}: {name} must be uint8 {list(shape)}, got {t.dtype} {list(t.shape)}")
    for name, t, rows, cols in (("gemm1_weights_scale", gemm1_weights_scale, N13, H // 16),
                                ("gemm2_weights_scale", gemm2_weights_scale, H, I // 16)):
        want = E * _round_up(rows, 128) * _round_up(cols, 4)
        if t.dtype not in (torch.float8_e4m3fn, torch.uint8) or t.numel() != want:
            raise ValueError(f"{where}: {name} must hold the 128x4-swizzled e4m3 scales of [{E}, {rows}, {cols}] "
                             f"({want} float8_e4m3fn elements), got {t.dtype} with {t.numel()}")
    key = ("trtllm", *(_tensor_key(t) for t in (gemm1_weights, gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta,
                                                 gemm1_clamp_limit, gemm2_weights, gemm2_weights_scale, gemm2_bias,
                                                 output1_scale_scalar, output1_scale_gate_scalar,
                                                 output2_scale_scalar)),
           int(num_experts), int(top_k), tuple(sorted(routing.items())), I, int(local_expert_offset), E,
           int(activation_type), str(hidden_states.device))

    def build(max_tokens):
        dev = hidden_states.device
        w13 = torch.stack([_unshuffle_rows(gemm1_weights[e], gated) for e in range(E)])
        s13 = _unswizzle_128x4(gemm1_weights_scale.reshape(-1).view(torch.uint8), E, N13, H // 16)
        s13 = torch.stack([_unshuffle_rows(s13[e], gated) for e in range(E)])
        w2 = torch.stack([_unshuffle_rows(gemm2_weights[e], False) for e in range(E)])
        s2 = _unswizzle_128x4(gemm2_weights_scale.reshape(-1).view(torch.uint8), E, H, I // 16)
        s2 = torch.stack([_unshuffle_rows(s2[e], False) for e in range(E)])
        # NOTE: fp4moe's alphas (docs/flashinfer.md, "Scales"): alpha1 = w13_scale_2 * input_scale with input
        # scale 1 is the dequantization of the GEMM1 accumulator, output1_scale_gate_scalar; the activation is
        # re-quantized with w2_input_scale = gate / out1 (the intermediate's dequantize-direction scale) and
        # alpha2 = w2_scale_2 * w2_input_scale is output2_scale_scalar.
        gate = _per_expert("output1_scale_gate_scalar", output1_scale_gate_scalar, E)
        out1 = _per_expert("output1_scale_scalar", output1_scale_scalar, E)
        out2 = _per_expert("output2_scale_scalar", output2_scale_scalar, E)
        w2_input = gate / out1 if gated else 1.0 / out1
        weights = {"w13": w13.cpu(), "w13_scale": s13.cpu(), "w13_scale_2": gate.clone(),
                   "w13_input_scale": torch.ones(E), "w2": w2.cpu(), "w2_scale": s2.cpu(),
                   "w2_scale_2": out2 / w2_input, "w2_input_scale": w2_input.clone()}
        w2_bias = None
        if gemm1_bias is not None:  # in accumulator units, rows permuted as the weights'
            b = torch.stack([_unshuffle_rows(gemm1_bias[e].float().reshape(-1, 1), gated).reshape(-1) for e in range(E)])
            weights["w13_bias"] = (b.cpu() * gate.reshape(E, 1)).contiguous()
        if gemm2_bias is not None:
            b = torch.stack([_unshuffle_rows(gemm2_bias[e].float().reshape(-1, 1), False).reshape(-1) for e in range(E)])
            weights["w2_bias"] = (b.cpu() * out2.reshape(E, 1)).contiguous()
            w2_bias = weights["w2_bias"].to(dev)
        problem = Problem(num_experts=E, hidden=H, inter=I, top_k=int(top_k), routing_method="precomputed",
                          skip_foreign_ids=E < num_experts, activation=act, swiglu_alpha=alpha, swiglu_beta=beta,
                          swiglu_limit=limit, act_quant="w4a4_scalar")
        layer = MoeLayer(problem, weights, device=dev, max_tokens=max_tokens, w13_up_gate=gated)
        router = Router(Problem(num_experts=int(num_experts), hidden=H, inter=I, top_k=int(top_k), **routing),
                        device=dev)
        return _Converted(layer, router, int(local_expert_offset), E, int(num_experts), w2_bias)

    return _layer_for(key, build, hidden_states.shape[0], tune_max_num_tokens), H


def _check_common(where, enable_pdl, per_token_scale):
    if enable_pdl is False:
        raise NotImplementedError(f"{where}: enable_pdl=False: fp4moe launches with programmatic dependent launch "
                                  "on every Hopper GPU (FP4MOE_PDL=0 turns it off for the process)")
    if per_token_scale is not None:
        raise NotImplementedError(f"{where}: per_token_scale (per-token NVFP4 activations) is not built in fp4moe")


def _rows(where, conv, hidden_states, hidden_states_scale, T, H):
    if hidden_states_scale is None:
        raise ValueError(f"{where}: hidden_states_scale is required with NVFP4 hidden states")
    scales = hidden_states_scale.view(torch.uint8) if hidden_states_scale.dtype == torch.float8_e4m3fn else \
        hidden_states_scale
    if scales.numel() != T * H // 16:
        raise ValueError(f"{where}: hidden_states_scale must hold the linear [T, H/16] = [{T}, {H // 16}] e4m3 "
                         f"scales, got {scales.numel()} elements")
    return hidden_states.reshape(T, H // 2), scales.reshape(T, H // 16)


def trtllm_fp4_block_scale_moe(routing_logits, routing_bias, hidden_states, hidden_states_scale, gemm1_weights,
                               gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
                               gemm2_weights, gemm2_weights_scale, gemm2_bias, output1_scale_scalar,
                               output1_scale_gate_scalar, output2_scale_scalar, num_experts, top_k, n_group,
                               topk_group, intermediate_size, local_expert_offset, local_num_experts,
                               routed_scaling_factor, routing_method_type=0, do_finalize=True, enable_pdl=None,
                               activation_type=ActivationType.Swiglu.value, per_token_scale=None, output=None,
                               tune_max_num_tokens=8192, norm_topk_prob=True, routing_replay_out=None,
                               num_fused_shared_experts=None):
    """FlashInfer's trtllm_fp4_block_scale_moe (v0.6.17): routing from logits, then the NVFP4 layer.
    Returns [output] (do_finalize) or [gemm2_output, expert_weights, expanded_idx_to_permuted_idx]."""
    where = "trtllm_fp4_block_scale_moe"
    _check_cuda(where, routing_logits=routing_logits, routing_bias=routing_bias, hidden_states=hidden_states,
                hidden_states_scale=hidden_states_scale, gemm1_weights=gemm1_weights, gemm2_weights=gemm2_weights,
                output=output, routing_replay_out=routing_replay_out)
    if num_fused_shared_experts:
        raise NotImplementedError(f"{where}: num_fused_shared_experts: fused shared experts are not built in fp4moe")
    _check_common(where, enable_pdl, per_token_scale)
    routing = _routing(where, routing_method_type, n_group, topk_group, routed_scaling_factor, norm_topk_prob, top_k)
    conv, H = _trtllm_layer(where, hidden_states, gemm1_weights, gemm1_weights_scale, gemm1_bias, gemm1_alpha,
                            gemm1_beta, gemm1_clamp_limit, gemm2_weights, gemm2_weights_scale, gemm2_bias,
                            output1_scale_scalar, output1_scale_gate_scalar, output2_scale_scalar, num_experts, top_k,
                            routing, intermediate_size, local_expert_offset, local_num_experts, activation_type,
                            tune_max_num_tokens)
    T = hidden_states.shape[0]
    if routing_logits is None or tuple(routing_logits.shape) != (T, num_experts):
        raise ValueError(f"{where}: routing_logits must be [{T}, {num_experts}] (float32 or bfloat16)")
    if routing_replay_out is not None and (routing_replay_out.dtype != torch.int16 or routing_replay_out.dim() != 2
                                           or routing_replay_out.shape[0] < T or routing_replay_out.shape[1] != top_k
                                           or not routing_replay_out.is_contiguous()):
        raise ValueError(f"{where}: routing_replay_out must be a contiguous int16 [N >= {T}, {top_k}] tensor")
    bias = None
    if routing_bias is not None and routing["routing_method"] == "deepseek_v3":
        bias = routing_bias.float().contiguous()
    ids, weights = conv.router(routing_logits.contiguous(), bias)
    # NOTE: FlashInfer's routing kernels store the weights in bf16, and its finalize reads those.
    weights = weights.to(torch.bfloat16)
    if routing_replay_out is not None:
        routing_replay_out[:T].copy_(ids.to(torch.int16))
    values, scales = _rows(where, conv, hidden_states, hidden_states_scale, T, H)
    return _run_stages(where, conv, values, scales, ids, weights, do_finalize, output, H)


def trtllm_fp4_block_scale_routed_moe(topk_ids, routing_bias, hidden_states, hidden_states_scale, gemm1_weights,
                                      gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
                                      gemm2_weights, gemm2_weights_scale, gemm2_bias, output1_scale_scalar,
                                      output1_scale_gate_scalar, output2_scale_scalar, num_experts, top_k, n_group,
                                      topk_group, intermediate_size, local_expert_offset, local_num_experts,
                                      routed_scaling_factor, routing_method_type=0, do_finalize=True, enable_pdl=None,
                                      activation_type=ActivationType.Swiglu.value, per_token_scale=None, output=None,
                                      tune_max_num_tokens=8192):
    """FlashInfer's trtllm_fp4_block_scale_routed_moe (v0.6.17): caller-given routing, packed as int32
    (expert_id << 16) | bf16 bits of the weight, or an (ids int32, weights bf16 / float32) pair."""
    where = "trtllm_fp4_block_scale_routed_moe"
    packed = not isinstance(topk_ids, tuple)
    ids_in, weights_in = (topk_ids, None) if packed else topk_ids
    _check_cuda(where, topk_ids=ids_in, topk_weights=weights_in, hidden_states=hidden_states,
                hidden_states_scale=hidden_states_scale, gemm1_weights=gemm1_weights, gemm2_weights=gemm2_weights,
                output=output)
    _check_common(where, enable_pdl, per_token_scale)
    routing = _routing(where, routing_method_type, n_group, topk_group, routed_scaling_factor, True, top_k)
    conv, H = _trtllm_layer(where, hidden_states, gemm1_weights, gemm1_weights_scale, gemm1_bias, gemm1_alpha,
                            gemm1_beta, gemm1_clamp_limit, gemm2_weights, gemm2_weights_scale, gemm2_bias,
                            output1_scale_scalar, output1_scale_gate_scalar, output2_scale_scalar, num_experts, top_k,
                            routing, intermediate_size, local_expert_offset, local_num_experts, activation_type,
                            tune_max_num_tokens)
    T = hidden_states.shape[0]
    if ids_in.dtype != torch.int32 or tuple(ids_in.shape) != (T, top_k):
        raise ValueError(f"{where}: topk_ids must be int32 [{T}, {top_k}], got {ids_in.dtype} {list(ids_in.shape)}")
    if packed:
        ids = (ids_in >> 16).to(torch.int32)
        weights = (ids_in & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    else:
        if weights_in.dtype not in (torch.bfloat16, torch.float32) or tuple(weights_in.shape) != (T, top_k):
            raise ValueError(f"{where}: the weights of an (ids, weights) pair must be bfloat16 or float32 "
                             f"[{T}, {top_k}], got {weights_in.dtype} {list(weights_in.shape)}")
        ids, weights = ids_in, weights_in
    values, scales = _rows(where, conv, hidden_states, hidden_states_scale, T, H)
    result = _run_stages(where, conv, values, scales, ids.contiguous(), weights, do_finalize, output, H)
    if not do_finalize and not packed:
        result[1] = weights_in  # the caller's weights, returned as given
    return result


# ---- cutlass_fused_moe (NVFP4 weights) --------------------------------------------------------------------

def cutlass_fused_moe(input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights,
                      output_dtype, quant_scales, fc1_expert_biases=None, fc2_expert_biases=None, input_sf=None,
                      swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None, tp_size=1, tp_rank=0, ep_size=1,
                      ep_rank=0, cluster_size=1, cluster_rank=0, output=None, enable_alltoall=False,
                      use_deepseek_fp8_block_scale=False, use_w4_group_scaling=False, use_mxfp8_act_scaling=False,
                      min_latency_mode=False, use_packed_weights=False, tune_max_num_tokens=8192, enable_pdl=None,
                      activation_type=ActivationType.Swiglu, swizzled_input_sf=True, use_fused_finalize=True,
                      profile_ids=None, workspace_buffer=None):
    """FlashInfer's cutlass_fused_moe (v0.6.17) with NVFP4 weights (fc1/fc2 uint8 viewed as int64, the
    6-entry quant_scales). Returns FlashInfer's list of 4: [output, and three placeholders it never writes
    in this mode]."""
    where = "cutlass_fused_moe"
    _check_cuda(where, input=input, token_selected_experts=token_selected_experts,
                token_final_scales=token_final_scales, fc1_expert_weights=fc1_expert_weights,
                fc2_expert_weights=fc2_expert_weights, input_sf=input_sf, output=output)
    if min_latency_mode:
        raise NotImplementedError(f"{where}: min_latency_mode")
    for name, flag in (("enable_alltoall", enable_alltoall), ("use_deepseek_fp8_block_scale",
                       use_deepseek_fp8_block_scale), ("use_w4_group_scaling", use_w4_group_scaling),
                       ("use_mxfp8_act_scaling", use_mxfp8_act_scaling), ("use_packed_weights", use_packed_weights)):
        if flag:
            raise NotImplementedError(f"{where}: {name}=True: fp4moe.flashinfer builds the NVFP4 path only")
    if cluster_size != 1 or cluster_rank != 0:
        raise ValueError(f"{where}: cluster_size must be 1 and cluster_rank 0")
    _check_common(where, enable_pdl, None)
    if fc1_expert_weights.dtype != torch.int64 or fc2_expert_weights.dtype != torch.int64:
        raise NotImplementedError(f"{where}: fc1/fc2 weights of dtype {fc1_expert_weights.dtype}: fp4moe.flashinfer "
                                  "takes NVFP4 weights (uint8 viewed as int64)")
    if len(quant_scales) != 6:
        raise ValueError(f"{where}: NVFP4 quant_scales has 6 entries, got {len(quant_scales)}")
    if output_dtype not in (torch.bfloat16, torch.float32):
        raise NotImplementedError(f"{where}: output_dtype {output_dtype}: fp4moe writes bfloat16 (or the float32 sums)")
    a1_gs, w1_block, fc1_global, a2_gs, w2_block, fc2_global = quant_scales
    E = fc1_expert_weights.shape[0]
    H = fc2_expert_weights.shape[1]
    I = fc2_expert_weights.shape[2] * 16
    act, alpha, beta, limit, gated = _activation(where, activation_type, swiglu_alpha, swiglu_beta, swiglu_limit, E)
    N13 = 2 * I if gated else I
    if fc1_expert_weights.shape[1] != N13 or fc1_expert_weights.shape[2] * 16 != H:
        raise ValueError(f"{where}: fc1_expert_weights must be [{E}, {N13}, {H // 16}] int64 (packed NVFP4), got "
                         f"{list(fc1_expert_weights.shape)}")
    T, k = token_selected_experts.shape
    E_total = E * int(ep_size)
    key = ("cutlass", *(_tensor_key(t) for t in (fc1_expert_weights, fc2_expert_weights, fc1_expert_biases,
                                                  fc2_expert_biases, swiglu_alpha, swiglu_beta, swiglu_limit,
                                                  *quant_scales)),
           int(ep_size), int(ep_rank), int(k), int(activation_type), str(input.device))

    def build(max_tokens):
        dev = input.device
        a1 = torch.as_tensor(a1_gs, dtype=torch.float32).reshape(-1).cpu()
        a2 = _per_expert("quant_scales[3]", a2_gs, E)
        if a1.numel() != 1 and not bool((a1 == a1[0]).all()):
            raise NotImplementedError(f"{where}: quant_scales[0] differs per expert: fp4moe.flashinfer quantizes the "
                                      "input once per token")
        w2_input = 1.0 / a2
        weights = {
            "w13": fc1_expert_weights.view(torch.uint8).reshape(E, N13, H // 2).cpu(),
            "w13_scale": w1_block.reshape(-1).view(torch.uint8).cpu(),
            "w13_scale_2": _per_expert("quant_scales[2]", fc1_global, E).clone(),  # alpha1, input scale 1
            "w13_input_scale": torch.ones(E),
            "w2": fc2_expert_weights.view(torch.uint8).reshape(E, H, I // 2).cpu(),
            "w2_scale": w2_block.reshape(-1).view(torch.uint8).cpu(),
            "w2_scale_2": _per_expert("quant_scales[5]", fc2_global, E) / w2_input,
            "w2_input_scale": w2_input.clone(),
        }
        if fc1_expert_biases is not None:
            weights["w13_bias"] = fc1_expert_biases.float().reshape(E, N13).cpu()
        if fc2_expert_biases is not None:
            weights["w2_bias"] = fc2_expert_biases.float().reshape(E, H).cpu()
        problem = Problem(num_experts=E, hidden=H, inter=I, top_k=int(k), routing_method="precomputed",
                          skip_foreign_ids=int(ep_size) > 1, activation=act, swiglu_alpha=alpha, swiglu_beta=beta,
                          swiglu_limit=limit, act_quant="w4a4_scalar")
        layer = MoeLayer(problem, weights, device=dev, max_tokens=max_tokens, scales_swizzled=True, w13_up_gate=gated)
        conv = _Converted(layer, None, E * int(ep_rank), E, E_total, None)
        conv.input_scale = float(a1[0])  # quantize direction
        return conv

    conv = _layer_for(key, build, T, tune_max_num_tokens)
    if token_final_scales.dtype != torch.float32 or tuple(token_final_scales.shape) != (T, k):
        raise ValueError(f"{where}: token_final_scales must be float32 [{T}, {k}]")
    if input.dtype == torch.uint8:  # pre-quantized NVFP4 with input_sf
        if input_sf is None:
            raise ValueError(f"{where}: input_sf is required with a pre-quantized (uint8) input")
        sf = input_sf.view(torch.uint8) if input_sf.dtype == torch.float8_e4m3fn else input_sf
        if swizzled_input_sf:
            sf = _unswizzle_128x4(sf.reshape(-1), 1, T, H // 16)[0]
        values, scales = input.reshape(T, H // 2), sf.reshape(T, H // 16)
    elif input.dtype == torch.bfloat16:
        values, scales = fp4_quantize(input, torch.tensor([conv.input_scale], device=input.device),
                                      is_sf_swizzled_layout=False)
    else:
        raise NotImplementedError(f"{where}: input of dtype {input.dtype}: fp4moe.flashinfer takes bfloat16 or "
                                  "pre-quantized NVFP4 (uint8 with input_sf)")
    local = _local_ids(conv, token_selected_experts.to(torch.int32)).contiguous()
    y = conv.layer.experts(values.contiguous(), scales.contiguous(), local)
    result = conv.layer.finalize(y, local, token_final_scales.contiguous(),
                                 output_dtype="float32" if output_dtype == torch.float32 else "bfloat16")
    if output is not None:
        if tuple(output.shape) != (T, H) or output.dtype != output_dtype:
            raise ValueError(f"{where}: output must be {output_dtype} [{T}, {H}], got {output.dtype} {list(output.shape)}")
        output.copy_(result)
        result = output
    dev = input.device
    return [result, torch.empty(1, dtype=torch.int32, device=dev),
            torch.empty((E, T), dtype=torch.float32, device=dev), torch.empty(E, dtype=torch.int32, device=dev)]
