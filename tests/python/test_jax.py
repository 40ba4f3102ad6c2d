"""The layer in JAX programs (fp4moe.jax_ops, XLA FFI custom calls): under jax.jit on the cpu against
the same layer's NumPy forward (bitwise: both are the CPU reference), the checks at trace time, a
call on a dropped layer; on the GPU (label gpu) the cuda layer against the cpu layer."""

import gc
import os

import pytest

import fp4moe

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with the other tests
jax = pytest.importorskip("jax")
np = pytest.importorskip("numpy")
import jax.numpy as jnp  # noqa: E402

from fp4moe import jax_ops  # noqa: E402  (registers the custom calls; fails in a build without them)
from tolerance import bf16_bits_to_float, expect_layer_close  # noqa: E402

CPU = jax.devices("cpu")[0]

PROBLEMS = {
    "tiny-w4a16": fp4moe.preset("tiny"),
    "tiny-w4a4_scalar": fp4moe.preset("tiny", act_quant="w4a4_scalar"),
    "deepseek_v3-groups": fp4moe.Problem(num_experts=32, hidden=256, inter=128, top_k=4, routing_method="deepseek_v3",
                                         n_group=4, topk_group=2, routed_scaling_factor=2.5, act_quant="w4a4_scalar"),
    "llama4-top1": fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=1, routing_method="llama4",
                                  apply_router_weight_on_input=True),
    "relu2-w4a4_per_expert": fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=2, activation="relu2",
                                            act_quant="w4a4_per_expert"),
}
ROUTED = fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=3, routing_method="precomputed")


def bf16(bits, device):
    """uint16 bf16 bits (NumPy) as a bfloat16 jax array on `device`."""
    return jax.lax.bitcast_convert_type(jax.device_put(np.asarray(bits, dtype=np.uint16), device), jnp.bfloat16)


def bits(x):
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))


def inputs(case, device, logits_bf16=False):
    """(hidden_states, router_logits, routing_bias or None) of a random case as jax arrays on `device`."""
    logits = case["router_logits"]
    if logits_bf16:  # bf16 logits: round the fp32 ones (the NumPy path then gets the same bf16 bits)
        logits = np.asarray(jnp.asarray(logits).astype(jnp.bfloat16).astype(jnp.float32))
        case["router_logits"] = logits
    bias = case.get("routing_bias")
    return (bf16(case["hidden_states"], device),
            jax.device_put(logits, device).astype(jnp.bfloat16) if logits_bf16 else jax.device_put(logits, device),
            None if bias is None else jax.device_put(bias, device))


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_jit_cpu_layer_matches_its_numpy_forward(name, tokens):
    problem = PROBLEMS[name]
    case = fp4moe.random_case(problem, tokens, seed=300 + tokens)
    layer = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=16)
    x, logits, bias = inputs(case, CPU, logits_bf16=name == "tiny-w4a16")
    want_out, want_ids, want_weights = layer(case["hidden_states"], case["router_logits"],
                                             routing_bias=case.get("routing_bias"))
    forward = jax.jit(lambda x, logits, bias: jax_ops.moe_forward(layer, x, logits, bias))
    out, ids, weights = forward(x, logits, bias)
    assert out.dtype == jnp.bfloat16 and out.shape == (tokens, problem.hidden)
    assert np.array_equal(bits(out), want_out), name
    assert np.array_equal(np.asarray(ids), want_ids), name
    assert np.array_equal(np.asarray(weights), want_weights), name
    if tokens:
        assert np.isfinite(bf16_bits_to_float(want_out)).all() and np.abs(bf16_bits_to_float(want_out)).max() > 0


def test_jit_routed_cpu_layer_matches_its_numpy_forward():
    tokens = 7
    case = fp4moe.random_case(ROUTED, tokens, seed=11)
    layer = fp4moe.MoeLayer(ROUTED, case["weights"], device="cpu", max_tokens=tokens)
    want, _, _ = layer(case["hidden_states"], topk_ids=case["topk_ids"], topk_weights=case["topk_weights"])
    forward = jax.jit(lambda x, i, w: jax_ops.moe_forward_routed(layer, x, i, w))
    out = forward(bf16(case["hidden_states"], CPU), jax.device_put(case["topk_ids"], CPU),
                  jax.device_put(case["topk_weights"], CPU))
    assert np.array_equal(bits(out), want)


def test_float32_output_is_the_sums_that_bf16_rounds():
    problem = PROBLEMS["deepseek_v3-groups"]
    case = fp4moe.random_case(problem, 6, seed=31)
    layer = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=8)
    x, logits, bias = inputs(case, CPU)
    forward = jax.jit(lambda *a: jax_ops.moe_forward(layer, *a, output_dtype=jnp.float32))
    out32, _, _ = forward(x, logits, bias)
    assert out32.dtype == jnp.float32
    want, _, _ = layer(case["hidden_states"], case["router_logits"], routing_bias=case["routing_bias"],
                       output_dtype="float32")
    np.testing.assert_array_equal(np.asarray(out32), want)
    with pytest.raises(fp4moe.Error, match="output_dtype must be bfloat16 or float32, got float16"):
        jax_ops.moe_forward(layer, x, logits, bias, output_dtype=jnp.float16)


def test_errors_at_trace_time_name_the_argument():
    problem = PROBLEMS["deepseek_v3-groups"]
    case = fp4moe.random_case(problem, 3, seed=5)
    layer = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=4)
    x, logits, bias = inputs(case, CPU)

    def fails(match, *args, op=jax_ops.moe_forward, on=layer):
        with pytest.raises(fp4moe.Error, match=match):
            jax.jit(lambda *a: op(on, *a))(*args)

    fails(r"hidden_states: expected bfloat16, got float32", x.astype(jnp.float32), logits, bias)
    fails(r"hidden_states: expected shape \[T, H\] = \[3, 256\], got \[3, 128\]", x[:, :128], logits, bias)
    fails(r"T = 3 exceeds the layer's max_tokens = 2",
          *inputs(case, CPU)[:2], bias, on=fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=2))
    fails(r"router_logits: expected float32 or bfloat16, got int32", x, logits.astype(jnp.int32), bias)
    fails(r"router_logits: expected shape \[T, E\] = \[3, 32\]", x, logits[:, :16], bias)
    fails(r"routing_bias: expected shape \[E\] = \[32\], got \[8\]", x, logits, bias[:8])
    fails(r"routing method deepseek_v3 routes the layer's own logits", x, logits, bias, op=jax_ops.moe_forward_routed)
    fails(r"layer must be an fp4moe.MoeLayer, got builtins.int", x, logits, bias, on=3)

    tiny = fp4moe.preset("tiny")
    tiny_case = fp4moe.random_case(tiny, 2, seed=6)
    tiny_layer = fp4moe.MoeLayer(tiny, tiny_case["weights"], device="cpu", max_tokens=2)
    tx, tlogits, _ = inputs(tiny_case, CPU)
    # A bias is ignored by renormalize routing (fp4moe/problem.hpp, routing_uses_bias), but still checked.
    fails(r"routing_bias: expected shape \[E\] = \[8\], got \[3\]", tx, tlogits, jnp.zeros((3,), jnp.float32),
          on=tiny_layer)
    ignored = jax.jit(lambda *a: jax_ops.moe_forward(tiny_layer, *a))(tx, tlogits, jnp.ones((tiny.num_experts,),
                                                                                            jnp.float32))
    plain = jax.jit(lambda *a: jax_ops.moe_forward(tiny_layer, *a))(tx, tlogits)
    for a, b in zip(ignored, plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    routed = fp4moe.MoeLayer(ROUTED, fp4moe.random_case(ROUTED, 1, seed=7)["weights"], device="cpu", max_tokens=4)
    fails(r"routing method precomputed: call moe_forward_routed", bf16(np.zeros((1, 256), np.uint16), CPU),
          jnp.zeros((1, 8), jnp.float32), on=routed)
    fails(r"topk_ids: expected int32, got float32", bf16(np.zeros((1, 256), np.uint16), CPU),
          jnp.zeros((1, 3), jnp.float32), jnp.zeros((1, 3), jnp.float32), op=jax_ops.moe_forward_routed, on=routed)


def test_the_handlers_check_what_xla_hands_them():
    """A custom call built without jax_ops (wrong result shapes, an unknown layer) fails in the handler."""
    problem = fp4moe.preset("tiny")
    case = fp4moe.random_case(problem, 2, seed=9)
    layer = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=2)
    x, logits, _ = inputs(case, CPU)
    bias = jnp.zeros((0,), jnp.float32)
    k = problem.top_k

    def call(output_columns=problem.hidden, layer_id=layer._impl.id, workspace=jnp.uint8):
        results = (jax.ShapeDtypeStruct((2, output_columns), jnp.bfloat16), jax.ShapeDtypeStruct((2, k), jnp.int32),
                   jax.ShapeDtypeStruct((2, k), jnp.float32), jax.ShapeDtypeStruct((0,), workspace))
        return jax.block_until_ready(
            jax.ffi.ffi_call("fp4moe_moe_forward", results)(x, logits, bias, layer=np.int64(layer_id)))

    assert np.array_equal(bits(call()[0]), layer(case["hidden_states"], case["router_logits"])[0])
    with pytest.raises(Exception, match=r"output: expected shape \[T, H\] = \[2, 256\], got \[2, 272\]"):
        call(output_columns=problem.hidden + 16)
    with pytest.raises(Exception, match=r"workspace: expected uint8, got float32"):
        call(workspace=jnp.float32)
    with pytest.raises(Exception, match=r"layer 999999 no longer exists"):
        call(layer_id=999999)


def test_a_compiled_call_on_a_dropped_layer_fails_with_a_message():
    problem = fp4moe.preset("tiny")
    case = fp4moe.random_case(problem, 2, seed=8)
    layer = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=2)
    x, logits, _ = inputs(case, CPU)
    compiled = jax.jit(lambda x, logits: jax_ops.moe_forward(layer, x, logits)).lower(x, logits).compile()
    assert np.array_equal(bits(compiled(x, logits)[0]), layer(case["hidden_states"], case["router_logits"])[0])
    del layer
    gc.collect()
    with pytest.raises(Exception, match=r"layer \d+ no longer exists"):
        jax.block_until_ready(compiled(x, logits))


# ---- GPU: the cuda layer through XLA's CUDA stream ---------------------------------------------------
def _gpu():
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    ok, why = fp4moe.cuda_device_available()
    return (devices[0] if devices and ok else None), (why if not ok else "JAX has no GPU backend")


GPU, NO_GPU_WHY = _gpu()


@pytest.mark.gpu
@pytest.mark.skipif(GPU is None, reason=f"no sm_90 GPU for fp4moe under JAX: {NO_GPU_WHY}")
@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("tokens", [0, 1, 17, 255])
def test_cuda_layer_under_jit_matches_the_cpu_layer(name, tokens):
    problem = PROBLEMS[name]
    weights = fp4moe.random_case(problem, 0, seed=tokens)["weights"]
    cpu_layer = fp4moe.MoeLayer(problem, weights, device="cpu", max_tokens=256)
    gpu_layer = fp4moe.MoeLayer(problem, weights, device=f"cuda:{GPU.id}", max_tokens=256)
    forward = jax.jit(lambda x, logits, bias: jax_ops.moe_forward(gpu_layer, x, logits, bias))
    for seed in (2000 + tokens, 3000 + tokens):  # two inputs through one compiled function: no stale results
        case = fp4moe.random_case(problem, tokens, seed=seed)  # its activations (and routing bias)
        x, logits, bias = inputs(case, GPU)
        want_out, want_ids, want_weights = cpu_layer(case["hidden_states"], case["router_logits"],
                                                     routing_bias=case.get("routing_bias"))
        # NaN garbage in freed device memory, which XLA may hand to the call's outputs.
        jax.block_until_ready(jnp.full((tokens, problem.hidden), jnp.nan, jnp.bfloat16, device=GPU))
        out, ids, weights = forward(x, logits, bias)
        assert list(out.devices())[0] == GPU
        assert np.array_equal(np.asarray(ids), want_ids), name
        assert np.array_equal(np.asarray(weights), want_weights), name
        expect_layer_close(bf16_bits_to_float(bits(out)), bf16_bits_to_float(want_out), f"{name} T={tokens}")


@pytest.mark.gpu
@pytest.mark.skipif(GPU is None, reason=f"no sm_90 GPU for fp4moe under JAX: {NO_GPU_WHY}")
def test_cuda_routed_layer_and_device_mismatch():
    tokens = 33
    case = fp4moe.random_case(ROUTED, tokens, seed=12)
    cpu_layer = fp4moe.MoeLayer(ROUTED, case["weights"], device="cpu", max_tokens=64)
    gpu_layer = fp4moe.MoeLayer(ROUTED, case["weights"], device=f"cuda:{GPU.id}", max_tokens=64)
    want, _, _ = cpu_layer(case["hidden_states"], topk_ids=case["topk_ids"], topk_weights=case["topk_weights"])
    args = (bf16(case["hidden_states"], GPU), jax.device_put(case["topk_ids"], GPU),
            jax.device_put(case["topk_weights"], GPU))
    out = jax.jit(lambda *a: jax_ops.moe_forward_routed(gpu_layer, *a))(*args)
    expect_layer_close(bf16_bits_to_float(bits(out)), bf16_bits_to_float(want), "routed")
    # A cpu layer called with GPU arrays, and a cuda layer with host arrays, say where each is.
    with pytest.raises(Exception, match=r"the layer is on cpu but the call runs on a CUDA device"):
        jax.block_until_ready(jax.jit(lambda *a: jax_ops.moe_forward_routed(cpu_layer, *a))(*args))
    host_args = tuple(jax.device_put(a, CPU) for a in args)
    with pytest.raises(Exception, match=r"the layer is on cuda:\d+ but the call runs on the cpu"):
        jax.block_until_ready(jax.jit(lambda *a: jax_ops.moe_forward_routed(gpu_layer, *a))(*host_args))
