"""Mixture of experts: the router, `ascend_dsa::moe_gating_top_k` (`gating`), and the routed SwiGLU experts,
`ascend_dsa::fused_moe` (`fused_moe`), each with its native path.
"""
