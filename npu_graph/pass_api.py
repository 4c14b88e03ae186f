"""What every graph pass receives and returns: PassContext in, PassResult out.

A pass knows no devices. What it may know of the machine a graph is compiled for is the TargetDescription the
target builds (npu_graph.targets.description.describe) and the context carries: the cost profile for
scheduling, how a planned weight layout is realised, whether streams need explicit switches. The node.meta
keys passes hand to later passes, the lowering and the runtime are declared once, in MetaKey.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from npu_graph.config import CompilerConfig
    from npu_graph.observe.dump import GraphDump


class MetaKey:
    """node.meta keys read after the pass that writes them (torch's own "val" aside)."""

    STREAM = "stream"                    # int: the stream a node launches on (assign_streams)
    SUPERKERNEL = "superkernel"          # int: the SuperKernel region a node belongs to (partition_superkernels)
    LAYOUT = "layout"                    # dict: a weight placeholder's planned layout (layout_nz)
    CREATED_BY = "created_by"            # str: the pass that made a node, "capture" for captured ones (pipeline)
    FUSED_INDEXER = "ascend_dsa_indexer"  # Node: the fused lightning_indexer whose indices a top-k node gives
    SUPERKERNEL_COMPILER = "superkernel_compiler"  # gm.meta, str: what compiles the SuperKernel regions


@dataclass(frozen=True)
class DeviceProfile:
    """A device's costs for the scheduling cost model (passes/streams/cost_model.py)."""

    name: str
    flops_per_s: float   # dense matmul peak in the compute dtype
    bytes_per_s: float   # memory bandwidth
    launch_s: float      # fixed cost of one operator launch
    event_s: float       # one cross-stream record + wait

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


PRE_TRANSPOSED = "pre-transposed contiguous [K, N]"  # a weight form: W [N, K] stored once as W.t().contiguous()
WeightForm = Callable[["torch.dtype", tuple[int, ...]], "str | None"]


@dataclass(frozen=True)
class TargetDescription:
    """What passes may ask of the target; the target builds it, passes never look at devices themselves.

    `weight_form(dtype, shape)` is the form the graph itself gives a matmul weight (PRE_TRANSPOSED) or None to
    leave it; `weight_form=None` means the lowering realises planned layouts (the NPU casts NZ weights at load).
    `stream_device` is the device whose launching stream set_stream nodes switch; None where streams are host
    threads that need no switch (the CPU). `channels_last_depthwise_conv`: the target's depthwise convolution
    is faster reading a channels-last input through a channels-last weight view. `dsa_key_starts`: the fused DSA
    operators take each batch row's first visible key (`key_starts`: left-padded batches); where they do not,
    a mask whose rows start past key 0 fails the run-time check and the graph runs eagerly."""

    name: str
    cost: DeviceProfile
    weight_form: WeightForm | None = None
    stream_device: str | None = None
    channels_last_depthwise_conv: bool = False
    dsa_key_starts: bool = False


@dataclass(frozen=True)
class GraphInputs:
    """What the backend knows of a graph's inputs: which are model parameters (`param_indices`, placeholder
    positions; their work is hoisted) and which are Python floats Dynamo passes as 0-dim tensors (`float_inputs`:
    position -> the float's symbol, which a pass may ask Dynamo to make a constant, npu_graph.capture)."""

    param_indices: tuple[int, ...] = ()
    float_inputs: dict[int, str] = field(default_factory=dict)


@dataclass
class PassContext:
    """What a pass may read: the config, the target's description (`machine`: the compiler passes the one
    npu_graph.targets.description.describe builds; there is no default, a pass context describes one target),
    whether the graph is inference-only, the dump, which graph inputs are model parameters (`param_indices`,
    placeholder positions; their work is hoisted) and which are floats Dynamo made tensors (`float_inputs`,
    GraphInputs)."""

    config: CompilerConfig | None
    machine: TargetDescription
    inference: bool = True
    fake_mode: Any = None
    dump: GraphDump | None = None
    graph_name: str = "graph"
    param_indices: tuple[int, ...] = ()
    float_inputs: dict[int, str] = field(default_factory=dict)

    def ask_constant(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
        """When `node` is a placeholder Dynamo made of a Python float (`float_inputs`), ask Dynamo to trace the
        frame again with that float a constant (raises Dynamo's restart, which the backend lets through);
        otherwise return."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        symbol = self.float_inputs.get(placeholders.index(node)) if node in placeholders else None
        if symbol is not None:
            from torch._dynamo.exc import TensorifyScalarRestartAnalysis
            from torch._dynamo.symbolic_convert import TensorifyState

            TensorifyState.specialize(symbol)
            raise TensorifyScalarRestartAnalysis

    def param_placeholders(self, gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
        """The placeholders of `gm` that are model parameters (`param_indices`)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return {placeholders[i] for i in self.param_indices if i < len(placeholders)}


@dataclass
class PassResult:
    """What a pass did: whether the graph changed, and counts worth showing (matches, removals...).

    `summary` holds top-level sections of the graph's summary.json that this pass owns (e.g. `quantized`,
    `layouts`, `streams`, `superkernels`); they are merged into the report after the pipeline ran."""

    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
