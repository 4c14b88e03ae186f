"""The DeepSeek-V3.2 lightning indexer, `ascend_dsa::lightning_indexer` (`lightning_indexer`), and the lengths and
key windows the DSA operators share: `causal_lengths` (the op that turns a model's mask into the lengths and first
visible keys) and `key_windows` (left-padded batches). Sparse attention reads keys and checks lengths with this
family's `keys` and `checks`.
"""
