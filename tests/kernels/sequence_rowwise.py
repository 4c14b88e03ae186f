"""The row-wise, MoE and KDA ops for the call-sequence fuzzer (tests/kernels/sequence_ops.py): weights, biases,
norm scales and states persist between calls and are changed in place, the way a model's parameters and caches
are; inputs come fresh, aliased or as strided or expanded views."""
from __future__ import annotations

import torch
from hypothesis import strategies as st
from sequence_ops import OPS, Call, Family, close, randn, tolerance, variant

from npu_graph.kernels.aten import skinny_mm
from npu_graph.kernels.attn_res import reference_attn_res
from npu_graph.kernels.indexer.causal_lengths import reference_causal_lengths
from npu_graph.kernels.kda.chunk_kda import reference_chunk_kda
from npu_graph.kernels.moe.fused_moe import reference_fused_moe
from npu_graph.kernels.moe.gating import reference_moe_gating_top_k
from npu_graph.kernels.rowwise.rms_norm import reference_add_rms_norm, reference_rms_norm
from npu_graph.kernels.rowwise.rotary_mul import reference_rotary_mul

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class Gating(Family):
    op = "moe_gating_top_k"

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        super().__init__(data, gen)
        self.tokens = data.draw(st.integers(1, 6), label="gating tokens")
        self.groups, self.k_group = data.draw(st.sampled_from([(1, 1), (4, 2), (8, 3)]), label="groups")
        self.experts = self.groups * data.draw(st.integers(2, 8), label="experts per group")
        self.k = data.draw(st.integers(1, min(8, self.experts // self.groups * self.k_group)), label="gating k")
        self.norm_type, self.renorm = data.draw(st.sampled_from([(0, 0), (0, 1), (1, 0)]), label="norm")
        self.buffers["bias"] = randn(gen, self.experts)

    def draw_call(self, data: st.DataObject) -> Call:
        x = variant(data, randn(self.gen, self.tokens, self.experts), "router logits")
        bias = data.draw(st.sampled_from([None, self.buffers["bias"], self.buffers["bias"][:]]), label="bias")
        kwargs = {"k_group": self.k_group, "group_count": self.groups, "norm_type": self.norm_type,
                  "renorm": self.renorm, "routed_scaling_factor": 2.5}
        return Call(self.op, lambda: OPS.moe_gating_top_k(x, self.k, bias, **kwargs),
                    lambda: reference_moe_gating_top_k(x, self.k, bias, **kwargs), close(1e-5))


class Norm(Family):
    op = "rms_norm"

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        super().__init__(data, gen)
        self.rows, self.n = data.draw(st.integers(1, 5), label="norm rows"), data.draw(st.integers(1, 300), label="n")
        self.dtype = data.draw(st.sampled_from(DTYPES), label="norm dtype")
        self.buffers["gamma"] = randn(gen, self.n, dtype=self.dtype)

    def draw_call(self, data: st.DataObject) -> Call:
        x = variant(data, randn(self.gen, self.rows, self.n, dtype=self.dtype), "x")
        if data.draw(st.booleans(), label="rows expanded"):
            x = x[:1].expand(x.shape)
        gamma = variant(data, self.buffers["gamma"], "gamma")
        if data.draw(st.booleans(), label="add"):
            x2 = data.draw(st.sampled_from([x, x.view(x.shape), x.clone()]), label="x2")
            return Call("add_rms_norm", lambda: OPS.add_rms_norm(x, x2, gamma, 1e-6),
                        lambda: reference_add_rms_norm(x, x2, gamma, 1e-6), close(tolerance(self.dtype)))
        return Call(self.op, lambda: OPS.rms_norm(x, gamma, 1e-6), lambda: reference_rms_norm(x, gamma, 1e-6),
                    close(tolerance(self.dtype)))


class Rotary(Family):
    op = "rotary_mul"

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        super().__init__(data, gen)
        self.shape = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4)),
                      2 * data.draw(st.integers(1, 16), label="rotary half dim"))
        self.mode = data.draw(st.sampled_from(["half", "interleave"]), label="rotary mode")
        self.buffers["cos"] = randn(gen, 1, self.shape[1], 1, self.shape[3])
        self.buffers["sin"] = randn(gen, 1, self.shape[1], 1, self.shape[3])

    def draw_call(self, data: st.DataObject) -> Call:
        x = variant(data, randn(self.gen, *self.shape), "input")
        cos = self.buffers["cos"]
        sin = data.draw(st.sampled_from(["sin", "cos"]), label="r2")
        sin = cos if sin == "cos" else self.buffers["sin"]
        return Call(self.op, lambda: OPS.rotary_mul(x, cos, sin, self.mode),
                    lambda: reference_rotary_mul(x, cos, sin, self.mode), close(1e-5))


class Experts(Family):
    op = "fused_moe"

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        super().__init__(data, gen)
        self.tokens, self.k = data.draw(st.integers(1, 6), label="moe tokens"), data.draw(st.integers(1, 3))
        self.experts, hidden, inter = data.draw(st.integers(3, 6)), data.draw(st.integers(4, 48)), data.draw(
            st.integers(2, 32))
        self.hidden = hidden
        self.buffers["w13"] = randn(gen, self.experts, 2 * inter, hidden) * 0.2
        self.buffers["w2"] = randn(gen, self.experts, hidden, inter) * 0.2

    def draw_call(self, data: st.DataObject) -> Call:
        x = variant(data, randn(self.gen, self.tokens, self.hidden), "moe x")
        ids = torch.stack([torch.randperm(self.experts, generator=self.gen)[:self.k] for _ in range(self.tokens)])
        ids = ids.to(data.draw(st.sampled_from([torch.int32, torch.int64]), label="ids dtype"))
        weights = torch.rand(self.tokens, self.k, generator=self.gen)
        w13, w2 = self.buffers["w13"], self.buffers["w2"]
        return Call(self.op, lambda: OPS.fused_moe(x, w13, w2, weights, ids),
                    lambda: reference_fused_moe(x, w13, w2, weights, ids), close(1e-4))


class Kda(Family):
    op = "chunk_kda"

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        super().__init__(data, gen)
        self.b, self.h = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
        self.t = data.draw(st.sampled_from([1, 5, 24]), label="kda steps")
        self.dk, self.dv = data.draw(st.integers(2, 16), label="kda dk"), data.draw(st.integers(1, 16), label="dv")
        self.buffers["state"] = randn(gen, self.b, self.h, self.dk, self.dv)

    def draw_call(self, data: st.DataObject) -> Call:
        shape = (self.b, self.t, self.h)
        q = randn(self.gen, *shape, self.dk)
        k = torch.nn.functional.normalize(randn(self.gen, *shape, self.dk), dim=-1)
        q = data.draw(st.sampled_from([q, k]), label="q is k")
        v = variant(data, randn(self.gen, *shape, self.dv), "v")
        g, beta = -torch.rand(*shape, self.dk, generator=self.gen) * 0.3, torch.rand(*shape, generator=self.gen)
        state = data.draw(st.sampled_from([None, self.buffers["state"]]), label="initial state")
        return Call(self.op, lambda: OPS.chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True),
                    lambda: reference_chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True),
                    close(1e-4))


class Lengths(Family):
    op = "causal_lengths"

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        super().__init__(data, gen)
        self.b, self.s1, self.s2 = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), data.draw(
            st.integers(4, 30))
        self.additive, self.windows = data.draw(st.booleans(), label="additive"), data.draw(st.booleans())

    def draw_call(self, data: st.DataObject) -> Call:
        start = data.draw(st.integers(0, self.s2 - 1), label="mask start")
        seen = torch.arange(self.s2) <= (torch.arange(self.s1) + self.s2 - self.s1).unsqueeze(1)
        mask = (seen & (torch.arange(self.s2) >= start)).expand(self.b, self.s1, self.s2).clone()
        if data.draw(st.booleans(), label="not causal"):
            mask.view(-1)[data.draw(st.integers(0, mask.numel() - 1))] ^= True
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if self.additive else mask
        return Call(self.op, lambda: OPS.causal_lengths(mask, self.additive, self.windows),
                    lambda: reference_causal_lengths(mask, self.additive, self.windows), close(0))


class Products(Family):
    op = "skinny_mm"

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        super().__init__(data, gen)
        self.m, self.k, self.n = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 80)), data.draw(
            st.integers(1, 80))
        self.buffers["weight"] = randn(gen, self.n, self.k)

    def draw_call(self, data: st.DataObject) -> Call:
        x = variant(data, randn(self.gen, self.m, self.k), "x")
        w = self.buffers["weight"]
        if data.draw(st.booleans(), label="linear"):
            return Call("skinny_linear", lambda: skinny_mm.linear(x, w), lambda: x @ w.T, close(1e-4))
        wt = w.t()
        return Call(self.op, lambda: skinny_mm.mm(x, wt), lambda: x @ wt, close(1e-4))


class DepthAttention(Family):
    op = "attn_res"

    def __init__(self, data: st.DataObject, gen: torch.Generator):
        super().__init__(data, gen)
        self.n, self.b, self.t = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 2)), data.draw(
            st.integers(1, 3))
        self.d, self.s = data.draw(st.integers(2, 40), label="attn_res dim"), data.draw(st.integers(1, 3))
        self.buffers["queries"] = randn(gen, self.s, self.d)
        self.buffers["norm_weight"] = randn(gen, self.d)

    def draw_call(self, data: st.DataObject) -> Call:
        blocks = variant(data, randn(self.gen, self.n, self.b, self.t, self.d), "blocks")
        partial = data.draw(st.sampled_from([None, "fresh", "block"]), label="partial")
        partial = {None: None, "fresh": randn(self.gen, self.b, self.t, self.d), "block": blocks[0]}[partial]
        weight = data.draw(st.sampled_from([None, self.buffers["norm_weight"]]), label="norm weight")
        queries = self.buffers["queries"]
        return Call(self.op, lambda: OPS.attn_res(blocks, partial, queries, weight),
                    lambda: reference_attn_res(blocks, partial, queries, weight), close(1e-4))
