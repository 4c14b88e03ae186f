"""fuse_sibling_matmuls: products of one decode row with several pre-transposed weights become one product against
the weights concatenated in the parameter prologue, sliced per original product; numbers unchanged, a weight
update seen, and rows of more than one token left alone."""
import json
from pathlib import Path

import torch

import npu_graph  # noqa: F401  (registers the backend)


class Siblings(torch.nn.Module):
    """Three bias-free projections of one input (as q_a / kv_a / an indexer's wk), one of another input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(64, n, bias=False) for n in (32, 48, 16))
        self.d = torch.nn.Linear(32, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.a(x), self.b(x), self.c(x)
        return torch.cat([self.d(torch.relu(a)).view(x.shape[0], -1), b.sigmoid(), c * 2], dim=-1)


def compiled_stats(module: torch.nn.Module, x: torch.Tensor, dump: Path) -> tuple[torch.Tensor, dict, str]:
    compiled = torch.compile(module, backend="ascend_dsa", options={"cache": False, "dump_dir": str(dump)})
    with torch.no_grad():
        out = compiled(x)
    summary = json.loads(next(dump.rglob("summary.json")).read_text())
    stats = next(p["stats"] for p in summary["passes"] if p["name"] == "fuse_sibling_matmuls")
    return out, stats, (next(dump.rglob("*fuse_sibling_matmuls.txt"))).read_text()


def test_one_row_reads_one_product(tmp_path) -> None:
    module, x = Siblings().eval(), torch.randn(1, 64)
    with torch.no_grad():
        want = module(x)
    out, stats, graph = compiled_stats(module, x, tmp_path)
    assert stats == {"groups": 1, "products": 3, "calls_saved": 2}
    assert graph.count("aten.mm.default(") == 2 and "aten.cat.default(" in graph
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_rows_of_several_tokens_are_left_alone(tmp_path) -> None:
    module, x = Siblings().eval(), torch.randn(3, 64)
    with torch.no_grad():
        want = module(x)
    out, stats, _ = compiled_stats(module, x, tmp_path)
    assert stats["groups"] == 0
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_a_weight_update_reaches_the_concatenated_weight(tmp_path) -> None:
    module, x = Siblings().eval(), torch.randn(1, 64)
    compiled = torch.compile(module, backend="ascend_dsa", options={"cache": False})
    with torch.no_grad():
        compiled(x)
        module.b.weight.mul_(-3.0)                  # in place: the prologue runs again for the new version
        torch.testing.assert_close(compiled(x), module(x), rtol=1e-6, atol=1e-6)
