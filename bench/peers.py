#!/usr/bin/env python3
"""fp4moe against its peers: the same MoE presets and token counts through fp4moe and the torch baselines.

Runs on a machine with an sm_90 GPU, torch (CUDA build) and a built `fp4moe` CLI. In one run it

  1. runs `fp4moe bench --json` (CUDA-graph replays, L2 flushed, ceilings measured in the same process)
     for the chosen presets and token counts; fp4moe's correctness is covered there: its bench runs
     one checked forward per shape before timing;
  2. measures the two ceilings in torch (device-to-device copy of a 2 GiB tensor counting bytes read
     + written; bf16 matmul 8192^3) next to fp4moe's own;
  3. times the eager torch MoE baselines the way bench/h200-reference-numbers.md describes: gather the
     tokens by expert, GEMM1 and GEMM2 with `torch._grouped_mm` (bf16) or `torch._scaled_grouped_mm`
     (fp8 e4m3, rowwise scales, activations quantized per row on the fly) with int32 cumulative
     offsets, silu*mul between (the preset's activation), weighted index_add at the end; CUDA events
     around each eager forward, median of --reps after warm-up. Routing (the preset's method,
     implemented in torch) runs once per shape outside the timed region; its time is reported
     separately (torch_route_us). These are the table's torch columns: the same routing as fp4moe.
  3b. with --reference-protocol (default on when --anchors is given), also times the baselines the way
     the reference file words it, literally, for every model: softmax over E of random normal logits,
     top-k of the probabilities WITHOUT renormalization ("softmax top-k"; for top-1 Llama-4 the weight
     is the softmax probability, not 1.0), weight applied after GEMM2 (weighted index_add), silu*mul.
     The routing is INSIDE the timed region with the whole eager layer: the timed call takes (hidden
     states, logits) -- the expert weights are bound -- and returns the output (softmax, top-k, sort,
     offsets, gather, [fp8 row quantization,] GEMM1, silu*mul, GEMM2, weighted index_add). Events,
     each timed call starting on an idle GPU (a synchronize before it: host launch time counts, as in
     an eager serving step; the table's columns in 3 let the host run ahead), median of --reps after
     warm-up, only at the (model, T) of the anchors file (all T without one),
     with the model's weights already allocated for 3. These timings (torch_*_refproto_us) are what
     the anchors section compares with the reference numbers.
  3c. with --triton-kernels PATH (the python/triton_kernels folder of a triton checkout at v3.6.0; never
     vendored here), for the gpt-oss presets, the triton_mxfp4 row: OpenAI's triton_kernels as vLLM runs
     gpt-oss on Hopper -- MXFP4 copies of the same bf16 weights (downcast_to_mxfp, the default Hopper
     layouts), random fp32 biases, bf16 activations; the timed call takes (hidden states, logits) and runs
     topk with the softmax over the k, the ragged metadata, matmul_ogs GEMM1 (gather, bias, fused
     swiglu_oai with alpha 1.702, limit 7) and matmul_ogs GEMM2 (bias, router weight, scatter-sum).
     Events, median of --reps after warm-up, as in 3. Its refcheck uses the fp32 loop on the
     dequantized MXFP4 weights (tolerance 2e-2). Without the option the row is absent and the table
     says why; a PATH that lacks a name the row calls fails with that name and the expected release.
  4. with --refcheck (default), before timing a shape, checks the torch bf16 baseline (tolerance
     2e-2) and the fp8 baseline (tolerance 0.2: fp8 quantization error) against a plain fp32
     per-token loop over a few tokens; a baseline that fails is reported and never counted as the
     best peer.

Writes one JSON (--json) and prints one table: per (model, T) experts hit, floor, fp4moe median/min,
the torch baselines, the best peer and the ratio fp4moe / best peer (< 1: fp4moe is faster); with
--anchors, then the torch baselines against the reference numbers (deviation per row, rows within 20%).
A baseline that raises for a shape is recorded in the row (its error string) and the run goes on.
Exit status 1 when anything failed (fp4moe, a baseline, a refcheck); all outputs are written anyway.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = "deepseek-r1,qwen3-30b-a3b,llama4-scout"
DEFAULT_TOKENS = "1,8,64,256,1024,4096,16384"
FP8_MAX = 448.0

# The presets of format/presets.cpp (docs/architecture.md, "Interfaces"): E, H, I, k, routing, activation.
PRESETS = {
    "deepseek-r1": dict(E=256, H=7168, I=2048, k=8, routing="deepseek_v3", n_group=8, topk_group=4,
                        scale=2.5, weight_on_input=False, act="swiglu"),
    "qwen3-30b-a3b": dict(E=128, H=2048, I=768, k=8, routing="renormalize", act="swiglu"),
    "qwen3-235b-a22b": dict(E=128, H=4096, I=1536, k=8, routing="renormalize", act="swiglu"),
    "llama4-scout": dict(E=16, H=5120, I=8192, k=1, routing="llama4", weight_on_input=True, act="swiglu"),
    # gpt-oss: MXFP4 weights in fp4moe's presets, which run in mode w4a16 only.
    "gpt-oss-120b": dict(E=128, H=2880, I=2880, k=4, routing="renormalize", act="swiglu_oai",
                         alpha=1.702, beta=1.0, limit=7.0, weights="mxfp4"),
    "gpt-oss-20b": dict(E=32, H=2880, I=2880, k=4, routing="renormalize", act="swiglu_oai",
                        alpha=1.702, beta=1.0, limit=7.0, weights="mxfp4"),
    "tiny": dict(E=8, H=256, I=128, k=2, routing="renormalize", act="swiglu"),
}
for _p in PRESETS.values():
    _p.setdefault("n_group", 1)
    _p.setdefault("topk_group", 1)
    _p.setdefault("scale", 1.0)
    _p.setdefault("weight_on_input", False)
    _p.setdefault("weights", "nvfp4")

PEERS = ("torch_bf16", "torch_fp8")
# triton_mxfp4 is checked against the same loop on its own dequantized MXFP4 weights: bf16 rounding only.
REFCHECK_TOL = {"torch_bf16": 2e-2, "torch_fp8": 0.2, "triton_mxfp4": 2e-2}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def median(v):
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def floor_model(p, T, hit, copy_tbps, bf16_tflops):
    """The floor (docs/performance.md, "Method"), computed exactly as runner/bench.cu does."""
    n13 = 2 * p["I"]  # gated activations: w13 = [gate; up]
    params = n13 * p["H"] + p["H"] * p["I"]
    weight_bytes = hit * params * 0.5625
    nbytes = weight_bytes + T * p["H"] * 2 * 2 + T * p["E"] * 4
    flops = 2.0 * T * p["k"] * params
    return max(nbytes / (copy_tbps * 1e12), flops / (bf16_tflops * 1e12)) * 1e6


# ----------------------------------------------------------------------------------------------------
# fp4moe through its CLI
# ----------------------------------------------------------------------------------------------------

def run_fp4moe(args, models, tokens):
    """Runs `fp4moe bench`; returns (result dict or None, error string or None, elapsed seconds)."""
    if args.fp4moe_results:
        try:
            return json.loads(Path(args.fp4moe_results).read_text()), None, 0.0
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            return None, f"--fp4moe-results {args.fp4moe_results}: {e}", 0.0
    binary = Path(args.fp4moe_bin)
    if not binary.is_file() or not os.access(binary, os.X_OK):
        return None, f"fp4moe binary not found or not executable: {binary}", 0.0
    keep_json = args.fp4moe_json
    tmp = None
    if not keep_json:
        fd, tmp = tempfile.mkstemp(prefix="fp4moe-bench-", suffix=".json")
        os.close(fd)
    out_json = keep_json or tmp
    cmd = [str(binary), "bench", "--model", ",".join(models), "--tokens", ",".join(map(str, tokens)),
           "--mode", args.mode, "--reps", str(args.reps), "--json", out_json]
    if args.fp4moe_csv:
        cmd += ["--csv", args.fp4moe_csv]
    log("fp4moe: " + " ".join(cmd))
    t0 = time.time()
    try:
        # stderr (progress) goes straight through; stdout (its table) is echoed to stderr afterwards.
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=args.fp4moe_timeout)
        elapsed = time.time() - t0
        for line in proc.stdout.splitlines():
            log("  | " + line)
        if proc.returncode != 0:
            return None, f"fp4moe bench exited with status {proc.returncode}", elapsed
        return json.loads(Path(out_json).read_text()), None, elapsed
    except subprocess.TimeoutExpired:
        return None, f"fp4moe bench did not finish within {args.fp4moe_timeout} s", time.time() - t0
    except Exception as e:  # noqa: BLE001
        return None, f"fp4moe bench: {type(e).__name__}: {e}", time.time() - t0
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


# ----------------------------------------------------------------------------------------------------
# torch: ceilings, routing, baselines, reference
# ----------------------------------------------------------------------------------------------------

torch = None  # imported by torch_setup(), so that --help and the table code work without torch
F = None


def torch_setup():
    global torch, F  # noqa: PLW0603
    import torch as _torch
    import torch.nn.functional as _F

    torch, F = _torch, _F
    if not torch.cuda.is_available():
        raise RuntimeError("torch reports no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False


def grouped_mm_fn():
    """torch._grouped_mm(mat_a [M,K], mat_b [G,K,N], offs=int32 cumulative [G], out_dtype) -> [M,N]."""
    if hasattr(torch, "_grouped_mm"):
        return lambda a, b, offs: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)
    if hasattr(F, "grouped_mm"):
        return lambda a, b, offs: F.grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)
    raise RuntimeError("this torch has neither torch._grouped_mm nor torch.nn.functional.grouped_mm")


def scaled_grouped_mm_fn(fast_accum):
    """torch._scaled_grouped_mm(a fp8 [M,K] row-major, b fp8 [G,K,N] column-major (a transposed view of
    [G,N,K]), scale_a fp32 [M], scale_b fp32 [G,N], offs int32 cumulative [G]) -> bf16 [M,N]; scales are
    dequantization multipliers."""
    if hasattr(torch, "_scaled_grouped_mm"):
        return lambda a, b, sa, sb, offs: torch._scaled_grouped_mm(
            a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    if hasattr(F, "scaled_grouped_mm"):
        st = F.ScalingType.RowWise
        return lambda a, b, sa, sb, offs: F.scaled_grouped_mm(
            a, b, sa, st, sb, st, offs=offs, output_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    raise RuntimeError("this torch has neither torch._scaled_grouped_mm nor torch.nn.functional.scaled_grouped_mm")


def time_cuda(fn, reps, warmup_max=3, warmup_s=0.05, sync_each=False):
    """CUDA events around each call; warm-up until warmup_max calls or warmup_s seconds (>= 1 call).
    sync_each: the GPU is idle when each timed call starts (synchronize before its start event), so
    host launch time the GPU waits for counts, as in a serving step; otherwise the host runs ahead and
    the calls queue back to back (GPU time only). Returns (median_us, min_us, all_us)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(warmup_max):
        fn()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 > warmup_s:
            break
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if sync_each:
            torch.cuda.synchronize()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    us = [1e3 * s.elapsed_time(e) for s, e in zip(starts, ends)]
    if not all(v > 0 and math.isfinite(v) for v in us):
        raise RuntimeError(f"a timed call measured a non-positive or non-finite time: {us}")
    return median(us), min(us), us


def torch_ceilings(reps=10):
    c = {"gpu": torch.cuda.get_device_name(), "sm_count": torch.cuda.get_device_properties(0).multi_processor_count}
    nbytes = 2 << 30
    a = torch.full((nbytes,), 1, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    med, _, _ = time_cuda(lambda: b.copy_(a), reps)
    c["copy_tbps"] = 2.0 * nbytes / (med * 1e-6) / 1e12
    a = b = None  # free before the GEMM test
    n = 8192
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    z = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    med, _, _ = time_cuda(lambda: torch.mm(x, y, out=z), reps)
    c["bf16_tflops"] = 2.0 * n ** 3 / (med * 1e-6) / 1e12
    try:  # informational: fp8 e4m3 dense GEMM (per-tensor scales, fast accumulation)
        xf = x.to(torch.float8_e4m3fn)
        yf = y.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major B
        one = torch.ones((), device="cuda", dtype=torch.float32)
        med, _, _ = time_cuda(lambda: torch._scaled_mm(xf, yf, one, one, out_dtype=torch.bfloat16,
                                                        use_fast_accum=True), reps)
        c["fp8_tflops"] = 2.0 * n ** 3 / (med * 1e-6) / 1e12
        xf = yf = None
    except Exception as e:  # noqa: BLE001
        c["fp8_tflops"] = None
        c["fp8_error"] = f"{type(e).__name__}: {e}"
    x = y = z = None
    torch.cuda.empty_cache()
    return c


def route(p, logits, bias):
    """The preset's routing method (docs/numerics.md, "Routing methods") in torch: -> ids int64 [T,k] (descending score), w fp32 [T,k]."""
    s = logits.float()
    k = p["k"]
    m = p["routing"]
    if m == "renormalize":
        vals, ids = s.topk(k, dim=-1)
        return ids, torch.softmax(vals, dim=-1)
    if m == "llama4":
        vals, ids = s.topk(1, dim=-1)
        return ids, torch.sigmoid(vals)
    if m == "deepseek_v3":
        T, E = s.shape
        sig = torch.sigmoid(s)
        c = sig + (bias.float() if bias is not None else 0.0)
        ng, tg = p["n_group"], p["topk_group"]
        if ng > 1:
            gscore = c.view(T, ng, E // ng).topk(2, dim=-1).values.sum(dim=-1)
            gidx = gscore.topk(tg, dim=-1).indices
            keep = torch.zeros(T, ng, dtype=torch.bool, device=s.device).scatter_(1, gidx, True)
            keep = keep.unsqueeze(-1).expand(T, ng, E // ng).reshape(T, E)
            c = c.masked_fill(~keep, float("-inf"))
        ids = c.topk(k, dim=-1).indices
        w = sig.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * p["scale"]
    raise ValueError(f"routing method {m} is not implemented here")


def act_fn(p):
    """Gated activation on h = [g | u] (bf16 [M, 2I]) -> bf16 [M, I]."""
    I = p["I"]
    if p["act"] == "swiglu":
        return lambda h: F.silu(h[:, :I]) * h[:, I:]
    if p["act"] == "swiglu_oai":
        a, b, L = p["alpha"], p["beta"], p["limit"]

        def oai(h):
            g = h[:, :I].clamp(max=L)
            u = h[:, I:].clamp(min=-L, max=L)
            return g * torch.sigmoid(a * g) * (u + b)
        return oai
    raise ValueError(f"activation {p['act']} is not implemented here")


def act_ref(p, h):
    """The activation in fp32 on one token's h [2I]."""
    I = p["I"]
    g, u = h[:I], h[I:]
    if p["act"] == "swiglu":
        return F.silu(g) * u
    a, b, L = p["alpha"], p["beta"], p["limit"]
    g = g.clamp(max=L)
    u = u.clamp(min=-L, max=L)
    return g * torch.sigmoid(a * g) * (u + b)


def quant_rows_fp8(x):
    """Per-row dynamic e4m3 quantization: -> (fp8 [M,K], fp32 [M] dequantization scales)."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.view(-1)


class Weights:
    """Random bf16 expert weights (nn.Linear layout: w13 [E, 2I, H] = [gate; up], w2 [E, H, I]) and their
    per-output-channel e4m3 copies for the fp8 baseline."""

    def __init__(self, p, seed, want_fp8):
        E, H, I = p["E"], p["H"], p["I"]
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g).mul_(H ** -0.5)
        self.w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g).mul_(I ** -0.5)
        self.w13_t = self.w13.transpose(1, 2)  # [E, H, 2I] column-major view: mat_b of GEMM1
        self.w2_t = self.w2.transpose(1, 2)    # [E, I, H]
        self.fp8_error = None
        self.w13_f8_t = self.w2_f8_t = self.w13_s = self.w2_s = None
        if want_fp8:
            try:
                w13_f8, self.w13_s = self._to_fp8(self.w13)
                w2_f8, self.w2_s = self._to_fp8(self.w2)
                self.w13_f8_t = w13_f8.transpose(1, 2)
                self.w2_f8_t = w2_f8.transpose(1, 2)
            except Exception as e:  # noqa: BLE001
                self.fp8_error = f"fp8 weight preparation: {type(e).__name__}: {e}"

    @staticmethod
    def _to_fp8(w):
        E, N, K = w.shape
        q = torch.empty(E, N, K, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.empty(E, N, device="cuda", dtype=torch.float32)
        for e in range(E):  # one expert at a time: no fp32 copy of the whole tensor
            we = w[e].float()
            se = we.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
            q[e] = (we / se[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            s[e] = se
        return q, s

    def nbytes(self):
        t = [self.w13, self.w2, self.w13_s, self.w2_s, self.w13_f8_t, self.w2_f8_t]
        return sum(x.numel() * x.element_size() for x in t if x is not None)


def make_layer(p, W, kind, mm, smm):
    """One eager MoE forward from (x bf16 [T,H], ids [T,k], w fp32 [T,k]) -> bf16 [T,H]."""
    E, H, k = p["E"], p["H"], p["k"]
    act = act_fn(p)
    experts = torch.arange(E, device="cuda", dtype=torch.int64)
    on_input = p["weight_on_input"]

    def dispatch(ids):
        flat = ids.reshape(-1)
        sorted_ids, order = torch.sort(flat, stable=True)
        offs = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)  # cumulative, no sync
        return order, order // k, offs

    def finish(x, y, token_idx, order, w):
        if not on_input:
            y.mul_(w.reshape(-1)[order].unsqueeze(1))  # bf16 *= fp32 weight: computed in fp32, rounded once
        out = torch.zeros(x.shape[0], H, device="cuda", dtype=torch.bfloat16)
        out.index_add_(0, token_idx, y)
        return out

    def inputs(x, w):
        # Llama-4: the router weight is applied on the input (k = 1): bf16(x * bf16(w)).
        return x * w.to(torch.bfloat16) if on_input else x

    if kind == "torch_bf16":
        def forward(x, ids, w):
            order, token_idx, offs = dispatch(ids)
            xs = inputs(x, w).index_select(0, token_idx)
            h = mm(xs, W.w13_t, offs)
            y = mm(act(h), W.w2_t, offs)
            return finish(x, y, token_idx, order, w)
        return forward

    if kind == "torch_fp8":
        if W.fp8_error:
            raise RuntimeError(W.fp8_error)

        def forward(x, ids, w):
            order, token_idx, offs = dispatch(ids)
            xq, xs = quant_rows_fp8(inputs(x, w))  # every token quantized once, before the gather
            aq = xq.view(torch.uint8).index_select(0, token_idx).view(torch.float8_e4m3fn)
            h = smm(aq, W.w13_f8_t, xs.index_select(0, token_idx), W.w13_s, offs)
            hq, hs = quant_rows_fp8(act(h))
            y = smm(hq, W.w2_f8_t, hs, W.w2_s, offs)
            return finish(x, y, token_idx, order, w)
        return forward
    raise ValueError(kind)


# The reference protocol (step 3b): how bench/h200-reference-numbers.md describes its torch rows.
REFPROTO_ROUTING = ("softmax over E of random normal logits (fp32), top-k of the probabilities, no renormalization; "
                    "weight applied after GEMM2; silu*mul; for every model")
REFPROTO_TIMING = ("eager forward from (hidden states, logits): softmax top-k routing, sort by expert, offsets, gather, "
                   "[fp8: rowwise activation quantization,] grouped GEMM1, silu*mul, grouped GEMM2, weighted index_add; "
                   "routing inside the timed region; CUDA events per call, median after warm-up")
ANCHOR_TOL = 0.20  # issue 4: the torch-baseline rows within 20% of the reference numbers


def refproto_preset(p):
    """The preset as the reference protocol sees it: same shapes, softmax top-k, weights on the output, silu*mul."""
    return dict(p, routing="softmax_topk", weight_on_input=False, act="swiglu", scale=1.0, n_group=1, topk_group=1)


def route_softmax_topk(logits, k):
    """Plain softmax top-k: -> ids int64 [T,k] (descending probability), w fp32 [T,k] = the softmax
    probabilities themselves (no renormalization over the k)."""
    w, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids, w


def make_refproto_layer(p, W, kind, mm, smm):
    """The reference protocol's timed call: (x bf16 [T,H], logits fp32 [T,E]) -> bf16 [T,H], routing included.
    Reuses the model's bf16 / e4m3 weights W."""
    pr = refproto_preset(p)
    inner = make_layer(pr, W, kind, mm, smm)
    k = pr["k"]

    def forward(x, logits):
        ids, w = route_softmax_topk(logits, k)
        return inner(x, ids, w)
    return forward


def reference_rows(p, W, x, ids, w, rows):
    """Plain fp32 per-token loop over the k slots with the bf16 weights -> fp32 [len(rows), H]."""
    out = torch.zeros(len(rows), p["H"], device="cuda", dtype=torch.float32)
    for r, t in enumerate(rows):
        for j in range(p["k"]):
            e = int(ids[t, j])
            wt = w[t, j]
            if p["weight_on_input"]:
                xin, wt = (x[t] * wt.to(torch.bfloat16)).float(), 1.0
            else:
                xin = x[t].float()
            h = W.w13[e].float() @ xin
            y = W.w2[e].float() @ act_ref(p, h)
            out[r] += wt * y
    return out


def check_rows(got, ref):
    return float((got.float() - ref).norm() / ref.norm().clamp(min=1e-30))


# ----------------------------------------------------------------------------------------------------
# triton_kernels (OpenAI's MoE kernels, vLLM's default MXFP4 MoE on Hopper): the gpt-oss layer
# ----------------------------------------------------------------------------------------------------

TRITON_PEER = "triton_mxfp4"
TRITON_KERNELS_EXPECTED = ("the triton_kernels of triton v3.6.0 (the python/triton_kernels folder of a triton "
                           "checkout at tag v3.6.0 or branch release/3.6.x)")
# (module, attribute) pairs the row calls; checked before anything runs, so that a checkout of another
# release fails with the name it lacks instead of inside a kernel launch.
TRITON_KERNELS_NEEDS = (
    ("triton_kernels.matmul_ogs", "matmul_ogs"),
    ("triton_kernels.matmul_ogs", "PrecisionConfig"),
    ("triton_kernels.matmul_ogs", "FlexCtx"),
    ("triton_kernels.matmul_ogs", "FnSpecs"),
    ("triton_kernels.matmul_ogs", "FusedActivation"),
    ("triton_kernels.matmul_ogs", "RoutingData"),
    ("triton_kernels.matmul_ogs", "GatherIndx"),
    ("triton_kernels.matmul_ogs", "ScatterIndx"),
    ("triton_kernels.matmul_ogs", "update_opt_flags_constraints"),
    ("triton_kernels.swiglu", "swiglu_fn"),
    ("triton_kernels.topk", "topk"),
    ("triton_kernels.tensor", "SparseMatrix"),
    ("triton_kernels.tensor", "make_ragged_tensor_metadata"),
    ("triton_kernels.tensor", "convert_layout"),
    ("triton_kernels.tensor", "wrap_torch_tensor"),
    ("triton_kernels.tensor", "FP4"),
    ("triton_kernels.tensor_details.layout", "make_default_matmul_mxfp4_w_layout"),
    ("triton_kernels.tensor_details.layout", "make_default_matmul_mxfp4_w_scale_layout"),
    ("triton_kernels.numerics_details.mxfp", "downcast_to_mxfp"),
    ("triton_kernels.numerics_details.mxfp", "upcast_from_mxfp"),
    ("triton_kernels.numerics", "InFlexData"),
)
# The scale layout of the Hopper MXFP4 path depends on the GEMM's warp count; vLLM's weight preparation
# uses 8.
TRITON_SCALE_NUM_WARPS = 8


class TritonKernelsError(RuntimeError):
    pass


def triton_applies(p):
    """The row runs for the gpt-oss presets: triton_kernels' fused activation is the clamped swiglu_oai."""
    return p["act"] == "swiglu_oai" and p["routing"] == "renormalize"


def check_triton_kernels_path(path):
    """-> the resolved folder holding the triton_kernels package; TritonKernelsError when PATH is not one."""
    if not str(path).strip():
        raise TritonKernelsError(f"--triton-kernels: expected a directory, {TRITON_KERNELS_EXPECTED}")
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise TritonKernelsError(f"--triton-kernels {path}: no such directory; expected {TRITON_KERNELS_EXPECTED}")
    if not (root / "triton_kernels" / "__init__.py").is_file():
        hint = ""
        if (root / "__init__.py").is_file() and root.name == "triton_kernels":
            hint = f" (this looks like the package itself: pass its parent, {root.parent})"
        raise TritonKernelsError(f"--triton-kernels {path}: no triton_kernels/__init__.py under it{hint}; "
                                 f"expected {TRITON_KERNELS_EXPECTED}")
    return root


def load_triton_kernels(path):
    """Puts PATH (the python/triton_kernels folder of a triton checkout) first on sys.path, imports the
    package from there and checks every name the row calls. -> SimpleNamespace of those names.
    Raises TritonKernelsError naming what is missing and the triton_kernels this script expects."""
    import importlib
    import inspect
    import types

    root = check_triton_kernels_path(path)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    ns = types.SimpleNamespace(path=str(root))
    for mod_name, attr in TRITON_KERNELS_NEEDS:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and (e.name == mod_name or mod_name.startswith(e.name + ".")):
                raise TritonKernelsError(f"triton_kernels at {root}: missing module {mod_name} (needed for "
                                         f"{mod_name}.{attr}); bench/peers.py expects {TRITON_KERNELS_EXPECTED}") from e
            raise TritonKernelsError(f"triton_kernels at {root}: importing {mod_name} failed: {e}") from e
        except Exception as e:  # noqa: BLE001 - e.g. triton itself missing or of another release
            raise TritonKernelsError(f"triton_kernels at {root}: importing {mod_name} failed: "
                                     f"{type(e).__name__}: {e}") from e
        mod_file = getattr(mod, "__file__", None)
        if mod_file and not Path(mod_file).resolve().is_relative_to(root):
            raise TritonKernelsError(f"{mod_name} was imported from {mod_file}, not from --triton-kernels {root} "
                                     "(another triton_kernels is installed or was imported first)")
        if not hasattr(mod, attr):
            raise TritonKernelsError(f"triton_kernels at {root}: missing {mod_name}.{attr}; bench/peers.py expects "
                                     f"{TRITON_KERNELS_EXPECTED}")
        setattr(ns, attr, getattr(mod, attr))
    # Names of that release whose meaning changed later: the weight-scale field and FnSpecs' reduction_n.
    import dataclasses
    fields = {f.name for f in dataclasses.fields(ns.PrecisionConfig)} if dataclasses.is_dataclass(ns.PrecisionConfig) else set()
    if "weight_scale" not in fields:
        raise TritonKernelsError(f"triton_kernels at {root}: missing triton_kernels.matmul_ogs.PrecisionConfig."
                                 f"weight_scale; bench/peers.py expects {TRITON_KERNELS_EXPECTED}")
    try:
        params = inspect.signature(ns.FnSpecs).parameters
    except (TypeError, ValueError):
        params = {}
    if "reduction_n" not in params:
        raise TritonKernelsError(f"triton_kernels at {root}: missing triton_kernels.matmul_ogs.FnSpecs(reduction_n=); "
                                 f"bench/peers.py expects {TRITON_KERNELS_EXPECTED}")
    return ns


def _tk_layout(result):
    """make_default_matmul_mxfp4_w[_scale]_layout -> (layout, convert_layout keyword arguments)."""
    if isinstance(result, tuple):
        layout, opts = result
        return layout, dict(opts or {})
    return result, {}


class TritonWeights:
    """The model's bf16 weights (W) as triton_kernels MXFP4, prepared the way vLLM prepares a gpt-oss
    checkpoint: w13 with gate and up rows interleaved (the layout triton_kernels' swiglu reads: output
    2i gate i, 2i+1 up i), each weight [E, N, K] quantized along K with downcast_to_mxfp (e2m1 pairs
    [E, N, K/2], ue8m0 scales [E, N, K/32], the checkpoint's layout), then the [E, K, N] views (K
    innermost in memory) converted to the default Hopper layouts; random fp32 biases. The un-swizzled
    values and scales stay for the reference."""

    def __init__(self, tk, p, W, seed):
        E, H, I = p["E"], p["H"], p["I"]
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.b13 = (0.1 * torch.randn(E, 2 * I, device="cuda", generator=g)).float()  # interleaved, like w13
        self.b2 = (0.1 * torch.randn(E, H, device="cuda", generator=g)).float()
        perm = torch.stack([torch.arange(I, device="cuda"), torch.arange(I, 2 * I, device="cuda")], dim=1).reshape(-1)
        self.q13, self.s13 = self._quantize(tk, W.w13, perm)  # [E, 2I, H/2], [E, 2I, H/32]
        self.q2, self.s2 = self._quantize(tk, W.w2, None)     # [E, H, I/2], [E, H, I/32]
        self.w13, self.pc13 = self._hopper(tk, self.q13, self.s13)
        self.w2, self.pc2 = self._hopper(tk, self.q2, self.s2)

    @staticmethod
    def _quantize(tk, w, row_perm):
        """w bf16 [E, N, K] (nn.Linear) -> (u8 [E, N, K/2], u8 [E, N, K/32]), one expert at a time."""
        E, N, K = w.shape
        q = torch.empty(E, N, K // 2, device="cuda", dtype=torch.uint8)
        s = torch.empty(E, N, K // 32, device="cuda", dtype=torch.uint8)
        for e in range(E):
            we = w[e] if row_perm is None else w[e].index_select(0, row_perm)
            qe, se = tk.downcast_to_mxfp(we.contiguous(), torch.uint8, axis=1)
            q[e].copy_(qe)
            s[e].copy_(se)
        return q, s

    @staticmethod
    def _hopper(tk, q, s):
        """[E, N, K/2] values and [E, N, K/32] scales -> the matmul_ogs operand [E, K, N] (FP4 takes its
        packed dimension from the innermost one: the [E, K/2, N] view) and its PrecisionConfig."""
        vl, vopts = _tk_layout(tk.make_default_matmul_mxfp4_w_layout(mx_axis=1))
        sl, sopts = _tk_layout(tk.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=TRITON_SCALE_NUM_WARPS))
        wt = tk.convert_layout(tk.wrap_torch_tensor(q.transpose(-2, -1), dtype=tk.FP4), vl, **vopts)
        st = tk.convert_layout(tk.wrap_torch_tensor(s.transpose(-2, -1)), sl, **sopts)
        return wt, tk.PrecisionConfig(weight_scale=st, flex_ctx=tk.FlexCtx(rhs_data=tk.InFlexData()))

    def dequant(self, tk, which, e):
        """Expert e's weight as fp32 [N, K] from the un-swizzled MXFP4 values and scales."""
        q, s = (self.q13, self.s13) if which == 13 else (self.q2, self.s2)
        return tk.upcast_from_mxfp(q[e], s[e], torch.bfloat16, axis=1).float()

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.q13, self.s13, self.q2, self.s2, self.b13, self.b2))


def make_triton_layer(tk, p, TW):
    """The gpt-oss layer as vLLM runs it on triton_kernels: (x bf16 [T,H], logits fp32 [T,E]) -> bf16 [T,H].
    topk of the logits with the softmax over the k (the preset's renormalize routing), the ragged metadata
    of the experts' rows, GEMM1 (gather, bias, fused swiglu_oai), GEMM2 (bias, router weight, scatter and
    the sum over the k)."""
    E, k = p["E"], p["k"]
    act = tk.FusedActivation(tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                             (p["alpha"], p["limit"]))
    if p.get("beta", 1.0) != 1.0:
        raise ValueError("triton_kernels' swiglu adds 1 to the linear half: beta must be 1")

    def forward(x, logits):
        sparse = tk.topk(logits, k, apply_softmax=True)
        md = sparse.mask_metadata
        dispatch, combine = md.row_sorted_indx, md.col_sorted_indx
        ragged = tk.make_ragged_tensor_metadata(md.col_sum, dispatch.shape[0])
        gate = sparse.vals.flatten()[combine]
        rd = tk.RoutingData(gate, md.col_sum, E, k, ragged)
        h = tk.matmul_ogs(x, TW.w13, TW.b13, rd, gather_indx=tk.GatherIndx(combine, dispatch),
                          precision_config=TW.pc13, fused_activation=act)
        return tk.matmul_ogs(h, TW.w2, TW.b2, rd, scatter_indx=tk.ScatterIndx(dispatch, combine),
                             precision_config=TW.pc2, gammas=gate)
    return forward


def reference_rows_mxfp4(tk, p, TW, x, ids, w, rows):
    """fp32 per-token loop with the dequantized MXFP4 weights and the biases -> fp32 [len(rows), H]."""
    out = torch.zeros(len(rows), p["H"], device="cuda", dtype=torch.float32)
    a, L = p["alpha"], p["limit"]
    for r, t in enumerate(rows):
        for j in range(p["k"]):
            e = int(ids[t, j])
            h = TW.dequant(tk, 13, e) @ x[t].float() + TW.b13[e]
            g, u = h[0::2].clamp(max=L), h[1::2].clamp(min=-L, max=L)
            y = TW.dequant(tk, 2, e) @ (g * torch.sigmoid(a * g) * (u + 1.0)).to(torch.bfloat16).float() + TW.b2[e]
            out[r] += w[t, j] * y
    return out


def bench_triton_model(args, model, W, tk, rows_out, failures, seed):
    """Times the triton_kernels row of one gpt-oss model at every T, on MXFP4 copies of its bf16 weights W."""
    p = PRESETS[model]
    E, H = p["E"], p["H"]
    t0 = time.time()
    try:
        tk.update_opt_flags_constraints({"split_k": 1})  # vLLM's setting on Hopper
        TW = TritonWeights(tk, p, W, seed + 3)
        layer = make_triton_layer(tk, p, TW)
    except Exception as e:  # noqa: BLE001
        err = f"weights: {type(e).__name__}: {e}"
        log(f"triton_kernels {model}: {err}")
        for T in args.token_list:
            rows_out[(model, T)][f"{TRITON_PEER}_error"] = err
            failures.append(f"{model} T={T} {TRITON_PEER}: {err}")
        return
    log(f"triton_kernels {model}: MXFP4 weights ready ({TW.nbytes() / 1e9:.1f} GB, {time.time() - t0:.1f} s)")
    g = torch.Generator(device="cuda").manual_seed(seed + 4)
    for T in args.token_list:
        r = rows_out[(model, T)]
        try:
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
            logits = torch.randn(T, E, device="cuda", dtype=torch.float32, generator=g)
            ids, w = route(p, logits, None)
        except Exception as e:  # noqa: BLE001
            r[f"{TRITON_PEER}_error"] = f"inputs/routing: {type(e).__name__}: {e}"
            failures.append(f"{model} T={T} {TRITON_PEER}: {r[f'{TRITON_PEER}_error']}")
            continue
        check_tok = check_tokens(T)
        cache = {}

        def get_ref():
            if "ref" not in cache:
                cache["ref"] = reference_rows_mxfp4(tk, p, TW, x, ids, w, check_tok)
            return cache["ref"]
        measure(args, r, TRITON_PEER, REFCHECK_TOL[TRITON_PEER], lambda: layer(x, logits), get_ref, check_tok,
                f"{model} T={T} {TRITON_PEER}", failures)
        cache = x = logits = ids = w = None  # noqa: F841
    del layer, TW
    log(f"triton_kernels {model}: done in {time.time() - t0:.1f} s")


# ----------------------------------------------------------------------------------------------------
# anchors (optional): the reference table of bench/h200-reference-numbers.md
# ----------------------------------------------------------------------------------------------------

def read_anchors(path):
    """-> (ceilings dict, {(model, T): {column: us}}) from a markdown table with `model` and `T` columns."""
    text = Path(path).read_text()
    ceil = {}
    m = re.search(r"device copy\s+([\d.]+)\s*TB/s", text)
    if m:
        ceil["copy_tbps"] = float(m.group(1))
    m = re.search(r"bf16 GEMM[^,\n]*?([\d.]+)\s*TFLOP/s", text)
    if m:
        ceil["bf16_tflops"] = float(m.group(1))
    m = re.search(r"fp8 GEMM[^,\n]*?([\d.]+)\s*TFLOP/s", text)
    if m:
        ceil["fp8_tflops"] = float(m.group(1))
    rows, header = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            header = None if not line else header
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if "model" in cells and "T" in cells:
                header = cells
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue
        d = dict(zip(header, cells))
        try:
            key = (d["model"], int(d["T"]))
        except (KeyError, ValueError):
            continue
        vals = {}
        for col, v in d.items():
            if col in ("model", "T"):
                continue
            try:
                vals[col] = float(v)
            except ValueError:
                pass
        rows[key] = vals
    return ceil, rows


# ----------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="bench/peers.py", description=__doc__,
        epilog=("correctness: --refcheck (on by default) checks the torch baselines against an fp32 per-token\n"
                "loop on a few tokens before timing each shape. fp4moe's outputs are not re-checked here: that\n"
                "is the job of its own C++ bench, which runs one checked forward per shape before timing it\n"
                "(runner/bench.cu), and of the GPU tests against the CPU oracle.\n"
                "Progress goes to stderr, the table to stdout."),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated presets (default {DEFAULT_MODELS}); "
                    f"known: {', '.join(PRESETS)}")
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, help=f"comma-separated token counts (default {DEFAULT_TOKENS})")
    ap.add_argument("--mode", default="w4a4_scalar", choices=["w4a4_scalar", "w4a4_per_expert", "w4a16"],
                    help="fp4moe activation mode, passed to `fp4moe bench` (default w4a4_scalar)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per row, >= 20 (default 20)")
    ap.add_argument("--json", help="write the merged results here")
    ap.add_argument("--table", help="also write the printed table to this file")
    ap.add_argument("--fp4moe-bin", default=str(ROOT / "build-gpu" / "fp4moe"),
                    help="the fp4moe CLI (default build-gpu/fp4moe)")
    ap.add_argument("--fp4moe-json", help="keep fp4moe bench's own JSON here (default: a temporary file)")
    ap.add_argument("--fp4moe-csv", help="keep fp4moe bench's own CSV here")
    ap.add_argument("--fp4moe-results", help="use this fp4moe bench JSON instead of running fp4moe")
    ap.add_argument("--fp4moe-timeout", type=int, default=1800, help="seconds (default 1800)")
    ap.add_argument("--no-fp4moe", action="store_true", help="time the peers only")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"baselines to time (default {','.join(PEERS)})")
    ap.add_argument("--refcheck", action=argparse.BooleanOptionalAction, default=True,
                    help="check each torch baseline against an fp32 loop on a few tokens before timing (default on)")
    ap.add_argument("--fp8-fast-accum", action="store_true",
                    help="use_fast_accum=True for torch._scaled_grouped_mm (default: torch's default, False)")
    ap.add_argument("--anchors", help="a markdown table of reference numbers (bench/h200-reference-numbers.md) to compare "
                    "the torch rows and ceilings with")
    ap.add_argument("--reference-protocol", action=argparse.BooleanOptionalAction, default=None,
                    help="also time the torch baselines the way the anchors file describes them (softmax top-k of "
                    "random logits for every model, routing inside the timed call; step 3b) at the anchors' T, "
                    "and compare those with the anchors (default: on when --anchors is given)")
    ap.add_argument("--triton-kernels", metavar="PATH",
                    help="the python/triton_kernels folder of a triton checkout (expected: tag v3.6.0 / branch "
                    "release/3.6.x), put first on sys.path: adds the triton_mxfp4 row (OpenAI's triton_kernels "
                    "matmul_ogs with MXFP4 weights, bf16 activations; vLLM's MXFP4 MoE on Hopper) for the gpt-oss "
                    "presets. Without it the row is absent and the table says so")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    if a.reps < 20:
        ap.error(f"--reps must be >= 20, got {a.reps}")
    if a.reference_protocol is None:
        a.reference_protocol = bool(a.anchors)
    a.model_list = [m for m in a.models.split(",") if m]
    for m in a.model_list:
        if m not in PRESETS:
            ap.error(f"--models: unknown preset '{m}'; known: {', '.join(PRESETS)}")
    mx = [m for m in a.model_list if PRESETS[m]["weights"] == "mxfp4"]
    if mx and a.mode != "w4a16" and not a.no_fp4moe and not a.fp4moe_results:
        ap.error(f"--models {','.join(mx)}: MXFP4 presets run in fp4moe's mode w4a16 only; pass --mode w4a16 "
                 f"(or bench them apart from the NVFP4 presets), got --mode {a.mode}")
    try:
        a.token_list = [int(t) for t in a.tokens.split(",") if t]
    except ValueError:
        ap.error(f"--tokens: expected comma-separated integers, got '{a.tokens}'")
    if not a.token_list or min(a.token_list) < 1:
        ap.error("--tokens: token counts must be >= 1")
    a.peer_list = [x for x in a.peers.split(",") if x]
    for x in a.peer_list:
        if x not in PEERS:
            hint = " (the triton_kernels row is enabled by --triton-kernels PATH)" if x == TRITON_PEER else ""
            ap.error(f"--peers: unknown baseline '{x}'; known: {', '.join(PEERS)}{hint}")
    if a.triton_kernels is not None:
        try:
            check_triton_kernels_path(a.triton_kernels)
        except TritonKernelsError as e:
            ap.error(str(e))
    # Every peer whose columns the merge and the table read: the torch baselines, then triton_kernels.
    a.all_peers = a.peer_list + ([TRITON_PEER] if a.triton_kernels else [])
    a.tk = None  # the loaded triton_kernels names (load_triton_kernels), set in main
    return a


def git_commit():
    """The commit measured: FP4MOE_COMMIT when set (a copied tree without .git), else git describe."""
    if os.environ.get("FP4MOE_COMMIT"):
        return os.environ["FP4MOE_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def measure(args, r, key, tol, fwd, get_ref, check_tok, what, failures, sync_each=False):
    """Optionally refchecks fwd() on the rows check_tok against get_ref() (fp32 [len(check_tok), H]), then
    times it; fills r[key + '_us' | '_min_us' | '_refcheck' | '_error']. Errors are recorded, never raised."""
    try:
        if args.refcheck:
            ref = get_ref()
            out = fwd()  # also the first warm-up call
            torch.cuda.synchronize()
            rel = check_rows(out[check_tok], ref)
            ok = math.isfinite(rel) and rel < tol
            r[f"{key}_refcheck"] = {"rel_err": rel, "tol": tol, "tokens": check_tok, "ok": ok}
            del out
            if not ok:
                failures.append(f"{what}: refcheck rel_err {rel:.3g} >= {tol}")
                log(f"torch {what}: REFCHECK FAILED, rel_err {rel:.3g}")
        # With --refcheck the checked call above was the first warm-up: one more, then the timed calls.
        med, mn, _ = time_cuda(fwd, args.reps, warmup_max=1 if args.refcheck else 3, sync_each=sync_each)
        r[f"{key}_us"] = med
        r[f"{key}_min_us"] = mn
        log(f"torch {what}: {med:.1f} us (min {mn:.1f})"
            + (f", refcheck rel_err {r[f'{key}_refcheck']['rel_err']:.2e}" if args.refcheck else ""))
    except Exception as e:  # noqa: BLE001
        text = str(e).strip()
        msg = f"{type(e).__name__}: {text[:1500]}"  # the whole message (torch's first line is the gist)
        first = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
        r[f"{key}_error"] = msg
        failures.append(f"{what}: {first}")
        log(f"torch {what}: ERROR {msg}")
        if os.environ.get("FP4MOE_PEERS_TRACEBACK"):
            traceback.print_exc()
        try:  # leave the stream idle before the next baseline; a broken context shows up there
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass


def check_tokens(T):
    return sorted({0, T // 3, (2 * T) // 3, T - 1})


def bench_torch_model(args, model, rows_out, failures, refproto_tokens=()):
    """Times the baselines of one model with the preset's routing (step 3) at every T, then with the reference
    protocol (step 3b) at the T in refproto_tokens, all on one set of weights."""
    p = PRESETS[model]
    E, H = p["E"], p["H"]
    seed = args.seed * 1000003 + sum(map(ord, model))
    t0 = time.time()
    log(f"torch {model}: preparing random bf16 weights" + (" and e4m3 copies" if "torch_fp8" in args.peer_list else ""))
    try:
        W = Weights(p, seed, "torch_fp8" in args.peer_list)
    except Exception as e:  # noqa: BLE001
        err = f"weights: {type(e).__name__}: {e}"
        log(f"torch {model}: {err}")
        for T in args.token_list:
            r = rows_out[(model, T)]
            for peer in args.peer_list:
                r[f"{peer}_error"] = err
                failures.append(f"{model} T={T} {peer}: {err}")
                if T in refproto_tokens:
                    r[f"{peer}_refproto_error"] = err
            if args.tk is not None and triton_applies(p):
                r[f"{TRITON_PEER}_error"] = err
                failures.append(f"{model} T={T} {TRITON_PEER}: {err}")
        torch.cuda.empty_cache()
        return
    log(f"torch {model}: weights ready ({W.nbytes() / 1e9:.1f} GB, {time.time() - t0:.1f} s)")
    mm = smm = None
    fn_errors = {}
    try:
        mm = grouped_mm_fn()
    except Exception as e:  # noqa: BLE001
        fn_errors["torch_bf16"] = str(e)
    try:
        smm = scaled_grouped_mm_fn(args.fp8_fast_accum)
    except Exception as e:  # noqa: BLE001
        fn_errors["torch_fp8"] = str(e)

    def checked(peer, build):
        if peer in fn_errors:
            raise RuntimeError(fn_errors[peer])
        return build()

    # 3. the preset's routing, outside the timed region.
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    bias = (0.1 * torch.randn(E, device="cuda", generator=g)) if p["routing"] == "deepseek_v3" else None
    for T in args.token_list:
        r = rows_out[(model, T)]
        try:
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
            logits = torch.randn(T, E, device="cuda", dtype=torch.float32, generator=g)
            ids, w = route(p, logits, bias)
            r["torch_experts_hit"] = int(torch.unique(ids).numel())
            med, _, _ = time_cuda(lambda: route(p, logits, bias), args.reps)
            r["torch_route_us"] = med
        except Exception as e:  # noqa: BLE001
            err = f"inputs/routing: {type(e).__name__}: {e}"
            for peer in args.peer_list:
                r[f"{peer}_error"] = err
                failures.append(f"{model} T={T} {peer}: {err}")
            log(f"torch {model} T={T}: {err}")
            continue
        check_tok = check_tokens(T)
        cache = {}

        def get_ref():
            if "ref" not in cache:
                cache["ref"] = reference_rows(p, W, x, ids, w, check_tok)
            return cache["ref"]
        for peer in args.peer_list:
            layer = None
            try:
                layer = checked(peer, lambda: make_layer(p, W, peer, mm, smm))
            except Exception as e:  # noqa: BLE001
                r[f"{peer}_error"] = f"{type(e).__name__}: {e}"
                failures.append(f"{model} T={T} {peer}: {type(e).__name__}: {e}")
                log(f"torch {model} T={T} {peer}: ERROR {e}")
                continue
            measure(args, r, peer, REFCHECK_TOL[peer], lambda: layer(x, ids, w), get_ref, check_tok,
                    f"{model} T={T} {peer}", failures)
        layer = cache = x = logits = ids = w = None  # noqa: F841 - drop references before the next T

    # 3b. the reference protocol: softmax top-k of random logits, routing inside the timed call.
    pr = refproto_preset(p)
    gr = torch.Generator(device="cuda").manual_seed(seed + 2)  # own stream: step 3's inputs stay as they were
    for T in args.token_list:
        if T not in refproto_tokens:
            continue
        r = rows_out[(model, T)]
        try:
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gr)
            logits = torch.randn(T, E, device="cuda", dtype=torch.float32, generator=gr)
            ids, w = route_softmax_topk(logits, pr["k"])  # the same routing the timed call does, for hit/refcheck
            r["refproto_experts_hit"] = int(torch.unique(ids).numel())
        except Exception as e:  # noqa: BLE001
            err = f"reference protocol inputs/routing: {type(e).__name__}: {e}"
            for peer in args.peer_list:
                r[f"{peer}_refproto_error"] = err
                failures.append(f"{model} T={T} {peer} (reference protocol): {err}")
            log(f"torch {model} T={T}: {err}")
            continue
        check_tok = check_tokens(T)
        cache = {}

        def get_ref():
            if "ref" not in cache:
                cache["ref"] = reference_rows(pr, W, x, ids, w, check_tok)
            return cache["ref"]
        for peer in args.peer_list:
            layer = None
            key = f"{peer}_refproto"
            try:
                layer = checked(peer, lambda: make_refproto_layer(p, W, peer, mm, smm))
            except Exception as e:  # noqa: BLE001
                r[f"{key}_error"] = f"{type(e).__name__}: {e}"
                failures.append(f"{model} T={T} {key}: {type(e).__name__}: {e}")
                log(f"torch {model} T={T} {key}: ERROR {e}")
                continue
            measure(args, r, key, REFCHECK_TOL[peer], lambda: layer(x, logits), get_ref, check_tok,
                    f"{model} T={T} {key}", failures, sync_each=True)
        layer = cache = x = logits = ids = w = None  # noqa: F841
    # 4. triton_kernels on MXFP4 copies of the same weights (gpt-oss presets).
    if args.tk is not None and triton_applies(p):
        bench_triton_model(args, model, W, args.tk, rows_out, failures, seed)
    del W
    log(f"torch {model}: done in {time.time() - t0:.1f} s")


ANCHOR_COLUMNS = {"torch_bf16": "torch bf16", "torch_fp8": "torch fp8"}


def compare_with_anchors(rows, peers, reference_protocol):
    """Adds r["anchor_deviation"] (measured / anchor - 1 for the preset-routing and reference-protocol timings;
    experts hit minus the anchor's) to each row with an anchor; returns the summary: how many rows of the compared
    protocol (the reference protocol when it ran, else the preset routing) are within ANCHOR_TOL."""
    suffix = "_refproto" if reference_protocol else ""
    summary = {"protocol": "reference" if reference_protocol else "preset routing", "tolerance": ANCHOR_TOL,
               "compared_fields": [f"{peer}{suffix}_us" for peer in peers], "per_peer": {}}
    counts = {peer: {"within": 0, "compared": 0, "missing": 0, "max_abs_dev": None, "outside": []} for peer in peers}
    for r in rows:
        a = r.get("anchor")
        if not a:
            continue
        dev = {}
        for peer in peers:
            ref = a.get(ANCHOR_COLUMNS.get(peer, ""))
            for suf in ("", "_refproto"):
                m = r.get(f"{peer}{suf}_us")
                if m and ref:
                    dev[f"{peer}{suf}"] = m / ref - 1.0
        ahit = a.get("experts hit")
        for hk in ("torch_experts_hit", "refproto_experts_hit"):
            if r.get(hk) is not None and ahit is not None:
                dev[f"{hk}_diff"] = int(r[hk] - ahit)
        r["anchor_deviation"] = dev
        for peer in peers:
            if not a.get(ANCHOR_COLUMNS.get(peer, "")):
                continue
            c = counts[peer]
            d = dev.get(f"{peer}{suffix}")
            if d is None:
                c["missing"] += 1
                continue
            c["compared"] += 1
            bad = r.get(f"{peer}{suffix}_refcheck", {}).get("ok") is False
            if abs(d) <= ANCHOR_TOL and not bad:  # a baseline that failed its refcheck is never counted within
                c["within"] += 1
            else:
                c["outside"].append(f"{r['model']} T={r['tokens']} {100 * d:+.1f}%" + (" (refcheck failed)" if bad else ""))
            c["max_abs_dev"] = abs(d) if c["max_abs_dev"] is None else max(c["max_abs_dev"], abs(d))
    summary["per_peer"] = counts
    summary["all"] = {k: sum(c[k] for c in counts.values()) for k in ("within", "compared", "missing")}
    return summary


def fmt(v, spec="8.1f", width=8):
    if v is None:
        return "-".rjust(width)
    if isinstance(v, str):
        return v.rjust(width)
    return format(v, spec).rjust(width)


def triton_table_note(tk):
    """One line saying what the triton_mx4 column holds, or why it is empty."""
    if not tk.get("requested"):
        return tk.get("reason") or "not run"
    if tk.get("error"):
        return f"not run: {tk['error']}"
    models = ", ".join(tk.get("models") or []) or "none of the chosen presets"
    return (f"triton_kernels matmul_ogs, MXFP4 weights, bf16 activations, routing inside the timed call "
            f"(eager, events, median), for the gpt-oss presets ({models}); from {tk.get('path')}")


def build_table(doc):
    c = doc["ceilings"]
    lines = [f"GPU: {doc['gpu']} ({doc['sm_count']} SMs)   mode {doc['mode']}   reps {doc['reps']}   {doc['date']}"
             f"   commit {doc.get('commit') or '?'}"]
    for who in ("fp4moe", "torch"):
        cc = c.get(who) or {}
        if cc:
            extra = f"   fp8 GEMM {cc['fp8_tflops']:.0f} TFLOP/s" if cc.get("fp8_tflops") else ""
            lines.append(f"ceilings ({who:6s}): copy {cc['copy_tbps']:.2f} TB/s (read+write)   bf16 GEMM "
                         f"{cc['bf16_tflops']:.0f} TFLOP/s{extra}")
    anc = doc.get("anchors", {}).get("ceilings")
    if anc:
        lines.append("ceilings (anchors): " + "   ".join(f"{k} {v:g}" for k, v in anc.items()))
        for who in ("fp4moe", "torch"):
            cc = c.get(who) or {}
            devs = [f"{k} {100 * (cc[k] / v - 1):+.1f}%" for k, v in anc.items() if cc.get(k) and v]
            if devs:
                lines.append(f"  {who} / anchors - 1: " + "   ".join(devs))
    lines.append("")
    hdr = (f"{'model':<16} {'T':>6} {'hit':>4} {'floor_us':>9} {'fp4moe':>9} {'min':>9} {'%floor':>7} "
           f"{'torch_bf16':>10} {'torch_fp8':>10} {'triton_mx4':>10} {'best_peer':>12} {'fp4/peer':>8}")
    lines += [hdr, "-" * len(hdr)]
    for r in doc["rows"]:
        def peer(name):
            if r.get(f"{name}_error"):
                return "error"
            v = r.get(f"{name}_us")
            if v is None:
                return None
            bad = r.get(f"{name}_refcheck", {}).get("ok") is False
            return f"{v:.1f}" + ("!" if bad else "")
        lines.append(
            f"{r['model']:<16} {r['tokens']:>6} {fmt(r.get('experts_hit'), 'd', 4)} {fmt(r.get('floor_us'), '.1f', 9)} "
            f"{fmt('error' if r.get('fp4moe_error') else r.get('fp4moe_median_us'), '.1f', 9)} "
            f"{fmt(r.get('fp4moe_min_us'), '.1f', 9)} {fmt(r.get('fp4moe_pct_of_floor'), '.1f', 7)} "
            f"{fmt(peer('torch_bf16'), '', 10)} {fmt(peer('torch_fp8'), '', 10)} {fmt(peer(TRITON_PEER), '', 10)} "
            f"{fmt((r.get('best_peer') or '-').replace('torch_', ''), '', 12)} {fmt(r.get('ratio'), '.3f', 8)}")
    lines.append("")
    lines.append(f"times in microseconds; fp4moe: CUDA-graph replays, L2 flushed by a "
                 f"{doc.get('fp4moe_l2_flush', 'write')} of 256 MiB (median, min); torch: eager, events, "
                 "median; fp4/peer < 1: fp4moe faster; '!': refcheck failed (never the best peer)")
    lines.append("triton_mx4: " + triton_table_note(doc.get("triton_kernels") or {}))
    anchor_rows = [r for r in doc["rows"] if r.get("anchor")]
    if anchor_rows:
        comp = doc.get("anchor_comparison") or {}
        refp = comp.get("protocol") == "reference"
        suf, hitkey = ("_refproto", "refproto_experts_hit") if refp else ("", "torch_experts_hit")
        if refp:
            lines += ["", "torch baselines against the anchors, measured with the reference protocol (measured / anchor - 1):",
                      "  " + (doc.get("reference_protocol") or {}).get("routing", REFPROTO_ROUTING) + ";",
                      "  routing inside the timed call (the table above: the preset's routing, excluded from the time)"]
        else:
            lines += ["", "torch baselines against the anchors, preset routing (measured / anchor - 1):"]
        lines.append(f"{'model':<16} {'T':>6} {'hit':>4} {'a.hit':>5} {'bf16':>9} {'anchor':>9} {'dev':>7} "
                     f"{'fp8':>9} {'anchor':>9} {'dev':>7}")
        for r in anchor_rows:
            a = r["anchor"]
            ahit = a.get("experts hit")
            cells = [fmt(r.get(hitkey), "d", 4), fmt(int(ahit) if ahit is not None else None, "d", 5)]
            for peer, col in ANCHOR_COLUMNS.items():
                key = f"{peer}{suf}"
                m, ref = r.get(f"{key}_us"), a.get(col)
                if r.get(f"{key}_error"):
                    m = "error"
                elif m is not None and r.get(f"{key}_refcheck", {}).get("ok") is False:
                    m = f"{m:.0f}!"
                dev = f"{100 * (r[f'{key}_us'] / ref - 1):+.0f}%" if r.get(f"{key}_us") and ref else "-"
                cells += [fmt(m, ".0f", 9), fmt(ref, ".0f", 9), dev.rjust(7)]
            lines.append(f"{r['model']:<16} {r['tokens']:>6} " + " ".join(cells))
        if comp.get("per_peer"):
            tol = 100 * comp.get("tolerance", ANCHOR_TOL)
            parts = [f"{peer.replace('torch_', '')} {c['within']}/{c['compared']}"
                     + (f" ({c['missing']} not measured)" if c["missing"] else "")
                     for peer, c in comp["per_peer"].items()]
            al = comp["all"]
            lines.append(f"within {tol:.0f}% of the anchors ({comp['protocol']}): " + ", ".join(parts)
                         + f"; all {al['within']}/{al['compared']}")
    return "\n".join(lines)


def triton_kernels_doc(args):
    """The JSON's and the table's account of the triton_kernels row before it runs."""
    if not args.triton_kernels:
        return {"requested": False, "ok": False,
                "reason": "not run: no --triton-kernels PATH (the python/triton_kernels folder of a triton checkout)"}
    return {"requested": True, "ok": False, "path": args.triton_kernels, "expected": TRITON_KERNELS_EXPECTED,
            "models": [m for m in args.model_list if triton_applies(PRESETS[m])],
            "timing": "eager forward from (hidden states, logits): triton_kernels topk (softmax over the k), ragged "
                      "metadata, matmul_ogs GEMM1 (gather, bias, fused swiglu_oai), matmul_ogs GEMM2 (bias, router "
                      "weight, scatter-sum); routing inside the timed call; CUDA events per call, median"}


def triton_unavailable(args, doc, rows, failures, msg):
    """--triton-kernels was given but the package cannot be used: every gpt-oss row records why."""
    log(f"triton_kernels: {msg}")
    doc["triton_kernels"]["error"] = msg
    failures.append(f"{TRITON_PEER}: {msg}")
    for (m, _T), r in rows.items():
        if triton_applies(PRESETS[m]):
            r[f"{TRITON_PEER}_error"] = msg


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    failures = []
    started = datetime.datetime.now(datetime.timezone.utc)
    doc = {"date": started.strftime("%Y-%m-%d %H:%M UTC"), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "commit": git_commit(), "mode": args.mode, "reps": args.reps, "models": args.model_list,
           "tokens": args.token_list, "peers": args.peer_list, "refcheck": args.refcheck,
           "fp8_fast_accum": args.fp8_fast_accum,
           "torch_timing": "eager forward from (x, topk ids, topk weights): sort by expert, gather, grouped GEMM1, "
                           "activation, grouped GEMM2, weighted index_add; routing excluded (torch_route_us); "
                           "CUDA events per call, median",
           "reference_protocol": {"enabled": args.reference_protocol, "routing": REFPROTO_ROUTING,
                                  "timing": REFPROTO_TIMING} if args.reference_protocol else {"enabled": False},
           "ceilings": {}, "rows": []}
    doc["triton_kernels"] = triton_kernels_doc(args)

    # The anchors first: the reference protocol is timed only at their (model, T).
    anchors_rows = {}
    if args.anchors:
        try:
            aceil, anchors_rows = read_anchors(args.anchors)
            doc["anchors"] = {"file": args.anchors, "ceilings": aceil}
        except Exception as e:  # noqa: BLE001
            log(f"anchors: cannot read {args.anchors}: {e}")
    refproto_tokens = {}
    if args.reference_protocol:
        for m in args.model_list:
            refproto_tokens[m] = ({T for T in args.token_list if (m, T) in anchors_rows} if args.anchors
                                  else set(args.token_list))
        doc["reference_protocol"]["shapes"] = {m: sorted(v) for m, v in refproto_tokens.items()}

    # 1. fp4moe first, before this process holds any GPU memory.
    fp = None
    if args.no_fp4moe:
        doc["fp4moe"] = {"ok": False, "error": "not run (--no-fp4moe)"}
    else:
        fp, err, elapsed = run_fp4moe(args, args.model_list, args.token_list)
        doc["fp4moe"] = {"ok": fp is not None, "error": err, "bin": args.fp4moe_bin, "elapsed_s": round(elapsed, 1)}
        if err:
            failures.append(f"fp4moe: {err}")
            log(f"fp4moe: ERROR {err}")
        else:
            log(f"fp4moe: done in {elapsed:.1f} s")
    fp_rows = {}
    if fp:
        doc["ceilings"]["fp4moe"] = dict(fp.get("ceilings", {}))
        doc["gpu"], doc["sm_count"] = fp.get("gpu"), fp.get("sm_count")
        # "read" (the L2 left clean) is the default; a bench JSON without the key used "write" (memset)
        doc["fp4moe_l2_flush"] = fp.get("l2_flush", "write")
        for r in fp.get("rows", []):
            fp_rows[(r["model"], int(r["tokens"]))] = r

    rows = {}
    for m in args.model_list:
        for T in args.token_list:
            rows[(m, T)] = {"model": m, "tokens": T}

    # 2. + 3. torch: ceilings and baselines.
    try:
        torch_setup()
        log(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
        doc["torch_version"], doc["torch_cuda"] = torch.__version__, torch.version.cuda
        log("torch: measuring ceilings ...")
        tc = torch_ceilings()
        gpu, sms = tc.pop("gpu"), tc.pop("sm_count")
        doc["gpu"] = doc.get("gpu") or gpu
        doc["sm_count"] = doc.get("sm_count") or sms
        doc["ceilings"]["torch"] = tc
        log(f"torch: copy {tc['copy_tbps']:.2f} TB/s, bf16 GEMM {tc['bf16_tflops']:.0f} TFLOP/s"
            + (f", fp8 GEMM {tc['fp8_tflops']:.0f} TFLOP/s" if tc.get("fp8_tflops") else ""))
        if args.triton_kernels:
            try:
                args.tk = load_triton_kernels(args.triton_kernels)
                doc["triton_kernels"]["ok"] = True
                log(f"triton_kernels: loaded from {args.tk.path}")
            except TritonKernelsError as e:
                triton_unavailable(args, doc, rows, failures, str(e))
        for m in args.model_list:
            bench_torch_model(args, m, rows, failures, refproto_tokens.get(m, set()))
            torch.cuda.empty_cache()  # the model's weights are gone: hand their memory back
    except Exception as e:  # noqa: BLE001 - no torch / no GPU: fp4moe rows still get written
        msg = f"torch: {type(e).__name__}: {e}"
        log(msg)
        failures.append(msg)
        doc["torch_error"] = msg
        if args.triton_kernels and args.tk is None and not doc["triton_kernels"].get("error"):
            doc["triton_kernels"]["error"] = msg
        for (m, T), r in rows.items():
            for peer in args.peer_list:
                r.setdefault(f"{peer}_error", msg)
                if T in refproto_tokens.get(m, ()):
                    r.setdefault(f"{peer}_refproto_error", msg)
            if args.triton_kernels and triton_applies(PRESETS[m]):
                r.setdefault(f"{TRITON_PEER}_error", msg)
    doc.setdefault("gpu", None)
    doc.setdefault("sm_count", None)

    # 4. merge.
    tc = doc["ceilings"].get("torch")
    for key, r in rows.items():
        m, T = key
        p = PRESETS[m]
        r.update({"E": p["E"], "H": p["H"], "I": p["I"], "k": p["k"]})
        f = fp_rows.get(key)
        if f:
            r["experts_hit"] = f["experts_hit"]
            r["floor_us"], r["floor_source"] = f["floor_us"], "fp4moe"
            r["fp4moe_median_us"], r["fp4moe_min_us"] = f["median_us"], f["min_us"]
            r["fp4moe_pct_of_floor"] = f.get("pct_of_floor")
            r["fp4moe"] = f
        else:
            if not args.no_fp4moe:
                r["fp4moe_error"] = doc["fp4moe"].get("error") or "row missing from fp4moe bench output"
                if fp:
                    failures.append(f"{m} T={T} fp4moe: row missing")
            r["experts_hit"] = r.get("torch_experts_hit")
            if tc and r["experts_hit"] is not None:
                r["floor_us"], r["floor_source"] = floor_model(p, T, r["experts_hit"], tc["copy_tbps"],
                                                               tc["bf16_tflops"]), "torch ceilings"
        if tc and r.get("torch_experts_hit") is not None:
            r["floor_us_torch_ceilings"] = floor_model(p, T, r["torch_experts_hit"], tc["copy_tbps"], tc["bf16_tflops"])
        best = None
        for peer in args.all_peers:
            v = r.get(f"{peer}_us")
            if v is None or r.get(f"{peer}_refcheck", {}).get("ok") is False:
                continue
            if best is None or v < best[1]:
                best = (peer, v)
        if best:
            r["best_peer"], r["best_peer_us"] = best
            if r.get("fp4moe_median_us"):
                r["ratio"] = r["fp4moe_median_us"] / best[1]
        if r.get("floor_us"):
            for peer in args.all_peers:
                if r.get(f"{peer}_us"):
                    r[f"{peer}_pct_of_floor"] = 100.0 * r["floor_us"] / r[f"{peer}_us"]
        if key in anchors_rows:
            r["anchor"] = anchors_rows[key]
        doc["rows"].append(r)
    if anchors_rows:
        doc["anchor_comparison"] = compare_with_anchors(doc["rows"], args.peer_list, args.reference_protocol)
    doc["failures"] = failures
    doc["elapsed_s"] = round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)

    table = build_table(doc)
    print(table, flush=True)
    if args.table:
        Path(args.table).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        log(f"wrote {args.json}")
    if failures:
        log(f"{len(failures)} failure(s):")
        for f in failures:
            log("  " + f)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
