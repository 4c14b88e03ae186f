"""`ascend-dsa --help` answers without importing torch or the compiler; `import npu_graph` alone does not
import torch, yet registers the fused ops whichever of torch and npu_graph is imported first."""
import subprocess
import sys

import pytest


def python(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


HEAVY = "[m for m in ('torch', 'npu_graph.backend', 'npu_graph.kernels', 'transformers') if m in sys.modules]"


def test_cli_module_and_parser_import_no_torch():
    code = ("import sys, contextlib, io\nimport npu_graph.tools.cli as cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    for argv in (['--help'], ['inspect', 'show', '-h'], ['cache', 'ls', '-h'], ['demo', '-h']):\n"
            "        try:\n            cli.main(argv)\n        except SystemExit:\n            pass\n"
            f"print({HEAVY})")
    assert python(code) == "[]"


def test_help_runs_as_a_command_without_torch():
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "npu_graph", "--help"], capture_output=True,
                       text=True, timeout=300, cwd="/")
    assert p.returncode == 0 and "demo" in p.stdout and "inspect" in p.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines()}
    assert "torch" not in imported and "npu_graph.backend" not in imported


@pytest.mark.slow
@pytest.mark.parametrize("order", ["import npu_graph, torch", "import npu_graph.kernels, torch, npu_graph",
                                   "import npu_graph.backend, torch, npu_graph"])
def test_fused_ops_registered_whatever_the_import_order(order):
    out = python(f"{order}\nprint(torch.ops.ascend_dsa.rms_norm.default, npu_graph.get_backend.__module__)")
    assert out == "ascend_dsa.rms_norm.default npu_graph.backend"


def test_import_npu_graph_alone_imports_no_torch():
    assert python(f"import sys, npu_graph\nprint({HEAVY}, npu_graph.__version__)").startswith("[] ")
