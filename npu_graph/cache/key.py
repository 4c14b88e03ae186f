"""The compile-cache key, computed from Dynamo's graph before AOT capture.

key = sha256 of: the canonical graph (ops, arguments, constants, wiring; placeholders by position, so the
names Dynamo picks do not matter), input metadata (dtypes, shapes with symbolic sizes by name, strides,
devices, requires_grad), the settings that change compiled code, the uuid of every pass, the digest of the
compiler's own source files (as Inductor keys its cache on torch's source: an edit of a pass helper, a kernel
module or a native C source is a miss), and versions (python, torch, torch_npu if installed, ascend-dsa).
Nothing in it depends on object addresses or on PYTHONHASHSEED. A graph whose arguments cannot be written down
stably raises Uncacheable.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import platform
import re
from pathlib import Path
from typing import Any

import torch
import torch.fx

from npu_graph.config import CompilerConfig
from npu_graph.pipeline import pipeline_uuids

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SOURCE_SUFFIXES = {".py", ".c", ".h"}
# Subpackages that do not shape compiled code (the command line) or that are walked as roots of their own.
_NOT_UNDER_ROOT = {"tools", "passes", "kernels", "__pycache__"}
# Settings that only change how the compiler reports or stores (dump, cache, verify, strict); every other setting,
# including any added later, changes what it produces and is part of the key (cpu.glue was once left out, and a
# cache hit then ran the glue another setting had compiled).
REPORTING_SETTINGS = ("strict", "debug", "cache", "verify")


class Uncacheable(Exception):
    """This graph cannot be keyed or stored safely; the cache is bypassed with this reason."""


@functools.cache
def versions() -> dict[str, str]:
    """Versions that invalidate compiled code; fixed for the life of a process (looked up once)."""
    from npu_graph import __version__

    found = {"python": platform.python_version(), "torch": torch.__version__, "ascend-dsa": __version__}
    try:
        found["torch_npu"] = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        found["torch_npu"] = "absent"
    return found


def source_files(roots: dict[str, Path]) -> list[tuple[str, Path]]:
    """(name relative to its root, path) of every source file (.py, .c, .h) under each named root, in a fixed
    order; folders in _NOT_UNDER_ROOT are skipped."""
    found = []
    for name, root in sorted(roots.items()):
        files = sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()
                       and not _NOT_UNDER_ROOT.intersection(p.relative_to(root).parts[:-1]))
        found += [(f"{name}/{path.relative_to(root).as_posix()}", path) for path in files]
    return found


def source_digest_of(roots: dict[str, Path]) -> str:
    """sha256 over the source files under each named root, by name relative to it, so the digest is the same
    wherever the package is installed."""
    digest = hashlib.sha256()
    for name, path in source_files(roots):
        digest.update(f"{name}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def package_roots() -> dict[str, Path]:
    """The folders of the compiler's source: npu_graph (with targets, models, parallel), its passes and kernels
    (with the native C sources); not tools/, the command line."""
    import npu_graph
    import npu_graph.kernels
    import npu_graph.passes

    return {module.__name__: Path(module.__path__[0]) for module in (npu_graph, npu_graph.passes, npu_graph.kernels)}


@functools.cache
def source_digest() -> str:
    """Digest of the compiler's source (package_roots), read once per process as Inductor's torch_key is."""
    return source_digest_of(package_roots())


def _callable_name(fn: Any) -> str:
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op:{fn}"
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if qualname is None or "<locals>" in qualname or "<lambda>" in qualname:
        raise Uncacheable(f"graph calls a local function {fn!r}")
    return f"{module}.{qualname}"


def _tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().cpu()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()[:16]


def canonical_value(value: Any, index: dict[torch.fx.Node, int]) -> Any:
    """A JSON-able, address-free description of one node argument."""
    if isinstance(value, torch.fx.Node):
        return f"%{index[value]}"
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [canonical_value(v, index) for v in value]]
    if isinstance(value, dict):
        return {str(k): canonical_value(v, index) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, slice):
        return ["slice", [canonical_value(v, index) for v in (value.start, value.stop, value.step)]]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape), _tensor_digest(value)]
    if callable(value):
        return _callable_name(value)
    if (constant := opaque_constant(value)) is not None:
        return constant
    text = repr(value)
    if _ADDRESS.search(text):
        raise Uncacheable(f"graph argument {type(value).__name__} has no stable description")
    return [type(value).__qualname__, text]


def _attribute(gm: torch.fx.GraphModule, path: str) -> Any:
    owner: Any = gm
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner


def _node_entry(gm: torch.fx.GraphModule, node: torch.fx.Node, index: dict[torch.fx.Node, int]) -> list[Any]:
    if node.op == "placeholder":
        return ["placeholder"]
    if node.op == "get_attr":
        value = _attribute(gm, node.target)
        described = canonical_value(value, index) if isinstance(value, torch.Tensor) else type(value).__qualname__
        return ["get_attr", node.target, described]
    if node.op == "call_module":
        module = _attribute(gm, node.target)
        state = {k: canonical_value(v, index) for k, v in module.state_dict().items()}
        target = [_callable_name(type(module)), module.extra_repr(), state]
    elif node.op == "call_function":
        target = _callable_name(node.target)
    else:
        target = str(node.target)
    return [node.op, target, canonical_value(node.args, index), canonical_value(node.kwargs, index)]


def canonical_graph(gm: torch.fx.GraphModule) -> list[list[Any]]:
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    return [_node_entry(gm, node, index) for node in gm.graph.nodes]


def input_metadata(example_inputs: list[Any]) -> list[Any]:
    """Dtypes, shapes (symbolic sizes by name), strides, devices of the graph inputs."""
    described: list[Any] = []
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            described.append({"dtype": str(value.dtype), "shape": [str(s) for s in value.shape],
                              "stride": [str(s) for s in value.stride()], "device": str(value.device),
                              "requires_grad": value.requires_grad})
        elif isinstance(value, torch.SymInt):
            described.append(f"symint:{value.node.expr}")
        elif isinstance(value, (int, float, bool)) or value is None:
            described.append(repr(value))
        elif (constant := opaque_constant(value)) is not None:
            described.append(constant)
        else:
            raise Uncacheable(f"graph input of type {type(value).__name__} is not supported by the cache")
    return described


def opaque_constant(value: Any) -> str | None:
    """How a value-type opaque input is keyed: by its value (vLLM's layer names, `LayerName("model.layers.0.attn")`,
    reach a graph as such inputs; Dynamo guards them by value, so each compiled graph sees one constant). None for
    anything else."""
    from torch._library import opaque_object

    real = getattr(value, "real_obj", value)     # the fake object Dynamo's example input wraps
    if not opaque_object.is_opaque_value_type(type(real)):
        return None
    text, _ = opaque_object.get_opaque_obj_repr(real)
    if _ADDRESS.search(text):
        raise Uncacheable(f"graph input {type(real).__name__} has no stable description")
    return f"opaque:{opaque_object.get_opaque_type_name(type(real))}:{text}"


def symbolic_inputs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> list[Any]:
    """The graph inputs as Dynamo traced them (fake tensors with symbolic sizes), else the given values."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return list(example_inputs)
    return [n.meta.get("example_value", value) for n, value in zip(placeholders, example_inputs)]


def key_settings(config: CompilerConfig) -> dict[str, Any]:
    settings = config.to_dict()
    return {name: value for name, value in settings.items() if name not in REPORTING_SETTINGS}


def key_material(gm: torch.fx.GraphModule, example_inputs: list[Any], config: CompilerConfig,
                 inference: bool) -> dict[str, Any]:
    inputs = input_metadata(symbolic_inputs(gm, example_inputs))
    return {"graph": canonical_graph(gm), "inputs": inputs, "inference": inference,
            "settings": key_settings(config), "passes": pipeline_uuids(), "sources": source_digest(),
            "versions": versions()}


def cache_key(material: dict[str, Any]) -> str:
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
