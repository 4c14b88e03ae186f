"""ascend_dsa as vLLM's compiler, chosen by configuration alone.

    pip install -e ".[vllm]"
    LLM(model, compilation_config={"backend": "ascend_dsa"})

The `vllm.general_plugins` entry point (setup.py: npu_graph.vllm.plugin:register) runs in every vLLM process. It
hooks the current platform's config check and compile-backend choice, so that `backend="ascend_dsa"`:
  - in vLLM's default compile mode (VLLM_COMPILE) is the platform's CompilerInterface
    (npu_graph.vllm.compiler.AscendDsaCompiler): vLLM splits the model at its attention ops and hands each piece
    to it (on a platform whose own default compiles one whole graph, as vLLM's CPU platform does, nothing is split
    and the whole model is one piece); pieces are stored in our compile cache under vLLM's cache folder, and
    vLLM's AOT compile keeps the Dynamo graph, so a second process neither traces nor compiles;
  - in the whole-graph modes (STOCK_TORCH_COMPILE, DYNAMO_TRACE_ONCE) is a torch.compile backend whose compiled
    program vLLM's AOT compile serializes (npu_graph.cache.precompiled).
Other backends are left as vLLM chooses them. Nothing is imported from vLLM until the plugin runs.
"""
BACKEND_NAME = "ascend_dsa"
