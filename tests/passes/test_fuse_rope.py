"""fuse_rope on the ways models write RoPE: the op sets around the pass, the pattern counted, and results equal
to eager bit for bit (the op repeats the unfused arithmetic); near misses and graphs left alone."""
import math

import pytest
import torch

from npu_graph.models.dsa import apply_rope
from npu_graph.passes import fuse_rope

ROTATION_OPS = {"aten.sub", "aten.neg"}


def run(watch_pass, fn, *args, dynamic=None):
    return watch_pass(fuse_rope, fn, *args, dynamic=dynamic)


def angles(shape, dtype=torch.float32, seed=0):
    theta = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 * math.pi
    return theta.cos().to(dtype), theta.sin().to(dtype)


def rand(*shape, dtype=torch.float32, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_fused(watched, count, pattern=fuse_rope.PATTERN_PAIRS):
    assert watched.stats["matches"] == {pattern: count}
    assert "ascend_dsa.rotary_mul" in watched.after_names
    assert not ROTATION_OPS & watched.after_names and "aten.sub" in watched.before_names
    assert watched.out.dtype == watched.ref.dtype
    assert torch.equal(watched.out, watched.ref)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_model_rope(watch_pass, interleaved, dtype):
    x = rand(2, 5, 4, 16, dtype=dtype)
    cos, sin = angles((2, 5, 8), dtype)
    watched = run(watch_pass, lambda x, c, s: apply_rope(x, c, s, interleaved) * 2, x, cos, sin)
    assert_fused(watched, 1)
    assert watched.after["aten.cat.default"] == 2 - interleaved * 2


def test_mixed_dtypes_compute_in_the_promoted_dtype(watch_pass):
    """bf16 values rotated by fp32 angles give fp32, as type promotion does: the op runs on exact casts."""
    x = rand(1, 3, 2, 8, dtype=torch.bfloat16)
    cos, sin = angles((1, 3, 4))
    watched = run(watch_pass, lambda x, c, s: apply_rope(x, c, s, False), x, cos, sin)
    assert_fused(watched, 1)
    assert watched.out.dtype == torch.float32


def test_query_and_key_of_one_layer_share_the_angles(watch_pass):
    """Two rotations by the same cos/sin: two ops (the full-width angles are built per match and merged by
    eliminate_common_subexpressions later)."""
    q, k = rand(1, 4, 3, 8), rand(1, 4, 1, 8, seed=2)
    cos, sin = angles((1, 4, 4))
    watched = run(watch_pass, lambda q, k, c, s: (apply_rope(q, c, s, True), apply_rope(k, c, s, True)), q, k,
                  cos, sin)
    assert watched.stats["matches"] == {fuse_rope.PATTERN_PAIRS: 2}
    assert all(torch.equal(a, b) for a, b in zip(watched.out, watched.ref))


@pytest.mark.parametrize(("form", "q_shape", "k_shape", "pattern"), [
    ("rotate_half", (2, 6, 3, 16), (2, 6, 1, 16), fuse_rope.PATTERN_ROTATE_HALF),
    ("interleave", (2, 3, 5, 16), (2, 1, 5, 16), fuse_rope.PATTERN_PAIRS),
])
def test_transformers_deepseek_v32_rope(watch_pass, form, q_shape, k_shape, pattern):
    """transformers' DeepSeek-V3.2: the indexer's `rotate_half` form on [B, S, H, D], and the MLA's interleaved
    form on [B, H, S, D] (even/odd values in, halves out: the op gets cat(x1, x2))."""
    hf = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
    q, k = rand(*q_shape), rand(*k_shape, seed=3)
    half_cos, half_sin = angles((2, q_shape[1 if form == "rotate_half" else 2], 8))
    cos, sin = torch.cat((half_cos, half_cos), -1), torch.cat((half_sin, half_sin), -1)
    rope = (lambda q, k, c, s: hf.apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=2)) if form == "rotate_half" \
        else hf.apply_rotary_pos_emb_interleave
    watched = run(watch_pass, rope, q, k, cos, sin)
    assert watched.stats["matches"] == {pattern: 2}
    assert "aten.neg" not in watched.after_names
    assert all(torch.equal(a, b) for a, b in zip(watched.out, watched.ref))


def test_halves_into_pairs_and_low_rank(watch_pass):
    """Halves in, pairs out, on a 3-D tensor: the op gets stack(x1, x2) flattened, with a leading unit dim."""
    def rope(x, c, s):
        x1, x2 = x[..., :4], x[..., 4:]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)

    cos, sin = angles((5, 1, 4))
    watched = run(watch_pass, rope, rand(5, 3, 8), cos, sin)
    assert_fused(watched, 1)
    assert "aten.squeeze" in watched.after_names


def test_dynamic_sequence_length(watch_pass):
    """A symbolic sequence length (head dims stay static, as in real models)."""
    x, (cos, sin) = rand(1, 7, 2, 16), angles((1, 7, 8))
    for t in (x, cos, sin):
        torch._dynamo.mark_dynamic(t, 1)
    watched = run(watch_pass, lambda x, c, s: apply_rope(x, c, s, True), x, cos, sin)
    assert_fused(watched, 1)


def test_angles_broadcast_along_the_rotated_dim_are_a_near_miss(watch_pass):
    cos, sin = angles((2, 5, 1))
    watched = run(watch_pass, lambda x, c, s: apply_rope(x, c, s, False), rand(2, 5, 4, 16), cos, sin)
    assert watched.stats["matches"] == {}
    assert [m["reason"] for m in watched.stats["near_misses"]] == \
        ["cos broadcasts along the rotated dim (rotary_mul takes one angle per value)"]
    assert watched.before == watched.after and torch.equal(watched.out, watched.ref)


def test_angles_that_enlarge_the_input_are_a_near_miss(watch_pass):
    def rope(x, c, s):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    cos, sin = angles((2, 5, 3, 8))
    watched = run(watch_pass, rope, rand(2, 5, 1, 16), cos, sin)
    assert watched.stats["matches"] == {}
    assert "enlarges" in watched.stats["near_misses"][0]["reason"]


def test_graphs_without_rotations_are_unchanged(watch_pass):
    def not_rope(a, b, c):
        return torch.cat((a * b - c * a, c * b + a * b), -1), torch.stack((a - b, a + b), -1).flatten(-2)

    watched = run(watch_pass, not_rope, rand(2, 8), rand(2, 8, seed=2), rand(2, 8, seed=3))
    assert watched.stats == {"matches": {}, "near_misses": []}
    assert watched.before == watched.after


def test_output_keeps_the_unfused_layout(watch_pass):
    """A transposed (dense) input: rotate_half's sum keeps its layout, the op does too; cat's output is
    contiguous, so the op's result is copied to that layout for the views traced after it."""
    def both(y, c, s, full_c, full_s):
        x = y.transpose(1, 2)
        x1, x2 = x.chunk(2, -1)
        rotated = torch.cat((-x2, x1), -1)
        return (apply_rope(x, c, s, False).view(-1), (x * full_c + rotated * full_s).transpose(1, 2).view(-1))

    cos, sin = angles((2, 3, 8))
    full = [torch.cat((a, a), -1).unsqueeze(2) for a in (cos, sin)]
    watched = run(watch_pass, both, rand(2, 4, 3, 16), cos, sin, *full)
    assert watched.stats["matches"] == {fuse_rope.PATTERN_PAIRS: 1, fuse_rope.PATTERN_ROTATE_HALF: 1}
    assert watched.after["aten.clone.default"] == watched.before["aten.clone.default"] + 1
    assert all(torch.equal(a, b) for a, b in zip(watched.out, watched.ref))
