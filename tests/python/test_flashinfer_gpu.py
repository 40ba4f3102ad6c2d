"""fp4moe.flashinfer (ctest label gpu): FlashInfer v0.6.17's NVFP4 MoE calls, with inputs built the way
FlashInfer's own tests build them (fp4_quantize with the quantize-direction global scale 448 * 6 / amax,
gemm1 rows reordered for the gated activation and shuffled, scales 128x4-interleaved, the output scalars
of tests/moe/test_trtllm_gen_fused_moe.py), checked against the contract reference: fp4moe's CPU layer on
the logical weights. Global scales are rounded to powers of two so that every reciprocal is exact and
the two sides quantize the same values; the tolerance is tests/python/tolerance.py's (fp32 summation
order)."""

import math

import numpy as np
import pytest

import fp4moe

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not fp4moe.cuda_device_available()[0]:
    pytest.skip(f"no sm_90 GPU for fp4moe: {fp4moe.cuda_device_available()[1]}", allow_module_level=True)

from fp4moe import flashinfer as fi  # noqa: E402  (needs torch)
from tolerance import expect_layer_close  # noqa: E402

DEV = "cuda:0"


def pow2_scale(t):
    """FlashInfer's global scale (448 * 6) / amax, rounded down to a power of two."""
    amax = float(t.float().abs().max())
    return 2.0 ** math.floor(math.log2(448 * 6 / amax))


class Weights:
    """Random NVFP4 weights: the logical per-expert tensors (gemm1 rows [up; gate]) and their FlashInfer
    trtllm-gen and cutlass layouts."""

    def __init__(self, E, H, I, gated, seed, bias=False):
        g = torch.Generator().manual_seed(seed)
        N13 = 2 * I if gated else I
        w13 = (torch.randn(E, N13, H, generator=g) / math.sqrt(H)).to(torch.bfloat16)
        w2 = (torch.randn(E, H, I, generator=g) / math.sqrt(I)).to(torch.bfloat16)
        self.E, self.H, self.I, self.N13, self.gated = E, H, I, N13, gated
        self.gs1 = torch.tensor([pow2_scale(w13[e]) for e in range(E)])
        self.gs2 = torch.tensor([pow2_scale(w2[e]) for e in range(E)])
        q13, s13, q2, s2 = [], [], [], []
        for e in range(E):
            q, s = fi.fp4_quantize(w13[e].to(DEV), self.gs1[e:e + 1].to(DEV), is_sf_swizzled_layout=False)
            q13.append(q), s13.append(s)
            q, s = fi.fp4_quantize(w2[e].to(DEV), self.gs2[e:e + 1].to(DEV), is_sf_swizzled_layout=False)
            q2.append(q), s2.append(s)
        self.q13, self.s13 = torch.stack(q13), torch.stack(s13)  # logical, linear scales
        self.q2, self.s2 = torch.stack(q2), torch.stack(s2)
        self.b13 = (0.1 * torch.randn(E, N13, generator=g)).to(DEV) if bias else None
        self.b2 = (0.02 * torch.randn(E, H, generator=g)).to(DEV) if bias else None

    def trtllm(self):
        """gemm1/gemm2 weights and scales as the trtllm-gen kernels take them (FlashInfer's test prep)."""
        g1, g1s, g2, g2s, b1, b2 = [], [], [], [], [], []
        for e in range(self.E):
            q, s = self.q13[e], self.s13[e]
            if self.gated:
                q, s = fi.reorder_rows_for_gated_act_gemm(q), fi.reorder_rows_for_gated_act_gemm(s)
            g1.append(fi.shuffle_matrix_a(q, 128))
            g1s.append(fi.shuffle_matrix_sf_a(s, 128))
            g2.append(fi.shuffle_matrix_a(self.q2[e], 128))
            g2s.append(fi.shuffle_matrix_sf_a(self.s2[e], 128))
            if self.b13 is not None:
                b = self.b13[e].reshape(-1, 1)
                b = fi.reorder_rows_for_gated_act_gemm(b) if self.gated else b
                b1.append(fi.shuffle_matrix_a(b, 128).reshape(-1))
                b2.append(fi.shuffle_matrix_a(self.b2[e].reshape(-1, 1), 128).reshape(-1))
        view = lambda xs, rows, cols: torch.stack(xs).view(torch.float8_e4m3fn).reshape(self.E, rows, cols)
        return (torch.stack(g1), view(g1s, self.N13, self.H // 16), torch.stack(g2), view(g2s, self.H, self.I // 16),
                torch.stack(b1) if b1 else None, torch.stack(b2) if b2 else None)

    def reference_layer(self, problem, a_scale, c_scale):
        """fp4moe's CPU layer on the logical weights: alpha1 = (1 / gs1) * a_scale, the intermediate
        re-quantized with c_scale (dequantize direction), alpha2 = (1 / gs2) * c_scale."""
        E = self.E
        weights = {"w13": self.q13.cpu(), "w13_scale": self.s13.cpu(), "w13_scale_2": 1.0 / self.gs1,
                   "w13_input_scale": torch.full((E,), a_scale), "w2": self.q2.cpu(), "w2_scale": self.s2.cpu(),
                   "w2_scale_2": 1.0 / self.gs2, "w2_input_scale": torch.full((E,), c_scale)}
        if self.b13 is not None:
            weights["w13_bias"] = self.b13.cpu()
            weights["w2_bias"] = self.b2.cpu()
        return fp4moe.MoeLayer(problem, weights, device="cpu", max_tokens=4096, w13_up_gate=self.gated)


ROUTING = {  # FlashInfer method -> (fp4moe method keywords, top_k)
    "Default": (dict(routing_method="default"), 4),
    "Renormalize": (dict(routing_method="renormalize"), 4),
    "RenormalizeNaive": (dict(routing_method="renormalize"), 4),  # the same weights (FlashInfer: one kernel)
    "TopK": (dict(routing_method="topk"), 2),
    "Sigmoid": (dict(routing_method="sigmoid"), 4),
    "SigmoidRenorm": (dict(routing_method="sigmoid_renorm"), 4),
    "Llama4": (dict(routing_method="llama4"), 1),
    "DeepSeekV3": (dict(routing_method="deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5), 4),
    # sigmoid + bias selects without groups, the un-biased sigmoids normalised and scaled
    "MiniMax2": (dict(routing_method="deepseek_v3", routed_scaling_factor=2.0), 4),
}
ACTIVATIONS = {  # name -> (ActivationType, fp4moe activation, alpha, beta, limit)
    "Swiglu": (fi.ActivationType.Swiglu, "swiglu", None, None, None),
    "Geglu": (fi.ActivationType.Geglu, "geglu", None, None, None),
    "Relu2": (fi.ActivationType.Relu2, "relu2", None, None, None),
    "SwigluOai": (fi.ActivationType.Swiglu, "swiglu_oai", 1.702, 1.0, 7.0),
}


def routed_reference(w, act_name, k, ids, weights, hidden, a_gs, c_gs):
    """The reference output for caller-given ids (-1: a slot that adds nothing) and weights."""
    kind, act, alpha, beta, limit = ACTIVATIONS[act_name]
    problem = fp4moe.Problem(num_experts=w.E, hidden=w.H, inter=w.I, top_k=k, routing_method="precomputed",
                             activation=act, swiglu_alpha=alpha or 1.702, swiglu_beta=beta or 1.0,
                             swiglu_limit=limit or 7.0, act_quant="w4a4_scalar", skip_foreign_ids=True)
    layer = w.reference_layer(problem, 1.0 / a_gs, 1.0 / c_gs)
    out, _, _ = layer(hidden.cpu(), topk_ids=ids.cpu().to(torch.int32).contiguous(),
                      topk_weights=weights.float().cpu().contiguous())
    return out


def trtllm_inputs(E, H, I, k, act_name, T, seed, bias=False):
    kind, act, alpha, beta, limit = ACTIVATIONS[act_name]
    w = Weights(E, H, I, kind != fi.ActivationType.Relu2, seed, bias=bias)
    g = torch.Generator().manual_seed(seed + 1)
    hidden = (2 * torch.randn(T, H, generator=g)).to(torch.bfloat16).to(DEV)
    a_gs = pow2_scale(hidden) if T else 1.0
    c_gs = 2.0 ** 4  # the intermediate's quantize scale (its amax ~ 10..100 for these weights)
    hq, hs = fi.fp4_quantize(hidden, torch.tensor([a_gs], device=DEV), is_sf_swizzled_layout=False)
    hs = hs.view(torch.float8_e4m3fn).reshape(T, H // 16)
    dq = 1.0 / (w.gs1 * a_gs)
    scalars = dict(output1_scale_scalar=(c_gs * dq).to(DEV), output1_scale_gate_scalar=dq.to(DEV),
                   output2_scale_scalar=(1.0 / (c_gs * w.gs2)).to(DEV))
    if kind == fi.ActivationType.Relu2:  # non-gated: output1 carries the quantize scale only
        scalars["output1_scale_scalar"] = torch.full((E,), c_gs, device=DEV)
    g1, g1s, g2, g2s, b1, b2 = w.trtllm()
    acts = {}
    if alpha is not None:
        acts = dict(gemm1_alpha=torch.full((E,), alpha, device=DEV), gemm1_beta=torch.full((E,), beta, device=DEV),
                    gemm1_clamp_limit=torch.full((E,), limit, device=DEV))
    # Biases in accumulator units, as FlashInfer's test passes them.
    if b1 is not None:
        b1 = b1 / dq.to(DEV).reshape(E, 1)
        b2 = b2 * (c_gs * w.gs2).to(DEV).reshape(E, 1)
    return w, hidden, hq, hs, a_gs, c_gs, dict(gemm1_weights=g1, gemm1_weights_scale=g1s, gemm1_bias=b1,
                                               gemm2_weights=g2, gemm2_weights_scale=g2s, gemm2_bias=b2,
                                               **scalars, **acts)


def call_trtllm(hq, hs, logits, bias, tensors, E, k, I, method, act_kind, routing_kw, do_finalize=True, offset=0,
                local=None, **extra):
    args = dict(gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None)
    args.update(tensors)
    return fi.trtllm_fp4_block_scale_moe(
        logits, bias, hq, hs, args["gemm1_weights"], args["gemm1_weights_scale"], args["gemm1_bias"],
        args["gemm1_alpha"], args["gemm1_beta"], args["gemm1_clamp_limit"], args["gemm2_weights"],
        args["gemm2_weights_scale"], args["gemm2_bias"], args["output1_scale_scalar"],
        args["output1_scale_gate_scalar"], args["output2_scale_scalar"], E, k, routing_kw.get("n_group"),
        routing_kw.get("topk_group"), I, offset, E if local is None else local, routing_kw.get("routed_scaling_factor"),
        routing_method_type=int(fi.RoutingMethodType[method]), do_finalize=do_finalize,
        activation_type=int(act_kind), **extra)


def route_like_flashinfer(method, E, k, logits, bias):
    """fp4moe's routing of the method, weights rounded to bf16 as FlashInfer's routing stores them."""
    kw, _ = ROUTING[method]
    router = fp4moe.Router(fp4moe.Problem(num_experts=E, hidden=256, inter=128, top_k=k, **kw), device=DEV)
    ids, weights = router(logits, bias if kw["routing_method"] == "deepseek_v3" else None)
    return ids, weights.to(torch.bfloat16)


def unfinalized_sum(result, T, k, H):
    """The output from do_finalize=False's triple, summed the way FlashInfer's finalize does."""
    gemm2, w, idx = result
    out = torch.zeros(T, H, dtype=torch.float32, device=gemm2.device)
    for j in range(k):
        rows = idx.reshape(T, k)[:, j].long()
        valid = (rows >= 0).unsqueeze(1)
        out += torch.where(valid, w[:, j:j + 1].float() * gemm2[rows.clamp(min=0)].float(), 0)
    return out.to(torch.bfloat16)


@pytest.mark.parametrize("method", list(ROUTING))
@pytest.mark.parametrize("tokens", [0, 1, 37, 1024])
def test_trtllm_routing_methods_match_the_reference(method, tokens):
    E, H, I = 16, 256, 128
    kw, k = ROUTING[method]
    w, hidden, hq, hs, a_gs, c_gs, tensors = trtllm_inputs(E, H, I, k, "Swiglu", tokens, 10 + tokens)
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, E, generator=g).to(DEV)
    bias = torch.randn(E, generator=g).to(DEV) if method in ("DeepSeekV3", "MiniMax2") else None
    (out,) = call_trtllm(hq, hs, logits, bias, tensors, E, k, I, method, fi.ActivationType.Swiglu, kw)
    ids, weights = route_like_flashinfer(method, E, k, logits, bias)
    ref = routed_reference(w, "Swiglu", k, ids, weights, hidden, a_gs, c_gs)
    assert out.shape == (tokens, H) and out.dtype == torch.bfloat16
    expect_layer_close(out.float().cpu().numpy(), ref.float().numpy(), f"{method} T={tokens}")


@pytest.mark.parametrize("act_name", list(ACTIVATIONS))
@pytest.mark.parametrize("do_finalize", [True, False])
def test_trtllm_activations_biases_and_unfinalized(act_name, do_finalize):
    E, H, I, k, T = 8, 512, 256, 2, 37
    w, hidden, hq, hs, a_gs, c_gs, tensors = trtllm_inputs(E, H, I, k, act_name, T, 50,
                                                           bias=act_name == "SwigluOai")
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(3)).to(DEV)
    kind = ACTIVATIONS[act_name][0]
    result = call_trtllm(hq, hs, logits, None, tensors, E, k, I, "Renormalize", kind, {}, do_finalize=do_finalize)
    ids, weights = route_like_flashinfer("Renormalize", E, k, logits, None)
    ref = routed_reference(w, act_name, k, ids, weights, hidden, a_gs, c_gs)
    if do_finalize:
        out = result[0]
    else:
        assert len(result) == 3 and result[1].dtype == torch.bfloat16 and result[2].dtype == torch.int32
        assert torch.equal(result[1], weights)
        # FlashInfer's gemm2_output is bf16: each slot's output is rounded before the sum, so the sum is held
        # to the relative L2 error only (the element count of the tolerance assumes one rounding).
        out = unfinalized_sum(result, T, k, H).float().cpu().numpy()
        ref = ref.float().numpy()
        assert np.isfinite(out).all()
        assert np.linalg.norm(out - ref) <= 5e-3 * np.linalg.norm(ref), f"{act_name}: unfinalized sum"
        return
    expect_layer_close(out.float().cpu().numpy(), ref.float().numpy(), f"{act_name} do_finalize={do_finalize}")


@pytest.mark.parametrize("form", ["packed", "pair_bf16", "pair_f32"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_trtllm_routed_equals_the_logits_call(form, tokens):
    E, H, I, k = 16, 256, 128, 4
    w, hidden, hq, hs, a_gs, c_gs, t = trtllm_inputs(E, H, I, k, "Swiglu", tokens, 70)
    logits = torch.randn(tokens, E, generator=torch.Generator().manual_seed(5)).to(DEV)
    (want,) = call_trtllm(hq, hs, logits, None, t, E, k, I, "Renormalize", fi.ActivationType.Swiglu, {})
    ids, weights = route_like_flashinfer("Renormalize", E, k, logits, None)
    if form == "packed":
        topk = (ids << 16) | (weights.view(torch.int16).to(torch.int32) & 0xFFFF)
    else:
        topk = (ids, weights if form == "pair_bf16" else weights.float())
    (got,) = fi.trtllm_fp4_block_scale_routed_moe(
        topk, None, hq, hs, t["gemm1_weights"], t["gemm1_weights_scale"], None, None, None, None, t["gemm2_weights"],
        t["gemm2_weights_scale"], None, t["output1_scale_scalar"], t["output1_scale_gate_scalar"],
        t["output2_scale_scalar"], E, k, None, None, I, 0, E, None, routing_method_type=1)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), form


def test_trtllm_expert_parallel_offsets_and_output_buffer():
    E_total, E_local, offset, H, I, k, T = 16, 8, 4, 256, 128, 4, 37
    w_all, hidden, hq, hs, a_gs, c_gs, t_all = trtllm_inputs(E_total, H, I, k, "Swiglu", T, 90)
    # This rank's experts [4, 12): the slices of every per-expert tensor.
    t = {name: (v[offset:offset + E_local] if isinstance(v, torch.Tensor) else v) for name, v in t_all.items()}
    logits = torch.randn(T, E_total, generator=torch.Generator().manual_seed(9)).to(DEV)
    output = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    (out,) = call_trtllm(hq, hs, logits, None, t, E_total, k, I, "Renormalize", fi.ActivationType.Swiglu, {},
                         offset=offset, local=E_local, output=output)
    assert out.data_ptr() == output.data_ptr()
    ids, weights = route_like_flashinfer("Renormalize", E_total, k, logits, None)
    ref = routed_reference(w_all, "Swiglu", k, ids, weights, hidden, a_gs, c_gs)
    # The reference of this rank: the whole layer's slots of experts [4, 12) only.
    ref_local = routed_reference(w_all, "Swiglu", k, torch.where((ids >= offset) & (ids < offset + E_local), ids,
                                                                 torch.full_like(ids, -1)), weights, hidden, a_gs, c_gs)
    expect_layer_close(out.float().cpu().numpy(), ref_local.float().numpy(), "expert parallel rank")
    assert not torch.equal(out.cpu(), ref), "a rank's partial output is not the whole layer's"
    replay = torch.full((T + 3, k), -1, dtype=torch.int16, device=DEV)
    call_trtllm(hq, hs, logits, None, t, E_total, k, I, "Renormalize", fi.ActivationType.Swiglu, {}, offset=offset,
                local=E_local, routing_replay_out=replay)
    assert torch.equal(replay[:T].long(), ids.long()) and bool((replay[T:] == -1).all())


def test_weights_are_converted_once():
    E, H, I, k, T = 8, 256, 128, 2, 5
    fi.clear_weight_cache()
    w, hidden, hq, hs, a_gs, c_gs, t = trtllm_inputs(E, H, I, k, "Swiglu", T, 33)
    logits = torch.randn(T, E, device=DEV)
    call_trtllm(hq, hs, logits, None, t, E, k, I, "Renormalize", fi.ActivationType.Swiglu, {})
    layers = list(fi._CACHE.values())
    call_trtllm(hq, hs, logits, None, t, E, k, I, "Renormalize", fi.ActivationType.Swiglu, {})
    assert list(fi._CACHE.values()) == layers and len(layers) == 1
    t["gemm2_weights"].add_(0)  # an in-place write: the version counter moves, the weights convert again
    call_trtllm(hq, hs, logits, None, t, E, k, I, "Renormalize", fi.ActivationType.Swiglu, {})
    assert len(fi._CACHE) == 2
    fi.clear_weight_cache()
    assert len(fi._CACHE) == 0


@pytest.mark.parametrize("input_form", ["bf16", "nvfp4_swizzled", "nvfp4_linear"])
@pytest.mark.parametrize("act_name", ["Swiglu", "Relu2", "SwigluOai"])
def test_cutlass_fused_moe_matches_the_reference(input_form, act_name):
    E, H, I, k, T = 8, 256, 128, 2, 37
    kind = ACTIVATIONS[act_name][0]
    w = Weights(E, H, I, kind != fi.ActivationType.Relu2, 120, bias=act_name == "SwigluOai")
    g = torch.Generator().manual_seed(121)
    hidden = (2 * torch.randn(T, H, generator=g)).to(torch.bfloat16).to(DEV)
    a_gs, c_gs = pow2_scale(hidden), 2.0 ** 4
    # cutlass layout: [up; gate] rows as they are, block scales swizzled per expert.
    fc1 = w.q13.contiguous().view(torch.int64)
    fc2 = w.q2.contiguous().view(torch.int64)
    s1 = torch.stack([fi.block_scale_interleave(w.s13[e]) for e in range(E)]).view(torch.int32)
    s2 = torch.stack([fi.block_scale_interleave(w.s2[e]) for e in range(E)]).view(torch.int32)
    quant_scales = [torch.tensor(a_gs, device=DEV), s1, (1.0 / (a_gs * w.gs1)).to(DEV), torch.tensor(c_gs, device=DEV),
                    s2, (1.0 / (c_gs * w.gs2)).to(DEV)]
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32).to(DEV)
    scales = torch.rand(T, k, generator=g).to(DEV)
    extra = {}
    if act_name == "SwigluOai":
        extra = dict(swiglu_alpha=torch.full((E,), 1.702, device=DEV), swiglu_beta=torch.full((E,), 1.0, device=DEV),
                     swiglu_limit=torch.full((E,), 7.0, device=DEV), fc1_expert_biases=w.b13, fc2_expert_biases=w.b2)
    if input_form == "bf16":
        x, sf = hidden, None
    else:
        x, sf = fi.fp4_quantize(hidden, torch.tensor([a_gs], device=DEV),
                                is_sf_swizzled_layout=input_form == "nvfp4_swizzled")
    result = fi.cutlass_fused_moe(x, ids, scales, fc1, fc2, torch.bfloat16, quant_scales, input_sf=sf,
                                  swizzled_input_sf=input_form == "nvfp4_swizzled", activation_type=kind, **extra)
    assert isinstance(result, list) and len(result) == 4
    ref = routed_reference(w, act_name, k, ids, scales, hidden, a_gs, c_gs)
    expect_layer_close(result[0].float().cpu().numpy(), ref.float().numpy(), f"cutlass {input_form} {act_name}")


def test_fp4_quantize_equals_the_prepare_stage():
    """fp4_quantize (torch ops) and fp4moe's CUDA quantization (MoeLayer.prepare) write the same bytes."""
    problem = fp4moe.preset("tiny", act_quant="w4a4_scalar")
    case = fp4moe.random_case(problem, 150, seed=4, framework="torch")
    hidden = case["hidden_states"].to(DEV)
    gs = pow2_scale(hidden)
    weights = dict(case["weights"])
    weights["w13_input_scale"] = torch.full_like(weights["w13_input_scale"], 1.0 / gs)
    layer = fp4moe.MoeLayer(problem, weights, device=DEV, max_tokens=150)
    for swizzled in (False, True):
        values, scales = layer.prepare(hidden, scale_layout="swizzled" if swizzled else "linear")
        q, s = fi.fp4_quantize(hidden, torch.tensor([gs], device=DEV), is_sf_swizzled_layout=swizzled)
        assert torch.equal(q, values)
        assert torch.equal(s.reshape(-1), scales.reshape(-1))
    # the inverse-scale form and the interleave helper
    q2, s2 = fi.fp4_quantize(hidden, torch.tensor([1.0 / gs], device=DEV), is_sf_swizzled_layout=False,
                             is_global_scale_inversed=True)
    assert torch.equal(q2, q)
    assert torch.equal(fi.block_scale_interleave(s2), s.reshape(-1))


def test_enums_have_flashinfers_values():
    assert [(m.name, m.value) for m in fi.RoutingMethodType] == [
        ("Default", 0), ("Renormalize", 1), ("DeepSeekV3", 2), ("Llama4", 3), ("RenormalizeNaive", 4), ("TopK", 5),
        ("SigmoidRenorm", 6), ("MiniMax2", 7), ("Sigmoid", 8), ("Unspecified", 9)]
    assert fi.ActivationType.Swiglu == 3 and fi.ActivationType.Relu2 == 6 and fi.ActivationType.Identity == 9
    assert fi.ActivationType.Situ == 10 and fi.ActivationType.InvalidType == 11 and fi.ActivationType.Swiglu.is_gated


def test_what_fp4moe_cannot_honour_raises_not_implemented():
    E, H, I, k, T = 8, 256, 128, 2, 3
    w, hidden, hq, hs, a_gs, c_gs, t = trtllm_inputs(E, H, I, k, "Swiglu", T, 7)
    logits = torch.randn(T, E, device=DEV)
    with pytest.raises(NotImplementedError, match="num_fused_shared_experts"):
        call_trtllm(hq, hs, logits, None, t, E, k, I, "Renormalize", fi.ActivationType.Swiglu, {},
                    num_fused_shared_experts=1)
    with pytest.raises(NotImplementedError, match="Situ"):
        call_trtllm(hq, hs, logits, None, t, E, k, I, "Renormalize", fi.ActivationType.Situ, {})
    with pytest.raises(NotImplementedError, match="enable_pdl"):
        call_trtllm(hq, hs, logits, None, t, E, k, I, "Renormalize", fi.ActivationType.Swiglu, {}, enable_pdl=False)
    with pytest.raises(NotImplementedError, match="per_token_scale"):
        call_trtllm(hq, hs, logits, None, t, E, k, I, "Renormalize", fi.ActivationType.Swiglu, {},
                    per_token_scale=torch.ones(T, device=DEV))
    with pytest.raises(NotImplementedError, match="hidden_states of dtype"):
        call_trtllm(hidden, None, logits, None, t, E, k, I, "Renormalize", fi.ActivationType.Swiglu, {})
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        call_trtllm(hq.cpu(), hs, logits, None, t, E, k, I, "Renormalize", fi.ActivationType.Swiglu, {})


def test_the_switching_snippet_of_docs_flashinfer_md_runs():
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "flashinfer.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    E, H, I, k, T = 16, 256, 128, 4, 9
    w, hidden, hq, hs, a_gs, c_gs, t = trtllm_inputs(E, H, I, k, "Swiglu", T, 140)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(141)).to(DEV)
    scope = dict(router_logits=logits, hidden_fp4=hq, hidden_scale=hs, num_experts=E, top_k=k, intermediate_size=I,
                 **{name: t[name] for name in ("gemm1_weights", "gemm1_weights_scale", "gemm2_weights",
                                               "gemm2_weights_scale", "output1_scale_scalar",
                                               "output1_scale_gate_scalar", "output2_scale_scalar")})
    exec(snippet, scope)
    ids, weights = route_like_flashinfer("Renormalize", E, k, logits, None)
    ref = routed_reference(w, "Swiglu", k, ids, weights, hidden, a_gs, c_gs)
    expect_layer_close(scope["output"].float().cpu().numpy(), ref.float().numpy(), "docs/flashinfer.md snippet")
