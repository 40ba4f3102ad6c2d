"""Property-based tests of the Python API (hypothesis): wrong arguments of every kind (dtype, rank, shape,
layout, alignment, zero-size, outputs aliasing inputs, non-tensors, read-only outputs, a small or
misplaced workspace, wrong devices and streams on cuda) thrown at each entry point. Every call either
succeeds with the documented result or raises fp4moe.Error, and after any bad call a good call still
gives the right output. The cpu layer runs in CI; the cuda layer (marked gpu) where there is an sm_90
GPU and torch. Each entry point draws at least 500 examples on the tiny preset."""

import tempfile

import numpy as np
import pytest

import fp4moe

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = settings(max_examples=500, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))

PROBLEM = fp4moe.preset("tiny")  # renormalize: a routing bias is ignored (but checked)
DEEPSEEK = fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=2, routing_method="deepseek_v3", n_group=2,
                          topk_group=1, routed_scaling_factor=2.5)
ROUTED = PROBLEM.with_routing_method("precomputed")
T = 3
MAX_TOKENS = 4
E, H, K = PROBLEM.num_experts, PROBLEM.hidden, PROBLEM.top_k

# Mutations of one argument. RAISES: the call must raise fp4moe.Error. VALID: the call must succeed.
RAISES = ["dtype", "rank", "extent", "strided", "misaligned", "not_a_tensor", "empty", "readonly", "alias",
          "small_workspace", "wrong_device", "too_many_tokens"]


class Numpy:
    """Host arrays (the cpu layer): bf16 as uint16 bits."""
    on_cuda = False
    bf16 = np.uint16

    def __init__(self):
        self.device = "cpu"

    def asarray(self, a):
        return np.ascontiguousarray(a)

    def to_host(self, a):
        return np.asarray(a)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def astype(self, a, dtype):
        return a.astype(dtype)

    def misaligned(self, a, offset):
        raw = np.zeros(a.nbytes + 64, np.uint8)
        base = (-raw.ctypes.data) % 64 + offset
        out = raw[base:base + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        return out

    def strided(self, a):
        if a.ndim == 1:
            wide = np.zeros(2 * a.shape[0], a.dtype)
            wide[::2] = a
            return wide[::2]
        return np.asfortranarray(a)

    def readonly(self, a):
        a = a.copy()
        a.flags.writeable = False
        return a

    def reinterpret(self, a, dtype, shape):
        """A contiguous view of a's memory as another dtype and shape (for aliasing)."""
        return a.reshape(-1).view(dtype)[:int(np.prod(shape))].reshape(shape)

    def other_device(self, a):
        return None  # no other device in a host-only build

    def equal(self, a, b):
        return np.array_equal(self.to_host(a), self.to_host(b))


class Torch:
    """torch tensors on cuda:0 (the cuda layer); wrong devices are the cpu and, with two GPUs, cuda:1."""
    on_cuda = True

    def __init__(self):
        import torch
        self.torch = torch
        self.device = "cuda:0"
        self.bf16 = torch.bfloat16

    def asarray(self, a):
        t = self.torch
        a = t.as_tensor(np.ascontiguousarray(a))
        if a.dtype == t.int16 or a.dtype == t.uint16:
            a = a.view(t.bfloat16)
        return a.to(self.device)

    def to_host(self, a):
        if isinstance(a, np.ndarray):
            return a
        a = a.detach().cpu()
        return a.view(self.torch.int16).numpy().view(np.uint16) if a.dtype == self.torch.bfloat16 else a.numpy()

    def zeros(self, shape, dtype):
        return self.torch.zeros(shape, dtype=self._dtype(dtype), device=self.device)

    def _dtype(self, dtype):
        t = self.torch
        return {np.float32: t.float32, np.float64: t.float64, np.int32: t.int32, np.int64: t.int64,
                np.uint8: t.uint8, np.uint16: t.bfloat16}.get(dtype, dtype)

    def astype(self, a, dtype):
        return a.to(self._dtype(dtype))

    def misaligned(self, a, offset):
        t = self.torch
        nbytes = a.numel() * a.element_size()
        raw = t.zeros(nbytes + 512, dtype=t.uint8, device=a.device)
        view = raw[offset:offset + nbytes].view(a.dtype).view(a.shape) if offset % a.element_size() == 0 else None
        if view is None:  # torch refuses views at offsets that are not a multiple of the element size
            return raw[offset:offset + nbytes]
        view.copy_(a)
        return view

    def strided(self, a):
        if a.dim() == 1:
            wide = self.torch.zeros(2 * a.shape[0], dtype=a.dtype, device=a.device)
            wide[::2] = a
            return wide[::2]
        return a.transpose(-1, -2).contiguous().transpose(-1, -2)  # any rank >= 2

    def readonly(self, a):
        return None  # torch tensors are never read-only

    def reinterpret(self, a, dtype, shape):
        n = int(np.prod(shape))
        return a.reshape(-1).view(self._dtype(dtype))[:n].view(shape)

    def other_device(self, a):
        t = self.torch
        if t.cuda.device_count() > 1 and a.device.type == "cuda":
            return a.to("cuda:1")
        return a.cpu()

    def equal(self, a, b):
        return np.array_equal(self.to_host(a), self.to_host(b))


def mutate(fw, kind, value, name, draw_int, t_from="hidden_states"):
    """`value` with one wrong property of `kind`, or None when the kind does not apply to it."""
    if value is None or not hasattr(value, "shape"):  # already replaced by a non-tensor
        return None
    if kind == "dtype":
        wrong = {"hidden_states": np.float32, "router_logits": np.float64, "routing_bias": np.float64,
                 "topk_ids": np.int64, "topk_weights": np.float64, "output": np.int32, "workspace": np.float32}
        return fw.astype(value, wrong[name])
    if kind == "rank":
        return value.reshape((1,) + tuple(value.shape))
    if kind == "extent":
        shape = list(value.shape)
        axis = draw_int(0, len(shape) - 1)
        if name == "workspace" or (name == t_from and axis == 0):
            return None  # any size past the minimum is valid; t_from's T sets the other tensors'
        shape[axis] += 1 if draw_int(0, 1) or shape[axis] <= 1 else -1
        return fw.zeros(tuple(shape), _np_dtype(fw, value))
    if kind == "strided":
        if name == "workspace":
            return None
        return fw.strided(value)
    if kind == "misaligned":
        align = {"hidden_states": 16, "output": 16, "workspace": 256}.get(name, 4 if name != "router_logits" else 4)
        offset = draw_int(1, align - 1)
        if name == "router_logits" or name in ("topk_ids", "topk_weights", "routing_bias"):
            offset = draw_int(1, 3)
        return fw.misaligned(value, offset)
    if kind == "not_a_tensor":
        return [None, 3, "tensor", [1.0, 2.0], object()][draw_int(0, 4)]
    if kind == "empty":
        if name == t_from:
            return None  # T = 0 is valid (zero_tokens)
        return fw.zeros((0,) * len(value.shape), _np_dtype(fw, value))
    if kind == "readonly":
        if name not in ("topk_ids", "topk_weights", "output", "workspace"):
            return None
        return fw.readonly(value)
    if kind == "wrong_device":
        return fw.other_device(value)
    return None


def _np_dtype(fw, value):
    if isinstance(value, np.ndarray):
        return value.dtype.type
    return value.dtype


class Case:
    """A good call's arguments and its result (from the cpu layer), in framework `fw`."""

    def __init__(self, fw, problem, seed=1):
        case = fp4moe.random_case(problem, T, seed=seed)
        self.fw, self.problem = fw, problem
        self.weights = case["weights"]
        self.hidden = case["hidden_states"]
        self.logits = case.get("router_logits")
        self.bias = case.get("routing_bias")
        if self.bias is None and problem.routing_method != "precomputed":
            self.bias = np.linspace(-3, 3, problem.num_experts).astype(np.float32)  # ignored: no effect
        ref = fp4moe.MoeLayer(problem, self.weights, device="cpu", max_tokens=MAX_TOKENS)
        if problem.routing_method == "precomputed":
            self.ids, self.topk_weights = case["topk_ids"], case["topk_weights"]
            self.out, _, _ = ref(self.hidden, topk_ids=self.ids, topk_weights=self.topk_weights)
        else:
            self.out, self.ids, self.topk_weights = ref(self.hidden, self.logits, routing_bias=self.bias)
        self.layer = fp4moe.MoeLayer(problem, self.weights, device=fw.device, max_tokens=MAX_TOKENS)

    def good_call_is_right(self):
        fw = self.fw
        if self.problem.routing_method == "precomputed":
            out, _, _ = self.layer(fw.asarray(self.hidden), topk_ids=fw.asarray(self.ids),
                                   topk_weights=fw.asarray(self.topk_weights))
        else:
            out, ids, _ = self.layer(fw.asarray(self.hidden), fw.asarray(self.logits),
                                     routing_bias=fw.asarray(self.bias))
            assert fw.equal(ids, self.ids)
        assert fw.to_host(out).shape == self.out.shape
        if not fw.on_cuda:  # the cpu layer is the reference: bit for bit
            assert fw.equal(out, self.out)
        else:
            from tolerance import expect_layer_close
            expect_layer_close(_bf16_float(fw.to_host(out)), _bf16_float(self.out), "after bad calls")


def _bf16_float(bits):
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _run(fw, case, call, names, draw, t_from="hidden_states"):
    """Applies 0..3 drawn mutations to the good arguments and calls `call`; checks the outcome."""
    args = {name: fw.asarray(v) for name, v in names.items() if v is not None}
    must_raise = False
    applied = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(RAISES + ["zero_tokens", "bias_ignored"]))
        name = draw(st.sampled_from(sorted(args)))
        if any(n == name for _, n in applied):
            continue  # a second mutation of one argument can undo the first (extent +1, then -1)
        if kind == "zero_tokens":
            continue  # drawn as a whole call below
        if kind == "bias_ignored":
            continue  # the good arguments carry a bias already
        if kind == "alias":
            target = _alias(fw, args, name, draw)
            if target is None:
                continue
            args[name] = target
        elif kind == "small_workspace":
            if "workspace" not in args or not fw.on_cuda:
                continue
            args["workspace"] = fw.zeros((max(case.layer.workspace_size() - draw(st.integers(1, 4096)), 0),),
                                         np.uint8)
        elif kind == "too_many_tokens":
            continue
        else:
            new = mutate(fw, kind, args[name], name, lambda lo, hi: draw(st.integers(lo, hi)), t_from)
            if new is None:
                continue
            args[name] = new
        applied.append((kind, name))
        must_raise = True
    try:
        result = call(**args)
    except fp4moe.Error:
        return "raised", applied
    assert not must_raise, f"no fp4moe.Error for {applied}"
    return result, applied


def _alias(fw, args, name, draw):
    """An output (topk_ids, topk_weights, output, workspace) as a view of another argument's memory."""
    writable = [n for n in ("topk_ids", "topk_weights", "output", "workspace") if n in args]
    if not writable:
        return None
    out_name = name if name in writable else draw(st.sampled_from(writable))
    others = [n for n in args if n != out_name and not isinstance(args[n], (int, str, list))]
    if not others:
        return None
    src = args[draw(st.sampled_from(sorted(others)))]
    shape_dtype = {"topk_ids": ((T, K), np.int32), "topk_weights": ((T, K), np.float32),
                   "output": ((T, H), np.uint16), "workspace": ((16,), np.uint8)}[out_name]
    shape, dtype = shape_dtype
    try:
        nbytes_src = src.nbytes if isinstance(src, np.ndarray) else src.numel() * src.element_size()
    except AttributeError:
        return None
    need = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if out_name == "workspace" and fw.on_cuda:
        return None  # a workspace must also be large: an alias of a small input is refused as too small anyway
    if nbytes_src < need:
        return None
    args[out_name] = fw.reinterpret(src, dtype, shape)
    return args[out_name] if out_name == name else args[name]


# ---- the entry points -------------------------------------------------------------------------------
def layer_call(fw, case, draw):
    def call(hidden_states, router_logits=None, routing_bias=None):
        return case.layer(hidden_states, router_logits, routing_bias=routing_bias)
    result, applied = _run(fw, case, call, {"hidden_states": case.hidden, "router_logits": case.logits,
                                            "routing_bias": case.bias}, draw)
    if result != "raised":
        out, ids, _ = result
        assert fw.equal(ids, case.ids)
        if not fw.on_cuda:
            assert fw.equal(out, case.out)


def layer_forward_into(fw, case, draw):
    def call(hidden_states, router_logits=None, routing_bias=None, topk_ids=None, topk_weights=None, output=None,
             workspace=None):
        case.layer.forward_into(hidden_states, router_logits, routing_bias=routing_bias, topk_ids=topk_ids,
                                topk_weights=topk_weights, output=output, workspace=workspace)
        return output, topk_ids
    names = {"hidden_states": case.hidden, "router_logits": case.logits, "routing_bias": case.bias,
             "topk_ids": np.zeros((T, K), np.int32), "topk_weights": np.zeros((T, K), np.float32),
             "output": np.zeros((T, H), np.uint16)}
    if fw.on_cuda:
        names["workspace"] = np.zeros(case.layer.workspace_size(), np.uint8)
    result, _ = _run(fw, case, call, names, draw)
    if result != "raised":
        out, ids = result
        assert fw.equal(ids, case.ids)
        if not fw.on_cuda:
            assert fw.equal(out, case.out)


def router_call(fw, case, draw):
    if not hasattr(case, "router"):
        case.router = fp4moe.Router(case.problem, device=fw.device)
    router = case.router

    def call(router_logits, routing_bias=None):
        return router(router_logits, routing_bias)
    result, _ = _run(fw, case, call, {"router_logits": case.logits, "routing_bias": case.bias}, draw,
                     t_from="router_logits")
    if result != "raised":
        assert fw.equal(result[0], case.ids)


def zero_tokens(fw, case):
    """T = 0 is a valid call: empty outputs."""
    x = fw.zeros((0, H), fw.bf16 if fw.on_cuda else np.uint16)
    out, ids, weights = case.layer(x, fw.zeros((0, E), np.float32))
    assert tuple(out.shape) == (0, H) and tuple(ids.shape) == (0, K)


@pytest.fixture(scope="module")
def cpu_case():
    return Case(Numpy(), PROBLEM)


@EXAMPLES
@given(data=st.data())
def test_cpu_layer_call(cpu_case, data):
    layer_call(cpu_case.fw, cpu_case, data.draw)
    cpu_case.good_call_is_right()


@EXAMPLES
@given(data=st.data())
def test_cpu_layer_forward_into(cpu_case, data):
    layer_forward_into(cpu_case.fw, cpu_case, data.draw)
    cpu_case.good_call_is_right()


@EXAMPLES
@given(data=st.data())
def test_cpu_router(cpu_case, data):
    router_call(cpu_case.fw, cpu_case, data.draw)
    cpu_case.good_call_is_right()


def test_cpu_zero_tokens_and_too_many(cpu_case):
    zero_tokens(cpu_case.fw, cpu_case)
    with pytest.raises(fp4moe.Error, match="exceeds the layer's max_tokens"):
        big = fp4moe.random_case(PROBLEM, MAX_TOKENS + 1, seed=3)
        cpu_case.layer(big["hidden_states"], big["router_logits"])
    cpu_case.good_call_is_right()


def _ints():
    return st.one_of(st.integers(-3, 5), st.sampled_from([None, "1", 1.5, True, 2 ** 40]))


@EXAMPLES
@given(rank=_ints(), size=_ints(), drop=st.sampled_from([None, "w13", "w2_scale", "w2_scale_2"]),
       wrong=st.sampled_from([None, "w13", "w13_scale", "w2", "w13_scale_2"]),
       kind=st.sampled_from(["dtype", "extent", "not_a_tensor", "strided"]))
def test_tensor_parallel_shard(cpu_case, rank, size, drop, wrong, kind):
    weights = dict(cpu_case.weights)
    bad = False
    if drop is not None:
        del weights[drop]
        bad = True
    if wrong is not None and wrong in weights:
        value = weights[wrong]
        if kind == "dtype":
            weights[wrong] = value.astype(np.float64)
        elif kind == "extent":
            weights[wrong] = np.zeros((value.shape[0] + 1,) + value.shape[1:], value.dtype)
        elif kind == "not_a_tensor":
            weights[wrong] = "weights"
        else:
            weights[wrong] = np.asfortranarray(value) if value.ndim > 1 and value.shape[-1] > 1 else value[::-1]
            bad = value.ndim > 1 or value.shape[0] > 1
        bad = bad or kind != "strided"
    valid_ints = all(isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2 ** 31 for v in (rank, size))
    inter_blocks = PROBLEM.inter // 16
    good_ranks = valid_ints and 1 <= size <= inter_blocks and 0 <= rank < size
    try:
        shard = fp4moe.tensor_parallel_shard(PROBLEM, weights, rank, size)
    except fp4moe.Error:
        assert not (good_ranks and not bad), (rank, size, drop, wrong, kind)
        return
    assert good_ranks and not bad, (rank, size, drop, wrong, kind)
    assert shard["inter_end"] - shard["inter_begin"] == shard["problem"].inter


@pytest.fixture(scope="module")
def checkpoint():
    directory = tempfile.mkdtemp(prefix="fp4moe-properties-")
    layers = fp4moe._fp4moe._write_checkpoint_fixture(directory, "deepseek_v3", "modelopt", 2)
    return directory, sorted(layers)


@EXAMPLES
@given(layer=_ints(), ep=st.tuples(_ints(), _ints()), tp=st.tuples(_ints(), _ints()),
       fusion=st.sampled_from(["rescale_to_max", "none", "bogus", 3]), framework=st.sampled_from(["numpy", "jax", 0]),
       path=st.sampled_from(["good", "missing"]))
def test_load_checkpoint_layer(checkpoint, layer, ep, tp, fusion, framework, path):
    directory, layers = checkpoint
    try:
        d = fp4moe.load_checkpoint_layer(directory if path == "good" else directory + "/missing", layer,
                                         ep_rank=ep[0], ep_size=ep[1], tp_rank=tp[0], tp_size=tp[1], fusion=fusion,
                                         framework=framework)
    except fp4moe.Error:
        return
    assert path == "good" and layer in layers and framework == "numpy"
    assert d["layer"] == layer and d["expert_end"] > d["expert_begin"]


def test_jax_ops_on_the_cpu_layer(cpu_case):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    try:
        from fp4moe import jax_ops
    except fp4moe.Error as e:
        pytest.skip(str(e))

    @EXAMPLES
    @given(data=st.data())
    def run(data):
        draw = data.draw
        cpu = jax.devices("cpu")[0]
        x = jax.device_put(jnp.asarray(cpu_case.hidden).view(jnp.bfloat16), cpu)
        args = {"hidden_states": x, "router_logits": jax.device_put(jnp.asarray(cpu_case.logits), cpu),
                "routing_bias": jax.device_put(jnp.asarray(cpu_case.bias), cpu)}
        must_raise = False
        for _ in range(draw(st.integers(0, 2))):
            name = draw(st.sampled_from(sorted(args)))
            kind = draw(st.sampled_from(["dtype", "rank", "extent", "not_a_tensor"]))
            value = args[name]
            if isinstance(value, list):
                continue  # replaced by a non-array already
            if kind == "dtype":
                args[name] = value.astype(jnp.int32)
            elif kind == "rank":
                args[name] = value.reshape((1,) + value.shape)
            elif kind == "extent":
                axis = draw(st.integers(0, value.ndim - 1))
                if name == "hidden_states" and axis == 0:
                    continue
                shape = list(value.shape)
                shape[axis] += 1
                args[name] = jnp.zeros(shape, value.dtype)
            else:
                args[name] = [1.0, 2.0]
            must_raise = True
        try:
            out, ids, _ = jax_ops.moe_forward(cpu_case.layer, args["hidden_states"], args["router_logits"],
                                              args["routing_bias"])
        except fp4moe.Error:
            return
        assert not must_raise
        np.testing.assert_array_equal(np.asarray(ids), cpu_case.ids)
        np.testing.assert_array_equal(np.asarray(out).view(np.uint16), cpu_case.out)

    run()
    cpu_case.good_call_is_right()



# ---- MXFP4 weights (weight_format mxfp4) ------------------------------------------------------------
MX_PROBLEM = fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=2, activation="swiglu_oai",
                            weight_format="mxfp4")
# Weight mutations of an MXFP4 layer, each an fp4moe.Error whose message names `the argument` (None: the
# message is not fixed by one name). "none" and "as_nvfp4_problem" (weight_format= on an NVFP4 problem)
# are valid.
MX_WEIGHT_KINDS = ["none", "as_nvfp4_problem", "scale_dtype", "nvfp4_scale_shape", "scale_rank", "nvfp4_key",
                   "missing", "swizzled", "nan_code", "w4a4", "as_nvfp4", "bad_format", "bias_shape",
                   "scale_strided"]


@pytest.fixture(scope="module")
def mx_cpu_case():
    return Case(Numpy(), MX_PROBLEM, seed=5)


@EXAMPLES
@given(data=st.data())
def test_cpu_mxfp4_layer_call(mx_cpu_case, data):
    layer_call(mx_cpu_case.fw, mx_cpu_case, data.draw)
    mx_cpu_case.good_call_is_right()


def _mx_weights_call(case, kind, draw):
    """(weights, MoeLayer keyword arguments, problem, the name the error must carry) for one mutation."""
    w = dict(case.weights)
    problem, options, name = MX_PROBLEM, {}, None
    tensor = draw(st.sampled_from(["w13_scale", "w2_scale"]))
    if kind == "as_nvfp4_problem":
        problem, options = MX_PROBLEM.with_weight_format("nvfp4"), {"weight_format": "mxfp4"}
    elif kind == "scale_dtype":
        dtype = draw(st.sampled_from([np.int8, np.uint16, np.float32]))
        w[tensor], name = w[tensor].astype(dtype), tensor
    elif kind == "nvfp4_scale_shape":  # NVFP4's K/16 columns
        v = w[tensor]
        w[tensor], name = np.zeros(v.shape[:-1] + (2 * v.shape[-1],), np.uint8), tensor
    elif kind == "scale_rank":
        w[tensor], name = w[tensor].reshape(-1), tensor
    elif kind == "nvfp4_key":
        name = draw(st.sampled_from(["w13_scale_2", "w2_scale_2", "w13_input_scale", "w2_input_scale"]))
        w[name] = np.ones(MX_PROBLEM.num_experts, np.float32)
    elif kind == "missing":
        name = draw(st.sampled_from(["w13", "w13_scale", "w2", "w2_scale"]))
        del w[name]
    elif kind == "swizzled":
        options, name = {"scales_swizzled": True}, "scales_swizzled"
    elif kind == "nan_code":
        v = w[tensor].copy()
        v.reshape(-1)[draw(st.integers(0, v.size - 1))] = 255
        w[tensor], name = v, tensor
    elif kind == "w4a4":
        options, name = {"weight_format": "mxfp4"}, "act_quant"
        problem = MX_PROBLEM.with_weight_format("nvfp4").with_act_quant(draw(st.sampled_from(
            ["w4a4_scalar", "w4a4_per_expert"])))
    elif kind == "as_nvfp4":
        options, name = {"weight_format": "nvfp4"}, None  # MXFP4 tensors read as NVFP4
    elif kind == "bad_format":
        options, name = {"weight_format": draw(st.sampled_from(["MXFP4", "mxfp8", "", 4]))}, "weight_format"
    elif kind == "bias_shape":
        w["w2_bias"], name = np.zeros((MX_PROBLEM.num_experts, 3), np.float32), "w2_bias"
    elif kind == "scale_strided":
        v = w[tensor]
        wide = np.zeros(v.shape[:-1] + (2 * v.shape[-1],), np.uint8)
        wide[..., ::2] = v
        w[tensor], name = wide[..., ::2], tensor
    return w, options, problem, name


@EXAMPLES
@given(data=st.data())
def test_cpu_mxfp4_weight_errors(mx_cpu_case, data):
    """MoeLayer on MXFP4 weights with one wrong argument: an fp4moe.Error naming it (the MXFP4 shapes in
    the shape messages), or, for the valid forms, the layer's right output."""
    kind = data.draw(st.sampled_from(MX_WEIGHT_KINDS))
    weights, options, problem, name = _mx_weights_call(mx_cpu_case, kind, data.draw)
    case = mx_cpu_case
    try:
        layer = fp4moe.MoeLayer(problem, weights, device="cpu", max_tokens=MAX_TOKENS, **options)
        out, ids, _ = layer(case.hidden, case.logits)
    except fp4moe.Error as e:
        assert kind not in ("none", "as_nvfp4_problem"), f"{kind}: {e}"
        message = str(e)
        if name is not None:
            assert name in message, (kind, message)
        if kind in ("nvfp4_scale_shape", "scale_rank"):
            assert ("H/32" if name == "w13_scale" else "I/32") in message, message
        if kind == "nan_code":
            assert "255" in message, message
        return
    assert kind in ("none", "as_nvfp4_problem"), f"{kind}: no fp4moe.Error"
    assert layer.problem.weight_format == "mxfp4"
    np.testing.assert_array_equal(ids, case.ids)
    np.testing.assert_array_equal(out, case.out)


# ---- the cuda layer (gpu) ---------------------------------------------------------------------------
def _torch_fw():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not fp4moe.cuda_device_available()[0]:
        pytest.skip(f"no sm_90 GPU for fp4moe: {fp4moe.cuda_device_available()[1]}")
    return Torch()


@pytest.fixture(scope="module")
def gpu_case():
    return Case(_torch_fw(), PROBLEM)


@pytest.mark.gpu
@EXAMPLES
@given(data=st.data())
def test_cuda_layer_call(gpu_case, data):
    layer_call(gpu_case.fw, gpu_case, data.draw)
    gpu_case.good_call_is_right()


@pytest.mark.gpu
@EXAMPLES
@given(data=st.data())
def test_cuda_layer_forward_into(gpu_case, data):
    layer_forward_into(gpu_case.fw, gpu_case, data.draw)
    gpu_case.good_call_is_right()


@pytest.mark.gpu
@EXAMPLES
@given(data=st.data())
def test_cuda_router(gpu_case, data):
    router_call(gpu_case.fw, gpu_case, data.draw)
    gpu_case.good_call_is_right()


@pytest.mark.gpu
@EXAMPLES
@given(data=st.data())
def test_cuda_fused_moe_and_streams(gpu_case, data):
    """FusedMoE (the torch ops) with wrong arguments, and streams: a non-stream object, a negative handle,
    and (with two GPUs) a stream of another device."""
    from fp4moe.torch_ops import FusedMoE
    torch = gpu_case.fw.torch
    if not hasattr(gpu_case, "fused"):
        gpu_case.fused = FusedMoE(PROBLEM, gpu_case.weights, device="cuda:0", max_tokens=MAX_TOKENS)
    fw = gpu_case.fw
    names = {"hidden_states": gpu_case.hidden, "router_logits": gpu_case.logits, "routing_bias": gpu_case.bias}

    def call(hidden_states, router_logits=None, routing_bias=None):
        return gpu_case.fused(hidden_states, router_logits, routing_bias, return_routing=True)
    result, _ = _run(fw, gpu_case, call, names, data.draw)
    if result != "raised":
        assert fw.equal(result[1], gpu_case.ids)
    stream = data.draw(st.sampled_from(["object", "negative", "other_device", "side"]))
    x, logits = fw.asarray(gpu_case.hidden), fw.asarray(gpu_case.logits)
    if stream == "side":
        side = torch.cuda.Stream(device="cuda:0")
        side.wait_stream(torch.cuda.current_stream())
        _, ids, _ = gpu_case.layer(x, logits, stream=side)
        side.synchronize()
        assert fw.equal(ids, gpu_case.ids)
    else:
        if stream == "other_device" and torch.cuda.device_count() < 2:
            stream = "object"
        bad = {"object": object(), "negative": -1}.get(stream)
        if stream == "other_device":
            bad = torch.cuda.Stream(device="cuda:1")
        with pytest.raises(fp4moe.Error, match="stream"):
            gpu_case.layer(x, logits, stream=bad)
    gpu_case.good_call_is_right()


@pytest.fixture(scope="module")
def mx_gpu_case():
    return Case(_torch_fw(), MX_PROBLEM, seed=5)


@pytest.mark.gpu
@EXAMPLES
@given(data=st.data())
def test_cuda_mxfp4_layer_call(mx_gpu_case, data):
    layer_call(mx_gpu_case.fw, mx_gpu_case, data.draw)
    mx_gpu_case.good_call_is_right()


@pytest.mark.gpu
def test_cuda_zero_tokens_and_wrong_devices(gpu_case):
    fw = gpu_case.fw
    zero_tokens(fw, gpu_case)
    x, logits = fw.asarray(gpu_case.hidden), fw.asarray(gpu_case.logits)
    with pytest.raises(fp4moe.Error, match="hidden_states: expected a tensor on cuda:0 .*got cpu"):
        gpu_case.layer(x.cpu(), logits)
    with pytest.raises(fp4moe.Error, match="workspace: expected a tensor on cuda:0"):
        gpu_case.layer(x, logits, workspace=fw.torch.zeros(gpu_case.layer.workspace_size(), dtype=fw.torch.uint8))
    if fw.torch.cuda.device_count() > 1:
        with pytest.raises(fp4moe.Error, match="expected a tensor on cuda:0 .*got cuda:1"):
            gpu_case.layer(x.to("cuda:1"), logits.to("cuda:1"))
    gpu_case.good_call_is_right()
