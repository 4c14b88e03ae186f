"""Cost model for stream scheduling: modeled run time of one graph node on a device profile.

A node costs `launch + max(flops / peak, bytes / bandwidth)`; FLOPs and bytes come from the fake tensors in
node.meta["val"] (symbolic sizes use their hints). Views, tuple access and size arithmetic cost nothing.
`event` is the cost of one cross-stream record/wait pair, paid by the waiting node.

Profiles: "cpu" was measured on the development machine with `python -m npu_graph.passes.streams.cost_model` (that command
re-measures and prints a new table; the constants stay fixed so plans and cache keys are reproducible);
"npu" (Ascend 910B, Atlas 800T A2) and "cuda" (H200 SXM) use published peak figures.
"""
from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops_per_s: float   # dense matmul peak in the compute dtype
    bytes_per_s: float   # memory bandwidth
    launch_s: float      # fixed cost of one operator launch
    event_s: float       # one cross-stream record + wait

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


PROFILES: dict[str, DeviceProfile] = {
    # measured: `python -m npu_graph.passes.streams.cost_model`, best of 3 runs (2 shared cores, torch 2.13 CPU, fp32)
    "cpu": DeviceProfile("cpu", flops_per_s=1.9e11, bytes_per_s=4.6e10, launch_s=2.0e-6, event_s=1.1e-5),
    # Ascend 910B: 313 TFLOPS fp16/bf16, 1.6 TB/s HBM2e; ~5 us host launch, ~10 us event sync
    "npu": DeviceProfile("npu", flops_per_s=3.13e14, bytes_per_s=1.6e12, launch_s=5.0e-6, event_s=1.0e-5),
    # H200 SXM: 989 TFLOPS dense bf16, 4.8 TB/s HBM3e; ~4 us launch, ~5 us event sync
    "cuda": DeviceProfile("cuda", flops_per_s=9.89e14, bytes_per_s=4.8e12, launch_s=4.0e-6, event_s=5.0e-6),
}

aten = torch.ops.aten
_MATMUL = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_VIEWS = {aten._unsafe_view.default, aten.alias.default}
_GATHERS = {aten.embedding.default, aten.index.Tensor, aten.gather.default, aten.index_select.default}


def profile_for(target: str, device_type: str = "cpu") -> DeviceProfile:
    """The profile of the device a graph runs on: its tensors' device type, else the compile target."""
    if device_type in ("cuda", "npu"):
        return PROFILES[device_type]
    return PROFILES["npu" if target == "npu" else "cpu"]


def _size(value: Any) -> int:
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else 64
    return int(value)


def numel(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    count = 1
    for size in value.shape:
        count *= _size(size)
    return count


def nbytes(value: Any) -> int:
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    return numel(value) * value.element_size() if isinstance(value, torch.Tensor) else 0


def is_free(node: torch.fx.Node) -> bool:
    """Nodes that launch nothing: views, tuple access, size arithmetic."""
    if node.op != "call_function":
        return True
    if node.target in _VIEWS:
        return True
    if node.target is operator.getitem or not isinstance(node.target, torch._ops.OpOverload):
        return not isinstance(node.meta.get("val"), torch.Tensor) or node.target is operator.getitem
    schema = node.target._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    if schema.returns and all(r.alias_info is not None for r in schema.returns):
        return True
    return not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list))


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def _shape(arg: Any) -> list[int]:
    value = _val(arg)
    return [_size(s) for s in value.shape] if isinstance(value, torch.Tensor) else []


def node_flops(node: torch.fx.Node) -> float:
    """Multiply-adds x 2 for matmuls and the attention-like fused ops; one per output element otherwise."""
    target, args = node.target, node.args
    if target in _MATMUL:
        a, b = _shape(args[-2]), _shape(args[-1])
        return 2.0 * numel(_val(args[-2])) * (b[-1] if b else 1) if a else 0.0
    name = getattr(target, "_opname", "")
    if name == "lightning_indexer":
        k = _shape(args[1])
        keys = k[0] * k[1] if len(k) == 4 else 1
        return 2.0 * numel(_val(args[0])) * keys
    if name == "sparse_flash_attention":
        return 4.0 * numel(_val(args[0])) * (_shape(args[3]) or [1])[-1]
    return float(sum(numel(v) for v in _outputs(node)))


def _outputs(node: torch.fx.Node) -> list[Any]:
    value = node.meta.get("val")
    return list(value) if isinstance(value, (tuple, list)) else [value]


def node_bytes(node: torch.fx.Node) -> float:
    """Bytes read and written; a written input counts only through the values written into it."""
    schema = getattr(node.target, "_schema", None)
    written = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write} \
        if schema else set()
    total = 0
    for i, arg in enumerate(node.args):
        if i in written:
            continue
        if i == 0 and node.target in _GATHERS:
            total += nbytes(node.meta.get("val"))
            continue
        total += nbytes(_val(arg)) if not isinstance(arg, (tuple, list)) else sum(nbytes(_val(a)) for a in arg)
    if not written:
        total += nbytes(node.meta.get("val"))
    return float(total)


def node_seconds(node: torch.fx.Node, profile: DeviceProfile) -> float:
    """Modeled run time of one node; 0 for nodes that launch nothing."""
    if is_free(node):
        return 0.0
    compute = node_flops(node) / profile.flops_per_s
    memory = node_bytes(node) / profile.bytes_per_s
    return profile.launch_s + max(compute, memory)


def _best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _event_round_trip(rounds: int = 200) -> float:
    """One hand-off to another thread and back: what a cross-'stream' dependency costs with CPU threads."""
    ping, pong = threading.Event(), threading.Event()

    def worker() -> None:
        for _ in range(rounds):
            ping.wait()
            ping.clear()
            pong.set()

    thread = threading.Thread(target=worker)
    thread.start()
    start = time.perf_counter()
    for _ in range(rounds):
        ping.set()
        pong.wait()
        pong.clear()
    thread.join()
    return (time.perf_counter() - start) / rounds / 2


def measure_cpu_profile() -> DeviceProfile:
    """Measure this machine: fp32 GEMM rate, copy bandwidth, per-operator launch cost, thread hand-off."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = 2 * 1024 ** 3 / _best_of(lambda: torch.mm(a, b), 5)
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / _best_of(lambda: dst.copy_(src), 5)
    x = torch.ones(8)
    add = torch.ops.aten.add.Tensor
    launch = _best_of(lambda: [add(x, x) for _ in range(1000)], 5) / 1000
    return DeviceProfile("cpu", flops_per_s=flops, bytes_per_s=bandwidth, launch_s=launch,
                         event_s=_event_round_trip())


if __name__ == "__main__":
    print(measure_cpu_profile())
