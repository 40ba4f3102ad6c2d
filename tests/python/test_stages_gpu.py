"""The layer as separate stages from Python (ctest label gpu): route -> prepare -> experts -> finalize gives
the fused forward's output bit for bit in every quantization mode, with both scale layouts, from
poisoned buffers, and inside a CUDA graph; a cpu layer and bad stage arguments raise fp4moe.Error."""

import pytest

import fp4moe

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not fp4moe.cuda_device_available()[0]:
    pytest.skip(f"no sm_90 GPU for fp4moe: {fp4moe.cuda_device_available()[1]}", allow_module_level=True)

DEVICE = "cuda:0"

PROBLEMS = {
    "w4a16": fp4moe.preset("tiny"),
    "w4a4_scalar": fp4moe.preset("tiny", act_quant="w4a4_scalar"),
    "w4a4_per_expert": fp4moe.preset("tiny", act_quant="w4a4_per_expert"),
    "llama4-w4a4": fp4moe.Problem(num_experts=8, hidden=512, inter=256, top_k=1, routing_method="llama4",
                                  apply_router_weight_on_input=True, act_quant="w4a4_scalar"),
    "deepseek_v3": fp4moe.Problem(num_experts=32, hidden=512, inter=256, top_k=4, routing_method="deepseek_v3",
                                  n_group=4, topk_group=2, routed_scaling_factor=2.5, act_quant="w4a4_scalar"),
    "mxfp4-bias": fp4moe.Problem(num_experts=8, hidden=1088, inter=544, top_k=2, activation="swiglu_oai",
                                 weight_format="mxfp4"),
}


def layer_and_inputs(name, tokens, seed):
    problem = PROBLEMS[name]
    case = fp4moe.random_case(problem, tokens, seed=seed, framework="torch",
                              expert_biases=problem.activation == "swiglu_oai")
    layer = fp4moe.MoeLayer(problem, case["weights"], device=DEVICE, max_tokens=max(tokens, 1))
    hidden = case["hidden_states"].to(DEVICE)
    logits = case["router_logits"].to(DEVICE)
    bias = case["routing_bias"].to(DEVICE) if case.get("routing_bias") is not None else None
    return layer, hidden, logits, bias


def staged(layer, hidden, ids, weights, scale_layout):
    rows = layer.prepared_rows(hidden.shape[0], scale_layout=scale_layout)
    values = torch.full(rows["values_shape"], 0xFF if rows["format"] == "nvfp4" else float("nan"),
                        dtype=torch.uint8 if rows["format"] == "nvfp4" else torch.bfloat16, device=DEVICE)
    scales = (None if rows["scales_shape"] is None
              else torch.full(rows["scales_shape"], 0xFF, dtype=torch.uint8, device=DEVICE))
    layer.prepare(hidden, ids, weights, scale_layout=scale_layout, values=values, scales=scales)
    row_ids = ids.reshape(rows["num_rows"], rows["rows_top_k"])
    y = torch.full((ids.numel(), layer.problem.hidden), float("nan"), dtype=torch.float32, device=DEVICE)
    layer.experts(values, scales, row_ids, scale_layout=scale_layout, y=y)
    return layer.finalize(y, ids, weights)


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("tokens", [0, 1, 37])
@pytest.mark.parametrize("scale_layout", ["linear", "swizzled"])
def test_stages_equal_the_fused_forward(name, tokens, scale_layout):
    layer, hidden, logits, bias = layer_and_inputs(name, tokens, 2000 + tokens)
    out, ids, weights = layer(hidden, logits, routing_bias=bias)
    got = staged(layer, hidden, ids, weights, scale_layout)
    torch.cuda.synchronize()
    assert got.shape == out.shape
    assert torch.equal(got.view(torch.int16), out.view(torch.int16)), f"{name} T={tokens}: stages differ from forward"


def test_stages_replay_in_a_cuda_graph():
    layer, hidden, logits, bias = layer_and_inputs("w4a4_scalar", 16, 7)
    out, ids, weights = layer(hidden, logits)
    rows = layer.prepared_rows(16)
    values = torch.empty(rows["values_shape"], dtype=torch.uint8, device=DEVICE)
    scales = torch.empty(rows["scales_shape"], dtype=torch.uint8, device=DEVICE)
    y = torch.empty((ids.numel(), layer.problem.hidden), dtype=torch.float32, device=DEVICE)
    result = torch.empty_like(out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        layer.prepare(hidden, ids, weights, values=values, scales=scales)
        layer.experts(values, scales, ids, y=y)
        layer.finalize(y, ids, weights, output=result)
    result.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(result.view(torch.int16), out.view(torch.int16))


def test_stage_errors_name_the_argument():
    layer, hidden, logits, _ = layer_and_inputs("w4a4_scalar", 8, 9)
    out, ids, weights = layer(hidden, logits)
    values, scales = layer.prepare(hidden, ids, weights)
    with pytest.raises(fp4moe.Error, match="scales is required"):
        layer.experts(values, None, ids)
    with pytest.raises(fp4moe.Error, match="values: expected dtype"):
        layer.experts(values.view(torch.int16), scales, ids)
    with pytest.raises(fp4moe.Error, match="rows_top_k"):
        layer.experts(values, scales, ids.repeat(1, 2))
    with pytest.raises(fp4moe.Error, match="topk_ids: expected a tensor on cuda:0"):
        layer.experts(values, scales, ids.cpu())
    with pytest.raises(fp4moe.Error, match="scale_layout must be"):
        layer.prepare(hidden, ids, weights, scale_layout="blocked")
    with pytest.raises(fp4moe.Error, match="y: expected shape"):
        layer.finalize(torch.zeros((3, layer.problem.hidden), dtype=torch.float32, device=DEVICE), ids, weights)
    problem = PROBLEMS["w4a16"]
    case = fp4moe.random_case(problem, 2, seed=3, framework="torch")
    cpu = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=2)
    with pytest.raises(fp4moe.Error, match="the stages run on a cuda layer"):
        cpu.prepare(case["hidden_states"])
