"""fp4moe layers in JAX programs: XLA FFI custom calls (the extension's python/jax_ffi.cpp), so that a
layer runs inside jax.jit like any other operation.

    import jax, fp4moe
    from fp4moe import jax_ops
    layer = fp4moe.MoeLayer(problem, weights, device="cuda:0", max_tokens=8192)    # or device="cpu"
    forward = jax.jit(lambda x, logits: jax_ops.moe_forward(layer, x, logits))
    output, topk_ids, topk_weights = forward(hidden_states, router_logits)         # jax arrays

The call runs where its arrays live: a cuda layer takes arrays on its GPU and runs on XLA's stream
(no allocation or synchronisation of its own, so XLA may record it into command buffers); a cpu
layer takes host arrays and runs the CPU reference. XLA allocates every buffer, the layer's
workspace included. A traced function names its layer by the layer's id: keep the MoeLayer alive
while the function is used (a call on a dropped layer fails with an error that says so).
Importing this module registers the custom calls; a build without jaxlib's XLA FFI headers raises
fp4moe.Error here.
"""
import jax
import jax.numpy as jnp
import numpy as np

from . import Error, _fp4moe

__all__ = ["moe_forward", "moe_forward_routed"]


def _register():
    for platform, targets in _fp4moe._jax_ffi_handlers().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


_register()


def _impl(layer):
    impl = getattr(layer, "_impl", None)
    if not isinstance(impl, _fp4moe.Layer):
        raise Error(f"fp4moe.jax_ops: layer must be an fp4moe.MoeLayer, got {type(layer).__module__}."
                    f"{type(layer).__name__}")
    return impl


def _spec(name, x):
    """(dtype, shape) of a traced argument, or fp4moe.Error naming it (the C++ check takes it from here)."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise Error(f"fp4moe.jax_ops: {name}: expected a jax array, got {type(x).__module__}.{type(x).__name__}")
    return str(x.dtype), [int(d) for d in x.shape]


def _results(impl, T, output_dtype, *routing):
    """The call's results: output, the routing's (moe_forward), and the workspace that XLA allocates."""
    if jnp.dtype(output_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise Error(f"fp4moe.jax_ops: output_dtype must be bfloat16 or float32, got {jnp.dtype(output_dtype)}")
    return (jax.ShapeDtypeStruct((T, impl.problem.hidden), output_dtype),
            *routing,
            jax.ShapeDtypeStruct((_fp4moe._jax_workspace_bytes(impl),), jnp.uint8))


def moe_forward(layer, hidden_states, router_logits, routing_bias=None, output_dtype=jnp.bfloat16):
    """The layer on hidden_states (bf16 [T, H]) routed by router_logits (float32 or bfloat16 [T, E]);
    routing_bias (float32 [E]) is read by deepseek_v3 routing and ignored (but checked) by the others. Returns (output bf16 [T, H], topk_ids int32
    [T, k], topk_weights float32 [T, k]); output_dtype=jnp.float32 gives the fp32 sums before the
    rounding (partial outputs of tensor / expert parallelism, to add in fp32 and round once)."""
    impl = _impl(layer)
    if routing_bias is None:
        routing_bias = jnp.zeros((0,), jnp.float32)  # none: the handler sees an empty buffer
    T = _fp4moe._jax_check_args(impl, False, _spec("hidden_states", hidden_states),
                                  _spec("router_logits", router_logits), _spec("routing_bias", routing_bias))
    k = impl.problem.top_k
    results = _results(impl, T, output_dtype, jax.ShapeDtypeStruct((T, k), jnp.int32),
                       jax.ShapeDtypeStruct((T, k), jnp.float32))
    output, topk_ids, topk_weights, _ = jax.ffi.ffi_call("fp4moe_moe_forward", results)(
        hidden_states, router_logits, routing_bias, layer=np.int64(impl.id))
    return output, topk_ids, topk_weights


def moe_forward_routed(layer, hidden_states, topk_ids, topk_weights, output_dtype=jnp.bfloat16):
    """The layer (routing method precomputed) on hidden_states (bf16 [T, H]) with the caller's topk_ids
    (int32 [T, k]) and topk_weights (float32 [T, k]). Returns the output, bf16 [T, H] (or float32:
    see moe_forward)."""
    impl = _impl(layer)
    T = _fp4moe._jax_check_args(impl, True, _spec("hidden_states", hidden_states),
                                  _spec("topk_ids", topk_ids), _spec("topk_weights", topk_weights))
    output, _ = jax.ffi.ffi_call("fp4moe_moe_forward_routed", _results(impl, T, output_dtype))(
        hidden_states, topk_ids, topk_weights, layer=np.int64(impl.id))
    return output
