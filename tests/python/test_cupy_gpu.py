"""The cuda layer with CuPy arrays (ctest label gpu): outputs allocated by CuPy (bf16 as uint16 bits),
the launch on CuPy's current stream, results against the CPU reference layer."""

import pytest

import fp4moe

cupy = pytest.importorskip("cupy")
np = pytest.importorskip("numpy")
pytestmark = pytest.mark.gpu

if not fp4moe.cuda_device_available()[0]:
    pytest.skip(f"no sm_90 GPU for fp4moe: {fp4moe.cuda_device_available()[1]}", allow_module_level=True)

from tolerance import bf16_bits_to_float, expect_layer_close  # noqa: E402


@pytest.mark.parametrize("act_quant", ["w4a16", "w4a4_scalar"])
def test_cupy_arrays_on_a_side_stream(act_quant):
    problem = fp4moe.preset("tiny", act_quant=act_quant)
    case = fp4moe.random_case(problem, 40, seed=12)
    ref_out, ref_ids, ref_weights = fp4moe.MoeLayer(problem, case["weights"], device="cpu", max_tokens=64)(
        case["hidden_states"], case["router_logits"])
    gpu = fp4moe.MoeLayer(problem, case["weights"], device="cuda:0", max_tokens=64)
    x, logits = cupy.asarray(case["hidden_states"]), cupy.asarray(case["router_logits"])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, ids, weights = gpu(x, logits)
    stream.synchronize()
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.uint16 and out.shape == (40, problem.hidden)
    np.testing.assert_array_equal(cupy.asnumpy(ids), ref_ids)
    np.testing.assert_allclose(cupy.asnumpy(weights), ref_weights, rtol=1e-6)
    expect_layer_close(bf16_bits_to_float(cupy.asnumpy(out)), bf16_bits_to_float(ref_out), act_quant)
