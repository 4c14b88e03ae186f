"""Fused operators `torch.ops.ascend_dsa.*`: schema, fake function, reference and fast CPU implementation.

Importing this package registers every op. The ops live in one subpackage per family (indexer, sparse_attention,
kda, moe, quant, rowwise; attn_res on its own), the native C kernels and what builds, loads and chooses them in
native/, and the native kernels the CPU runtime binds in place of ATen calls in aten/; the list of op modules below
is literal.

When the repository root is on sys.path, other code may import this folder as a top-level `kernels` package
(transformers probes for the hub `kernels` package that way): under that name the module stays inert, so it
neither registers ops twice nor imports npu_graph halfway through someone else's import.
"""
if __name__ == "npu_graph.kernels":
    from npu_graph.kernels import (
        attn_res,  # noqa: F401
        nz,  # noqa: F401
    )
    from npu_graph.kernels.indexer import (
        causal_lengths,  # noqa: F401
        lightning_indexer,  # noqa: F401
    )
    from npu_graph.kernels.kda import chunk_kda  # noqa: F401
    from npu_graph.kernels.moe import (
        fused_moe,  # noqa: F401
        gating,  # noqa: F401
    )
    from npu_graph.kernels.quant import (
        block,  # noqa: F401
        mx,  # noqa: F401
    )
    from npu_graph.kernels.rowwise import (
        rms_norm,  # noqa: F401
        rotary_mul,  # noqa: F401
    )
    from npu_graph.kernels.sparse_attention import sparse_flash_attention  # noqa: F401
