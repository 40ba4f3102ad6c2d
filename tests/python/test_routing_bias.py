"""One rule for routing_bias on every backend (fp4moe/problem.hpp, routing_uses_bias): deepseek_v3 reads
it; every other method accepts one and ignores it, its dtype and shape still checked. The cpu layer and
router here; the same on a cuda layer (marked gpu), which must also give the cpu layer's routing."""

import numpy as np
import pytest

import fp4moe

IGNORING = {
    "llama4": fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=1, routing_method="llama4",
                             apply_router_weight_on_input=True),
    "renormalize": fp4moe.preset("tiny"),
    "sigmoid": fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=2, routing_method="sigmoid"),
}
DEEPSEEK = fp4moe.Problem(num_experts=16, hidden=256, inter=128, top_k=4, routing_method="deepseek_v3", n_group=4,
                          topk_group=2, routed_scaling_factor=2.5)


def strong_bias(problem, seed):
    """A bias large enough to change every token's choice where it is read."""
    return (np.random.default_rng(seed).permutation(problem.num_experts) * 10.0).astype(np.float32)


@pytest.mark.parametrize("method", list(IGNORING))
def test_other_methods_ignore_a_bias_on_the_cpu(method):
    problem = IGNORING[method]
    case = fp4moe.random_case(problem, 7, seed=21)
    layer = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=8)
    x, logits = case["hidden_states"], case["router_logits"]
    plain = layer(x, logits)
    biased = layer(x, logits, routing_bias=strong_bias(problem, 1))
    for a, b in zip(plain, biased):
        np.testing.assert_array_equal(a, b)
    router = fp4moe.Router(problem, device="cpu")
    for a, b in zip(router(logits), router(logits, strong_bias(problem, 2))):
        np.testing.assert_array_equal(a, b)
    # Ignored, but checked where given.
    with pytest.raises(fp4moe.Error, match=r"routing_bias: expected dtype float32, got float64"):
        layer(x, logits, routing_bias=np.zeros(problem.num_experts, np.float64))
    with pytest.raises(fp4moe.Error, match=r"routing_bias: expected shape \[E\] = \[8\], got \[9\]"):
        router(logits, np.zeros(9, np.float32))


def test_deepseek_v3_reads_the_bias_on_the_cpu():
    case = fp4moe.random_case(DEEPSEEK, 7, seed=22)
    layer = fp4moe.MoeLayer(DEEPSEEK, case["weights"], device="cpu", max_tokens=8)
    x, logits = case["hidden_states"], case["router_logits"]
    _, ids_zero, _ = layer(x, logits, routing_bias=np.zeros(DEEPSEEK.num_experts, np.float32))
    _, ids_strong, _ = layer(x, logits, routing_bias=strong_bias(DEEPSEEK, 3))
    assert not np.array_equal(ids_zero, ids_strong)
    router = fp4moe.Router(DEEPSEEK, device="cpu")
    np.testing.assert_array_equal(router(logits, strong_bias(DEEPSEEK, 3))[0], ids_strong)


def _torch_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not fp4moe.cuda_device_available()[0]:
        pytest.skip(f"no sm_90 GPU for fp4moe: {fp4moe.cuda_device_available()[1]}")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("method", list(IGNORING) + ["deepseek_v3"])
def test_the_cuda_layer_follows_the_same_rule(method):
    torch = _torch_gpu()
    problem = IGNORING.get(method, DEEPSEEK)
    case = fp4moe.random_case(problem, 9, seed=23, framework="torch")
    bias = torch.from_numpy(strong_bias(problem, 4))
    cpu = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=16)
    gpu = fp4moe.MoeLayer(problem, case["weights"], device="cuda:0", max_tokens=16)
    x, logits = case["hidden_states"], case["router_logits"]
    _, ref_ids, ref_weights = cpu(x, logits, routing_bias=bias)
    _, ids, weights = gpu(x.cuda(), logits.cuda(), routing_bias=bias.cuda())
    torch.cuda.synchronize()
    assert torch.equal(ids.cpu(), ref_ids), method
    torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-6, atol=1e-30)
    router = fp4moe.Router(problem, device="cuda:0")
    gpu_ids, _ = router(logits.cuda(), bias.cuda())
    assert torch.equal(gpu_ids.cpu(), ref_ids), method
    with pytest.raises(fp4moe.Error, match=r"routing_bias: expected a tensor on cuda:0 .*got cpu"):
        gpu(x.cuda(), logits.cuda(), routing_bias=bias)
