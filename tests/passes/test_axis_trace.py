"""axis_trace on hand-built ATen graphs: which atomic axes each dim of a traced value holds through reshapes,
permutes, broadcasts and atom splits, with static and symbolic sizes; contractions, scales and softmax as
expressions; materialize laying a leaf out again; and the failures (TraceError, or a leaf where the tracer
cannot see through)."""
import operator

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from npu_graph.passes.matching.axis_trace import Axis, TraceError, Tracer, find, flat, flatten, softmax_of, unify_dim
from npu_graph.passes.matching.materialize import materialize, size_arg

aten = torch.ops.aten
NEG_INF = float("-inf")


class Builder:
    """A graph built op by op: `x = b.input(shape)`, `y = b(aten.op, x, ...)`; `b.done(out)` fills every
    node's fake value (sizes listed in `dynamic` as {input index: dims} become symbolic)."""

    def __init__(self) -> None:
        self.graph = torch.fx.Graph()
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[torch.dtype] = []

    def input(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.fx.Node:
        self.shapes.append(shape)
        self.dtypes.append(dtype)
        return self.graph.placeholder(f"x{len(self.shapes) - 1}")

    def __call__(self, target, *args) -> torch.fx.Node:
        return self.graph.call_function(target, args)

    def done(self, out: torch.fx.Node, dynamic: dict[int, list[int]] | None = None) -> torch.fx.GraphModule:
        self.graph.output(out)
        gm = torch.fx.GraphModule(torch.nn.Module(), self.graph)
        mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = []
        for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes)):
            sizes = [DimDynamic.DYNAMIC if d in (dynamic or {}).get(i, []) else DimDynamic.STATIC
                     for d in range(len(shape))]
            real = torch.zeros(shape, dtype=dtype)
            fakes.append(mode.from_tensor(real, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes)))
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
        return gm


def sources(dim) -> list[tuple[str, int]]:
    """(leaf name, leaf dim) of each atom of a dim, through unifications."""
    out = []
    for axis in flat(dim):
        owner = axis if axis.source is not None else find(axis)
        out.append((owner.source[0].name, owner.source[1]) if owner.source else ("?", -1))
    return out


def test_reshape_merges_and_unmerges_along_atom_boundaries():
    b = Builder()
    x = b.input(2, 3, 4)
    merged = b(aten.view.default, x, [6, 4])
    back = b(aten.reshape.default, merged, [2, 3, 4])
    b.done(back)
    tracer = Tracer()
    value = tracer.trace(merged)
    assert value.expr.kind == "leaf" and value.expr.node is x
    assert [sources(d) for d in value.dims] == [[("x0", 0), ("x0", 1)], [("x0", 2)]]
    again = tracer.trace(back)
    assert [d[0] for d in again.dims] == [d[0] for d in tracer.leaf_dims[x]]


def test_unit_dims_hold_no_axes_and_squeeze_removes_them():
    b = Builder()
    x = b.input(3, 4)
    grown = b(aten.unsqueeze.default, x, 1)
    shrunk = b(aten.squeeze.dim, grown, 1)
    b.done(shrunk)
    tracer = Tracer()
    assert [len(d) for d in tracer.trace(grown).dims] == [1, 0, 1]
    assert tracer.trace(shrunk).dims == tracer.leaf_dims[x]


def test_permute_transpose_and_t_reorder_dims():
    b = Builder()
    x = b.input(2, 3, 4)
    perm = b(aten.permute.default, x, [2, 0, 1])
    swapped = b(aten.transpose.int, perm, 0, -1)
    m = b.input(5, 6)
    mt = b(aten.t.default, m)
    b.done(b(aten.add.Tensor, swapped, swapped))
    tracer = Tracer()
    assert [sources(d) for d in tracer.trace(perm).dims] == [[("x0", 2)], [("x0", 0)], [("x0", 1)]]
    assert [sources(d) for d in tracer.trace(swapped).dims] == [[("x0", 1)], [("x0", 0)], [("x0", 2)]]
    assert [sources(d) for d in tracer.trace(mt).dims] == [[("x1", 1)], [("x1", 0)]]


def test_expand_adds_broadcast_axes_that_a_product_resolves():
    b = Builder()
    col, row = b.input(3, 1), b.input(1, 4)
    wide = b(aten.expand.default, col, [3, 4])
    product = b(aten.mul.Tensor, wide, row)
    b.done(product)
    tracer = Tracer()
    expanded = tracer.trace(wide).dims
    assert sources(expanded[0]) == [("x0", 0)] and expanded[1][0].broadcast and expanded[1][0].size == 4
    value = tracer.trace(product)
    assert value.expr.kind == "mul" and [f.node for f in value.expr.factors] == [col, row]
    assert [sources(d) for d in value.dims] == [[("x0", 0)], [("x1", 1)]]
    assert not find(value.dims[1][0]).broadcast


def test_a_product_splits_a_merged_axis_to_match_the_other_side():
    b = Builder()
    a, c = b.input(6), b.input(2, 3)
    flat_c = b(aten.view.default, c, [6])
    product = b(aten.mul.Tensor, a, flat_c)
    b.done(product)
    tracer = Tracer()
    (dim,) = tracer.trace(product).dims
    assert [axis.size for axis in flat(dim)] == [2, 3]
    a_parts, c_axes = flat(tracer.leaf_dims[a][0]), flat(tracer.leaf_dims[c][0] + tracer.leaf_dims[c][1])
    assert len(a_parts) == 2 and all(x is y for x, y in zip(a_parts, c_axes))


def test_a_view_that_splits_a_static_atomic_axis_refines_it():
    """A projection's output viewed as heads × head dim: the atom of the merged dim is split into two parts, and
    the view stays an expression of its input."""
    b = Builder()
    x = b.input(6)
    split = b(aten.view.default, x, [2, 3])
    b.done(split)
    tracer = Tracer()
    value = tracer.trace(split)
    assert value.expr.kind == "leaf" and value.expr.node is x
    assert [a.size for d in value.dims for a in d] == [2, 3]
    assert [a.size for a in flat(tracer.leaf_dims[x][0])] == [2, 3]


def test_a_split_op_is_opaque_and_its_pieces_are_leaves():
    b = Builder()
    x = b.input(4, 6)
    pieces = b(aten.split.Tensor, x, 3, -1)
    first = b(operator.getitem, pieces, 0)
    scaled = b(aten.mul.Scalar, first, 2.0)
    b.done(scaled)
    value = Tracer().trace(scaled)
    assert value.expr.kind == "leaf" and value.expr.node is scaled and value.expr.scale == 2.0
    assert [sources(d) for d in value.dims] == [[(first.name, 0)], [(first.name, 1)]]


def attention_scores(b: Builder, q, k):
    """q [B, S, D] · kᵀ [B, D, T] written as bmm."""
    return b(aten.bmm.default, q, b(aten.transpose.int, k, 1, 2))


def test_bmm_contracts_the_shared_axis_and_identifies_the_batch():
    b = Builder()
    q, k = b.input(2, 5, 8), b.input(2, 7, 8)
    score = b(aten.div.Scalar, attention_scores(b, q, k), 4.0)
    b.done(score)
    tracer = Tracer()
    value = tracer.trace(score)
    assert value.expr.kind == "matmul" and value.expr.scale == 0.25
    assert [leaf.node for leaf in value.expr.leaves()] == [q, k]
    (contracted,) = value.expr.reduced
    assert find(contracted) is find(tracer.leaf_dims[q][2][0]) is find(tracer.leaf_dims[k][2][0])
    assert find(tracer.leaf_dims[q][0][0]) is find(tracer.leaf_dims[k][0][0])
    assert [sources(d) for d in value.dims] == [[("x0", 0)], [("x0", 1)], [("x1", 1)]]


def test_mul_and_sum_read_as_the_same_contraction():
    b = Builder()
    q, k = b.input(5, 8), b.input(7, 8)
    product = b(aten.mul.Tensor, b(aten.unsqueeze.default, q, 1), b(aten.unsqueeze.default, k, 0))
    total = b(aten.sum.dim_IntList, product, [-1])
    b.done(total)
    tracer = Tracer()
    expr = flatten(tracer.trace(total).expr)
    assert expr.kind == "mul" and [f.node for f in expr.factors] == [q, k]
    (contracted,) = expr.reduced
    assert find(contracted) is find(tracer.leaf_dims[q][1][0]) is find(tracer.leaf_dims[k][1][0])
    assert [sources(d) for d in tracer.trace(total).dims] == [[("x0", 0)], [("x1", 0)]]


def test_softmax_and_a_minus_inf_mask_are_traced():
    b = Builder()
    q, k = b.input(2, 5, 8), b.input(2, 7, 8)
    mask = b.input(2, 5, 7, dtype=torch.bool)
    masked = b(aten.masked_fill.Scalar, attention_scores(b, q, k), mask, NEG_INF)
    probs = b(aten._softmax.default, masked, -1, False)
    b.done(probs)
    tracer = Tracer()
    value = tracer.trace(probs)
    assert value.expr.kind == "softmax" and value.expr.factors[0].kind == "masked"
    score, axes, node = softmax_of(tracer, value.expr)
    assert node is probs and score.kind == "masked" and find(axes[0]) is find(tracer.leaf_dims[k][1][0])


def test_a_fill_other_than_minus_inf_is_not_a_mask():
    b = Builder()
    x, mask = b.input(5, 7), b.input(5, 7, dtype=torch.bool)
    filled = b(aten.masked_fill.Scalar, x, mask, 0.0)
    b.done(filled)
    value = Tracer().trace(filled)
    assert value.expr.kind == "leaf" and value.expr.node is filled


def test_symbolic_sizes_merge_unify_and_become_sym_size_nodes():
    b = Builder()
    q, k = b.input(3, 5, 8), b.input(3, 7, 8)
    score = attention_scores(b, q, k)
    rows = b(aten.view.default, score, [-1, 7])
    gm = b.done(rows, dynamic={0: [0, 1], 1: [0]})
    assert isinstance(rows.meta["val"].shape[0], torch.SymInt) and rows.meta["val"].shape[1] == 7
    tracer = Tracer()
    value = tracer.trace(rows)
    assert value.expr.kind == "matmul"
    assert [sources(d) for d in value.dims] == [[("x0", 0), ("x0", 1)], [("x1", 1)]]
    assert find(tracer.leaf_dims[q][0][0]) is find(tracer.leaf_dims[k][0][0])
    with gm.graph.inserting_before(rows):
        size = size_arg(gm.graph, value.dims[0])
    assert size.target is operator.mul and [a.target for a in size.args] == [aten.sym_size.int] * 2
    assert [a.args for a in size.args] == [(q, 0), (q, 1)]


def test_materialize_lays_a_leaf_out_as_the_wanted_dims():
    b = Builder()
    x = b.input(2, 3, 4)
    out = b(aten.permute.default, x, [2, 0, 1])
    gm = b.done(out)
    tracer = Tracer()
    tracer.trace(out)
    dims = tracer.leaf_dims[x]
    with gm.graph.inserting_before(list(gm.graph.nodes)[-1]):
        laid = materialize(gm.graph, x, dims, [dims[2], dims[0] + dims[1]])
    next(n for n in gm.graph.nodes if n.op == "output").args = (laid,)
    gm.recompile()
    data = torch.arange(24.0).view(2, 3, 4)
    torch.testing.assert_close(gm(data), data.permute(2, 0, 1).reshape(4, 6))


def test_failures_raise_trace_error():
    b = Builder()
    x = b.input(3, 4)
    bare = b(aten.relu.default, x)
    with pytest.raises(TraceError, match=f"{bare.name} has no tensor metadata"):
        Tracer().trace(bare)
    with pytest.raises(TraceError, match="different axes"):
        unify_dim((Axis(3),), (Axis(4),))
    symbolic = b.done(bare, dynamic={0: [0]}).graph
    size = next(n for n in symbolic.nodes if n.op == "placeholder").meta["val"].shape[0]
    with pytest.raises(TraceError, match="symbolic size without a source"):
        size_arg(symbolic, [Axis(size)])


def test_materialize_rejects_a_layout_that_drops_an_axis():
    b = Builder()
    x = b.input(2, 3)
    gm = b.done(b(aten.relu.default, x))
    tracer = Tracer()
    tracer.trace(x)
    dims = tracer.leaf_dims[x]
    with pytest.raises(TraceError, match="every axis of the leaf exactly once"):
        materialize(gm.graph, x, dims, [dims[0]])


@pytest.mark.parametrize("case", ["opaque op", "division by a tensor", "add with alpha", "broadcast contraction"])
def test_what_the_tracer_cannot_see_through_is_a_leaf(case):
    b = Builder()
    x, y = b.input(4, 4), b.input(4, 4)
    if case == "opaque op":
        node = b(aten.cumsum.default, x, 0)
    elif case == "division by a tensor":
        node = b(aten.div.Tensor, x, y)
    elif case == "add with alpha":
        node = b.graph.call_function(aten.add.Tensor, (x, y), {"alpha": 2})
    else:
        node = b(aten.mm.default, b(aten.expand.default, b.input(4, 1), [4, 3]),
                 b(aten.expand.default, b.input(1, 4), [3, 4]))
    b.done(node)
    value = Tracer().trace(node)
    assert value.expr.kind == "leaf" and value.expr.node is node


def test_an_elementwise_function_is_a_named_unary_term():
    """gelu, exp, sigmoid... trace as "unary" terms over their input (a near miss names the function); neg is a
    scale of -1."""
    b = Builder()
    x = b.input(4, 4)
    gelu = b(aten.gelu.default, b(aten.neg.default, x))
    b.done(gelu)
    value = Tracer().trace(gelu)
    assert value.expr.kind == "unary" and value.expr.node is gelu
    assert value.expr.factors[0].kind == "leaf" and value.expr.factors[0].scale == -1.0
