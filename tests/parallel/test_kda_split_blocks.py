"""The two-pass KDA sequence split on time blocks (npu_graph.parallel.kda_split: `slice_transition`,
`kda_split_blocks`), in one process: a slice's transition maps any initial state to its final state, and slices
run from their folded states give the whole sequence's outputs."""
import torch
import torch.nn.functional as F

from npu_graph.parallel.kda_split import fold_states, kda_split_blocks, slice_transition

HEADS, DIM_K, DIM_V, BLOCK, BLOCKS = 2, 16, 8, 32, 6


def _blocks() -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(BLOCKS):
        shape = (1, BLOCK, HEADS, DIM_K)
        out.append((F.normalize(torch.randn(shape, generator=gen), dim=-1),
                    F.normalize(torch.randn(shape, generator=gen), dim=-1),
                    torch.randn(1, BLOCK, HEADS, DIM_V, generator=gen), -torch.rand(shape, generator=gen) * 0.3,
                    torch.rand(1, BLOCK, HEADS, generator=gen)))
    return out


def _whole(blocks, state=None):
    q, k, v, g, beta = (torch.cat(parts, dim=1) for parts in zip(*blocks))
    return torch.ops.ascend_dsa.chunk_kda(q, k, v, g, beta, None, state, output_final_state=True)


def test_slice_transition_maps_any_initial_state_to_the_final_state():
    blocks = _blocks()
    transition = slice_transition(blocks)
    start = torch.randn(1, HEADS, DIM_K, DIM_V, generator=torch.Generator().manual_seed(5))
    _, final = _whole(blocks, start)
    torch.testing.assert_close(fold_states([transition], start)[-1], final, rtol=1e-4, atol=1e-5)


def test_slices_run_from_their_folded_states_give_the_whole_sequence():
    blocks = _blocks()
    expected, final = _whole(blocks)
    slices = [blocks[:2], blocks[2:]]                 # unequal slices, as tensor_split may give
    states = fold_states([slice_transition(s) for s in slices], torch.zeros(1, HEADS, DIM_K, DIM_V))
    got = []
    for s, state in zip(slices, states):
        q, k, v, g, beta = (torch.cat(parts, dim=1) for parts in zip(*s))
        got.append(torch.ops.ascend_dsa.chunk_kda(q, k, v, g, beta, None, state)[0])
    torch.testing.assert_close(torch.cat(got, dim=1), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states[-1], final, rtol=1e-4, atol=1e-5)


def test_split_blocks_without_a_group_emits_every_block_and_times_its_parts():
    blocks = _blocks()
    expected, final = _whole(blocks)
    outputs, clock = {}, {}
    state = kda_split_blocks(blocks, None, outputs.__setitem__, clock=clock)
    assert sorted(outputs) == list(range(BLOCKS)) and set(clock) == {"transition", "exchange", "outputs"}
    torch.testing.assert_close(torch.cat([outputs[i] for i in range(BLOCKS)], dim=1), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-4, atol=1e-5)
