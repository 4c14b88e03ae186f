"""DeepSeek-V3.2 sparse attention in the MLA absorbed form, `ascend_dsa::sparse_flash_attention`: attention over
the key positions the lightning indexer selected (`sparse_flash_attention`; its native path, torch path, plans,
checks and readable reference beside it).
"""
