"""Kernel routes: transformers' Kimi KDA (prefill and decode loops) and fla's chunk_kda / fused_recurrent_kda are
traced as one ascend_dsa.chunk_kda."""
import sys
import textwrap

import pytest
import torch

import npu_graph
from npu_graph import routes

transformers = pytest.importorskip("transformers")


def compile_and_report(fn, *args):
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    with torch.no_grad():
        ref = fn(*args)
        out = torch.compile(fn, backend=backend)(*args)
    return ref, out, backend.reports


def test_transformers_kimi_kda_is_routed(tiny_transformers):
    model = tiny_transformers("kimi_linear")
    ids = torch.randint(3, 256, (1, 80), generator=torch.Generator().manual_seed(1))
    ref, out, reports = compile_and_report(lambda x: model(x).logits, ids)
    assert sum(r.fused_ops.get("chunk_kda", 0) for r in reports) == 1
    assert "transformers.models.kimi_linear.modeling_kimi_linear" in routes.routed()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


FAKE_FLA = textwrap.dedent('''
    import torch

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        B, T, H, K = k.shape
        scale = K ** -0.5 if scale is None else scale
        S = torch.zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.clone()
        out = []
        for t in range(T):
            S = S * g[:, t].exp()[..., None]
            kt = k[:, t]
            delta = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)
            S = S + beta[:, t][..., None, None] * kt[..., None] * delta[..., None, :]
            out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
        return torch.stack(out, 1), (S if output_final_state else None)


    def fused_recurrent_kda(*args, **kwargs):
        return chunk_kda(*args, **kwargs)
''')


def test_fla_chunk_kda_imported_after_npu_graph_is_routed(tmp_path, monkeypatch):
    package = tmp_path / "fla" / "ops"
    package.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "kda.py").write_text(FAKE_FLA)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    import fla.ops.kda as fla_kda

    assert "fla.ops.kda" in routes.routed()
    torch.manual_seed(0)
    q, k = torch.randn(1, 70, 2, 16), torch.nn.functional.normalize(torch.randn(1, 70, 2, 16), dim=-1)
    v, g, beta = torch.randn(1, 70, 2, 16), -torch.rand(1, 70, 2, 16) * 0.2, torch.rand(1, 70, 2)

    def layer(q, k, v, g, beta):
        return fla_kda.chunk_kda(q, k, v, g, beta, output_final_state=True)

    ref, out, reports = compile_and_report(layer, q, k, v, g, beta)
    assert reports[-1].fused_ops == {"chunk_kda": 1}
    torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-4, atol=1e-4)

    def decode(q, k, v, g, beta, state):
        return fla_kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)

    step = [x[:, :1] for x in (q, k, v, g, beta)]
    ref, out, reports = compile_and_report(decode, *step, ref[1])
    assert reports[-1].fused_ops == {"chunk_kda": 1}
    torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("l2", [False, True])
def test_transformers_kimi_decode_loop_is_routed(l2):
    """One decode step of transformers' `recurrent_kimi_delta_attention` (bf16 in, fp32 state) becomes one
    chunk_kda, equal to the loop it replaces."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 1, 3, 16, generator=g).bfloat16() for _ in range(3))
    gate, beta = (-torch.rand(2, 1, 3, 16, generator=g) * 0.3).bfloat16(), torch.rand(2, 1, 3, generator=g).bfloat16()
    state = torch.randn(2, 3, 16, 16, generator=g)

    def step(q, k, v, gate, beta, state):
        return kimi.recurrent_kimi_delta_attention(q, k, v, gate, beta, state, True, use_qk_l2norm_in_kernel=l2)

    ref, out, reports = compile_and_report(step, q, k, v, gate, beta, state)
    assert reports[-1].fused_ops == {"chunk_kda": 1}
    assert out[0].dtype == ref[0].dtype == torch.bfloat16
    torch.testing.assert_close(out[0], ref[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-4, atol=1e-4)
