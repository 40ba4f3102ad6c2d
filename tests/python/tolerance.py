"""The layer tolerance of the GPU tests (docs/numerics.md; the same table as tests/runner/moe_runner_test.cpp).

Two computations of the layer that differ only in fp32 summation order move a bf16 rounding of the
activation (or, in w4a4, an NVFP4 rounding of the re-quantized activation) on rare elements. So: no
NaN where the reference has none, relative L2 error below 5e-3, and at most 0.5% of the elements
beyond one bf16 ulp of the reference plus 1e-3 of their token row's RMS (outputs that nearly cancel).
"""

import numpy as np


def bf16_bits_to_float(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_ulp(x):
    _, exponent = np.frexp(np.maximum(np.abs(x), 1e-30))
    return np.ldexp(1.0, exponent - 8)


def expect_layer_close(got, ref, label):
    """got, ref: [T, H] float arrays (bf16 values)."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{label}: shape {got.shape} != {ref.shape}"
    assert not (np.isnan(got) & ~np.isnan(ref)).any(), f"{label}: NaN where the reference has none"
    if ref.size == 0:
        return
    assert np.linalg.norm(got - ref) <= 5e-3 * np.linalg.norm(ref), f"{label}: relative L2 error"
    floor = 1e-3 * np.sqrt(np.mean(ref**2, axis=1, keepdims=True))
    off = int((np.abs(got - ref) > bf16_ulp(ref) * 1.01 + floor).sum())
    assert off <= int(0.005 * ref.size) + 1, f"{label}: {off} of {ref.size} beyond 1 ulp + 1e-3 row RMS"
