"""The Python module on the CPU (NumPy arrays, the reference backend): problems and presets, the layer
against an independent NumPy model of it (docs/numerics.md, "The layer, step by step"), the input
layouts, and the error messages at the API boundary."""

import pytest

import fp4moe

np = pytest.importorskip("numpy")

from tolerance import bf16_bits_to_float, expect_layer_close  # noqa: E402  (needs NumPy)

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def e4m3_to_float(codes):
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exponent, mantissa = (c >> 3) & 0xF, c & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7))
    return np.where((c & 0x7F) == 0x7F, np.nan, sign * value)


def bf16_round(x):
    """fp64 -> fp32 -> bf16 (round to nearest even) -> fp64."""
    u = x.astype(np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.view(np.float32).astype(np.float64)


def dequantize(packed, scales, scale_2):
    """[E, rows, cols/2] e2m1 pairs and [E, rows, cols/16] e4m3 -> [E, rows, cols] values."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return E2M1[codes] * np.repeat(e4m3_to_float(scales), 16, axis=-1) * scale_2[:, None, None]


def numpy_moe_w4a16(problem, case):
    """Renormalize routing, SwiGLU, w4a16 (docs/numerics.md, "The layer, step by step") in fp64 with the
    contract's bf16 roundings."""
    assert problem.routing_method == "renormalize" and problem.activation == "swiglu"
    w = case["weights"]
    w13 = dequantize(w["w13"], w["w13_scale"], w["w13_scale_2"])
    w2 = dequantize(w["w2"], w["w2_scale"], w["w2_scale_2"])
    x = bf16_bits_to_float(case["hidden_states"])
    logits = case["router_logits"].astype(np.float64)
    k, inter = problem.top_k, problem.inter
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # ties: lower id first
    top = np.take_along_axis(logits, ids, axis=1)
    weights = np.exp(top - top.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    b13 = w.get("w13_bias", np.zeros(w13.shape[:2]))  # optional expert biases
    b2 = w.get("w2_bias", np.zeros(w2.shape[:2]))
    out = np.zeros((x.shape[0], problem.hidden))
    for t in range(x.shape[0]):
        for j in range(k):
            e = ids[t, j]
            h = w13[e] @ x[t] + b13[e]
            gate, up = h[:inter], h[inter:]
            act = bf16_round(gate / (1 + np.exp(-gate)) * up)
            out[t] += weights[t, j] * (w2[e] @ act + b2[e])
    return bf16_round(out), ids.astype(np.int32), weights


def test_presets_and_problem():
    assert "deepseek-r1" in fp4moe.preset_names() and "tiny" in fp4moe.preset_names()
    p = fp4moe.preset("deepseek-r1", act_quant="w4a4_scalar")
    assert (p.num_experts, p.hidden, p.inter, p.top_k) == (256, 7168, 2048, 8)
    assert p.routing_method == "deepseek_v3" and p.act_quant == "w4a4_scalar" and p.n_group == 8
    assert p.with_act_quant("w4a16").act_quant == "w4a16"
    q = fp4moe.Problem(num_experts=16, hidden=256, inter=128, top_k=4, routing_method="sigmoid_renorm",
                       activation="relu2")
    assert q.w13_rows == 128 and "sigmoid_renorm" in repr(q)
    with pytest.raises(fp4moe.Error, match="routing_method"):
        fp4moe.Problem(num_experts=16, hidden=256, inter=128, top_k=4, routing_method="softmax")
    with pytest.raises(fp4moe.Error, match="16"):
        fp4moe.Problem(num_experts=16, hidden=100, inter=128, top_k=4)
    with pytest.raises(fp4moe.Error, match="tiny"):
        fp4moe.preset("no-such-model")


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_cpu_layer_matches_numpy_model(tokens):
    problem = fp4moe.preset("tiny")
    case = fp4moe.random_case(problem, tokens, seed=100 + tokens)
    layer = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=64)
    assert layer.device == "cpu" and layer.max_tokens == 64 and "E=8 H=256 I=128" in repr(layer)
    output, ids, weights = layer(case["hidden_states"], case["router_logits"])
    assert output.dtype == np.uint16 and output.shape == (tokens, problem.hidden)
    ref_out, ref_ids, ref_weights = numpy_moe_w4a16(problem, case)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-6)
    # The library's summation order against fp64 here: the tolerance of the GPU layer tests.
    expect_layer_close(bf16_bits_to_float(output), ref_out, f"T={tokens}")


@pytest.mark.parametrize("tokens", [1, 6])
def test_cpu_layer_with_expert_biases_matches_numpy(tokens):
    problem = fp4moe.preset("tiny")
    case = fp4moe.random_case(problem, tokens, seed=200 + tokens, expert_biases=True)
    w = case["weights"]
    assert w["w13_bias"].shape == (problem.num_experts, problem.w13_rows) and w["w2_bias"].dtype == np.float32
    output, _, _ = fp4moe.MoeLayer(problem, w, device="cpu", max_tokens=8)(case["hidden_states"], case["router_logits"])
    ref_out, _, _ = numpy_moe_w4a16(problem, case)
    expect_layer_close(bf16_bits_to_float(output), ref_out, f"biases T={tokens}")
    plain, _, _ = numpy_moe_w4a16(problem, {**case, "weights": {n: v for n, v in w.items() if "bias" not in n}})
    assert np.abs(ref_out - plain).max() > 0.01  # the biases matter here
    with pytest.raises(fp4moe.Error, match=r"w2_bias: expected shape \[E, H\]"):
        fp4moe.MoeLayer(problem, {**w, "w2_bias": w["w2_bias"][:, :16]}, device="cpu", max_tokens=8)
    with pytest.raises(fp4moe.Error, match=r"weights.w13_bias\[0, 1\] is not finite"):
        bad = w["w13_bias"].copy()
        bad[0, 1] = np.inf
        fp4moe.MoeLayer(problem, {**w, "w13_bias": bad}, device="cpu", max_tokens=8)


def test_forward_forms_agree():
    problem = fp4moe.preset("tiny", act_quant="w4a4_scalar")
    case = fp4moe.random_case(problem, 9, seed=7)
    layer = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=16)
    out, ids, weights = layer(case["hidden_states"], case["router_logits"])
    # forward_into writes every element of poisoned outputs.
    poisoned = [np.full_like(out, 0xFFFF), np.full_like(ids, -1), np.full_like(weights, np.nan)]
    layer.forward_into(case["hidden_states"], case["router_logits"], output=poisoned[0], topk_ids=poisoned[1],
                       topk_weights=poisoned[2])
    np.testing.assert_array_equal(poisoned[0], out)
    np.testing.assert_array_equal(poisoned[1], ids)
    np.testing.assert_array_equal(poisoned[2], weights)
    # bf16 logits (as bits) of the same values route the same way.
    logits = case["router_logits"]
    logits_bf16 = (bf16_round(logits.astype(np.float64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    out_bf16, ids_bf16, _ = layer(case["hidden_states"], logits_bf16)
    out_rounded, ids_rounded, _ = layer(case["hidden_states"], bf16_bits_to_float(logits_bf16).astype(np.float32))
    np.testing.assert_array_equal(out_bf16, out_rounded)
    np.testing.assert_array_equal(ids_bf16, ids_rounded)
    # Precomputed routing with the ids and weights the router gave: the same output.
    routed = fp4moe.MoeLayer(problem.with_routing_method("precomputed"), case["weights"], device="cpu", max_tokens=16)
    out_routed, _, _ = routed(case["hidden_states"], topk_ids=ids, topk_weights=weights)
    np.testing.assert_array_equal(out_routed, out)
    # T = 0 is valid.
    empty, empty_ids, _ = layer(case["hidden_states"][:0], logits[:0])
    assert empty.shape == (0, problem.hidden) and empty_ids.shape == (0, problem.top_k)


def swizzle_scales(linear):
    """[E, rows, cols] e4m3 -> the 128x4-swizzled bytes (fp4moe/format.hpp), written out independently."""
    batches, rows, cols = linear.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    out = np.zeros(batches * row_tiles * col_tiles * 512, dtype=np.uint8)
    b, m, k = np.meshgrid(np.arange(batches), np.arange(rows), np.arange(cols), indexing="ij")
    offset = (b * row_tiles * col_tiles * 512 + (m // 128) * col_tiles * 512 + (k // 4) * 512 + (m % 32) * 16
              + ((m % 128) // 32) * 4 + k % 4)
    out[offset.ravel()] = linear.ravel()
    return out


def test_swizzled_scales_and_up_gate_rows_give_the_same_layer():
    problem = fp4moe.preset("tiny")
    case = fp4moe.random_case(problem, 11, seed=8)
    w = case["weights"]
    out, _, _ = fp4moe.MoeLayer(problem, w, device="cpu", max_tokens=16)(case["hidden_states"], case["router_logits"])
    inter = problem.inter
    up_gate = lambda a: np.concatenate([a[:, inter:], a[:, :inter]], axis=1)
    other = dict(w, w13=up_gate(w["w13"]), w13_scale=swizzle_scales(up_gate(w["w13_scale"])),
                 w2_scale=swizzle_scales(w["w2_scale"]))
    layer = fp4moe.MoeLayer(problem, other, device="cpu", max_tokens=16, scales_swizzled=True, w13_up_gate=True)
    out_other, _, _ = layer(case["hidden_states"], case["router_logits"])
    np.testing.assert_array_equal(out_other, out)


def test_errors_name_the_argument():
    problem = fp4moe.preset("tiny", act_quant="w4a4_scalar")
    case = fp4moe.random_case(problem, 4, seed=9)
    w, x, logits = case["weights"], case["hidden_states"], case["router_logits"]
    with pytest.raises(fp4moe.Error, match=r"'w2_input_scale' is missing \(act_quant w4a4_scalar needs it\)"):
        fp4moe.MoeLayer(problem, {k: v for k, v in w.items() if k != "w2_input_scale"}, device="cpu", max_tokens=8)
    with pytest.raises(fp4moe.Error, match="unknown key 'w3'"):
        fp4moe.MoeLayer(problem, dict(w, w3=w["w2"]), device="cpu", max_tokens=8)
    with pytest.raises(fp4moe.Error, match=r"w13: expected shape \[E, w13_rows, H/2\] = \[8, 256, 128\], got \[8, 256, 64\]"):
        fp4moe.MoeLayer(problem, dict(w, w13=w["w13"][:, :, :64].copy()), device="cpu", max_tokens=8)
    with pytest.raises(fp4moe.Error, match="w2_scale_2: expected dtype float32, got float64"):
        fp4moe.MoeLayer(problem, dict(w, w2_scale_2=w["w2_scale_2"].astype(np.float64)), device="cpu", max_tokens=8)
    with pytest.raises(fp4moe.Error, match="'w2' is not an array"):
        fp4moe.MoeLayer(problem, dict(w, w2="weights"), device="cpu", max_tokens=8)
    with pytest.raises(fp4moe.Error, match="device must be"):
        fp4moe.MoeLayer(problem, w, device="tpu", max_tokens=8)

    layer = fp4moe.MoeLayer(problem, w, device="cpu", max_tokens=8)
    with pytest.raises(fp4moe.Error, match="hidden_states: expected dtype bfloat16"):
        layer(x.astype(np.float32), logits)
    with pytest.raises(fp4moe.Error, match="hidden_states: expected a contiguous row-major tensor"):
        layer(np.asfortranarray(x), logits)
    with pytest.raises(fp4moe.Error, match=r"router_logits: expected shape \[T, E\] = \[4, 8\], got \[4, 7\]"):
        layer(x, logits[:, :7].copy())
    with pytest.raises(fp4moe.Error, match="router_logits: expected dtype float32 or bfloat16 .*, got float64"):
        layer(x, logits.astype(np.float64))
    with pytest.raises(fp4moe.Error, match="router_logits is required"):
        layer(x)
    with pytest.raises(fp4moe.Error, match=r"routing_bias: expected shape \[E\] = \[8\], got \[7\]"):
        layer(x, logits, routing_bias=np.zeros(7, np.float32))
    with pytest.raises(fp4moe.Error, match="exceeds the layer's max_tokens = 8"):
        big = fp4moe.random_case(problem, 9, seed=10)
        layer(big["hidden_states"], big["router_logits"])
    with pytest.raises(fp4moe.Error, match="topk_ids / topk_weights are outputs"):
        layer(x, logits, topk_ids=np.zeros((4, 2), np.int32), topk_weights=np.zeros((4, 2), np.float32))


def test_cuda_layer_without_a_gpu_says_why():
    available, why = fp4moe.cuda_device_available()
    if available:
        pytest.skip("a GPU is present: the GPU tests cover the cuda layer")
    assert why
    problem = fp4moe.preset("tiny")
    case = fp4moe.random_case(problem, 1, seed=11)
    with pytest.raises(fp4moe.Error) as error:
        fp4moe.MoeLayer(problem, case["weights"], device="cuda:0", max_tokens=8)
    assert str(error.value)


@pytest.mark.parametrize("family,fmt", [("deepseek_v3", "modelopt"), ("qwen3_moe", "compressed-tensors"),
                                        ("llama4", "modelopt")])
def test_load_checkpoint_layer(tmp_path, family, fmt):
    expected = fp4moe._fp4moe._write_checkpoint_fixture(str(tmp_path), family, fmt)
    for layer, weights in expected.items():
        loaded = fp4moe.load_checkpoint_layer(tmp_path, layer)
        problem = loaded["problem"]
        assert loaded["layer"] == layer and (loaded["expert_begin"], loaded["expert_end"]) == (0, problem.num_experts)
        assert loaded["router_weight"].shape == (loaded["total_experts"], problem.hidden)
        assert ("routing_bias" in loaded) == (family == "deepseek_v3")
        for name, value in weights.items():
            np.testing.assert_array_equal(loaded["weights"][name], np.asarray(value), err_msg=name)
        tokens = 5
        x = fp4moe.random_case(problem, tokens, seed=layer)["hidden_states"]
        logits = (bf16_bits_to_float(x) @ bf16_bits_to_float(loaded["router_weight"]).T).astype(np.float32)
        bias = loaded.get("routing_bias")
        out, ids, _ = fp4moe.MoeLayer(problem, loaded["weights"], device="cpu", max_tokens=8)(x, logits, routing_bias=bias)
        assert out.shape == (tokens, problem.hidden) and ids.shape == (tokens, problem.top_k)
        assert not np.isnan(bf16_bits_to_float(out)).any()
    # Expert parallelism: rank 1 of 2 holds the second half of the experts.
    layer = next(iter(expected))
    half = fp4moe.load_checkpoint_layer(tmp_path, layer, ep_rank=1, ep_size=2)
    total = half["total_experts"]
    assert (half["expert_begin"], half["expert_end"]) == (total // 2, total)
    np.testing.assert_array_equal(half["weights"]["w2"], np.asarray(expected[layer]["w2"])[total // 2:])


@pytest.mark.parametrize("act_quant,size", [("w4a16", 2), ("w4a4_scalar", 3)])
def test_tensor_parallel_shards_sum_to_the_layer(act_quant, size):
    problem = fp4moe.preset("tiny", act_quant=act_quant)
    case = fp4moe.random_case(problem, 13, seed=21)
    w, inter = case["weights"], problem.inter
    full, ids, _ = fp4moe.MoeLayer(problem, w, device="cpu", max_tokens=16)(case["hidden_states"], case["router_logits"])
    total = np.zeros(full.shape)
    blocks = np.array_split(np.arange(inter // 16), size)  # whole 16-column blocks, the first ranks one more
    for rank in range(size):
        begin, end = 16 * blocks[rank][0], 16 * (blocks[rank][-1] + 1)
        shard = fp4moe.tensor_parallel_shard(problem, w, rank, size)
        assert shard["problem"].inter == end - begin and (shard["inter_begin"], shard["inter_end"]) == (begin, end)
        rows = np.r_[begin:end, inter + begin:inter + end]  # gate rows, then up rows
        sw = shard["weights"]
        np.testing.assert_array_equal(sw["w13"], w["w13"][:, rows])
        np.testing.assert_array_equal(sw["w13_scale"], w["w13_scale"][:, rows])
        np.testing.assert_array_equal(sw["w2"], w["w2"][:, :, begin // 2:end // 2])
        np.testing.assert_array_equal(sw["w2_scale"], w["w2_scale"][:, :, begin // 16:end // 16])
        np.testing.assert_array_equal(sw["w2_input_scale"], w["w2_input_scale"])
        out, shard_ids, _ = fp4moe.MoeLayer(shard["problem"], sw, device="cpu", max_tokens=16)(
            case["hidden_states"], case["router_logits"])
        np.testing.assert_array_equal(shard_ids, ids)
        total += bf16_bits_to_float(out)
    ref = bf16_bits_to_float(full)
    assert np.linalg.norm(total - ref) <= 5e-3 * np.linalg.norm(ref)  # each partial is rounded to bf16 once
    with pytest.raises(fp4moe.Error, match="at least tp_size = 9 blocks of 16"):
        fp4moe.tensor_parallel_shard(problem, w, 0, 9)


def test_cpu_layer_needs_no_workspace():
    problem = fp4moe.preset("tiny")
    case = fp4moe.random_case(problem, 3, seed=4)
    layer = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=4)
    assert layer.workspace_size() == 0 and layer.new_workspace() is None
    out, _, _ = layer(case["hidden_states"], case["router_logits"], workspace=layer.new_workspace())
    np.testing.assert_array_equal(out, layer(case["hidden_states"], case["router_logits"])[0])


def bf16_bits(x):
    """float32 values -> bf16 bits, round to nearest even (finite values)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("act_quant", ["w4a16", "w4a4_scalar"])
def test_float32_outputs_are_the_sums_that_bf16_rounds_and_add_up_across_ranks(act_quant):
    problem = fp4moe.preset("tiny", act_quant=act_quant)
    case = fp4moe.random_case(problem, 13, seed=23)
    w = case["weights"]
    layer = fp4moe.MoeLayer(problem, w, device="cpu", max_tokens=16)
    out16, ids, _ = layer(case["hidden_states"], case["router_logits"])
    out32, ids32, _ = layer(case["hidden_states"], case["router_logits"], output_dtype="float32")
    assert out32.dtype == np.float32 and out32.shape == out16.shape
    np.testing.assert_array_equal(ids32, ids)
    np.testing.assert_array_equal(bf16_bits(out32), out16)
    # Tensor-parallel ranks' fp32 partials, added in fp32 and rounded once: the layer's output up to fp32
    # summation order, so at most one bf16 ulp apart, on few elements.
    total = np.zeros(out32.shape, dtype=np.float32)
    for rank in range(2):
        shard = fp4moe.tensor_parallel_shard(problem, w, rank, 2)
        part, _, _ = fp4moe.MoeLayer(shard["problem"], shard["weights"], device="cpu", max_tokens=16)(
            case["hidden_states"], case["router_logits"], output_dtype="float32")
        total += part
    got, want = bf16_bits_to_float(bf16_bits(total)), bf16_bits_to_float(out16)
    moved = got != want
    assert moved.sum() <= out16.size // 100
    assert (np.abs(got - want)[moved] <= np.ldexp(1.0, np.frexp(want[moved])[1] - 8)).all()
    with pytest.raises(fp4moe.Error, match="output_dtype must be 'bfloat16' or 'float32', got 'float16'"):
        layer(case["hidden_states"], case["router_logits"], output_dtype="float16")


def test_load_checkpoint_layer_tensor_parallel(tmp_path):
    fp4moe._fp4moe._write_checkpoint_fixture(str(tmp_path), "qwen3_moe", "modelopt")
    full = fp4moe.load_checkpoint_layer(tmp_path, 1)
    for rank in range(2):
        got = fp4moe.load_checkpoint_layer(tmp_path, 1, tp_rank=rank, tp_size=2)
        want = fp4moe.tensor_parallel_shard(full["problem"], full["weights"], rank, 2)
        assert got["total_inter"] == full["problem"].inter and got["inter_begin"] == want["inter_begin"]
        for name in want["weights"]:
            np.testing.assert_array_equal(got["weights"][name], want["weights"][name], err_msg=name)


def test_load_checkpoint_layer_errors_name_the_path(tmp_path):
    with pytest.raises(fp4moe.Error, match=str(tmp_path / "missing")):
        fp4moe.load_checkpoint_layer(tmp_path / "missing", 0)


@pytest.mark.parametrize("act_quant", ["w4a16", "w4a4_scalar"])
def test_expert_parallel_ranks_sum_to_the_layer(act_quant):
    problem = fp4moe.preset("tiny", act_quant=act_quant)  # E = 8, k = 2
    case = fp4moe.random_case(problem, 29, seed=31)
    w = case["weights"]
    full, ids, weights = fp4moe.MoeLayer(problem, w, device="cpu", max_tokens=32)(
        case["hidden_states"], case["router_logits"])
    total = np.zeros(full.shape)
    for begin, end in [(0, 3), (3, 6), (6, 8)]:
        local = {name: value[begin:end] for name, value in w.items()}
        local["w13_input_scale_max"] = float(w["w13_input_scale"].max())  # the whole layer's
        rank_problem = problem.expert_parallel_rank(end - begin)
        assert rank_problem.total_experts == problem.num_experts and rank_problem.skip_foreign_ids
        rank = fp4moe.MoeLayer(rank_problem, local, device="cpu", max_tokens=32)
        local_ids = np.where((ids >= begin) & (ids < end), ids - begin, -1).astype(np.int32)
        out, _, _ = rank(case["hidden_states"], topk_ids=local_ids, topk_weights=weights)
        total += bf16_bits_to_float(out)
    ref = bf16_bits_to_float(full)
    assert np.linalg.norm(total - ref) <= 5e-3 * np.linalg.norm(ref)
    with pytest.raises(fp4moe.Error, match="skip_foreign_ids needs routing method precomputed"):
        fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=2, skip_foreign_ids=True)


def test_load_checkpoint_layer_expert_parallel(tmp_path):
    fp4moe._fp4moe._write_checkpoint_fixture(str(tmp_path), "deepseek_v3", "modelopt")
    full = fp4moe.load_checkpoint_layer(tmp_path, 1)
    rank = fp4moe.load_checkpoint_layer(tmp_path, 1, ep_rank=1, ep_size=2)
    assert rank["problem"].routing_method == "precomputed" and rank["problem"].skip_foreign_ids
    assert rank["layer_problem"].num_experts == full["problem"].num_experts
    assert rank["layer_problem"].routing_method == "deepseek_v3"
    assert rank["weights"]["w13_input_scale_max"] == full["weights"]["w13_input_scale_max"] > 0


def test_router_gives_the_layers_routing():
    problem = fp4moe.Problem(num_experts=32, hidden=256, inter=128, top_k=4, routing_method="deepseek_v3", n_group=4,
                             topk_group=2, routed_scaling_factor=2.5)
    case = fp4moe.random_case(problem, 21, seed=41)
    _, ids, weights = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=32)(
        case["hidden_states"], case["router_logits"], routing_bias=case["routing_bias"])
    router = fp4moe.Router(problem, device="cpu")
    got_ids, got_weights = router(case["router_logits"], case["routing_bias"])
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_weights, weights)
    with pytest.raises(fp4moe.Error, match="nothing to route"):
        fp4moe.Router(problem.with_routing_method("precomputed"), device="cpu")
    with pytest.raises(fp4moe.Error, match=r"router_logits: expected shape \[T, E\] = \[21, 32\], got \[21, 8\]"):
        router(case["router_logits"][:, :8].copy())


def test_package_has_type_stubs():
    from pathlib import Path
    package = Path(fp4moe.__file__).parent
    assert (package / "py.typed").exists()
    stub = (package / "_fp4moe.pyi").read_text()
    assert "class MoeLayer" not in stub and "class Layer" in stub and "def preset(" in stub


# ---- MXFP4 weights (gpt-oss; docs/numerics.md, "MXFP4 weights") ------------------------------------
MX_PROBLEM = fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=2, activation="swiglu_oai",
                            weight_format="mxfp4")


def dequantize_mxfp4(packed, codes):
    """[E, rows, cols/2] e2m1 pairs and [E, rows, cols/32] ue8m0 codes -> [E, rows, cols] values q * 2^(c-127)."""
    values = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return E2M1[values] * np.repeat(np.ldexp(1.0, codes.astype(np.int64) - 127), 32, axis=-1)


def numpy_moe_mxfp4(problem, case, alpha=1.702, beta=1.0, limit=7.0):
    """Renormalize routing, w4a16 with MXFP4 weights (no global scale), the expert biases and the
    activation (swiglu, or swiglu_oai: gate clamped above at limit, up to [-limit, limit],
    gate * sigmoid(alpha * gate) * (up + beta)), in fp64 with the contract's bf16 roundings."""
    assert problem.routing_method == "renormalize" and problem.weight_format == "mxfp4"
    w = case["weights"]
    w13 = dequantize_mxfp4(w["w13"], w["w13_scale"])
    w2 = dequantize_mxfp4(w["w2"], w["w2_scale"])
    x = bf16_bits_to_float(case["hidden_states"])
    logits = case["router_logits"].astype(np.float64)
    k, inter = problem.top_k, problem.inter
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, ids, axis=1)
    weights = np.exp(top - top.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    b13 = w.get("w13_bias", np.zeros(w13.shape[:2]))
    b2 = w.get("w2_bias", np.zeros(w2.shape[:2]))
    out = np.zeros((x.shape[0], problem.hidden))
    for t in range(x.shape[0]):
        for j in range(k):
            e = ids[t, j]
            h = w13[e] @ x[t] + b13[e]
            gate, up = h[:inter], h[inter:]
            if problem.activation == "swiglu_oai":
                gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
                act = gate / (1 + np.exp(-alpha * gate)) * (up + beta)
            else:
                act = gate / (1 + np.exp(-gate)) * up
            out[t] += weights[t, j] * (w2[e] @ bf16_round(act) + b2[e])
    return bf16_round(out), ids.astype(np.int32), weights


def test_mxfp4_problems_and_presets():
    assert MX_PROBLEM.weight_format == "mxfp4" and MX_PROBLEM.weight_block == 32
    assert fp4moe.preset("tiny").weight_format == "nvfp4" and fp4moe.preset("tiny").weight_block == 16
    assert "weights=mxfp4" in repr(MX_PROBLEM)
    for name, experts in (("gpt-oss-120b", 128), ("gpt-oss-20b", 32)):
        p = fp4moe.preset(name)
        assert p.weight_format == "mxfp4" == fp4moe.preset_weight_format(name)
        assert (p.num_experts, p.hidden, p.inter, p.top_k, p.activation) == (experts, 2880, 2880, 4, "swiglu_oai")
        with pytest.raises(fp4moe.Error, match="mxfp4 weights, which run in mode w4a16 only"):
            fp4moe.preset(name, act_quant="w4a4_scalar")
    assert fp4moe.preset_weight_format("gpt-oss-120b-nvfp4") == "nvfp4"
    nv = fp4moe.preset("tiny")
    assert nv.with_weight_format("mxfp4").weight_format == "mxfp4"
    assert MX_PROBLEM.with_weight_format("nvfp4").weight_format == "nvfp4"
    for mode in ("w4a4_scalar", "w4a4_per_expert"):
        with pytest.raises(fp4moe.Error, match="act_quant must be w4a16 with mxfp4 weights"):
            fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=2, weight_format="mxfp4", act_quant=mode)
        with pytest.raises(fp4moe.Error, match="act_quant must be w4a16 with mxfp4 weights"):
            MX_PROBLEM.with_act_quant(mode)
        with pytest.raises(fp4moe.Error, match="act_quant must be w4a16 with mxfp4 weights"):
            fp4moe.preset("tiny", act_quant=mode).with_weight_format("mxfp4")
    with pytest.raises(fp4moe.Error, match="hidden .* multiple of 32 with mxfp4"):
        fp4moe.Problem(num_experts=8, hidden=272, inter=128, top_k=2, weight_format="mxfp4")
    with pytest.raises(fp4moe.Error, match="weight_format"):
        fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=2, weight_format="mxfp8")


def test_random_mxfp4_case_has_the_mxfp4_tensors():
    case = fp4moe.random_case(MX_PROBLEM, 2, seed=3, expert_biases=True)
    w = case["weights"]
    assert sorted(w) == ["w13", "w13_bias", "w13_scale", "w2", "w2_bias", "w2_scale"]
    E, H, I, N13 = MX_PROBLEM.num_experts, MX_PROBLEM.hidden, MX_PROBLEM.inter, MX_PROBLEM.w13_rows
    assert w["w13"].shape == (E, N13, H // 2) and w["w2"].shape == (E, H, I // 2)
    assert w["w13_scale"].shape == (E, N13, H // 32) and w["w2_scale"].shape == (E, H, I // 32)
    assert w["w13_scale"].dtype == np.uint8 and (w["w13_scale"] != 255).all()
    # weight_format= on an NVFP4 problem draws the MXFP4 tensors too.
    other = fp4moe.random_case(fp4moe.preset("tiny"), 2, seed=3, weight_format="mxfp4")["weights"]
    assert other["w2_scale"].shape == (8, 256, 128 // 32) and "w2_scale_2" not in other


@pytest.mark.parametrize("activation", ["swiglu_oai", "swiglu"])
@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_cpu_mxfp4_layer_matches_numpy_dequantize_then_compute(activation, tokens):
    problem = fp4moe.Problem(num_experts=8, hidden=256, inter=128, top_k=2, activation=activation,
                             weight_format="mxfp4")
    case = fp4moe.random_case(problem, tokens, seed=300 + tokens, expert_biases=True)
    layer = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=32)
    assert layer.problem.weight_format == "mxfp4"
    output, ids, weights = layer(case["hidden_states"], case["router_logits"])
    ref_out, ref_ids, ref_weights = numpy_moe_mxfp4(problem, case)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-6)
    expect_layer_close(bf16_bits_to_float(output), ref_out, f"mxfp4 {activation} T={tokens}")


def test_weight_format_argument_sets_the_layers_format():
    case = fp4moe.random_case(MX_PROBLEM, 6, seed=12, expert_biases=True)
    want, _, _ = fp4moe.MoeLayer(MX_PROBLEM, case["weights"], device="cpu", max_tokens=8)(
        case["hidden_states"], case["router_logits"])
    nv = MX_PROBLEM.with_weight_format("nvfp4")
    layer = fp4moe.MoeLayer(nv, case["weights"], device="cpu", max_tokens=8, weight_format="mxfp4")
    assert layer.problem.weight_format == "mxfp4"
    got, _, _ = layer(case["hidden_states"], case["router_logits"])
    np.testing.assert_array_equal(got, want)
    # MXFP4 tensors read as NVFP4: the scales' shape says so.
    with pytest.raises(fp4moe.Error, match=r"w13_scale: expected shape \[E, w13_rows, H/16\]"):
        fp4moe.MoeLayer(MX_PROBLEM, case["weights"], device="cpu", max_tokens=8, weight_format="nvfp4")
    with pytest.raises(fp4moe.Error, match="weight_format must be one of nvfp4, mxfp4"):
        fp4moe.MoeLayer(MX_PROBLEM, case["weights"], device="cpu", max_tokens=8, weight_format="MXFP4")
    with pytest.raises(fp4moe.Error, match="weight_format mxfp4: .*act_quant must be w4a16"):
        fp4moe.MoeLayer(fp4moe.preset("tiny", act_quant="w4a4_scalar"), case["weights"], device="cpu", max_tokens=8,
                        weight_format="mxfp4")


def test_mxfp4_errors_name_the_argument_and_the_mxfp4_shape():
    case = fp4moe.random_case(MX_PROBLEM, 4, seed=13)
    w = case["weights"]
    nv = fp4moe.random_case(fp4moe.preset("tiny"), 4, seed=13)["weights"]

    def layer(weights, **options):
        return fp4moe.MoeLayer(MX_PROBLEM, weights, device="cpu", max_tokens=8, **options)
    with pytest.raises(fp4moe.Error, match=r"w13_scale: expected shape \[E, w13_rows, H/32\] = \[8, 256, 8\], "
                                           r"got \[8, 256, 16\]"):
        layer(dict(w, w13_scale=nv["w13_scale"]))  # NVFP4's [E, w13_rows, H/16]
    with pytest.raises(fp4moe.Error, match=r"w2_scale: expected shape \[E, H, I/32\] = \[8, 256, 4\], got \[8, 256\]"):
        layer(dict(w, w2_scale=w["w2_scale"][:, :, 0].copy()))
    with pytest.raises(fp4moe.Error, match=r"w2_scale: expected dtype uint8 \(ue8m0 codes"):
        layer(dict(w, w2_scale=w["w2_scale"].astype(np.int8)))
    for extra in ("w13_scale_2", "w2_scale_2", "w13_input_scale", "w2_input_scale"):
        with pytest.raises(fp4moe.Error, match=f"'{extra}' must be absent with weight_format mxfp4"):
            layer(dict(w, **{extra: nv[extra]}))
    with pytest.raises(fp4moe.Error, match="'w13_input_scale_max' must be absent with weight_format mxfp4"):
        layer(dict(w, w13_input_scale_max=1.0))
    with pytest.raises(fp4moe.Error, match="scales_swizzled is for NVFP4 e4m3 scales"):
        layer(w, scales_swizzled=True)
    with pytest.raises(fp4moe.Error, match="'w2_scale' is missing"):
        layer({n: v for n, v in w.items() if n != "w2_scale"})
    bad = w["w13_scale"].copy()
    bad[2, 5, 1] = 255
    with pytest.raises(fp4moe.Error, match=r"w13_scale .*: ue8m0 block scale code 255 \(NaN\) at expert 2, row 5, "
                                           r"block 1"):
        layer(dict(w, w13_scale=bad))  # when the layer is built, as on cuda


def test_mxfp4_tensor_parallel_shards_sum_to_the_layer():
    case = fp4moe.random_case(MX_PROBLEM, 11, seed=22, expert_biases=True)
    w, inter = case["weights"], MX_PROBLEM.inter
    full, _, _ = fp4moe.MoeLayer(MX_PROBLEM, w, device="cpu", max_tokens=16)(case["hidden_states"],
                                                                            case["router_logits"])
    total = np.zeros(full.shape)
    for rank in range(2):  # whole 32-column blocks: 64 columns each
        shard = fp4moe.tensor_parallel_shard(MX_PROBLEM, w, rank, 2)
        begin, end = shard["inter_begin"], shard["inter_end"]
        assert (begin, end) == (64 * rank, 64 * (rank + 1)) and shard["problem"].weight_format == "mxfp4"
        sw = shard["weights"]
        assert "w2_scale_2" not in sw
        np.testing.assert_array_equal(sw["w2_scale"], w["w2_scale"][:, :, begin // 32:end // 32])
        out, _, _ = fp4moe.MoeLayer(shard["problem"], sw, device="cpu", max_tokens=16)(
            case["hidden_states"], case["router_logits"])
        total += bf16_bits_to_float(out)
    ref = bf16_bits_to_float(full)
    assert np.linalg.norm(total - ref) <= 5e-3 * np.linalg.norm(ref)
    with pytest.raises(fp4moe.Error, match="32"):
        fp4moe.tensor_parallel_shard(MX_PROBLEM, w, 0, 5)  # I / 32 = 4 blocks


def test_mxfp4_expert_parallel_ranks_sum_to_the_layer():
    case = fp4moe.random_case(MX_PROBLEM, 19, seed=32, expert_biases=True)
    w = case["weights"]
    full, ids, weights = fp4moe.MoeLayer(MX_PROBLEM, w, device="cpu", max_tokens=32)(
        case["hidden_states"], case["router_logits"])
    total = np.zeros(full.shape)
    for begin, end in [(0, 5), (5, 8)]:
        local = {name: value[begin:end] for name, value in w.items()}
        rank = fp4moe.MoeLayer(MX_PROBLEM.expert_parallel_rank(end - begin), local, device="cpu", max_tokens=32)
        local_ids = np.where((ids >= begin) & (ids < end), ids - begin, -1).astype(np.int32)
        out, _, _ = rank(case["hidden_states"], topk_ids=local_ids, topk_weights=weights)
        total += bf16_bits_to_float(out)
    ref = bf16_bits_to_float(full)
    assert np.linalg.norm(total - ref) <= 5e-3 * np.linalg.norm(ref)


def test_load_gpt_oss_checkpoint_layer(tmp_path):
    """A gpt-oss MXFP4 checkpoint (the fixture of io::write_fixture): the layer comes back as MXFP4 with
    its expert biases and router bias, and runs as the cpu layer against the NumPy model."""
    expected = fp4moe._fp4moe._write_checkpoint_fixture(str(tmp_path), "gpt_oss", "mxfp4")
    for layer, weights in expected.items():
        loaded = fp4moe.load_checkpoint_layer(tmp_path, layer)
        problem = loaded["problem"]
        assert loaded["weight_format"] == problem.weight_format == "mxfp4" and problem.act_quant == "w4a16"
        assert problem.activation == "swiglu_oai" and problem.routing_method == "renormalize"
        w = loaded["weights"]
        assert sorted(w) == ["w13", "w13_bias", "w13_scale", "w2", "w2_bias", "w2_scale"]
        assert w["w13_scale"].shape == (problem.num_experts, problem.w13_rows, problem.hidden // 32)
        for name, value in weights.items():
            np.testing.assert_array_equal(w[name], np.asarray(value), err_msg=name)
        assert loaded["router_bias"].shape == (loaded["total_experts"],) and "routing_bias" not in loaded
        x = fp4moe.random_case(problem, 4, seed=layer)["hidden_states"]
        logits = (bf16_bits_to_float(x) @ bf16_bits_to_float(loaded["router_weight"]).T
                  + loaded["router_bias"]).astype(np.float32)
        out, _, _ = fp4moe.MoeLayer(problem, w, device="cpu", max_tokens=8)(x, logits)
        ref, _, _ = numpy_moe_mxfp4(problem, {"weights": w, "hidden_states": x, "router_logits": logits})
        expect_layer_close(bf16_bits_to_float(out), ref, f"gpt-oss layer {layer}")
    layer = next(iter(expected))
    half = fp4moe.load_checkpoint_layer(tmp_path, layer, ep_rank=1, ep_size=2)
    assert half["weight_format"] == "mxfp4" and half["problem"].weight_format == "mxfp4"
    assert half["layer_problem"].weight_format == "mxfp4"
    tp = fp4moe.load_checkpoint_layer(tmp_path, layer, tp_rank=0, tp_size=1)
    np.testing.assert_array_equal(tp["weights"]["w2_scale"], np.asarray(expected[layer]["w2_scale"]))


@pytest.mark.skipif(fp4moe.cuda_device_available()[0], reason="the errors of a machine without a GPU")
def test_expert_parallel_layer_without_a_gpu_is_an_error():
    """The all-to-all layer runs on cuda only: without a GPU (or a CUDA build) every entry point says so."""
    problem = fp4moe.preset("tiny")
    weights = fp4moe.random_case(problem, 0, seed=1)["weights"]
    with pytest.raises(fp4moe.Error):
        fp4moe.virtual_ranks(2)
    with pytest.raises(fp4moe.Error, match="cuda device"):
        fp4moe.virtual_ranks(2, device="cpu")
    with pytest.raises(fp4moe.Error, match="communicator must come from"):
        fp4moe.ExpertParallelLayer(problem, weights, None)
    with pytest.raises(fp4moe.Error, match="unique_id must be the bytes"):
        fp4moe.nccl_communicator("x", 0, 1)
