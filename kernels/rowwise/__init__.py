"""Row-wise operators of a transformer layer, each token's row on its own: RMSNorm, `ascend_dsa::rms_norm` and
`ascend_dsa::add_rms_norm` (`rms_norm`), and the rotary position embedding, `ascend_dsa::rotary_mul`
(`rotary_mul`).
"""
