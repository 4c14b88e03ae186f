"""What NaN and ±inf in each input of each fused op do, on every path (the native kernel at each instruction-set
level this CPU runs, and the torch path) against the op's readable reference, under the rule its module docstring
writes down ("Non-finite values."): NaN in the same places, infinities in the same places with the same signs,
finite values close, and where an op selects, the same selection. Small shapes keep the module fast."""
import functools
import math

import pytest
import torch
from native_paths import native_and_torch
from test_lightning_indexer import to_paged

import npu_graph
from npu_graph.kernels import attn_res
from npu_graph.kernels.checks import FusedPreconditionError
from npu_graph.kernels.indexer import causal_lengths, lightning_indexer
from npu_graph.kernels.kda import chunk_kda
from npu_graph.kernels.moe import fused_moe
from npu_graph.kernels.quant import block as block_quant
from npu_graph.kernels.quant import mx as mx_quant
from npu_graph.kernels.rowwise import rms_norm, rotary_mul

OPS = torch.ops.ascend_dsa
NAN, INF = float("nan"), float("inf")
KINDS = {"nan": NAN, "+inf": INF, "-inf": -INF}
each_kind = pytest.mark.parametrize("value", list(KINDS.values()), ids=list(KINDS))

rms_path = native_and_torch(rms_norm.NATIVE_SOURCE)
rotary_path = native_and_torch(rotary_mul.NATIVE_SOURCE)
attn_res_path = native_and_torch(attn_res.NATIVE_SOURCE)
moe_path = native_and_torch(fused_moe.NATIVE_SOURCE)
kda_path = native_and_torch(chunk_kda.chunk_kda_native.NATIVE_SOURCE)
mask_path = native_and_torch(causal_lengths.NATIVE_SOURCE)
indexer_path = native_and_torch(lightning_indexer.lightning_indexer_native.NATIVE_SOURCE)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def poisoned(inputs: dict, name: str, value: float, seed: int = 1, count: int = 1) -> dict:
    """A copy of inputs with `value` at `count` random positions of inputs[name]."""
    t = inputs[name].clone()
    t.view(-1)[torch.randint(0, t.numel(), (count,), generator=torch.Generator().manual_seed(seed))] = value
    return {**inputs, name: t}


def assert_same(got, want, rtol: float = 1e-4, atol: float = 1e-4) -> None:
    """NaN in the same places, ±inf in the same places, finite values close (tuples item by item)."""
    if isinstance(want, (tuple, list)):
        for g, w in zip(got, want, strict=True):
            assert_same(g, w, rtol, atol)
        return
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan()), f"NaN in {int(g.isnan().sum())} places, want {int(w.isnan().sum())}"
    assert torch.equal(g.isinf(), w.isinf()) and torch.equal(g[g.isinf()], w[w.isinf()]), "infinities differ"
    finite = torch.isfinite(w)
    torch.testing.assert_close(g[finite], w[finite], rtol=rtol, atol=atol)


@each_kind
@pytest.mark.parametrize("name", ["x", "gamma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(name, value, dtype, rms_path):
    inputs = poisoned(dict(x=randn(3, 70, dtype=dtype), gamma=randn(70, seed=1, dtype=dtype)), name, value)
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    assert_same(OPS.rms_norm(**inputs), rms_norm.reference_rms_norm(**inputs), tol, tol)


@each_kind
@pytest.mark.parametrize("name", ["x1", "x2", "gamma", "x1 and -x2"])
def test_add_rms_norm(name, value, rms_path):
    inputs = dict(x1=randn(3, 70), x2=randn(3, 70, seed=1), gamma=randn(70, seed=2))
    if name == "x1 and -x2":                  # the same place: inf + -inf is NaN
        inputs = poisoned(poisoned(inputs, "x1", value), "x2", -value)
    else:
        inputs = poisoned(inputs, name, value)
    assert_same(OPS.add_rms_norm(**inputs), rms_norm.reference_add_rms_norm(**inputs))


@pytest.mark.parametrize("big", [INF, 1e20], ids=["inf", "1e20"])
def test_rms_norm_row_whose_squares_overflow(big, rms_path):
    """rstd 0 and y 0, but NaN at an infinite value (inf · 0); the other rows as they are."""
    x = randn(2, 70)
    x[1, 5] = big
    y, rstd = OPS.rms_norm(x, torch.ones(70))
    assert float(rstd[1, 0]) == 0 and bool((y[1, :5] == 0).all()) and bool(y[1, 5].isnan()) == math.isinf(big)
    torch.testing.assert_close(y[:1], rms_norm.reference_rms_norm(x[:1], torch.ones(70))[0])


def test_rms_norm_refuses_a_nan_epsilon(rms_path):
    with pytest.raises(ValueError, match="`epsilon` must be >= 0, got nan"):
        OPS.rms_norm(randn(2, 8), torch.ones(8), NAN)


@each_kind
@pytest.mark.parametrize("name", ["input", "r1", "r2"])
@pytest.mark.parametrize("mode", rotary_mul.MODES)
def test_rotary_mul(name, value, mode, rotary_path):
    for shape in ((1, 2, 4, 16), (2, 9, 4, 64)):        # a few rows (the native kernel) and many (per half)
        angles = torch.rand(1, shape[1], 1, shape[3], generator=torch.Generator().manual_seed(3)) * 6
        inputs = poisoned(dict(input=randn(*shape), r1=angles.cos(), r2=angles.sin()), name, value)
        want = rotary_mul.reference_rotary_mul(**inputs, rotary_mode=mode)
        assert_same(OPS.rotary_mul(**inputs, rotary_mode=mode), want, 1e-5, 1e-5)


@each_kind
@pytest.mark.parametrize("name", ["blocks", "partial", "queries", "norm_weight"])
def test_attn_res(name, value, attn_res_path):
    for n, b, t in ((3, 1, 2), (3, 2, 10)):            # one softmax over depth (the native kernel), two phases
        for with_partial in (True, False) if name != "partial" else (True,):
            inputs = dict(blocks=randn(n, b, t, 16), partial=randn(b, t, 16, seed=1) if with_partial else None,
                          queries=randn(2, 16, seed=2), norm_weight=randn(16, seed=3))
            inputs = poisoned(inputs, name, value)
            assert_same(OPS.attn_res(**inputs), attn_res.reference_attn_res(**inputs))


def test_attn_res_blocks_all_at_minus_inf_leave_the_partial(attn_res_path):
    """A query whose logits over the completed blocks all overflow to -inf takes the partial block, in the
    one-softmax path and the two-phase path alike; without a partial block its output is NaN."""
    q = torch.zeros(2, 16)
    q[:, 0] = 3e38
    for b, t in ((1, 2), (2, 10)):
        blocks, partial = torch.ones(3, b, t, 16), torch.ones(b, t, 16)
        blocks[..., 0], partial[..., 0] = -4.0, 1e-3
        out = OPS.attn_res(blocks, partial, q)
        torch.testing.assert_close(out, partial.expand(2, b, t, 16))
        assert_same(out, attn_res.reference_attn_res(blocks, partial, q))
        assert bool(OPS.attn_res(blocks, None, q).isnan().all())


@each_kind
@pytest.mark.parametrize("name", ["x", "w13", "w2", "topk_weights"])
def test_fused_moe(name, value, moe_path):
    for tokens in (1, 5):                               # decode, and tokens grouped by expert
        g = torch.Generator().manual_seed(tokens)
        ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(tokens)])
        inputs = dict(x=randn(tokens, 32), w13=randn(6, 32, 32, seed=1) * 0.2, w2=randn(6, 32, 16, seed=2) * 0.2,
                      topk_weights=torch.rand(tokens, 2, generator=g), topk_ids=ids)
        inputs = poisoned(inputs, name, value, count=3)
        assert_same(OPS.fused_moe(**inputs), fused_moe.reference_fused_moe(**inputs))


def kda_inputs(t_len: int) -> dict:
    g = torch.Generator().manual_seed(t_len)
    b, h, dk, dv = 1, 2, 16, 8
    return dict(q=torch.randn(b, t_len, h, dk, generator=g),
                k=torch.nn.functional.normalize(torch.randn(b, t_len, h, dk, generator=g), dim=-1),
                v=torch.randn(b, t_len, h, dv, generator=g), g=-torch.rand(b, t_len, h, dk, generator=g) * 0.2,
                beta=torch.rand(b, t_len, h, generator=g), initial_state=torch.randn(b, h, dk, dv, generator=g) * 0.1)


KDA_INPUTS = ["q", "k", "v", "g", "beta", "initial_state"]


@each_kind
@pytest.mark.parametrize("name", KDA_INPUTS)
def test_chunk_kda(name, value, kda_path):
    for t_len in (5, 40):                               # the step path (<= 16 steps) and the chunked form
        inputs = poisoned(kda_inputs(t_len), name, value, seed=t_len)
        if name == "g" and value == INF:
            with pytest.raises(ValueError, match="`g` is a log decay and must be <= 0"):
                OPS.chunk_kda(**inputs)
            continue
        want = chunk_kda.reference_chunk_kda(**inputs, output_final_state=True)
        assert_same(OPS.chunk_kda(**inputs, output_final_state=True), want)


@each_kind
@pytest.mark.parametrize("name", KDA_INPUTS)
def test_chunk_kda_states(name, value, kda_path):
    if name == "g" and value == INF:
        pytest.skip("refused, as test_chunk_kda shows")
    inputs = poisoned(kda_inputs(6), name, value, seed=3)
    o, final, states = OPS.chunk_kda_states(**inputs, num_states=4)
    assert_same((o, final), chunk_kda.reference_chunk_kda(**inputs, output_final_state=True))
    for t in range(4):
        prefix = {n: x if n == "initial_state" else x[:, :t + 1] for n, x in inputs.items()}
        assert_same(states[:, t], chunk_kda.reference_chunk_kda(**prefix, output_final_state=True)[1])


def test_chunk_kda_overflow_leaves_earlier_steps(kda_path):
    """Finite keys that overflow at step 12 make the outputs non-finite from step 12 on, as the definition does; in
    the chunked form the overflow would reach the earlier steps of the chunk too."""
    inputs = kda_inputs(40)
    inputs["k"][0, 12, 1] = 1e30
    o, final = OPS.chunk_kda(**inputs, output_final_state=True)
    assert bool(torch.isfinite(o[:, :12]).all()) and not bool(torch.isfinite(o[:, 12:, 1]).all())
    assert_same((o, final), chunk_kda.reference_chunk_kda(**inputs, output_final_state=True))


@each_kind
def test_chunk_kda_refuses_a_non_finite_scale(value, kda_path):
    for op in (OPS.chunk_kda, chunk_kda.reference_chunk_kda):
        with pytest.raises(ValueError, match="`scale` must be a finite number"):
            op(**kda_inputs(5), scale=value)


def as_values(outputs: tuple) -> tuple:
    """Quantizer outputs as fp32 values (e8m0 scales as their bytes), NaN where a code is NaN."""
    return tuple(t.view(torch.uint8).float() if t.dtype == mx_quant.SCALE_DTYPE else t.float() for t in outputs)


@each_kind
@pytest.mark.parametrize("scale_fmt", block_quant.SCALE_FORMATS)
def test_dynamic_block_quant(value, scale_fmt):
    x = poisoned(dict(x=randn(3, 256) * 3), "x", value)["x"]
    got = OPS.dynamic_block_quant(x, scale_fmt=scale_fmt)
    want = block_quant.reference_dynamic_block_quant(x, scale_fmt=scale_fmt)
    assert_same(as_values(got), as_values(want), 0, 0)
    assert bool(torch.isfinite(got[0].float()).all()) and int(got[1].isnan().sum()) == 1


@each_kind
@pytest.mark.parametrize("dst_type", list(mx_quant.FP8_MAX), ids=str)
@pytest.mark.parametrize("axis", [-1, 0])
def test_dynamic_mx_quant(value, dst_type, axis):
    x = poisoned(dict(x=randn(64, 64) * 3), "x", value)["x"]
    got = OPS.dynamic_mx_quant(x, axis=axis, dst_type=dst_type)
    assert_same(as_values(got), as_values(mx_quant.reference_dynamic_mx_quant(x, axis=axis, dst_type=dst_type)), 0, 0)
    assert bool(torch.isfinite(got[0].float()).all()) and int((got[1].view(torch.uint8) == 0xFF).sum()) == 1


@each_kind
def test_dequant_block_scale(value):
    y, scale = OPS.dynamic_block_quant(randn(3, 256) * 3)
    scale = poisoned(dict(s=scale), "s", value)["s"]
    assert_same(OPS.dequant_block(y, scale), block_quant.reference_dequant_block(y, scale), 0, 0)


def test_dequant_mx_nan_scale_decodes_its_block_as_nan():
    y, scale = OPS.dynamic_mx_quant(randn(4, 256) * 3)
    scale.view(torch.uint8)[2, 3] = 0xFF
    got = OPS.dequant_mx(y, scale)
    assert_same(got, mx_quant.reference_dequant_mx(y, scale), 0, 0)
    assert int(got.isnan().sum()) == 32 and bool(got[2, 96:128].isnan().all())


@pytest.mark.parametrize("dst_type,code", [(torch.float8_e4m3fn, 0x7F), (torch.float8_e4m3fn, 0xFF),
                                           (torch.float8_e5m2, 0x7C), (torch.float8_e5m2, 0xFC),
                                           (torch.float8_e5m2, 0x7E)], ids=["e4m3 nan", "e4m3 -nan", "e5m2 inf",
                                                                            "e5m2 -inf", "e5m2 nan"])
def test_dequant_non_finite_codes(dst_type, code):
    x = randn(4, 256) * 3
    y, scale = OPS.dynamic_mx_quant(x, dst_type=dst_type)
    y.view(torch.uint8)[1, 7] = code
    assert_same(OPS.dequant_mx(y, scale), mx_quant.reference_dequant_mx(y, scale), 0, 0)
    if dst_type is torch.float8_e4m3fn:
        y, scale = OPS.dynamic_block_quant(x)
        y.view(torch.uint8)[1, 7] = code
        assert_same(OPS.dequant_block(y, scale), block_quant.reference_dequant_block(y, scale), 0, 0)


def additive_causal(batch: int, s1: int, s2: int) -> torch.Tensor:
    return torch.full((batch, s1, s2), -INF).triu_(s2 - s1 + 1)


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "+inf"])
@pytest.mark.parametrize("where", [(0, 1, 2), (1, 2, 7)], ids=["visible", "masked"])
def test_causal_lengths_refuses_nan_and_plus_inf(value, where, mask_path):
    mask = additive_causal(2, 3, 8)
    mask[where] = value
    for op in (OPS.causal_lengths, causal_lengths.reference_causal_lengths):
        with pytest.raises(FusedPreconditionError, match=r"`mask` must hold 0 \(visible\) or a value <= -1e30"):
            op(mask, True)


def test_causal_lengths_takes_minus_inf_as_masked(mask_path):
    mask = additive_causal(2, 3, 8)
    assert [t.tolist() for t in OPS.causal_lengths(mask, True)] == [[3, 3], [8, 8], [0, 0]]
    assert_same(OPS.causal_lengths(mask, True), OPS.causal_lengths(mask.clamp(min=-1e30), True))


def test_nan_in_a_compiled_graphs_mask_runs_the_graph_eagerly():
    """The fused indexer's mask is refused at run time: the backend warns once and gives the eager result."""
    def masked_topk(q, k, w, mask):
        score = (torch.einsum("bshd,btd->bsht", q, k).relu() * w[..., None]).sum(dim=2)
        return (score + mask).topk(4, dim=-1)[1]

    q, k, w = randn(1, 4, 4, 16), randn(1, 12, 16, seed=1), randn(1, 4, 4, seed=2)
    mask = torch.full((4, 12), -INF).triu_(9)
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    compiled = torch.compile(masked_topk, backend=backend)
    with torch.no_grad():
        assert torch.equal(compiled(q, k, w, mask), masked_topk(q, k, w, mask))
        assert backend.reports[-1].fused_ops == {"causal_lengths": 1, "lightning_indexer": 1}
        mask[2, 3] = NAN
        with pytest.warns(npu_graph.backend.CompilationFallbackWarning, match="additive `mask`"):
            assert torch.equal(compiled(q, k, w, mask), masked_topk(q, k, w, mask))


# query shape, S2, K; the decode row fills its 19 cache blocks of 16 keys: as long as the layout's rows, over which
# the native kernel and the eager model settle ties, and as the definition's row of visible keys.
INDEXER_CASES = {"decode": ((1, 1, 4, 32), 304, 16), "prefill": ((1, 4, 4, 32), 40, 8)}


def indexer_call(case: str, poison: tuple, dtype: torch.dtype = torch.float32, paged: bool = False
                 ) -> tuple[dict, dict]:
    """(tensors, options) of a call; `poison` (name, value, count) goes into the BSND tensors before paging."""
    shape, s2, k = INDEXER_CASES[case]
    tensors = dict(query=randn(*shape, dtype=dtype), key=randn(shape[0], s2, 1, shape[3], seed=1, dtype=dtype),
                   weights=randn(*shape[:3], seed=2))
    name, value, count = poison
    tensors = poisoned(tensors, name, value, count=count)
    options = dict(sparse_count=k)
    if paged:
        tensors["key"], table = to_paged(tensors["key"], 16)
        options.update(block_table=table, layout_key="PA_BSND", actual_seq_lengths_key=torch.tensor([s2]))
    return tensors, options


@functools.cache
def indexer_reference(case: str, poison: tuple, dtype: torch.dtype = torch.float32, paged: bool = False) -> tuple:
    """The definition's result for indexer_call's call, computed once for all the paths compared with it."""
    tensors, options = indexer_call(case, poison, dtype, paged)
    return lightning_indexer.reference_lightning_indexer(**tensors, **options)


def assert_same_selection(got: tuple, want: tuple, whole_sets: bool = False) -> None:
    """Values as assert_same, -1 in the same places, and per row the same keys ranked above the cut (NaN above
    +inf above numbers); with `whole_sets` the same kept keys, ties at the cut included."""
    (gi, gv), (wi, wv) = got, want
    assert gi.dtype == torch.int32 and torch.equal(gi == -1, wi == -1)
    assert_same(gv, wv, 1e-4, 1e-3)
    k = gi.shape[-1]
    for ig, vg, iw, vw in zip(gi.reshape(-1, k), gv.reshape(-1, k), wi.reshape(-1, k), wv.reshape(-1, k)):
        cut = float(vw[iw >= 0][-1]) if bool((iw >= 0).any()) else NAN
        if whole_sets:
            assert set(ig.tolist()) == set(iw.tolist())
        elif not math.isnan(cut):
            bound = cut + 1e-3 + 1e-4 * abs(cut) if math.isfinite(cut) else cut
            assert set(ig[vg.isnan() | (vg > bound)].tolist()) == set(iw[vw.isnan() | (vw > bound)].tolist())


@each_kind
@pytest.mark.parametrize("name", ["query", "key", "weights"])
@pytest.mark.parametrize("case", list(INDEXER_CASES))
@pytest.mark.parametrize("paged", [False, True], ids=["BSND", "PA_BSND"])
def test_lightning_indexer(name, value, case, paged, indexer_path):
    for count in (1, 24):                               # a few, and more non-finite keys than sparse_count
        tensors, options = indexer_call(case, (name, value, count), paged=paged)
        want = indexer_reference(case, (name, value, count), paged=paged)
        assert_same_selection(OPS.lightning_indexer(**tensors, **options), want)


@pytest.mark.parametrize("value", [NAN, INF, -INF, 3e38], ids=["nan", "+inf", "-inf", "3e38"])
@pytest.mark.parametrize("name", ["query", "key", "weights"])
def test_lightning_indexer_bf16_prefilter(name, value, monkeypatch):
    """The torch path's bf16 prefilter (forced): a non-finite approximate score never narrows the candidates."""
    monkeypatch.setenv("ASCEND_DSA_NATIVE", "0")
    monkeypatch.setattr(lightning_indexer, "bf16_prefilter", lambda: True)
    for count in (1, 24):
        tensors, options = indexer_call("decode", (name, value, count), torch.bfloat16)
        want = lightning_indexer.reference_lightning_indexer(**tensors, **options)
        assert_same_selection(OPS.lightning_indexer(**tensors, **options), want)


@pytest.mark.parametrize("paged", [False, True], ids=["BSND", "PA_BSND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lightning_indexer_keeps_nan_ties_as_torch_topk(paged, dtype, indexer_path, monkeypatch):
    """40 keys of a decode row score NaN and 16 are kept: the 16 torch.topk keeps over the row, as the eager model
    and the definition keep them (the bf16 prefilter too)."""
    for prefilter in (False, True) if indexer_path == "torch" and dtype is torch.bfloat16 else (False,):
        monkeypatch.setattr(lightning_indexer, "bf16_prefilter", lambda chosen=prefilter: chosen)
        tensors, options = indexer_call("decode", ("key", NAN, 40), dtype, paged)
        want = indexer_reference("decode", ("key", NAN, 40), dtype, paged)
        assert bool(want[1].isnan().all())
        assert_same_selection(OPS.lightning_indexer(**tensors, **options), want, whole_sets=True)
