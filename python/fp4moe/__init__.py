"""fp4moe: NVFP4 and MXFP4 Mixture-of-Experts layers on Hopper GPUs (sm_90a), with the numerics of the
Blackwell NVFP4 kernels (W4A4) or weight-only W4A16, and the CPU reference of the same contract.

    import fp4moe, torch
    problem = fp4moe.preset("qwen3-30b-a3b", act_quant="w4a4_scalar")
    layer = fp4moe.MoeLayer(problem, weights, device="cuda:0", max_tokens=8192)
    output, topk_ids, topk_weights = layer(hidden_states, router_logits)

`weights` maps the tensor names of docs/architecture.md, "Interfaces" (w13, w13_scale, w13_scale_2, w13_input_scale, w2,
w2_scale, w2_scale_2, w2_input_scale) to arrays of any DLPack framework (torch, CuPy, NumPy, ...);
`load_checkpoint_layer` reads them from a checkpoint. MXFP4 weights (gpt-oss; `problem.weight_format`
"mxfp4", or `weight_format="mxfp4"` here; w4a16 only) are w13, w13_scale, w2, w2_scale with uint8
ue8m0 scale codes of shape [E, w13_rows, H/32] and [E, H, I/32] (no *_scale_2, no input scales) and
the optional biases. Tensors pass through DLPack without a
copy. On "cuda" the forward launches on the caller's stream (torch's or CuPy's current stream unless
`stream=` is given), allocates nothing but its outputs (none with `forward_into`) and never
synchronises, so it can be captured in a CUDA graph. On "cpu" it runs the reference (slow, exact).

bf16 tensors of frameworks without bfloat16 (NumPy, CuPy) are passed and returned as their uint16
bits. PyTorch ops (torch.compile, CUDA graphs) are in fp4moe.torch_ops.
"""

from . import _fp4moe
from ._fp4moe import Error, Problem, __version__, cuda_device_available, preset, preset_names, preset_weight_format

__all__ = ["Error", "ExpertParallelLayer", "MoeLayer", "Problem", "Router", "WEIGHT_FORMATS", "__version__",
           "cuda_device_available", "load_checkpoint_layer", "nccl_communicator", "nccl_unique_id", "preset",
           "preset_names", "preset_weight_format", "random_case", "tensor_parallel_shard", "virtual_ranks"]

WEIGHT_FORMATS = ("nvfp4", "mxfp4")


# ---- frameworks: which one a tensor comes from, and how to allocate like it --------------------------
def _type_name(x):
    return type(x).__module__ + "." + type(x).__name__


def _framework(x):
    module = type(x).__module__.split(".")[0]
    if module in ("torch", "cupy", "numpy"):
        return module
    return None


def _empty(like, shape, kind):
    """An uninitialised tensor of `kind` ("bf16", "int32", "float32", "uint8") in `like`'s framework and device."""
    framework = _framework(like)
    if framework == "torch":
        import torch
        dtype = {"bf16": torch.bfloat16, "int32": torch.int32, "float32": torch.float32, "uint8": torch.uint8}[kind]
        return torch.empty(shape, dtype=dtype, device=like.device)
    if framework in ("cupy", "numpy"):
        xp = __import__(framework)
        dtype = {"bf16": xp.uint16, "int32": xp.int32, "float32": xp.float32, "uint8": xp.uint8}[kind]
        if framework == "cupy":
            with like.device:
                return xp.empty(shape, dtype=dtype)
        return xp.empty(shape, dtype=dtype)
    raise Error(f"fp4moe: cannot allocate outputs like a {_type_name(like)} (torch, CuPy and NumPy can); "
                "pass writable output tensors to MoeLayer.forward_into instead")


def _to_host(name, x):
    """A weight tensor as a contiguous host array the extension reads (DLPack, no copy when it can)."""
    framework = _framework(x)
    if framework == "torch":
        import torch
        x = x.detach().to("cpu").contiguous()
        if x.dtype == torch.float8_e4m3fn or x.dtype == getattr(torch, "float8_e8m0fnu", None):
            x = x.view(torch.uint8)  # scale bits: e4m3 (NVFP4) or ue8m0 (MXFP4)
        return x
    if framework == "cupy":
        return x.get()
    return x


def _is_stream_object(stream):
    return hasattr(stream, "cuda_stream") or hasattr(stream, "ptr")


def _stream_device(stream):
    """The CUDA device index of a torch or CuPy stream object, or None when it does not say."""
    device = getattr(stream, "device", None)  # torch.cuda.Stream: a torch.device
    if device is not None and getattr(device, "index", None) is not None:
        return int(device.index)
    device_id = getattr(stream, "device_id", None)  # cupy.cuda.Stream
    return int(device_id) if isinstance(device_id, int) else None


def _stream_handle(stream, like, device_index=None):
    """The CUDA stream as an integer handle: given (int, torch.cuda.Stream, cupy Stream; an object's
    device must be `device_index`), else the current stream of `like`'s framework. An int handle is
    taken as it is: it must name a live stream of the layer's device (0 is the legacy default stream)."""
    if stream is not None:
        if isinstance(stream, bool) or not (isinstance(stream, int) or _is_stream_object(stream)):
            raise Error(f"fp4moe: stream must be an int handle, a torch.cuda.Stream or a cupy Stream, got "
                        f"{_type_name(stream)}")
        if isinstance(stream, int):
            if stream < 0 or stream >= 1 << 64:
                raise Error(f"fp4moe: stream: an int handle must be in [0, 2**64), got {stream}")
            return stream
        index = _stream_device(stream)
        if device_index is not None and index is not None and index != device_index:
            raise Error(f"fp4moe: stream: expected a stream of cuda:{device_index} (the layer's device), got one of "
                        f"cuda:{index}")
        for attribute in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
            if hasattr(stream, attribute):
                return int(getattr(stream, attribute))
    framework = _framework(like)
    if framework == "torch":
        import torch
        if like.device.type != "cuda":
            return 0  # the extension then reports the tensor's device
        return torch.cuda.current_stream(like.device).cuda_stream
    if framework == "cupy":
        import cupy
        return cupy.cuda.get_current_stream().ptr
    if framework == "numpy":
        return 0  # host arrays: the extension then reports the tensor's device
    raise Error(f"fp4moe: no current stream is known for a {_type_name(like)} (torch and CuPy tensors have one); "
                "pass stream= (an int handle; 0 is the legacy default stream)")


def _shape(where, name, x, rank):
    """x's shape as a tuple of `rank` ints, or fp4moe.Error naming the argument (before any allocation)."""
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise Error(f"{where}: {name}: expected a tensor (torch, CuPy, NumPy or another DLPack array), got "
                    f"{_type_name(x)}")
    shape = tuple(int(d) for d in shape)
    if len(shape) != rank:
        raise Error(f"{where}: {name}: expected a tensor of rank {rank}, got shape {list(shape)}")
    return shape


def _parse_device(device):
    """("cpu", 0) or ("cuda", index) from "cpu", "cuda", "cuda:N" or a torch.device."""
    text = str(device)
    if text == "cpu":
        return "cpu", 0
    if text == "cuda" or text.startswith("cuda:"):
        if ":" in text:
            index = text.split(":", 1)[1]
            if not index.isdigit():
                raise Error(f"fp4moe: device must be 'cpu', 'cuda' or 'cuda:N', got '{text}'")
            return "cuda", int(index)
        try:
            import torch
            return "cuda", torch.cuda.current_device()
        except ImportError:
            return "cuda", 0
    raise Error(f"fp4moe: device must be 'cpu', 'cuda' or 'cuda:N', got '{text}'")


def _allocate_workspace(nbytes, index):
    """The layer's device workspace, allocated once by torch or CuPy (whichever is installed); None
    without either (JAX calls get theirs from XLA: fp4moe.jax_ops)."""
    nbytes = max(int(nbytes), 256)
    try:
        import torch
        return torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    except ImportError:
        pass
    try:
        import cupy
        with cupy.cuda.Device(index):
            return cupy.empty(nbytes, dtype=cupy.uint8)
    except ImportError:
        pass
    return None


class MoeLayer:
    """One NVFP4 or MXFP4 MoE layer with prepared weights on a device ("cuda", "cuda:N" or "cpu").

    Weights are read once (any DLPack framework, host or device; device tensors are copied to the
    host first) and converted to the kernels' layout; `scales_swizzled` says the block scales come in
    the 128x4-swizzled layout (NVFP4 only), `w13_up_gate` that w13's rows are [up; gate] (FlashInfer's
    order). `weight_format` ("nvfp4" or "mxfp4"; default: the problem's, "nvfp4" unless the problem or
    preset says otherwise) sets the weights' format: the layer's problem is then
    problem.with_weight_format(weight_format). MXFP4 weights: w13 [E, w13_rows, H/2], w13_scale uint8
    ue8m0 codes [E, w13_rows, H/32], w2 [E, H, I/2], w2_scale [E, H, I/32], optional biases; the
    *_scale_2 and input scales must be absent; the mode is w4a16.
    A forward takes at most `max_tokens` tokens. The layer's own workspace serves one forward at a
    time; forwards of the same weights on several streams at once (e.g. two overlapped micro-batches)
    each pass their own workspace (`new_workspace()`) to `forward_into` / `__call__`.
    """

    def __init__(self, problem, weights, *, device="cuda", max_tokens=8192, scales_swizzled=False,
                 w13_up_gate=False, weight_format=None):
        _check_problem("MoeLayer", problem)
        problem = _with_weight_format("MoeLayer", problem, weight_format)
        max_tokens = _index("MoeLayer", "max_tokens", max_tokens)
        kind, index = _parse_device(device)
        host = {name: _to_host(name, value) for name, value in _weights_dict("MoeLayer", weights).items()}
        self._impl = _fp4moe.Layer(problem, host, kind, max_tokens, index, scales_swizzled, w13_up_gate)
        self._on_cuda = kind == "cuda"
        self._device_index = index
        self._workspace = _allocate_workspace(self._impl.workspace_size(), index) if self._on_cuda else None

    @property
    def problem(self):
        return self._impl.problem

    @property
    def device(self):
        return self._impl.device

    @property
    def max_tokens(self):
        return self._impl.max_tokens

    def __repr__(self):
        return f"fp4moe.MoeLayer({self.problem.describe()}, device={self.device}, max_tokens={self.max_tokens})"

    def workspace_size(self):
        """Bytes of device workspace one forward needs (0 on the cpu)."""
        return self._impl.workspace_size()

    def new_workspace(self):
        """A workspace of its own for concurrent forwards (torch or CuPy, on the layer's GPU; None on the cpu)."""
        if not self._on_cuda:
            return None
        workspace = _allocate_workspace(self._impl.workspace_size(), self._device_index)
        if workspace is None:
            raise Error("MoeLayer.new_workspace: a cuda workspace is allocated with torch or CuPy; neither is installed")
        return workspace

    def tactic(self, num_tokens):
        """The expert-GEMM tactic a forward of num_tokens tokens uses (cuda layers)."""
        return self._impl.tactic(num_tokens)

    def use_tune_cache(self, path):
        """Choose tactics from this tuning cache file (`fp4moe tune`); a bad file warns once and is ignored."""
        self._impl.use_tune_cache(str(path))

    def __call__(self, hidden_states, router_logits=None, *, routing_bias=None, topk_ids=None, topk_weights=None,
                 stream=None, output_dtype="bfloat16", workspace=None):
        """Runs the layer; returns (output [T, H] bf16, topk_ids [T, k] int32, topk_weights [T, k] float32),
        allocated in hidden_states' framework. With routing method "precomputed", pass topk_ids and
        topk_weights instead of router_logits (they are returned as given). output_dtype="float32" gives
        the fp32 sums before the bf16 rounding: partial outputs (tensor / expert parallelism) that are
        added in fp32 and rounded once equal the whole layer's up to fp32 summation order. workspace: see
        forward_into."""
        output, topk_ids, topk_weights = _forward_outputs("MoeLayer", self.problem, hidden_states, topk_ids,
                                                          topk_weights, output_dtype)
        self.forward_into(hidden_states, router_logits, routing_bias=routing_bias, topk_ids=topk_ids,
                          topk_weights=topk_weights, output=output, stream=stream, workspace=workspace)
        return output, topk_ids, topk_weights

    def forward_into(self, hidden_states, router_logits=None, *, routing_bias=None, topk_ids, topk_weights, output,
                     stream=None, workspace=None):
        """Runs the layer into caller tensors (no allocation). topk_ids / topk_weights are written, or
        read with routing method precomputed. output is bf16 [T, H], or float32 [T, H] for the fp32
        sums before the rounding (see __call__'s output_dtype). workspace: a uint8 device tensor of at
        least workspace_size() bytes (new_workspace()); default the layer's own, which serves one
        forward at a time."""
        if workspace is None:
            workspace = self._workspace
            if self._on_cuda and workspace is None:
                raise Error("MoeLayer.forward_into: a cuda layer's workspace is allocated with torch or CuPy and "
                            "neither is installed (pass workspace=, or call the layer from JAX through "
                            "fp4moe.jax_ops, which XLA allocates for)")
        handle = _stream_handle(stream, hidden_states, self._device_index) if self._on_cuda else 0
        self._impl.forward(hidden_states, router_logits, routing_bias, topk_ids, topk_weights, output, workspace,
                           handle)


    # ---- the layer as stages (cuda): route -> prepare -> experts -> finalize, the fused forward's bits ----

    def _swizzled(self, where, scale_layout):
        if scale_layout not in ("linear", "swizzled"):
            raise Error(f"{where}: scale_layout must be 'linear' or 'swizzled', got {scale_layout!r}")
        return scale_layout == "swizzled"

    def prepared_rows(self, num_tokens, *, scale_layout="linear"):
        """What prepare writes for num_tokens tokens: a dict with num_rows (S: T, or T * k where a token's
        slots differ), rows_top_k (ids per row: k or 1), format ("bf16" in w4a16, "nvfp4" in w4a4),
        scale_layout, values_shape and scales_shape (None for bf16)."""
        swizzled = self._swizzled("MoeLayer.prepared_rows", scale_layout)
        return self._impl.prepared_rows(_index("MoeLayer.prepared_rows", "num_tokens", num_tokens), swizzled)

    def prepare(self, hidden_states, topk_ids=None, topk_weights=None, *, scale_layout="linear", values=None,
                scales=None, stream=None):
        """Stage 2: hidden_states [T, H] -> (values, scales), the GEMM1 operand rows: bf16 [S, H] (w4a16;
        scales None) or NVFP4, packed e2m1 uint8 [S, H/2] with e4m3 block scales (uint8 bits; [S, H/16], or
        the 128x4-swizzled bytes with scale_layout="swizzled"). Row order: token t (S = T), or entry t*k + j
        (S = T*k; per-expert input scales, which read topk_ids, or the router weight on the input, which
        reads topk_weights). values / scales: caller tensors to write (default: allocated)."""
        where = "MoeLayer.prepare"
        swizzled = self._swizzled(where, scale_layout)
        T = _shape(where, "hidden_states", hidden_states, 2)[0]
        if T > self.max_tokens:
            raise Error(f"{where}: hidden_states: T = {T} exceeds the layer's max_tokens = {self.max_tokens}")
        rows = self._impl.prepared_rows(T, swizzled)
        if values is None:
            values = _empty(hidden_states, rows["values_shape"], "bf16" if rows["format"] == "bf16" else "uint8")
        if scales is None and rows["scales_shape"] is not None:
            scales = _empty(hidden_states, rows["scales_shape"], "uint8")
        handle = _stream_handle(stream, hidden_states, self._device_index) if self._on_cuda else 0
        self._impl.prepare(hidden_states, topk_ids, topk_weights, values, scales, swizzled, handle)
        return values, scales

    def experts(self, values, scales, topk_ids, *, scale_layout="linear", y=None, stream=None, workspace=None):
        """Stage 3: rows (from prepare, or received from other ranks, in any order) with their expert ids
        topk_ids [S, rows_top_k] -> y float32 [S * rows_top_k, H], row s * rows_top_k + j the output of
        row s's j-th expert without w2_bias (finalize adds it); entries whose id is outside [0, E) have no
        GEMM row and are not written. The tactic is the fused forward's for ceil(S * rows_top_k / k) tokens."""
        where = "MoeLayer.experts"
        swizzled = self._swizzled(where, scale_layout)
        S, rk = _shape(where, "topk_ids", topk_ids, 2)
        if y is None:
            y = _empty(topk_ids, (S * rk, self.problem.hidden), "float32")
        if workspace is None:
            workspace = self._workspace
        handle = _stream_handle(stream, topk_ids, self._device_index) if self._on_cuda else 0
        self._impl.experts(values, scales, swizzled, topk_ids, y, workspace, handle)
        return y

    def finalize(self, y, topk_ids, topk_weights, *, output=None, output_dtype="bfloat16", stream=None):
        """Stage 4: y [T * k, H] (experts) -> output [T, H]: the weighted sum of each token's slots in slot
        order (+ w2_bias), bf16 or the float32 sums; ids outside [0, E) make their token's row NaN, or
        add nothing with skip_foreign_ids (an expert-parallel rank)."""
        where = "MoeLayer.finalize"
        if output_dtype not in ("bfloat16", "float32"):
            raise Error(f"{where}: output_dtype must be 'bfloat16' or 'float32', got {output_dtype!r}")
        T = _shape(where, "topk_ids", topk_ids, 2)[0]
        if output is None:
            output = _empty(y, (T, self.problem.hidden), "bf16" if output_dtype == "bfloat16" else "float32")
        handle = _stream_handle(stream, y, self._device_index) if self._on_cuda else 0
        self._impl.finalize(y, topk_ids, topk_weights, output, handle)
        return output


class Router:
    """Routing alone (docs/numerics.md, "Routing methods") over the experts of `problem` (its routing method, k, groups,
    scaling): the whole layer's routing, which expert-parallel ranks share before each runs its own
    experts. On "cuda" the same kernel and bits as MoeLayer's routing; on "cpu" the reference."""

    def __init__(self, problem, *, device="cuda"):
        _check_problem("Router", problem)
        kind, index = _parse_device(device)
        self._impl = _fp4moe.Router(problem, kind, index)
        self._device_index = index
        self.problem = problem

    @property
    def device(self):
        return self._impl.device

    def __repr__(self):
        return f"fp4moe.Router({self.problem.describe()}, device={self.device})"

    def __call__(self, router_logits, routing_bias=None, *, stream=None):
        """(topk_ids [T, k] int32, topk_weights [T, k] float32), allocated like router_logits."""
        tokens, k = _shape("Router", "router_logits", router_logits, 2)[0], self.problem.top_k
        topk_ids = _empty(router_logits, (tokens, k), "int32")
        topk_weights = _empty(router_logits, (tokens, k), "float32")
        handle = 0 if self._impl.device == "cpu" else _stream_handle(stream, router_logits, self._device_index)
        self._impl.route(router_logits, routing_bias, topk_ids, topk_weights, handle)
        return topk_ids, topk_weights


# ---- expert parallelism, all-to-all -----------------------------------------------------------------
def virtual_ranks(size, *, device="cuda", timeout_seconds=120.0):
    """`size` communicators of one in-process group on one GPU (the exchanges are device copies): for
    tests and single-GPU benchmarks of ExpertParallelLayer. Each rank's layer is driven from its own
    thread; a call that waits longer than timeout_seconds for the other ranks fails, and so does every
    later call of the group."""
    kind, index = _parse_device(device)
    if kind != "cuda":
        raise Error(f"virtual_ranks: device must be a cuda device, got {device!r}")
    return _fp4moe.virtual_ranks(_index("virtual_ranks", "size", size), index, float(timeout_seconds))


def nccl_unique_id():
    """A new NCCL unique id (bytes) for nccl_communicator: made on one rank, broadcast by the caller's group."""
    return _fp4moe.nccl_unique_id()


def nccl_communicator(unique_id, rank, size, *, device="cuda"):
    """Rank `rank` of an NCCL group of `size` ranks on `device` (ncclCommInitRank with unique_id; returns
    once every rank has joined). NCCL is loaded at run time (the process's copy, e.g. torch's)."""
    kind, index = _parse_device(device)
    if kind != "cuda":
        raise Error(f"nccl_communicator: device must be a cuda device, got {device!r}")
    if not isinstance(unique_id, bytes):
        raise Error(f"nccl_communicator: unique_id must be the bytes of nccl_unique_id(), got {_type_name(unique_id)}")
    return _fp4moe.nccl_communicator(unique_id, int(rank), int(size), index)


class ExpertParallelLayer:
    """One rank of an MoE layer whose experts are split over a group (docs/numerics.md, "All-to-all
    expert parallelism"): each token is quantized once on its own rank, sent as FP4 rows (bf16 in
    w4a16) only to the ranks that hold its experts, computed there, and its fp32 results come back and
    are summed on its rank in slot order. Rank r of N holds experts io::expert_range(E, r, N): the first
    E mod N ranks one more than the others.

    problem and weights are the whole layer's (host or device arrays; the rank prepares only its own
    experts from them, in the linear scale layout). communicator: from virtual_ranks or
    nccl_communicator. scheme "all_to_all" (the default) sends each row only to the ranks of its
    experts; "all_gather" sends every row with its token's ids and weights to every rank, and each
    rank's fp32 partial outputs of the tokens to their ranks, summed there in rank order (the
    data-parallel prepare/finalize; the output up to fp32 summation order). receive_capacity_rows:
    the rows one rank can receive in a forward (0: every rank's max_tokens, so that a rank may receive
    every row); a forward that would overflow it fails on every rank. A forward waits for the other
    ranks and reads the send counts back on the host: it is not capturable in a CUDA graph."""

    def __init__(self, problem, weights, communicator, *, device="cuda", max_tokens=8192, receive_capacity_rows=0,
                 w13_up_gate=False, weight_format=None, scheme="all_to_all"):
        _check_problem("ExpertParallelLayer", problem)
        if scheme not in ("all_to_all", "all_gather"):
            raise Error(f"ExpertParallelLayer: scheme must be 'all_to_all' or 'all_gather', got {scheme!r}")
        problem = _with_weight_format("ExpertParallelLayer", problem, weight_format)
        kind, index = _parse_device(device)
        if kind != "cuda":
            raise Error(f"ExpertParallelLayer: device must be a cuda device, got {device!r}")
        if not isinstance(communicator, _fp4moe.Communicator):
            raise Error(f"ExpertParallelLayer: communicator must come from fp4moe.virtual_ranks or "
                        f"fp4moe.nccl_communicator, got {_type_name(communicator)}")
        max_tokens = _index("ExpertParallelLayer", "max_tokens", max_tokens)
        capacity = _index("ExpertParallelLayer", "receive_capacity_rows", receive_capacity_rows)
        host = {name: _to_host(name, value) for name, value in _weights_dict("ExpertParallelLayer", weights).items()}
        self._impl = _fp4moe.ExpertParallelLayer(problem, host, communicator, max_tokens, index, capacity, w13_up_gate,
                                                 scheme)
        self._communicator = communicator
        self._device_index = index

    @property
    def problem(self):
        return self._impl.problem

    @property
    def scheme(self):
        return self._impl.scheme

    @property
    def local_problem(self):
        """This rank's experts as the problem its runner runs (precomputed routing, foreign ids skipped)."""
        return self._impl.local_problem

    @property
    def rank(self):
        return self._impl.rank

    @property
    def size(self):
        return self._impl.size

    @property
    def max_tokens(self):
        return self._impl.max_tokens

    def __repr__(self):
        return (f"fp4moe.ExpertParallelLayer({self.problem.describe()}, {self.scheme}, rank {self.rank} of {self.size}, "
                f"device=cuda:{self._device_index}, max_tokens={self.max_tokens})")

    def last_traffic(self):
        """{rows_sent, rows_received, dispatch_bytes, combine_bytes} of this rank's last forward."""
        return self._impl.last_traffic()

    def __call__(self, hidden_states, router_logits=None, *, routing_bias=None, topk_ids=None, topk_weights=None,
                 stream=None, output_dtype="bfloat16"):
        """This rank's tokens: (output [T, H], topk_ids [T, k], topk_weights [T, k]) as MoeLayer returns
        them, for the whole layer's routing (ids of the whole layer's experts)."""
        output, topk_ids, topk_weights = _forward_outputs("ExpertParallelLayer", self.problem, hidden_states,
                                                          topk_ids, topk_weights, output_dtype)
        handle = _stream_handle(stream, hidden_states, self._device_index)
        self._impl.forward(hidden_states, router_logits, routing_bias, topk_ids, topk_weights, output, handle)
        return output, topk_ids, topk_weights


def _forward_outputs(where, problem, hidden_states, topk_ids, topk_weights, output_dtype):
    """(output, topk_ids, topk_weights) of a layer call, allocated like hidden_states: the output [T, H] in
    output_dtype, and the routing's [T, k] outputs (precomputed routing: the caller's, required)."""
    if output_dtype not in ("bfloat16", "float32"):
        raise Error(f"{where}: output_dtype must be 'bfloat16' or 'float32', got {output_dtype!r}")
    T = _shape(where, "hidden_states", hidden_states, 2)[0]
    output = _empty(hidden_states, (T, problem.hidden), "bf16" if output_dtype == "bfloat16" else "float32")
    if problem.routing_method != "precomputed":
        if topk_ids is not None or topk_weights is not None:
            raise Error(f"{where}: topk_ids / topk_weights are outputs with routing method "
                        f"{problem.routing_method}; give router_logits only")
        topk_ids = _empty(hidden_states, (T, problem.top_k), "int32")
        topk_weights = _empty(hidden_states, (T, problem.top_k), "float32")
    elif topk_ids is None or topk_weights is None:
        raise Error(f"{where}: routing method precomputed needs topk_ids [T, k] int32 and topk_weights [T, k] float32")
    return output, topk_ids, topk_weights


def _index(where, name, value):
    """An int argument (bool excluded), or fp4moe.Error naming it."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise Error(f"{where}: {name} must be an int, got {_type_name(value)}")
    value = int(value.__index__())
    if not -(1 << 31) <= value < 1 << 31:
        raise Error(f"{where}: {name} must fit in 32 bits, got {value}")
    return value


def _weights_dict(where, weights):
    if not hasattr(weights, "items"):
        raise Error(f"{where}: weights must be a dict of tensors, got {_type_name(weights)}")
    weights = dict(weights.items())
    for key in weights:
        if not isinstance(key, str):
            raise Error(f"{where}: weights: keys must be tensor names (str), got {_type_name(key)}")
    return weights


def _check_problem(where, problem):
    if not isinstance(problem, Problem):
        raise Error(f"{where}: problem must be an fp4moe.Problem, got {_type_name(problem)}")


def _with_weight_format(where, problem, weight_format):
    """problem, or problem in weight_format ("nvfp4", "mxfp4"; None: the problem's own)."""
    if weight_format is None or weight_format == problem.weight_format:
        return problem
    if weight_format not in WEIGHT_FORMATS:
        raise Error(f"{where}: weight_format must be one of {', '.join(WEIGHT_FORMATS)} (or None: the problem's), "
                    f"got {weight_format!r}")
    try:
        return problem.with_weight_format(weight_format)
    except Error as e:
        raise Error(f"{where}: weight_format {weight_format}: {e}") from None


def _check_framework(where, framework):
    if framework not in ("numpy", "torch"):
        raise Error(f"{where}: framework must be 'numpy' or 'torch', got {framework!r}")


_BF16_BITS = ("hidden_states", "router_weight")  # host arrays holding bf16 as uint16 bits


def _convert(value, framework, key=""):
    """The extension's host arrays (and dicts of them) as NumPy arrays or torch CPU tensors, no copy."""
    if isinstance(value, dict):
        return {k: _convert(v, framework, k) for k, v in value.items()}
    if not hasattr(value, "__dlpack__"):
        return value
    if framework == "numpy":
        import numpy
        return numpy.asarray(value)
    if framework == "torch":
        import torch
        tensor = torch.from_dlpack(value)
        return tensor.view(torch.bfloat16) if key in _BF16_BITS else tensor
    raise Error(f"fp4moe: framework must be 'numpy' or 'torch', got '{framework}'")


def load_checkpoint_layer(checkpoint, layer, *, ep_rank=0, ep_size=1, tp_rank=0, tp_size=1, fusion="rescale_to_max",
                          framework="numpy"):
    """One MoE layer of a checkpoint directory (NVFP4: ModelOpt or compressed-tensors; MXFP4: gpt-oss):
    a dict with "problem" (Problem; its weight_format the checkpoint's; for an expert-parallel rank its
    experts with precomputed routing and skip_foreign_ids), "weight_format" ("nvfp4" or "mxfp4", the
    same), "layer_problem" (the whole layer's, for routing), "weights" (host arrays for MoeLayer; NVFP4
    block scales as uint8 e4m3 bits, "w13_input_scale_max", the whole layer's, in w4a4; MXFP4 uint8
    ue8m0 codes, no [E] scales, the expert biases),
    "router_weight" [E_total, H] (bf16; uint16 bits in NumPy), "routing_bias" [E_total] when the
    model has one (deepseek_v3's correction bias, MoeLayer's routing_bias), "router_bias" [E_total]
    float32 for gpt-oss (the router's own bias: router_logits = x . router_weight^T + router_bias),
    "expert_begin" / "expert_end" (this expert-parallel rank's global ids),
    "inter_begin" / "inter_end" of "total_inter" (this tensor-parallel rank's columns of I; see
    tensor_parallel_shard) and the w1/w3 scale-fusion report. `framework`: "numpy" or "torch" (CPU tensors)."""
    where = "load_checkpoint_layer"
    layer = _index(where, "layer", layer)
    ep_rank, ep_size = _index(where, "ep_rank", ep_rank), _index(where, "ep_size", ep_size)
    tp_rank, tp_size = _index(where, "tp_rank", tp_rank), _index(where, "tp_size", tp_size)
    for rank_name, rank, size_name, size in (("ep_rank", ep_rank, "ep_size", ep_size),
                                             ("tp_rank", tp_rank, "tp_size", tp_size)):
        if size < 1 or not 0 <= rank < size:
            raise Error(f"{where}: expected 0 <= {rank_name} < {size_name} with {size_name} >= 1, got {rank_name} "
                        f"{rank}, {size_name} {size}")
    if layer < 0:
        raise Error(f"{where}: layer must be >= 0, got {layer}")
    if not isinstance(fusion, str):
        raise Error(f"{where}: fusion must be a string, got {_type_name(fusion)}")
    _check_framework(where, framework)
    return _convert(_fp4moe.load_layer(str(checkpoint), layer, ep_rank=ep_rank, ep_size=ep_size, tp_rank=tp_rank,
                                       tp_size=tp_size, fusion=fusion), framework)


def tensor_parallel_shard(problem, weights, rank, size, framework="numpy"):
    """Tensor parallelism: rank `rank` of `size` keeps a contiguous share of the intermediate columns of
    every expert, in whole blocks of problem.weight_block columns (16 NVFP4, 32 MXFP4; I/block >= size;
    the first ranks hold one block more when they do not divide evenly). Returns {"problem" (inter = the share), "weights", "inter_begin",
    "inter_end"}. Each rank's layer is a plain MoE layer; the sum
    of the ranks' outputs is the whole layer's output, up to fp32 summation order and the bf16
    rounding of each rank's partial output (fp4moe.torch_ops.FusedMoE all-reduces it when given a
    process group)."""
    _check_problem("tensor_parallel_shard", problem)
    rank, size = _index("tensor_parallel_shard", "rank", rank), _index("tensor_parallel_shard", "size", size)
    if size < 1 or not 0 <= rank < size:
        raise Error(f"tensor_parallel_shard: expected 0 <= rank < size with size >= 1, got rank {rank}, size {size}")
    _check_framework("tensor_parallel_shard", framework)
    host = {name: _to_host(name, value) for name, value in _weights_dict("tensor_parallel_shard", weights).items()}
    return _convert(_fp4moe.tensor_parallel_shard(problem, host, rank, size), framework)


def random_case(problem, num_tokens, seed=1, framework="numpy", expert_biases=False, weight_format=None):
    """Random weights and inputs for `problem` (host arrays): {"weights": {...}, "hidden_states"
    (bf16; uint16 bits in NumPy), "router_logits" or "topk_ids" / "topk_weights", "routing_bias" when
    the method is deepseek_v3}. The weights are of the problem's weight_format, or of `weight_format`
    ("nvfp4", "mxfp4") when given: NVFP4 with e4m3 scales and the [E] scales, MXFP4 with uint8 ue8m0
    codes [.., K/32] and no [E] scales. `framework`: "numpy" or "torch" (CPU tensors). expert_biases:
    the weights also hold random "w13_bias" [E, w13_rows] and "w2_bias" [E, H] (float32, gpt-oss
    style)."""
    _check_problem("random_case", problem)
    problem = _with_weight_format("random_case", problem, weight_format)
    return _convert(_fp4moe.random_case(problem, num_tokens, seed, expert_biases), framework)
