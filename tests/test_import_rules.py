"""The nevers of the package's layout, read from its source: kernels import no passes or compiler, passes import
no targets and read no devices, models import no compiler, only the NPU target imports torch_npu, no module of the
package imports itself back through others (an import inside a function counts), and `import npu_graph` patches
nothing of other libraries."""
import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
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


def _walk(tree: ast.AST, type_checking: bool) -> Iterator[ast.AST]:
    """Every node of `tree`; without `type_checking`, not those under an `if TYPE_CHECKING:` (its else branch is
    walked: it runs)."""
    for node in ast.iter_child_nodes(tree):
        yield node
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                yield from [child, *_walk(child, type_checking)]
            continue
        yield from _walk(node, type_checking)


def imports_of(tree: ast.AST, package: str, type_checking: bool = True) -> set[str]:
    """Every module an `import` or `from ... import` anywhere in the file names (function bodies included; `if
    TYPE_CHECKING:` blocks unless `type_checking` is False): for `from x import y`, both x and x.y."""
    found = set()
    for node in _walk(tree, type_checking):
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


def import_graph(sources: dict[str, str], packages: set[str]) -> dict[str, set[str]]:
    """{module: the modules it imports when it runs} of `sources` ({module name: its source}; `packages` are the
    names whose source is a package's __init__). Imports inside functions count, and so does `from x import y` of
    a module y; `if TYPE_CHECKING:` blocks do not run, so they do not count; neither does an import of a package
    itself (its __init__ runs first whichever of its modules is imported, and it only gathers what they define)."""
    graph = {}
    for module, source in sources.items():
        package = module if module in packages else module.rpartition(".")[0]
        names = imports_of(ast.parse(source), package, type_checking=False)
        graph[module] = {n for n in names if n in sources and n not in packages and n != module}
    return graph


def package_graph() -> dict[str, set[str]]:
    """The import graph of the whole package: npu_graph, and passes/, kernels/ and tools/ as its subpackages."""
    files = {module_name(path): path for path in package_files()}
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    return import_graph({name: path.read_text() for name, path in files.items()}, packages)


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


def test_the_package_has_no_import_circle():
    circle = cycle_in(package_graph())
    assert not circle, f"import circle: {' -> '.join(circle)} (move what both need where it belongs)"


def test_a_circle_is_found():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_graph_counts_what_runs_and_leaves_packages_out():
    sources = {
        "p": "from p import a\n",                                       # a package's __init__
        "p.a": "def f():\n    from p import b\n",                         # inside a function: counts
        "p.b": "from p.c import helper\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.a\n"
               "else:\n    from . import d\n",
        "p.c": "import p\n",                                            # the package: its __init__ is left out
        "p.d": "",
    }
    assert import_graph(sources, {"p"}) == {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.c", "p.d"}, "p.c": set(),
                                            "p.d": set()}


def test_a_circle_through_a_function_level_import_is_found():
    graph = import_graph({"p": "", "p.a": "from p.b import x\n", "p.b": "def f():\n    from p import a\n"}, {"p"})
    assert cycle_in(graph) == ["p.a", "p.b", "p.a"]


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
