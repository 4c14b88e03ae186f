"""Parameter-only work runs once per parameter version (the prologue), and results always match eager."""
import gc

import pytest
import torch

import npu_graph
from npu_graph.runtime import compiled_graph as runtime


class Stacked(torch.nn.Module):
    """Stacks and casts its weights on every call, as fused MoE graphs do."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        w = torch.stack([self.a, self.b]).double().sum(0).float()
        return x @ w.t()


def compile_model(tmp_path=None):
    options = {"cache": tmp_path is not None}
    if tmp_path is not None:
        options["cache_dir"] = str(tmp_path)
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options(options))
    torch.manual_seed(0)
    model = Stacked()
    return model, torch.compile(model, backend=backend), backend


def test_prologue_runs_once_per_parameter_version(monkeypatch):
    model, compiled, _ = compile_model()
    calls = []
    original = runtime.CompiledGraph._hoisted_values

    def counting(self, inputs):
        before = self._hoisted_for
        result = original(self, inputs)
        calls.append(before != self._hoisted_for)
        return result

    monkeypatch.setattr(runtime.CompiledGraph, "_hoisted_values", counting)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x))
        model.a.mul_(2.0)
        torch.testing.assert_close(compiled(x), model(x))
    assert calls == [True, False, False, True]


def test_a_parameter_replaced_at_the_same_address_is_a_new_parameter():
    """A parameter deleted and replaced by a new one often gets the freed object's address (its id) and the same
    version (0): the prologue must still run again."""
    model, compiled, _ = compile_model()
    x = torch.randn(3, 8)
    same_address = 0
    with torch.no_grad():
        compiled(x)
        for _ in range(40):
            before = id(model.a)
            del model.a
            gc.collect()
            model.a = torch.nn.Parameter(torch.randn(8, 8))
            same_address += id(model.a) == before
            torch.testing.assert_close(compiled(x), model(x))
    if not same_address:
        pytest.skip("no replacement landed at the freed parameter's address in 40 tries")


def test_a_parameter_given_new_data_is_seen():
    """`p.data = t` keeps the parameter object and its version: the data's address tells."""
    model, compiled, _ = compile_model()
    x = torch.randn(3, 8)
    with torch.no_grad():
        compiled(x)
        model.b.data = torch.randn(8, 8)
        torch.testing.assert_close(compiled(x), model(x))


def test_prologue_survives_the_disk_cache(tmp_path):
    x = torch.randn(3, 8)
    with torch.no_grad():
        model, compiled, _ = compile_model(tmp_path)
        first = compiled(x)
        torch._dynamo.reset()
        model, compiled, backend = compile_model(tmp_path)
        second = compiled(x)
    assert backend.reports[-1].cache == "hit"
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(second, model(x))


class MaskedScores(torch.nn.Module):
    """A causal mask built from aranges on every call (as transformers' mask helpers do), used and returned."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        n = x.shape[-2]
        positions = torch.arange(n)
        visible = (positions[None, :] <= positions[:, None]) & (torch.ones(n, n, dtype=torch.bool))
        h = x @ self.w
        scores = (h @ h.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
        return scores.softmax(-1) @ h, torch.arange(n) * 2


def test_constant_masks_are_computed_once_and_returned_constants_are_fresh(monkeypatch):
    from npu_graph.targets import cpu
    split = cpu.split_prologue
    seen = []

    def spy(gm, param_indices):
        prologue, used = split(gm, param_indices)
        seen.append((prologue, {str(n.target) for n in gm.graph.nodes}))
        return prologue, used
    monkeypatch.setattr(cpu, "split_prologue", spy)
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    model = MaskedScores()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(5, 4)
    with torch.no_grad():
        first_out, first_positions = compiled(x)
        first_positions.add_(100)                   # the caller changes a returned tensor
        out, positions = compiled(x)
    want_out, want_positions = model(x)
    torch.testing.assert_close(out, want_out)
    assert torch.equal(positions, want_positions) and torch.equal(first_out, out)
    prologue, main_ops = seen[-1]
    assert prologue is not None and "aten.le.Tensor" in {str(n.target) for n in prologue.graph.nodes}
    assert "aten.le.Tensor" not in main_ops and "aten.mul.Tensor" in main_ops   # the returned product stays


class HeadSlices(torch.nn.Module):
    """Absorbed-MLA style: per-head slices of one weight, read by batched products through einsum."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4 * (64 + 48), 64, dtype=torch.bfloat16))

    def forward(self, q, latent):
        w = self.w.view(4, 112, 64)
        w_k, w_v = w[:, :64], w[:, 64:]
        q_latent = torch.einsum("thd,hdc->thc", q, w_k)
        return torch.einsum("thc,hvc->thv", q_latent * latent, w_v)


def test_batched_products_get_their_weight_slices_contiguous_once():
    torch.manual_seed(0)
    model = HeadSlices()
    backend = npu_graph.backend.Backend(npu_graph.CompilerConfig.from_options({"cache": False}))
    compiled = torch.compile(model, backend=backend)
    # one token, bf16: CPU bmm copies a strided operand of this size
    q, latent = torch.randn(1, 4, 64).bfloat16(), torch.randn(1, 4, 64).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, latent), model(q, latent))
        with torch.profiler.profile() as prof:
            out = compiled(q, latent)
        torch.testing.assert_close(out, model(q, latent))
        copies = [e for e in prof.events() if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")]
        assert not copies, [e.name for e in copies]
        model.w.mul_(-1.0)                      # an in-place update reaches the materialized slices
        torch.testing.assert_close(compiled(q, latent), model(q, latent))
