"""Fused operators `torch.ops.ascend_dsa.*`: schema, fake function, reference and fast CPU implementation.

Importing this package registers every op. Each op lives in its own module; the list below is literal.

When the repository root is on sys.path, other code may import this folder as a top-level `kernels` package
(transformers probes for the hub `kernels` package that way): under that name the module stays inert, so it
neither registers ops twice nor imports npu_graph halfway through someone else's import.
"""
if __name__ == "npu_graph.kernels":
    from npu_graph.kernels import (
        attn_res,  # noqa: F401
        block_quant,  # noqa: F401
        causal_lengths,  # noqa: F401
        chunk_kda,  # noqa: F401
        fused_moe,  # noqa: F401
        lightning_indexer,  # noqa: F401
        moe_gating,  # noqa: F401
        mx_quant,  # noqa: F401
        nz,  # noqa: F401
        rms_norm,  # noqa: F401
        rotary_mul,  # noqa: F401
        sparse_flash_attention,  # noqa: F401
    )
