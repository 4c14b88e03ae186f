"""Fused operators `torch.ops.ascend_dsa.*`: schema, fake function, reference and fast CPU implementation.

Importing this package registers every op. Each op lives in its own module; the list below is literal.
"""
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
)
