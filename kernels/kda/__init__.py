"""Kimi Delta Attention, `ascend_dsa::chunk_kda` and `ascend_dsa::chunk_kda_states` (`chunk_kda`): the gated delta
rule with per-channel decay, its chunked torch form, native recurrence and gradients.
"""
