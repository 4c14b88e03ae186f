"""The nevers of the package's layout, read from its source: kernels import no passes or compiler, passes import
no targets and read no devices, models import no compiler, only the NPU target imports torch_npu, models/ has
no import circle, and `import npu_graph` patches nothing of other libraries."""
import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"npu_graph": "npu_graph", "passes": "npu_graph.passes", "kernels": "npu_graph.kernels",
           "tools": "npu_graph.tools"}
COMPILER = ("npu_graph.compiler", "npu_graph.pipeline", "npu_graph.backend", "npu_graph.capture", "npu_graph.passes")
DEVICE_READS = ("is_cpu", "is_cuda", "is_npu")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:-1]]
    if rel.stem != "__init__":
        parts.append(rel.stem)
    return ".".join(parts)


def imports_of(tree: ast.AST, package: str) -> set[str]:
    """Every module an `import` or `from ... import` anywhere in the file names (function bodies included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], base]).strip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def device_reads(tree: ast.AST) -> list[str]:
    """Branches on devices: `x.device.type`, `x.is_cpu`, `ctx.target`, `torch.device(...)`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in DEVICE_READS:
                found.append(node.attr)
            elif node.attr == "type" and isinstance(node.value, ast.Attribute) and node.value.attr == "device":
                found.append("device.type")
            elif node.attr == "target" and isinstance(node.value, ast.Name) and node.value.id == "ctx":
                found.append("ctx.target")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.device":
            found.append("torch.device(...)")
    return found


def broken_rules(module: str, source: str) -> list[str]:
    tree = ast.parse(source)
    package = module if module.count(".") == 0 else module.rsplit(".", 1)[0]
    names = imports_of(tree, package)

    def imports(prefixes: tuple[str, ...]) -> list[str]:
        return sorted(n for n in names if n.startswith(prefixes))

    problems = []
    if module.startswith("npu_graph.kernels") and (bad := imports(COMPILER)):
        problems.append(f"{module}: a kernel imports the compiler or passes: {bad}")
    if module.startswith("npu_graph.passes"):
        if bad := imports(("npu_graph.targets",)):
            problems.append(f"{module}: a pass imports a target: {bad}")
        if reads := device_reads(tree):
            problems.append(f"{module}: a pass reads devices: {reads}")
    if module.startswith("npu_graph.models") and (bad := imports(COMPILER)):
        problems.append(f"{module}: a model imports the compiler: {bad}")
    if not module.startswith("npu_graph.targets") and imports(("torch_npu", "torchair")):
        problems.append(f"{module}: imports torch_npu outside the NPU target")
    return problems


def package_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_package_keeps_every_never():
    problems = [p for path in package_files() for p in broken_rules(module_name(path), path.read_text())]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("module", "source", "rule"), [
    ("npu_graph.kernels.x", "from npu_graph.passes.matching import values", "kernel imports the compiler"),
    ("npu_graph.kernels.x", "def f():\n    import npu_graph.compiler", "kernel imports the compiler"),
    ("npu_graph.passes.x", "from npu_graph.targets.cpu_gemm_profile import preferred_form", "pass imports a target"),
    ("npu_graph.passes.x", "def run(gm, ctx):\n    return ctx.target == 'cpu'", "pass reads devices"),
    ("npu_graph.passes.x", "def f(v):\n    return v.device.type != 'cpu'", "pass reads devices"),
    ("npu_graph.passes.x", "def f(v):\n    return v.is_cpu", "pass reads devices"),
    ("npu_graph.models.x", "from npu_graph.backend import get_backend", "model imports the compiler"),
    ("npu_graph.runtime.x", "import torch_npu", "torch_npu outside the NPU target"),
])
def test_each_never_is_caught(module, source, rule):
    assert any(rule in p for p in broken_rules(module, source))


def test_the_npu_target_may_import_torch_npu():
    assert not broken_rules("npu_graph.targets.npu", "def f():\n    import torch_npu")


def import_graph(folder: str) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}
    return {m: {n for n in imports_of(ast.parse(p.read_text()), m.rsplit(".", 1)[0]) if n in modules and n != m}
            for m, p in modules.items()}


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    """One import circle in `graph`, as the modules along it, or [] when there is none."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


def test_models_have_no_import_circle():
    assert cycle_in(import_graph("npu_graph/models")) == []


def test_a_circle_is_found():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_importing_npu_graph_patches_nothing_until_the_backend_is_resolved():
    script = textwrap.dedent("""
        import sys, torch, npu_graph
        def routed():
            return any(type(f).__name__ == "_RouteAfterImport" for f in sys.meta_path)
        assert hasattr(torch.ops.ascend_dsa, "lightning_indexer")  # our own ops are registered
        assert not routed() and "npu_graph.routes" not in sys.modules
        torch.compile(lambda x: x + 1, backend="ascend_dsa")  # resolving the backend installs the routes
        assert routed()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_entrance_stays_small():
    """npu_graph/ itself holds at most ten modules (docs/DESIGN.md, Layout: where a new engineer starts), and no
    Python file of the package is over 400 lines."""
    top = [p.name for p in (ROOT / "npu_graph").glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= 10, sorted(top)
    long = {str(p.relative_to(ROOT)): n for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
