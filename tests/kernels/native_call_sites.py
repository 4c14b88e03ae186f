"""The Python call sites of the native kernels, found by reading the kernel modules (no kernel runs).

`find(modules)` follows each `typed(lib, SOURCE, "name")` of kernels/native/prototypes.py through assignments, tuple
returns, subscripts, conditional expressions, arguments of the module's own functions (also through
functools.partial and other kernel modules' functions) and closures, and records every call of such a function with
the number of arguments it passes. ctypes does not check that number for C functions: it refuses too few arguments
but passes extra ones on, so a call that still passes an argument the C no longer takes would go unnoticed. A call
with `*args` of unknown length records only the arguments it is sure of.
"""
import ast
from dataclasses import dataclass, field
from typing import Any

PACKAGE = "npu_graph.kernels"
PROTOTYPES = "native.prototypes"     # the module whose `typed` binds a native function


def kernel_module(package: str, name: str) -> str:
    """The name, relative to npu_graph.kernels, of what `from package import name` imports (a module or not)."""
    return f"{package}.{name}".removeprefix(f"{PACKAGE}.")


@dataclass(frozen=True)
class Fn:
    """A native function Python holds: kernels/native/<source>.c's `name`."""
    source: str
    name: str


@dataclass(frozen=True)
class CallSite:
    """One call of a native function: where, and how many arguments (at least that many when `open_ended`)."""
    module: str
    line: int
    fn: Fn
    args: int
    open_ended: bool


@dataclass
class Found:
    """What the kernel modules hold and call."""
    typed: set[tuple[str, int, Fn]] = field(default_factory=set)    # (module, line, function) of each typed()
    calls: set[CallSite] = field(default_factory=set)


class _Modules:
    """The functions, string constants and kernel-module imports of every module, and what the analysis learnt:
    which parameters receive native functions, and what each function returns."""

    def __init__(self, modules: dict[str, str]):
        self.trees = {name: ast.parse(text) for name, text in modules.items()}
        self.functions: dict[tuple[str, str], ast.FunctionDef] = {}
        self.constants: dict[tuple[str, str], str] = {}
        self.imports: dict[str, dict[str, str]] = {}     # local name -> kernel module, of every module
        self.aliases: dict[str, dict[str, str]] = {}     # the same, for the kernel modules being read
        for mod, tree in self.trees.items():
            self.imports[mod] = {a.asname or a.name: kernel_module(node.module, a.name) for node in tree.body
                                 if isinstance(node, ast.ImportFrom) and node.module for a in node.names}
            self.aliases[mod] = {name: full for name, full in self.imports[mod].items() if full in modules}
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.functions[(mod, node.name)] = node
                elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                    for target in node.targets:
                        if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                            self.constants[(mod, target.id)] = node.value.value
        self.params: dict[tuple[str, str], dict[str, Any]] = {key: {} for key in self.functions}
        self.returns: dict[tuple[str, str], Any] = {}

    def resolve(self, mod: str, node: ast.expr) -> tuple[str, str] | None:
        """(module, name) that a Name or `module.name` expression refers to in `mod`."""
        if isinstance(node, ast.Name):
            return mod, node.id
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in self.aliases[mod]:
            return self.aliases[mod][node.value.id], node.attr
        return None


class _Function:
    """Abstract evaluation of one function body: values are Fn, tuples of values, a frozenset of Fn (a parameter
    that receives several), or None (anything else)."""

    def __init__(self, modules: _Modules, found: Found, mod: str, env: dict[str, Any]):
        self.m, self.found, self.mod, self.env = modules, found, mod, env
        self.returned: Any = None

    def stmts(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            self.stmt(stmt)

    def stmt(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Assign):
            value = self.expr(stmt.value)
            for target in stmt.targets:
                self.bind(target, value)
        elif isinstance(stmt, ast.Return):
            value = self.expr(stmt.value) if stmt.value is not None else None
            self.returned = self.returned or value
        elif isinstance(stmt, ast.FunctionDef):
            inner = _Function(self.m, self.found, self.mod, dict(self.env))
            inner.stmts(stmt.body)
        else:
            self.children(stmt)

    def bind(self, target: ast.expr, value: Any) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple) and isinstance(value, tuple) and len(value) == len(target.elts):
            for elt, part in zip(target.elts, value, strict=True):
                self.bind(elt, part)

    def children(self, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.expr(child)
            elif isinstance(child, ast.stmt):
                self.stmt(child)
            else:
                self.children(child)

    def expr(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Name):
            return self.env.get(node.id)
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Tuple):
            return tuple(self.expr(elt) for elt in node.elts)
        if isinstance(node, ast.IfExp):
            self.expr(node.test)
            return self.expr(node.body) or self.expr(node.orelse)
        if isinstance(node, ast.Subscript):
            value = self.expr(node.value)
            index = node.slice.value if isinstance(node.slice, ast.Constant) else None
            return value[index] if isinstance(value, tuple) and isinstance(index, int) else None
        if isinstance(node, ast.Lambda):
            self.expr(node.body)
            return None
        self.children(node)
        return None

    def string(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        key = self.m.resolve(self.mod, node)
        return self.m.constants.get(key) if key else None

    def call(self, node: ast.Call) -> Any:
        args = [self.expr(arg) for arg in node.args]
        for keyword in node.keywords:
            self.expr(keyword.value)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "typed" and isinstance(func.value, ast.Name) and \
                self.m.imports[self.mod].get(func.value.id) == PROTOTYPES:
            source, name = (self.string(a) for a in node.args[1:3])
            fn = Fn(source or "?", name or "?")
            self.found.typed.add((self.mod, node.lineno, fn))
            return fn
        if isinstance(func, ast.Attribute) and func.attr == "partial" and node.args:
            self.pass_args(self.m.resolve(self.mod, node.args[0]), args[1:])
            return None
        key = self.m.resolve(self.mod, func)
        if key in self.m.functions:
            self.pass_args(key, args)
            return self.m.returns.get(key)
        callee = self.expr(func)
        for fn in (callee,) if isinstance(callee, Fn) else callee if isinstance(callee, frozenset) else ():
            starred = sum(isinstance(arg, ast.Starred) for arg in node.args)
            self.found.calls.add(CallSite(self.mod, node.lineno, fn, len(node.args) - starred, starred > 0))
        return None

    def pass_args(self, key: tuple[str, str] | None, args: list[Any]) -> None:
        if key not in self.m.functions:
            return
        names = [a.arg for a in (*self.m.functions[key].args.posonlyargs, *self.m.functions[key].args.args)]
        for name, value in zip(names, args, strict=False):
            held = self.m.params[key].get(name)
            if isinstance(value, Fn) and isinstance(held, (Fn, frozenset)) and value != held:
                value = frozenset((held,) if isinstance(held, Fn) else held) | {value}    # several functions
            if value is not None:
                self.m.params[key][name] = value


def find(modules: dict[str, str], rounds: int = 6) -> Found:
    """The native functions the modules ({name relative to npu_graph.kernels: source text}) bind, and their call
    sites (module docstring)."""
    m, found = _Modules(modules), Found()
    for _ in range(rounds):     # parameters and return values learnt in one round reach their users in the next
        before = (repr(m.params), repr(m.returns))
        for key, node in m.functions.items():
            body = _Function(m, found, key[0], dict(m.params[key]))
            body.stmts(node.body)
            m.returns[key] = body.returned
        if (repr(m.params), repr(m.returns)) == before:
            break
    return found
