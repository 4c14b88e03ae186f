"""The NPU program of the KDA core for short sequences (npu_graph.targets.npu_kda): chunk_kda_states over the verify
window and chunk_kda over a few tokens become a step recurrence in torch ops (labelled decomposition, no
composite, no host loop over rows) that computes what the op computes; a prefill keeps the labelled composite.
The rollback's slot selection is one device-side gather whatever the batch: its graph does not grow with rows."""
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import npu_graph.kernels  # noqa: F401
from npu_graph.models.cache import KDALayerCache
from npu_graph.models.kda_slots import KDASlots
from npu_graph.targets import npu
from npu_graph.targets.npu_op_table import lower_node
from npu_graph.targets.npu_ops import Names

A = torch.ops.ascend_dsa
B, H, K = 3, 2, 8


def inputs(steps: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, steps, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, steps, H, K, generator=gen)
    g = -torch.rand(B, steps, H, K, generator=gen)
    beta = torch.rand(B, steps, H, generator=gen)
    return [q, k, v, g, beta, torch.randn(B, H, K, K, generator=gen)]


def traced(fn, *args) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(*args)
    return gm


def run_lowering(gm: torch.fx.GraphModule, args: list[torch.Tensor]):
    """Execute the program lines of the graph's one ascend_dsa node on CPU tensors."""
    names, scope = Names(), {"torch": torch}
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], args):
        names.env[node], scope[node.name] = node.name, value
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target.namespace == "ascend_dsa")
    names.env[node] = "result"
    emission = lower_node(node, names)
    exec("\n".join(emission.lines), scope)
    return emission, scope["result"]


def states_op(q, k, v, g, beta, s0):
    return A.chunk_kda_states.default(q, k, v, g, beta, 0.3, s0, num_states=3)


def test_verify_window_states_are_a_device_recurrence_with_the_ops_numbers():
    args = inputs(4)
    gm = traced(states_op, *args)
    emission, (o, final, states) = run_lowering(gm, args)
    want = A.chunk_kda_states(*args[:5], 0.3, args[5], num_states=3)
    for got, ref in zip((o, final, states), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert emission.decomposed and not emission.composite and not emission.calls
    program = npu.build(gm, "verify")
    source = program.sources["eager"]
    compile(source, "npu_program", "exec")
    assert "chunk_kda_states" in program.decomposed and not program.composites
    assert "torch.ops.ascend_dsa" not in source and "# decomposition: no KDA op in the pinned torch_npu" in source
    assert program.summary()["decomposed_ops"] == program.decomposed


def test_a_decode_step_without_final_state_and_a_prefill():
    args = inputs(1)
    gm = traced(lambda q, k, v, g, beta, s0: A.chunk_kda.default(q, k, v, g, beta, None, s0)[0], *args)
    _, (o, final) = run_lowering(gm, args)
    torch.testing.assert_close(o, A.chunk_kda(*args[:5], None, args[5])[0], rtol=1e-5, atol=1e-5)
    assert final.numel() == 0
    long = inputs(24)
    program = npu.build(traced(lambda q, k, v, g, beta, s0: A.chunk_kda.default(q, k, v, g, beta, None, s0)[0],
                               *long), "prefill")
    assert "24 tokens are a prefill" in program.composites["chunk_kda"] and not program.decomposed


def rollback_graph(batch: int) -> torch.fx.GraphModule:
    width = 3

    def rollback(states, windows, accepted, state, conv_state):
        layer = KDALayerCache(state, conv_state)
        KDASlots("checkpoint", width, states, windows, None, None, None).rollback_(layer, accepted, 0.3)
        return layer.state, layer.conv_state

    args = (torch.randn(batch, width + 1, H, K, K), torch.randn(batch, width + 1, 6, 3),
            torch.randint(0, width + 1, (batch,)), torch.zeros(batch, H, K, K), torch.zeros(batch, 6, 3))
    gm = make_fx(rollback)(*args)
    state, conv = gm(*args)
    assert torch.equal(state, args[0][torch.arange(batch), args[2]])
    assert torch.equal(conv, args[1][torch.arange(batch), args[2]])
    return gm


def test_rollback_slot_selection_is_one_gather_whatever_the_batch():
    small, large = rollback_graph(2), rollback_graph(7)
    ops = [[str(n.target) for n in gm.graph.nodes if n.op == "call_function"] for gm in (small, large)]
    assert ops[0] == ops[1] and ops[0].count("aten.index.Tensor") == 2
    source = npu.build(large, "rollback").sources["eager"]
    assert source.count("torch.ops.aten.index.Tensor(") == 2 and ".item()" not in source
