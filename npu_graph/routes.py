"""Kernel routes: known linear-attention functions that Dynamo traces as one `ascend_dsa.chunk_kda` call.

transformers' Kimi Linear `chunk_kimi_delta_attention` (whose CPU fallback is a Python loop over chunks and
over rows inside each chunk) and its decode loop `recurrent_kimi_delta_attention`, and fla's `chunk_kda` and
`fused_recurrent_kda`, are registered with `torch._dynamo.substitute_in_graph`,
so a compiled model gets one fused node instead of thousands of unrolled ops. The routes compute exactly
what the originals compute (same fp32 upcast, same l2norm with +eps, same scale, same output dtype).
Eager calls are untouched. Dynamo's substitution is global: once installed, the routes serve every backend,
not only ascend_dsa; they change speed, not results. So they are installed when the ascend_dsa backend is
resolved (importing npu_graph.backend), or by a user who asks for them (`npu_graph.install_routes()`), never by
`import npu_graph` alone.

Registration happens at once for a target module already loaded, otherwise right after the target module is
imported (a small import hook), so import order does not matter.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

_registered: set[str] = set()


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps): the FLA / transformers l2norm (not F.normalize's max(‖x‖, eps))."""
    return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _kda(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool, l2: bool,
         chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    out_dtype = query.dtype
    query, key, value, g, beta = (t.to(torch.float32) for t in (query, key, value, g, beta))
    if l2:
        query, key = l2norm(query), l2norm(key)
    state = None if initial_state is None else initial_state.to(torch.float32)
    out, final = torch.ops.ascend_dsa.chunk_kda(query, key, value, g, beta, scale, state,
                                                output_final_state=output_final_state, chunk_size=chunk_size)
    return out.to(out_dtype), (final if output_final_state else None)


def _route_transformers_kimi(module: ModuleType) -> None:
    original = module.chunk_kimi_delta_attention
    fallback = getattr(original, "__wrapped__", original)

    @torch._dynamo.substitute_in_graph(original, skip_signature_check=True)
    def chunk_kimi_delta_attention(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                   output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        if kwargs.get("cu_seqlens") is not None:
            return fallback(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, **kwargs)
        return _kda(query, key, value, g, beta, None, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel, chunk_size)

    _route_transformers_kimi_decode(module)


def _route_transformers_kimi_decode(module: ModuleType) -> None:
    """The decode-time loop `recurrent_kimi_delta_attention` (fla's fused_recurrent_kda): the same recurrence,
    which chunk_kda runs step by step for short sequences."""
    original = getattr(module, "recurrent_kimi_delta_attention", None)
    if original is None:
        return
    fallback = getattr(original, "__wrapped__", original)

    @torch._dynamo.substitute_in_graph(original, skip_signature_check=True)
    def recurrent_kimi_delta_attention(query, key, value, g, beta, initial_state, output_final_state,
                                       use_qk_l2norm_in_kernel=False, **kwargs):
        if kwargs.get("cu_seqlens") is not None:
            return fallback(query, key, value, g, beta, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, **kwargs)
        return _kda(query, key, value, g, beta, None, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel, 64)


def _route_fla_kda(module: ModuleType) -> None:
    for name in ("chunk_kda", "fused_recurrent_kda"):
        if hasattr(module, name):
            _route_fla_function(module, name)


def _route_fla_function(module: ModuleType, name: str) -> None:
    """fla's `chunk_kda` or `fused_recurrent_kda` (same arguments, same recurrence)."""
    original = getattr(module, name)
    fallback = getattr(original, "__wrapped__", original)

    def routed(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None or kwargs.get("head_first"):
            return fallback(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            cu_seqlens=cu_seqlens, **kwargs)
        return _kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, 64)

    torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(routed)


ROUTES: dict[str, Callable[[ModuleType], None]] = {
    "transformers.models.kimi_linear.modeling_kimi_linear": _route_transformers_kimi,
    "fla.ops.kda": _route_fla_kda,
}


def _register(name: str, module: ModuleType) -> None:
    if name not in _registered:
        _registered.add(name)
        ROUTES[name](module)


class _RouteAfterImport(importlib.abc.MetaPathFinder):
    """Registers a route right after its target module finishes importing."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in ROUTES or fullname in _registered:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_and_route(module: ModuleType) -> None:
            execute(module)
            _register(fullname, module)

        spec.loader.exec_module = exec_and_route
        return spec


def install_routes() -> None:
    """Route the modules that are loaded now, and the others when they get imported."""
    for name in ROUTES:
        if name in sys.modules:
            _register(name, sys.modules[name])
    if not any(isinstance(f, _RouteAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RouteAfterImport())


def routed() -> list[str]:
    return sorted(_registered)
