"""Expert parallelism from Python (ctest label gpu), both schemes (all_to_all, all_gather): N virtual
ranks on one GPU, one thread each, through fp4moe.ExpertParallelLayer and FusedMoE(parallel=
"ep_all2all" | "dp_allgather", communicator=), and a one-rank torch.distributed NCCL group through
FusedMoE(parallel=..., process_group=). Every
rank's ids and weights equal the whole layer's; its outputs are within the layer tolerance (each rank
picks its own tactic: fp32 summation order, docs/numerics.md). Bad arguments raise fp4moe.Error."""

import threading

import pytest

import fp4moe

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not fp4moe.cuda_device_available()[0]:
    pytest.skip(f"no sm_90 GPU for fp4moe: {fp4moe.cuda_device_available()[1]}", allow_module_level=True)

from fp4moe.torch_ops import FusedMoE  # noqa: E402
from tolerance import expect_layer_close  # noqa: E402

DEVICE = "cuda:0"

PROBLEMS = {
    "deepseek_v3-w4a4_scalar": fp4moe.Problem(num_experts=32, hidden=512, inter=256, top_k=4,
                                              routing_method="deepseek_v3", n_group=4, topk_group=2,
                                              routed_scaling_factor=2.5, act_quant="w4a4_scalar"),
    "w4a4_per_expert": fp4moe.preset("tiny", act_quant="w4a4_per_expert"),
    "w4a16": fp4moe.preset("tiny"),
    "mxfp4-bias": fp4moe.Problem(num_experts=8, hidden=1088, inter=544, top_k=2, activation="swiglu_oai",
                                 weight_format="mxfp4"),
}
TOKENS = [37, 1, 0, 64]  # rank r's tokens; a group of n ranks takes the first n


def make_case(name, tokens, seed):
    problem = PROBLEMS[name]
    case = fp4moe.random_case(problem, sum(tokens), seed=seed, framework="torch",
                              expert_biases=problem.activation == "swiglu_oai")
    inputs = {key: case[key].to(DEVICE) for key in ("hidden_states", "router_logits")}
    inputs["routing_bias"] = case["routing_bias"].to(DEVICE) if case.get("routing_bias") is not None else None
    return problem, case, inputs


def whole_layer(problem, case, inputs):
    layer = fp4moe.MoeLayer(problem, case["weights"], device=DEVICE, max_tokens=max(inputs["hidden_states"].shape[0], 1))
    out = layer(inputs["hidden_states"], inputs["router_logits"], routing_bias=inputs["routing_bias"])
    torch.cuda.synchronize()
    return out


def on_ranks(tokens, call):
    """call(r, first, T) on one thread per rank; the ranks' results, or the first rank's exception."""
    results, errors = [None] * len(tokens), [None] * len(tokens)
    firsts = [sum(tokens[:r]) for r in range(len(tokens))]

    def body(r):
        try:
            results[r] = call(r, firsts[r], tokens[r])
        except BaseException as e:  # noqa: BLE001 - reported below, on the test's thread
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(tokens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def expect_equal_to_whole(results, whole, label):
    out = torch.cat([r[0] for r in results])
    ids = torch.cat([r[1] for r in results])
    weights = torch.cat([r[2] for r in results])
    assert torch.equal(ids, whole[1]), f"{label}: topk_ids"
    assert torch.equal(weights, whole[2]), f"{label}: topk_weights"
    expect_layer_close(out.float().cpu().numpy(), whole[0].float().cpu().numpy(), label)


@pytest.mark.parametrize("scheme", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_virtual_ranks_equal_the_whole_layer(name, ranks, scheme):
    tokens = TOKENS[:ranks]
    problem, case, inputs = make_case(name, tokens, seed=ranks)
    whole = whole_layer(problem, case, inputs)
    comms = fp4moe.virtual_ranks(ranks, timeout_seconds=60)
    layers = [fp4moe.ExpertParallelLayer(problem, case["weights"], comms[r], device=DEVICE, max_tokens=max(tokens),
                                         scheme=scheme) for r in range(ranks)]
    assert all(layer.scheme == scheme for layer in layers)
    assert [layer.rank for layer in layers] == list(range(ranks))
    assert sum(layer.local_problem.num_experts for layer in layers) == problem.num_experts

    def rank(r, first, T):
        stream = torch.cuda.Stream(DEVICE)
        x = {key: value[first:first + T] for key, value in inputs.items() if key != "routing_bias"}
        got = layers[r](x["hidden_states"], x["router_logits"], routing_bias=inputs["routing_bias"], stream=stream)
        stream.synchronize()
        return got

    expect_equal_to_whole(on_ranks(tokens, rank), whole, f"{name} on {ranks} virtual ranks, {scheme}")
    if scheme == "all_gather":
        return
    # H/2 + H/16 bytes of FP4 values and scales per row copy in w4a4 (bf16 rows in w4a16), + 4 per local id.
    for layer in layers:
        traffic = layer.last_traffic()
        if traffic["rows_sent"]:
            H, k = problem.hidden, problem.top_k
            rows_top_k = 1 if problem.act_quant == "w4a4_per_expert" else k
            row = (H // 2 + H // 16 if problem.act_quant != "w4a16" else 2 * H) + 4 * rows_top_k
            assert traffic["dispatch_bytes"] == traffic["rows_sent"] * row


@pytest.mark.parametrize("parallel", ["ep_all2all", "dp_allgather"])
def test_fused_moe_on_virtual_ranks_with_precomputed_routing(parallel):
    tokens = [20, 33]
    problem, case, inputs = make_case("deepseek_v3-w4a4_scalar", tokens, seed=5)
    whole = whole_layer(problem, case, inputs)
    routed = problem.with_routing_method("precomputed")
    comms = fp4moe.virtual_ranks(2, timeout_seconds=60)
    modules = [FusedMoE(routed, case["weights"], device=DEVICE, max_tokens=64, parallel=parallel,
                        communicator=comms[r]) for r in range(2)]

    def rank(r, first, T):
        stream = torch.cuda.Stream(DEVICE)
        with torch.cuda.stream(stream):
            ids, weights = whole[1][first:first + T], whole[2][first:first + T]
            out = modules[r](inputs["hidden_states"][first:first + T], topk_ids=ids, topk_weights=weights)
        stream.synchronize()
        return out, ids, weights

    expect_equal_to_whole(on_ranks(tokens, rank), whole, f"FusedMoE {parallel}, precomputed")


@pytest.mark.parametrize("parallel", ["ep_all2all", "dp_allgather"])
def test_fused_moe_over_a_one_rank_nccl_group(tmp_path, parallel):
    import torch.distributed as dist
    problem, case, inputs = make_case("deepseek_v3-w4a4_scalar", [40], seed=9)
    whole = whole_layer(problem, case, inputs)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", world_size=1, rank=0,
                            device_id=torch.device(DEVICE))
    try:
        moe = FusedMoE(problem, case["weights"], device=DEVICE, max_tokens=64, process_group=dist.group.WORLD,
                       parallel=parallel)
        assert f"{parallel} rank 0 of 1" in repr(moe)
        out, ids, weights = moe(inputs["hidden_states"], inputs["router_logits"], inputs["routing_bias"],
                                return_routing=True)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    expect_equal_to_whole([(out, ids, weights)], whole, f"FusedMoE {parallel} over NCCL, one rank")


def test_bad_arguments_are_errors():
    problem, case, inputs = make_case("w4a16", [8], seed=3)
    comms = fp4moe.virtual_ranks(1)
    with pytest.raises(fp4moe.Error, match="parallel must be one of"):
        FusedMoE(problem, case["weights"], device=DEVICE, parallel="all2all")
    with pytest.raises(fp4moe.Error, match="scheme must be 'all_to_all' or 'all_gather'"):
        fp4moe.ExpertParallelLayer(problem, case["weights"], comms[0], device=DEVICE, scheme="ring")
    with pytest.raises(fp4moe.Error, match="parallel='dp_allgather' needs exactly one of process_group"):
        FusedMoE(problem, case["weights"], device=DEVICE, parallel="dp_allgather")
    with pytest.raises(fp4moe.Error, match="exactly one of process_group"):
        FusedMoE(problem, case["weights"], device=DEVICE, parallel="ep_all2all")
    with pytest.raises(fp4moe.Error, match="expert_range"):
        FusedMoE(problem, case["weights"], device=DEVICE, parallel="ep_all2all", communicator=comms[0],
                 expert_range=(0, 4))
    with pytest.raises(fp4moe.Error, match="communicator is for parallel='ep_all2all' or 'dp_allgather'"):
        FusedMoE(problem, case["weights"], device=DEVICE, communicator=comms[0])
    with pytest.raises(fp4moe.Error, match="parallel='tp' needs process_group"):
        FusedMoE(problem, case["weights"], device=DEVICE, parallel="tp")
    with pytest.raises(fp4moe.Error, match="communicator must come from"):
        fp4moe.ExpertParallelLayer(problem, case["weights"], object(), device=DEVICE)
    with pytest.raises(fp4moe.Error, match="cuda device"):
        fp4moe.ExpertParallelLayer(problem, case["weights"], comms[0], device="cpu")
    with pytest.raises(fp4moe.Error, match="unique_id must be the bytes"):
        fp4moe.nccl_communicator("id", 0, 1)
    layer = fp4moe.ExpertParallelLayer(problem, case["weights"], comms[0], device=DEVICE, max_tokens=4)
    with pytest.raises(fp4moe.Error, match="exceeds the layer's max_tokens = 4"):
        layer(inputs["hidden_states"], inputs["router_logits"])
    with pytest.raises(fp4moe.Error, match="router_logits is required"):
        layer(inputs["hidden_states"][:4])
    with pytest.raises(fp4moe.Error, match="expected dtype"):
        layer(inputs["hidden_states"][:4].float(), inputs["router_logits"][:4])
