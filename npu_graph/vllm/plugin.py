"""The `vllm.general_plugins` entry point: makes `compilation_config={"backend": "ascend_dsa"}` select ascend_dsa.

vLLM validates a piecewise backend against its own names and lets the platform replace it (the CPU platform turns
piecewise into whole-graph Inductor), and its piecewise mode reaches a custom compiler only through
`vllm.compilation.backends.make_compiler`, which asks the platform's `get_compile_backend` (a method that is not
told which config it serves: vLLM loads an AOT-compiled model outside any current config). `register` wraps the
platform's config check and `make_compiler`, once per process: after the platform's own check, a config that asked
for ascend_dsa gets it back (vLLM's compile mode unless the user chose a whole-graph mode), and `make_compiler` gives
AscendDsaCompiler to a compilation config whose backend is ascend_dsa. Where the platform turned vLLM's piecewise
mode into one whole-graph program (the CPU platform: Dynamo traced once, Inductor on the whole graph), the
ascend_dsa config keeps vLLM's compile mode with no split ops (unless the user named some), so our compiler gets
the whole model as one piece too: no Python runs between vLLM's kernels, as in vLLM's own program. vLLM's
"mega" AOT artifact holds Inductor's compiled pieces only, so it is switched off for such a config (its AOT compile
of the Dynamo graph stays on), and so are vLLM's Inductor fusion passes (our pipeline fuses the pieces). Configs that
did not ask for ascend_dsa are untouched.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from npu_graph.vllm import BACKEND_NAME

COMPILER = "npu_graph.vllm.compiler.AscendDsaCompiler"
WHOLE_GRAPH = "npu_graph.vllm.compiler.whole_graph"


def asks_for_ascend_dsa(compilation_config: Any) -> bool:
    return compilation_config.backend in (BACKEND_NAME, WHOLE_GRAPH)


def select(vllm_config: Any, mode_asked: Any) -> None:
    """Give a config that asked for ascend_dsa what it asked for, after the platform's check changed it."""
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    if mode_asked in (CompilationMode.STOCK_TORCH_COMPILE, CompilationMode.DYNAMO_TRACE_ONCE):
        compilation.mode, compilation.backend = mode_asked, WHOLE_GRAPH
        return
    if mode_asked == CompilationMode.NONE:
        return
    whole = compilation.mode != CompilationMode.VLLM_COMPILE    # the platform compiles one whole graph (CPU)
    compilation.mode, compilation.backend = CompilationMode.VLLM_COMPILE, BACKEND_NAME
    if whole and compilation.splitting_ops is None:    # so do we: one piece, no Python between vLLM's kernels
        compilation.splitting_ops = []
    os.environ["VLLM_USE_MEGA_AOT_ARTIFACT"] = "0"      # read by vLLM's worker processes, started after this
    if compilation.compile_sizes is None:   # platforms that never run piecewise (CPU) leave it unset
        compilation.compile_sizes = []
    passes = compilation.pass_config       # vLLM's Inductor pattern passes: our pipeline does the fusing
    for name in (f.name for f in dataclasses.fields(passes)):
        if name.startswith(("fuse_", "enable_")) and getattr(passes, name) is True:
            setattr(passes, name, False)


def register() -> None:
    """Hook the current platform's config check and vLLM's compiler choice (idempotent: vLLM may call general plugins
    more than once in a process)."""
    from vllm.compilation import backends
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if platform.__dict__.get("_ascend_dsa_hooked"):
        return
    check, make_compiler = platform.check_and_update_config, backends.make_compiler

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        compilation = vllm_config.compilation_config
        asked, mode_asked = asks_for_ascend_dsa(compilation), compilation.mode
        check(vllm_config)
        if asked:
            select(vllm_config, mode_asked)

    def compiler_for(compilation_config: Any) -> Any:
        if compilation_config.backend == BACKEND_NAME:
            from npu_graph.vllm.compiler import AscendDsaCompiler

            return AscendDsaCompiler()
        return make_compiler(compilation_config)

    platform.check_and_update_config = classmethod(check_and_update_config)
    backends.make_compiler = compiler_for
    platform._ascend_dsa_hooked = True
