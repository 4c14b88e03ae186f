"""The DSA attention ops for the call-sequence fuzzer (tests/kernels/sequence_ops.py): sparse attention and the
lightning indexer over one KV cache that persists between calls, BSND (read at a growing length) or paged (its
block table reshuffled in place)."""
from __future__ import annotations

import torch
from hypothesis import strategies as st
from sequence_ops import OPS, Call, Family, close, randn, tolerance, topk_close, variant

from npu_graph.kernels.indexer.reference import reference_lightning_indexer
from npu_graph.kernels.sparse_attention.reference import reference_sparse_flash_attention

DTYPES = [torch.float32, torch.bfloat16]


class PagedCache(Family):
    """A KV cache of `capacity` positions per batch row: BSND [B, S2, 1, D] or paged [B * blocks, block, 1, D]
    with a block table [B, blocks] (int32 or int64) that `mutate` may reshuffle."""

    def __init__(self, data: st.DataObject, gen: torch.Generator, label: str):
        super().__init__(data, gen)
        self.batch = data.draw(st.integers(1, 2), label=f"{label} batch")
        self.s1 = data.draw(st.sampled_from([1, 1, 3]), label=f"{label} query tokens")
        self.dtype = data.draw(st.sampled_from(DTYPES), label=f"{label} dtype")
        self.paged = data.draw(st.booleans(), label=f"{label} paged")
        self.block = data.draw(st.sampled_from([8, 16]), label=f"{label} block") if self.paged else 1
        self.blocks = data.draw(st.integers(2, 6), label=f"{label} blocks") if self.paged else 0
        self.capacity = self.blocks * self.block if self.paged else data.draw(st.integers(8, 90), label="S2")
        self.mode = data.draw(st.sampled_from([0, 3]), label=f"{label} sparse_mode")
        if self.paged:
            table_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label=f"{label} table dtype")
            self.buffers["block_table"] = torch.randperm(self.batch * self.blocks, generator=gen).to(
                table_dtype).view(self.batch, self.blocks)

    def cache(self, dim: int) -> torch.Tensor:
        rows = (self.batch * self.blocks, self.block) if self.paged else (self.batch, self.capacity)
        return randn(self.gen, *rows, 1, dim, dtype=self.dtype)

    def remap(self, name: str, buf: torch.Tensor) -> None:
        buf.copy_(torch.randperm(buf.numel(), generator=self.gen).view(buf.shape))

    def layout(self, data: st.DataObject, cache: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The cache as this call reads it and the options that say so: a BSND cache at a drawn length (a decode
        step's growing cache: the same signature), a paged one with drawn key lengths."""
        if not self.paged:
            length = data.draw(st.integers(max(1, self.s1), self.capacity), label="kv length")
            return cache[:, :length], {}
        lengths = torch.tensor(data.draw(st.lists(st.integers(self.s1, self.capacity), min_size=self.batch,
                                                  max_size=self.batch), label="kv lengths"))
        return cache, {"block_table": self.buffers["block_table"], "lengths": lengths}


class SparseAttention(PagedCache):
    op = "sparse_flash_attention"

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        super().__init__(data, gen, "sfa")
        self.heads = data.draw(st.integers(1, 8), label="sfa heads")
        self.dl, self.dr = data.draw(st.sampled_from([(16, 0), (32, 16), (64, 32)]), label="sfa dims")
        self.k = data.draw(st.integers(1, 12), label="sfa selected")
        self.index_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="index dtype")
        self.buffers["key"], self.buffers["value"] = self.cache(self.dl), self.cache(self.dl)
        if self.dr:
            self.buffers["key_rope"] = self.cache(self.dr)

    def draw_call(self, data: st.DataObject) -> Call:
        key, options = self.layout(data, self.buffers["key"])
        value_kind = data.draw(st.sampled_from(["key", "value", "view of key", "copy of key"]), label="value")
        value = {"key": key, "value": self.layout_like(key, self.buffers["value"]), "view of key": key.view(key.shape),
                 "copy of key": key.clone()}[value_kind]
        query = variant(data, randn(self.gen, self.batch, self.s1, self.heads, self.dl, dtype=self.dtype), "query")
        rope = {}
        if self.dr:
            rope = {"query_rope": randn(self.gen, self.batch, self.s1, self.heads, self.dr, dtype=self.dtype),
                    "key_rope": self.layout_like(key, self.buffers["key_rope"])}
        indices = torch.randint(-1, self.capacity + 2, (self.batch, self.s1, 1, self.k), generator=self.gen,
                                dtype=self.index_dtype)
        kwargs = {**rope, "sparse_mode": self.mode}
        if self.paged:
            kwargs.update(block_table=options["block_table"], actual_seq_lengths_kv=options["lengths"],
                          layout_kv="PA_BSND")
        scale = data.draw(st.sampled_from([0.1, 0.25]), label="scale")
        return Call(self.op, lambda: OPS.sparse_flash_attention(query, key, value, indices, scale, **kwargs),
                    lambda: reference_sparse_flash_attention(query, key, value, indices, scale, **kwargs),
                    close(tolerance(self.dtype)), {"value": value_kind, "paged": self.paged, "dtype": self.dtype})

    def layout_like(self, key: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        return buf if self.paged else buf[:, :key.shape[1]]


class Indexer(PagedCache):
    op = "lightning_indexer"

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        super().__init__(data, gen, "indexer")
        self.heads = data.draw(st.integers(1, 8), label="indexer heads")
        self.dim = data.draw(st.sampled_from([16, 32, 64]), label="indexer dim")
        self.k = data.draw(st.integers(1, 40), label="indexer sparse_count")
        self.buffers["key"] = self.cache(self.dim)
        self.buffers["weights"] = randn(gen, self.batch, self.s1, self.heads)

    def draw_call(self, data: st.DataObject) -> Call:
        key, options = self.layout(data, self.buffers["key"])
        query = variant(data, randn(self.gen, self.batch, self.s1, self.heads, self.dim, dtype=self.dtype), "query")
        weights = self.buffers["weights"]
        if data.draw(st.booleans(), label="weights expanded over heads"):
            weights = weights[..., :1].expand(weights.shape)
        kwargs = {"sparse_count": self.k, "sparse_mode": self.mode}
        if self.paged:
            kwargs.update(block_table=options["block_table"], actual_seq_lengths_key=options["lengths"],
                          layout_key="PA_BSND")
        return Call(self.op, lambda: OPS.lightning_indexer(query, key, weights, **kwargs),
                    lambda: reference_lightning_indexer(query, key, weights, **kwargs), topk_close,
                    {"paged": self.paged, "dtype": self.dtype})
