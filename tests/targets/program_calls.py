"""Read a generated NPU program back with `ast` and check every torch_npu / torchair call it makes against the
pinned table by name and keyword names: a check on the source text itself, independent of the generator."""
import ast

from npu_graph.targets.npu_signatures import SIGNATURES


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def npu_calls(source: str) -> list[ast.Call]:
    """Every call in `source` whose callee is torch_npu.*, torchair.* or torch.npu.stream."""
    return [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
            and (dotted(n.func).startswith(("torch_npu.", "torchair.")) or dotted(n.func) == "torch.npu.stream")]


def check_source(source: str) -> list[str]:
    """Names of the checked calls; raises AssertionError on a callee or keyword the table does not have."""
    names = []
    for call in npu_calls(source):
        name = dotted(call.func)
        assert name in SIGNATURES, f"{name} is not in the pinned table"
        sig = SIGNATURES[name]
        positional = [p for p in sig.params if p.kind == "positional"]
        assert len(call.args) <= len(positional), f"{name}: too many positional arguments"
        for keyword in call.keywords:
            assert keyword.arg in sig.by_name, f"{name}: unknown keyword {keyword.arg}"
        given = {p.name for p in positional[:len(call.args)]} | {k.arg for k in call.keywords}
        assert all(p.name in given for p in sig.params if p.required), f"{name}: a required argument is missing"
        names.append(name)
    return names
