"""The Python module on the GPU through torch (ctest label gpu): the cuda layer against the CPU
reference layer on fresh random inputs with poisoned outputs, the torch ops (opcheck, torch.compile,
CUDA-graph capture, side streams) and the errors of device mismatches."""

import pytest

import fp4moe

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not fp4moe.cuda_device_available()[0]:
    pytest.skip(f"no sm_90 GPU for fp4moe: {fp4moe.cuda_device_available()[1]}", allow_module_level=True)

from fp4moe.torch_ops import FusedMoE, register_layer  # noqa: E402  (needs torch)
from tolerance import expect_layer_close  # noqa: E402

DEVICE = "cuda:0"

PROBLEMS = {
    "tiny-w4a16": fp4moe.preset("tiny"),
    "tiny-w4a4_scalar": fp4moe.preset("tiny", act_quant="w4a4_scalar"),
    "tiny-w4a4_per_expert": fp4moe.preset("tiny", act_quant="w4a4_per_expert"),
    "deepseek_v3-groups": fp4moe.Problem(num_experts=32, hidden=512, inter=256, top_k=4, routing_method="deepseek_v3",
                                         n_group=4, topk_group=2, routed_scaling_factor=2.5, act_quant="w4a4_scalar"),
    "llama4-top1": fp4moe.Problem(num_experts=8, hidden=512, inter=256, top_k=1, routing_method="llama4",
                                  apply_router_weight_on_input=True),
    "swiglu_oai-padded": fp4moe.Problem(num_experts=8, hidden=720, inter=720, top_k=2, activation="swiglu_oai"),
    # MXFP4 weights (gpt-oss): the GPU runs their exact NVFP4 equivalent; H / 32 and I / 32 odd.
    "mxfp4-swiglu_oai": fp4moe.Problem(num_experts=8, hidden=1088, inter=544, top_k=2, activation="swiglu_oai",
                                       weight_format="mxfp4"),
    "mxfp4-swiglu": fp4moe.Problem(num_experts=16, hidden=512, inter=256, top_k=4, weight_format="mxfp4"),
}


def to_device(case):
    """random_case(framework="torch") tensors on the GPU."""
    out = {k: v.to(DEVICE) for k, v in case.items() if k != "weights"}
    return out


def expect_close(gpu_out, ref_out, label):
    expect_layer_close(gpu_out.float().cpu().numpy(), ref_out.float().cpu().numpy(), label)


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("tokens", [0, 1, 3, 17, 255])
def test_cuda_layer_matches_cpu_layer(name, tokens):
    problem = PROBLEMS[name]
    case = fp4moe.random_case(problem, tokens, seed=1000 + tokens, framework="torch")
    cpu = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=256)
    gpu = fp4moe.MoeLayer(problem, case["weights"], device=DEVICE, max_tokens=256)
    assert gpu.device == DEVICE and gpu.tactic(max(tokens, 1))
    inputs = to_device(case)
    bias = inputs.get("routing_bias")
    ref_out, ref_ids, ref_weights = cpu(case["hidden_states"], case["router_logits"], routing_bias=case.get("routing_bias"))
    # Poisoned outputs: every element must be written.
    out = torch.full((tokens, problem.hidden), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    ids = torch.full((tokens, problem.top_k), -1, dtype=torch.int32, device=DEVICE)
    weights = torch.full((tokens, problem.top_k), float("nan"), dtype=torch.float32, device=DEVICE)
    gpu.forward_into(inputs["hidden_states"], inputs["router_logits"], routing_bias=bias, topk_ids=ids,
                     topk_weights=weights, output=out)
    torch.cuda.synchronize()
    assert torch.equal(ids.cpu(), ref_ids), name
    torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-6, atol=1e-30)
    expect_close(out, ref_out, f"{name} T={tokens}")
    # The allocating call gives the same bits (deterministic: no atomics).
    out2, ids2, _ = gpu(inputs["hidden_states"], inputs["router_logits"], routing_bias=bias)
    assert torch.equal(out2, out) and torch.equal(ids2, ids)
    # fp32 outputs (poisoned first): the sums that the bf16 output rounds, bit for bit, and close to the
    # cpu layer's fp32 sums.
    out32 = torch.full((tokens, problem.hidden), float("nan"), dtype=torch.float32, device=DEVICE)
    gpu.forward_into(inputs["hidden_states"], inputs["router_logits"], routing_bias=bias, topk_ids=ids,
                     topk_weights=weights, output=out32)
    assert torch.equal(out32.to(torch.bfloat16), out), name
    ref32, _, _ = cpu(case["hidden_states"], case["router_logits"], routing_bias=case.get("routing_bias"),
                      output_dtype="float32")
    expect_close(out32, ref32, f"{name} T={tokens} float32")


def test_bf16_logits_and_precomputed_routing():
    problem = PROBLEMS["tiny-w4a4_scalar"]
    case = fp4moe.random_case(problem, 33, seed=5, framework="torch")
    inputs = to_device(case)
    gpu = fp4moe.MoeLayer(problem, case["weights"], device=DEVICE, max_tokens=64)
    logits_bf16 = inputs["router_logits"].to(torch.bfloat16)
    out_bf16, ids_bf16, w_bf16 = gpu(inputs["hidden_states"], logits_bf16)
    out_f32, ids_f32, _ = gpu(inputs["hidden_states"], logits_bf16.float())
    assert torch.equal(out_bf16, out_f32) and torch.equal(ids_bf16, ids_f32)
    routed = fp4moe.MoeLayer(problem.with_routing_method("precomputed"), case["weights"], device=DEVICE, max_tokens=64)
    out_routed, _, _ = routed(inputs["hidden_states"], topk_ids=ids_bf16, topk_weights=w_bf16)
    assert torch.equal(out_routed, out_bf16)


@pytest.mark.parametrize("name", ["swiglu_oai-padded", "tiny-w4a4_scalar", "llama4-top1", "mxfp4-swiglu_oai"])
def test_expert_biases_match_the_cpu_layer(name):
    problem = PROBLEMS[name]
    case = fp4moe.random_case(problem, 41, seed=77, framework="torch", expert_biases=True)
    cpu = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=64)
    gpu = fp4moe.MoeLayer(problem, case["weights"], device=DEVICE, max_tokens=64)
    inputs = to_device(case)
    ref_out, ref_ids, _ = cpu(case["hidden_states"], case["router_logits"])
    out, ids, _ = gpu(inputs["hidden_states"], inputs["router_logits"])
    assert torch.equal(ids.cpu(), ref_ids), name
    expect_close(out, ref_out, f"{name} with expert biases")


def test_concurrent_forwards_with_their_own_workspaces():
    """One layer's weights on two streams at once (two overlapped micro-batches), a workspace each."""
    problem = PROBLEMS["tiny-w4a4_scalar"]
    layer = None
    batches = []
    for seed, tokens in ((8, 100), (9, 37)):
        case = fp4moe.random_case(problem, tokens, seed=seed, framework="torch")
        if layer is None:
            layer = fp4moe.MoeLayer(problem, case["weights"], device=DEVICE, max_tokens=128)
        inputs = to_device(case)
        want, _, _ = layer(inputs["hidden_states"], inputs["router_logits"])
        batches.append((inputs, want))
    workspaces = [layer.new_workspace(), layer.new_workspace()]
    assert all(w.numel() >= layer.workspace_size() for w in workspaces)
    streams = [torch.cuda.Stream(device=DEVICE), torch.cuda.Stream(device=DEVICE)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream(DEVICE))
    outputs = [None, None]
    for _ in range(3):
        for i, ((inputs, _), s, w) in enumerate(zip(batches, streams, workspaces)):
            with torch.cuda.stream(s):
                outputs[i], _, _ = layer(inputs["hidden_states"], inputs["router_logits"], workspace=w)
    torch.cuda.synchronize()
    for (_, want), got in zip(batches, outputs):
        assert torch.equal(got, want)


def test_torch_ops_opcheck_compile_and_graph():
    problem = PROBLEMS["deepseek_v3-groups"]
    case = fp4moe.random_case(problem, 64, seed=6, framework="torch")
    inputs = to_device(case)
    moe = FusedMoE(problem, case["weights"], device=DEVICE, max_tokens=64)
    x, logits, bias = inputs["hidden_states"], inputs["router_logits"], inputs["routing_bias"]
    eager, ids, weights = moe(x, logits, bias, return_routing=True)

    torch.library.opcheck(torch.ops.fp4moe.moe_forward.default, (moe.handle, x, logits, bias))
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, logits, bias), eager)

    # CUDA graph: capture once, replay on new inputs copied into the captured buffers.
    static_x, static_logits = x.clone(), logits.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe(static_x, static_logits, bias)  # warm-up off the default stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x, static_logits, bias)
    other = to_device(fp4moe.random_case(problem, 64, seed=7, framework="torch"))
    static_x.copy_(other["hidden_states"])
    static_logits.copy_(other["router_logits"])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, moe(other["hidden_states"], other["router_logits"], bias))


def test_mxfp4_fused_moe_weight_format_and_graph():
    """FusedMoE with weight_format="mxfp4" on an NVFP4-format problem: the MXFP4 layer, against the cpu
    layer, through torch.compile and a CUDA graph; float8_e8m0fnu scales (torch's ue8m0) read as their bits."""
    problem = PROBLEMS["mxfp4-swiglu_oai"]
    case = fp4moe.random_case(problem, 37, seed=9, framework="torch", expert_biases=True)
    weights = dict(case["weights"])
    if hasattr(torch, "float8_e8m0fnu"):
        weights["w2_scale"] = weights["w2_scale"].view(torch.float8_e8m0fnu).to(DEVICE)
    moe = FusedMoE(problem.with_weight_format("nvfp4"), weights, device=DEVICE, max_tokens=64, weight_format="mxfp4")
    assert moe.problem.weight_format == "mxfp4"
    cpu = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=64)
    ref, _, _ = cpu(case["hidden_states"], case["router_logits"])
    inputs = to_device(case)
    x, logits = inputs["hidden_states"], inputs["router_logits"]
    eager = moe(x, logits)
    expect_close(eager, ref, "mxfp4 FusedMoE")
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, logits), eager)
    static_x, static_logits = x.clone(), logits.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe(static_x, static_logits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x, static_logits)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    with pytest.raises(fp4moe.Error, match="act_quant must be w4a16 with mxfp4"):
        FusedMoE(fp4moe.preset("tiny", act_quant="w4a4_scalar"), case["weights"], device=DEVICE, max_tokens=8,
                 weight_format="mxfp4")


def test_mxfp4_codes_the_gpu_cannot_take_are_an_error():
    """The GPU runs MXFP4 as NVFP4: one expert's codes may span at most 18 powers of two (docs/numerics.md,
    "MXFP4 weights"); wider is an fp4moe.Error at preparation naming the tensor, the cpu layer takes it."""
    problem = PROBLEMS["mxfp4-swiglu"]
    case = fp4moe.random_case(problem, 3, seed=10, framework="torch")
    w = dict(case["weights"])
    scale = w["w13_scale"].clone()
    scale[1, 0, 0], scale[1, 0, 1] = 100, 140
    w["w13_scale"] = scale
    fp4moe.MoeLayer(problem, w, device="cpu", max_tokens=8)
    with pytest.raises(fp4moe.Error, match="w13_scale"):
        fp4moe.MoeLayer(problem, w, device=DEVICE, max_tokens=8)


def test_routed_op_and_cpu_op():
    problem = PROBLEMS["tiny-w4a16"].with_routing_method("precomputed")
    case = fp4moe.random_case(problem, 20, seed=8, framework="torch")
    moe = FusedMoE(problem, case["weights"], device=DEVICE, max_tokens=32)
    inputs = to_device(case)
    args = (moe.handle, inputs["hidden_states"], inputs["topk_ids"], inputs["topk_weights"])
    torch.library.opcheck(torch.ops.fp4moe.moe_forward_routed.default, args)
    out = moe(inputs["hidden_states"], topk_ids=inputs["topk_ids"], topk_weights=inputs["topk_weights"])
    # The same op on a cpu layer (the reference) with CPU tensors.
    cpu = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=32)
    handle = register_layer(cpu)
    ref = torch.ops.fp4moe.moe_forward_routed(handle, case["hidden_states"], case["topk_ids"], case["topk_weights"])
    expect_close(out, ref, "precomputed")


def test_device_mismatch_errors():
    problem = PROBLEMS["tiny-w4a16"]
    case = fp4moe.random_case(problem, 4, seed=9, framework="torch")
    gpu = fp4moe.MoeLayer(problem, case["weights"], device=DEVICE, max_tokens=8)
    with pytest.raises(fp4moe.Error, match="hidden_states: expected a tensor on cuda:0 .*got cpu"):
        gpu(case["hidden_states"], case["router_logits"].to(DEVICE))
    inputs = to_device(case)
    with pytest.raises(fp4moe.Error, match="router_logits: expected a tensor on cuda:0"):
        gpu(inputs["hidden_states"], case["router_logits"])
    with pytest.raises(fp4moe.Error, match="exceeds the layer's max_tokens"):
        big = to_device(fp4moe.random_case(problem, 9, seed=10, framework="torch"))
        gpu(big["hidden_states"], big["router_logits"])


def test_tensor_parallel_shards_on_the_gpu(tmp_path):
    """Two tensor-parallel shards run on one GPU sum to the whole layer; FusedMoE all-reduces its
    output over a process group (NCCL, one rank here: the 2-GPU run is a separate check)."""
    problem = PROBLEMS["deepseek_v3-groups"]
    case = fp4moe.random_case(problem, 37, seed=13, framework="torch")
    inputs = to_device(case)
    args = (inputs["hidden_states"], inputs["router_logits"], inputs["routing_bias"])
    whole = FusedMoE(problem, case["weights"], device=DEVICE, max_tokens=64)(*args)
    total = torch.zeros_like(whole, dtype=torch.float32)
    for rank in range(2):
        shard = fp4moe.tensor_parallel_shard(problem, case["weights"], rank, 2, framework="torch")
        total += FusedMoE(shard["problem"], shard["weights"], device=DEVICE, max_tokens=64)(*args).float()
    assert torch.linalg.norm(total - whole.float()) <= 5e-3 * torch.linalg.norm(whole.float())

    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", world_size=1, rank=0,
                            device_id=torch.device(DEVICE))
    try:
        reduced = FusedMoE(problem, case["weights"], device=DEVICE, max_tokens=64, process_group=dist.group.WORLD)
        assert torch.equal(reduced(*args), whole)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_ranks_on_the_gpu():
    """Three expert-parallel ranks run on one GPU (the whole layer's routing, mapped by FusedMoE) sum to
    the whole layer."""
    problem = PROBLEMS["deepseek_v3-groups"]  # 32 experts, w4a4_scalar
    case = fp4moe.random_case(problem, 45, seed=14, framework="torch")
    inputs = to_device(case)
    whole = FusedMoE(problem, case["weights"], device=DEVICE, max_tokens=64)
    out, ids, weights = whole(inputs["hidden_states"], inputs["router_logits"], inputs["routing_bias"],
                              return_routing=True)
    total = torch.zeros_like(out, dtype=torch.float32)
    scale_max = float(case["weights"]["w13_input_scale"].max())
    for begin, end in [(0, 11), (11, 22), (22, 32)]:
        local = {name: value[begin:end] for name, value in case["weights"].items()}
        local["w13_input_scale_max"] = scale_max
        rank = FusedMoE(problem.expert_parallel_rank(end - begin), local, device=DEVICE, max_tokens=64,
                        expert_range=(begin, end))
        total += rank(inputs["hidden_states"], topk_ids=ids, topk_weights=weights).float()
    assert torch.linalg.norm(total - out.float()) <= 5e-3 * torch.linalg.norm(out.float())


def test_router_and_expert_parallel_ranks_that_route_themselves():
    problem = PROBLEMS["deepseek_v3-groups"]
    case = fp4moe.random_case(problem, 50, seed=15, framework="torch")
    inputs = to_device(case)
    logits, bias = inputs["router_logits"], inputs["routing_bias"]
    cpu_ids, cpu_weights = fp4moe.Router(problem, device="cpu")(case["router_logits"], case["routing_bias"])
    router = fp4moe.Router(problem, device=DEVICE)
    ids, weights = router(logits, bias)
    assert torch.equal(ids.cpu(), cpu_ids)
    torch.testing.assert_close(weights.cpu(), cpu_weights, rtol=1e-6, atol=1e-30)
    handle = register_layer(router)  # a weak registry: `router` keeps it alive
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(torch.ops.fp4moe.route.default, (handle, logits.to(dtype), bias))
    whole = FusedMoE(problem, case["weights"], device=DEVICE, max_tokens=64)(inputs["hidden_states"], logits, bias)
    total = torch.zeros_like(whole, dtype=torch.float32)
    scale_max = float(case["weights"]["w13_input_scale"].max())
    for begin, end in [(0, 16), (16, 32)]:
        local = {name: value[begin:end] for name, value in case["weights"].items()}
        local["w13_input_scale_max"] = scale_max
        rank = FusedMoE(problem.expert_parallel_rank(end - begin), local, device=DEVICE, max_tokens=64,
                        expert_range=(begin, end), router_problem=problem)
        total += rank(inputs["hidden_states"], logits, bias).float()
    assert torch.linalg.norm(total - whole.float()) <= 5e-3 * torch.linalg.norm(whole.float())
