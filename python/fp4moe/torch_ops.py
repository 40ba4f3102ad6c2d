"""PyTorch ops over fp4moe.MoeLayer, for torch.compile and CUDA graphs.

    from fp4moe.torch_ops import FusedMoE
    moe = FusedMoE(problem, weights, device="cuda:0", max_tokens=8192)  # a torch.nn.Module
    output = moe(hidden_states, router_logits)                           # torch.ops.fp4moe.moe_forward
    output, topk_ids, topk_weights = moe(hidden_states, router_logits, return_routing=True)

The ops name their layer by an integer handle (a registry of live layers), so the graph that
torch.compile traces holds only tensors and ints:
    torch.ops.fp4moe.moe_forward(handle, hidden_states, router_logits, routing_bias, fp32_output=False)
        -> (output, topk_ids, topk_weights)
    torch.ops.fp4moe.moe_forward_routed(handle, hidden_states, topk_ids, topk_weights, fp32_output=False) -> output
fp32_output gives the fp32 sums before the bf16 rounding (partial outputs to add before rounding).
Both allocate their outputs with torch (the caching allocator; a captured graph's pool while
capturing) and launch on the current stream without synchronising.
"""

import itertools
import weakref
from typing import Optional

import torch

from . import Error, ExpertParallelLayer, MoeLayer, Router, _fp4moe, nccl_communicator

_layers = weakref.WeakValueDictionary()  # handle -> MoeLayer or Router
_handles = itertools.count(1)


def register_layer(layer) -> int:
    """A handle for `layer` (an fp4moe.MoeLayer or fp4moe.Router) to pass to the ops (valid while it lives)."""
    if not isinstance(layer, (MoeLayer, Router)):
        raise Error(f"register_layer: expected an fp4moe.MoeLayer or fp4moe.Router, got {type(layer).__module__}."
                    f"{type(layer).__name__}")
    handle = next(_handles)
    _layers[handle] = layer
    return handle


def _layer(handle: int):
    layer = _layers.get(handle)
    if layer is None:
        raise Error(f"fp4moe op: no live layer has handle {handle} (register it with fp4moe.torch_ops.register_layer)")
    return layer


@torch.library.custom_op("fp4moe::moe_forward", mutates_args=())
def moe_forward(layer: int, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                routing_bias: Optional[torch.Tensor] = None,
                fp32_output: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _layer(layer)(hidden_states, router_logits, routing_bias=routing_bias, output_dtype=_output_dtype(fp32_output))


def _output_dtype(fp32_output):
    return "float32" if fp32_output else "bfloat16"


@moe_forward.register_fake
def _(layer, hidden_states, router_logits, routing_bias=None, fp32_output=False):
    problem = _layer(layer).problem
    tokens = hidden_states.shape[0]
    return (hidden_states.new_empty((tokens, problem.hidden), dtype=torch.float32 if fp32_output else torch.bfloat16),
            hidden_states.new_empty((tokens, problem.top_k), dtype=torch.int32),
            hidden_states.new_empty((tokens, problem.top_k), dtype=torch.float32))


@torch.library.custom_op("fp4moe::moe_forward_routed", mutates_args=())
def moe_forward_routed(layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, fp32_output: bool = False) -> torch.Tensor:
    output, _, _ = _layer(layer)(hidden_states, topk_ids=topk_ids, topk_weights=topk_weights,
                                 output_dtype=_output_dtype(fp32_output))
    return output


@moe_forward_routed.register_fake
def _(layer, hidden_states, topk_ids, topk_weights, fp32_output=False):
    return hidden_states.new_empty((hidden_states.shape[0], _layer(layer).problem.hidden),
                                   dtype=torch.float32 if fp32_output else torch.bfloat16)


@torch.library.custom_op("fp4moe::route", mutates_args=())
def route(router: int, router_logits: torch.Tensor,
          routing_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer(router)(router_logits, routing_bias)


@route.register_fake
def _(router, router_logits, routing_bias=None):
    k = _layer(router).problem.top_k
    return (router_logits.new_empty((router_logits.shape[0], k), dtype=torch.int32),
            router_logits.new_empty((router_logits.shape[0], k), dtype=torch.float32))


def _tensor(name, x, optional=False):
    if (x is None and optional) or isinstance(x, torch.Tensor):
        return
    raise Error(f"FusedMoE: {name}: expected a torch.Tensor{' or None' if optional else ''}, got "
                f"{type(x).__module__}.{type(x).__name__}")


class FusedMoE(torch.nn.Module):
    """An NVFP4 or MXFP4 MoE layer as a torch module (weights prepared once; see fp4moe.MoeLayer, whose
    weight_format argument this takes too: "mxfp4" for gpt-oss weights, w4a16 only).

    Tensor parallelism: give each rank its shard (fp4moe.tensor_parallel_shard, or
    fp4moe.load_checkpoint_layer(..., tp_rank=, tp_size=)) and the ranks' `process_group`: the output
    is then all-reduced (sum) over it with torch.distributed. With `reduce_dtype=torch.float32` (the
    default) each rank's partial is its fp32 sums and the bf16 rounding comes once, after the
    all-reduce: the whole layer's output up to fp32 summation order; torch.bfloat16 halves the bytes
    of the all-reduce at one extra rounding per rank.

    Expert parallelism: give each rank its experts' weights (load_checkpoint_layer(..., ep_rank=,
    ep_size=), with the whole layer's "w13_input_scale_max"), its problem
    (problem.expert_parallel_rank(n_local)) and `expert_range=(begin, end)` of the whole layer's ids;
    forward then takes the whole layer's topk_ids / topk_weights, or, with `router_problem` (the whole
    layer's problem: load_checkpoint_layer's "layer_problem"), router_logits that it routes itself
    (torch.ops.fp4moe.route); it maps the ids to this rank's experts (another rank's: -1, adding
    nothing) and, with `process_group`, all-reduces.

    `parallel` names the scheme: "tp" and "ep_allreduce" are the two above (None: inferred from
    expert_range); "ep_all2all" is the all-to-all expert-parallel layer (fp4moe.ExpertParallelLayer):
    `problem` and `weights` are the whole layer's (each rank prepares its own experts from them),
    forward takes this rank's tokens and router_logits (or the whole layer's topk_ids / topk_weights),
    each token goes as FP4 rows only to the ranks of its experts and its fp32 results come back to be
    summed here. Its group is `process_group` (torch.distributed, NCCL: a communicator of fp4moe's own
    is made over it once, its id broadcast through the group) or `communicator` (fp4moe.virtual_ranks,
    fp4moe.nccl_communicator). It reads the send counts on the host: not capturable in a CUDA graph,
    and torch.compile runs it outside the graph. "dp_allgather" is the same layer's all-gather scheme
    (fp4moe.ExpertParallelLayer(scheme="all_gather")): every rank gets every rank's FP4 rows, ids and
    weights, runs its experts on all of them, and each token's rank sums the ranks' fp32 partials."""

    PARALLEL = ("tp", "ep_allreduce", "ep_all2all", "dp_allgather")

    def __init__(self, problem, weights, *, device="cuda", max_tokens=8192, scales_swizzled=False,
                 w13_up_gate=False, process_group=None, expert_range=None, router_problem=None,
                 reduce_dtype=torch.float32, weight_format=None, parallel=None, communicator=None,
                 receive_capacity_rows=0):
        super().__init__()
        if parallel is not None and parallel not in self.PARALLEL:
            raise Error(f"FusedMoE: parallel must be one of {', '.join(self.PARALLEL)} (or None), got {parallel!r}")
        self.all2all = None
        if parallel in ("ep_all2all", "dp_allgather"):
            self._init_all2all(parallel, problem, weights, device, max_tokens, scales_swizzled, w13_up_gate,
                               process_group, expert_range, router_problem, weight_format, communicator,
                               receive_capacity_rows)
            return
        if communicator is not None:
            raise Error("FusedMoE: communicator is for parallel='ep_all2all' or 'dp_allgather'")
        if parallel == "tp" and (process_group is None or expert_range is not None):
            raise Error("FusedMoE: parallel='tp' needs process_group (the ranks' shards) and no expert_range")
        if parallel == "ep_allreduce" and expert_range is None:
            raise Error("FusedMoE: parallel='ep_allreduce' needs expert_range (and the rank's problem and weights)")
        if reduce_dtype not in (torch.float32, torch.bfloat16):
            raise Error(f"FusedMoE: reduce_dtype must be torch.float32 or torch.bfloat16, got {reduce_dtype}")
        self.process_group = process_group
        # NOTE: a plain bool for forward (torch.compile), true only where partial outputs are added.
        self.fp32_partials = process_group is not None and reduce_dtype == torch.float32
        if expert_range is not None:
            begin, end = (int(v) for v in expert_range)
            if not (problem.skip_foreign_ids and end - begin == problem.num_experts):
                raise Error(f"FusedMoE: expert_range {expert_range} needs the rank's problem with {end - begin} "
                            "experts (problem.expert_parallel_rank(n_local))")
            expert_range = (begin, end)
        elif router_problem is not None:
            raise Error("FusedMoE: router_problem is for expert parallelism (with expert_range)")
        self.expert_range = expert_range
        self.layer = MoeLayer(problem, weights, device=device, max_tokens=max_tokens,
                              scales_swizzled=scales_swizzled, w13_up_gate=w13_up_gate, weight_format=weight_format)
        # NOTE: plain Python values only in forward, so that torch.compile traces it without a graph break.
        self.handle = register_layer(self.layer)
        self.precomputed = self.layer.problem.routing_method == "precomputed"
        self.router = Router(router_problem, device=device) if router_problem is not None else None
        self.router_handle = register_layer(self.router) if self.router is not None else 0

    def _init_all2all(self, parallel, problem, weights, device, max_tokens, scales_swizzled, w13_up_gate,
                      process_group, expert_range, router_problem, weight_format, communicator, receive_capacity_rows):
        if (process_group is None) == (communicator is None):
            raise Error(f"FusedMoE: parallel='{parallel}' needs exactly one of process_group (torch.distributed) "
                        "and communicator (fp4moe.virtual_ranks / nccl_communicator)")
        if expert_range is not None or router_problem is not None:
            raise Error(f"FusedMoE: parallel='{parallel}' takes the whole layer's problem and weights; expert_range "
                        "and router_problem are for 'ep_allreduce'")
        if scales_swizzled:
            raise Error(f"FusedMoE: parallel='{parallel}' takes the linear scale layout; scales_swizzled is not "
                        "supported with it yet")
        index = torch.device(device).index
        if index is None:
            index = torch.cuda.current_device()
        self.process_group = process_group
        if communicator is None:
            communicator = _group_communicator(process_group, index)
        self.all2all = ExpertParallelLayer(problem, weights, communicator, device=f"cuda:{index}",
                                           max_tokens=max_tokens, receive_capacity_rows=receive_capacity_rows,
                                           w13_up_gate=w13_up_gate, weight_format=weight_format,
                                           scheme="all_gather" if parallel == "dp_allgather" else "all_to_all")
        self.layer = self.all2all
        self.fp32_partials = False
        self.expert_range = None
        self.precomputed = self.all2all.problem.routing_method == "precomputed"
        self.router = None

    @property
    def problem(self):
        return self.layer.problem

    @torch.compiler.disable
    def _forward_all2all(self, hidden_states, router_logits, routing_bias, topk_ids, topk_weights, return_routing):
        if self.precomputed and (topk_ids is None or topk_weights is None):
            raise Error("FusedMoE: routing method precomputed needs topk_ids and topk_weights")
        if not self.precomputed and router_logits is None:
            raise Error(f"FusedMoE: router_logits is required (routing method {self.problem.routing_method})")
        output, ids, weights = self.all2all(hidden_states, router_logits, routing_bias=routing_bias,
                                            topk_ids=topk_ids if self.precomputed else None,
                                            topk_weights=topk_weights if self.precomputed else None)
        return (output, ids, weights) if return_routing else output

    def forward(self, hidden_states, router_logits=None, routing_bias=None, topk_ids=None, topk_weights=None,
                return_routing=False):
        # The ops' schemas take tensors: anything else is an fp4moe.Error here, not the dispatcher's TypeError.
        _tensor("hidden_states", hidden_states)
        _tensor("routing_bias", routing_bias, optional=True)
        _tensor("router_logits", router_logits, optional=True)
        _tensor("topk_ids", topk_ids, optional=True)
        _tensor("topk_weights", topk_weights, optional=True)
        if self.all2all is not None:
            return self._forward_all2all(hidden_states, router_logits, routing_bias, topk_ids, topk_weights,
                                         return_routing)
        if not self.precomputed and router_logits is None:
            raise Error(f"FusedMoE: router_logits is required (routing method {self.layer.problem.routing_method})")
        if self.precomputed:
            if self.router is not None and router_logits is not None:  # the whole layer's routing
                topk_ids, topk_weights = torch.ops.fp4moe.route(self.router_handle, router_logits, routing_bias)
            if topk_ids is None or topk_weights is None:
                raise Error("FusedMoE: routing method precomputed needs topk_ids and topk_weights"
                            + (" (or router_logits with router_problem)" if self.expert_range is not None else ""))
            local_ids = topk_ids
            if self.expert_range is not None:  # the whole layer's ids -> this rank's, another rank's -> -1
                begin, end = self.expert_range
                foreign = (topk_ids < begin) | (topk_ids >= end)
                local_ids = torch.where(foreign, torch.full_like(topk_ids, -1), topk_ids - begin).to(torch.int32)
            output = torch.ops.fp4moe.moe_forward_routed(self.handle, hidden_states, local_ids, topk_weights,
                                                         self.fp32_partials)
            ids, weights = topk_ids, topk_weights
        else:
            output, ids, weights = torch.ops.fp4moe.moe_forward(self.handle, hidden_states, router_logits, routing_bias,
                                                                self.fp32_partials)
        if self.process_group is not None:
            torch.distributed.all_reduce(output, group=self.process_group)
            if self.fp32_partials:
                output = output.to(torch.bfloat16)  # the one rounding, after the ranks' fp32 sum
        return (output, ids, weights) if return_routing else output

    def extra_repr(self):
        if self.all2all is not None:
            parallel = "dp_allgather" if self.all2all.scheme == "all_gather" else "ep_all2all"
            return f"{self.problem.describe()}, {parallel} rank {self.all2all.rank} of {self.all2all.size}"
        return f"{self.layer.problem.describe()}, device={self.layer.device}, max_tokens={self.layer.max_tokens}"


def _group_communicator(group, device_index):
    """fp4moe's NCCL communicator over the ranks of a torch.distributed group: rank 0 of the group makes
    the id, the group broadcasts it, every rank joins (ncclCommInitRank)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise Error("FusedMoE: process_group: torch.distributed is not initialized")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    box = [_fp4moe.nccl_unique_id() if rank == 0 else None]
    backend = dist.get_backend(group)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                               device=torch.device("cuda", device_index) if backend == "nccl" else None)
    return nccl_communicator(box[0], rank, size, device=f"cuda:{device_index}")
