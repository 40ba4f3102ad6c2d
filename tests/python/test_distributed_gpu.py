"""Tensor and expert parallelism over two GPUs (ctest label gpu; skipped on a machine with one GPU): two
processes, one rank each, NCCL all-reduce through FusedMoE(process_group=) (tp, ep_allreduce) or the
expert-parallel layer (FusedMoE(parallel="ep_all2all" | "dp_allgather"): each rank its own half of the
tokens), against the whole layer on one GPU."""

import os

import pytest

import fp4moe

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not fp4moe.cuda_device_available()[0]:
    pytest.skip("needs two sm_90 GPUs", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from fp4moe.torch_ops import FusedMoE  # noqa: E402
from tolerance import expect_layer_close  # noqa: E402

TOKENS = 40


def problem():
    return fp4moe.Problem(num_experts=32, hidden=512, inter=256, top_k=4, routing_method="deepseek_v3", n_group=4,
                          topk_group=2, routed_scaling_factor=2.5, act_quant="w4a4_scalar")


def run_rank(rank, mode, reduce_dtype, init_file, result_file):
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    dist.init_process_group("nccl", init_method=f"file://{init_file}", world_size=2, rank=rank,
                            device_id=torch.device(device))
    try:
        p = problem()
        case = fp4moe.random_case(p, TOKENS, seed=17, framework="torch")  # the same case on both ranks
        x = case["hidden_states"].to(device)
        logits, bias = case["router_logits"].to(device), case["routing_bias"].to(device)
        if mode in ("ep_all2all", "dp_allgather"):  # rank r's tokens: [r * TOKENS / 2, (r + 1) * TOKENS / 2)
            moe = FusedMoE(p, case["weights"], device=device, max_tokens=64, process_group=dist.group.WORLD,
                           parallel=mode)
            half = slice(rank * TOKENS // 2, (rank + 1) * TOKENS // 2)
            x, logits = x[half], logits[half]
        elif mode == "tp":
            shard = fp4moe.tensor_parallel_shard(p, case["weights"], rank, 2, framework="torch")
            moe = FusedMoE(shard["problem"], shard["weights"], device=device, max_tokens=64,
                           process_group=dist.group.WORLD, reduce_dtype=reduce_dtype)
        else:
            begin, end = 16 * rank, 16 * (rank + 1)
            local = {name: value[begin:end] for name, value in case["weights"].items()}
            local["w13_input_scale_max"] = float(case["weights"]["w13_input_scale"].max())
            moe = FusedMoE(p.expert_parallel_rank(16), local, device=device, max_tokens=64,
                           expert_range=(begin, end), router_problem=p, process_group=dist.group.WORLD,
                           reduce_dtype=reduce_dtype)
        out = moe(x, logits, bias)
        assert out.dtype == torch.bfloat16
        torch.cuda.synchronize()
        if rank == 0:
            torch.save(out.cpu(), result_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["tp", "ep", "ep_all2all", "dp_allgather"])
def test_two_ranks_sum_to_the_layer(tmp_path, mode, reduce_dtype):
    """fp32 partials (the default) are the whole layer's output up to fp32 summation order: the layer
    tolerance of the single-GPU tests; bf16 partials add one rounding per rank (relative L2 only)."""
    result = tmp_path / "out.pt"
    mp.spawn(run_rank, args=(mode, reduce_dtype, str(tmp_path / "pg"), str(result)), nprocs=2, join=True)
    assert os.path.exists(result)
    p = problem()
    case = fp4moe.random_case(p, TOKENS, seed=17, framework="torch")
    whole = FusedMoE(p, case["weights"], device="cuda:0", max_tokens=64)(
        case["hidden_states"].to("cuda:0"), case["router_logits"].to("cuda:0"), case["routing_bias"].to("cuda:0"))
    got = torch.load(result).float()
    want = whole.float().cpu()
    if mode in ("ep_all2all", "dp_allgather"):  # rank 0's tokens (reduce_dtype does not apply: fp32 always)
        want = want[:TOKENS // 2]
    assert torch.linalg.norm(got - want) <= 5e-3 * torch.linalg.norm(want), mode
    if reduce_dtype == torch.float32:
        expect_layer_close(got.numpy(), want.numpy(), f"{mode} fp32 partials")
