"""Inductor's C++ kernels of one glue module built as a few shared libraries, not one library each.

Inductor's module defines each CPU kernel with `async_compile.cpp_pybinding(argtypes, source)`: one g++ build
per kernel, each parsing Inductor's precompiled header again. A tiny DeepSeek-V3.2 decode graph has 15 kernels:
~0.7 s a build, 5-10 s of a cold first generate() on 2 cores, while the same 15 kernels as one translation unit
build in 1.7-2.0 s and as two halves side by side in 1.5-1.6 s (Zen 4, g++ with the header precompiled).

`BatchedKernels` is Inductor's AsyncCompile with the CPU kernels gathered: `cpp_pybinding` records the kernel and
hands back a placeholder, and `wait(globals())` — which every Inductor module calls after its kernel definitions —
builds them as one library per group (a group per compile thread, kernels balanced by source size) through
Inductor's own C++ code cache (same flags, vector ISA, precompiled header and on-disk cache), then puts the
functions in place of the placeholders. A group whose build fails is built kernel by kernel the usual way.
The glue module's source says `async_compile = BatchedKernels()` (npu_graph.runtime.inductor_glue rewrites
Inductor's line), and `building_batched()` gives Inductor's own load of the module during the compile the same
class, so that the libraries built then are the ones the module loads later.
"""
from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from torch._inductor import async_compile as inductor_async
from torch._inductor.async_compile import get_compile_threads
from torch._inductor.codecache import CppPythonBindingsCodeCache

log = logging.getLogger(__name__)

_DEFINITION = re.compile(r"\bvoid\s+kernel\(")
_INCLUDE = re.compile(r"^#include .*$", re.MULTILINE)
# The scalar argument types Inductor's own bindings take -> the conversion of a Python argument to each
_SCALARS = {"int64_t": "static_cast<int64_t>(PyLong_AsLongLong(item))",
            "uintptr_t": "reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(item))",
            "float": "static_cast<float>(PyFloat_AsDouble(item))"}


class _Library(CppPythonBindingsCodeCache):
    """Inductor's code cache for libraries that hold several kernels (module init `PyInit_kernels`)."""
    cache: ClassVar[dict[str, Any]] = {}
    entry_function = "kernels"


class Pending:
    """A kernel recorded by BatchedKernels.cpp_pybinding, until `wait` builds it."""

    def __init__(self, index: int, argtypes: tuple[str, ...], source: str) -> None:
        self.name = f"kernel_{index}"
        self.argtypes = argtypes
        self.source = source

    def __call__(self, *args: object) -> None:
        raise RuntimeError(f"Inductor kernel {self.name} was not built: its module did not call "
                           "async_compile.wait(globals()) after defining it")


def _argument(argtype: str, n: int) -> str:
    """A C++ statement declaring `a<n>`, Python argument n converted to argtype."""
    plain = argtype.replace("const ", "").strip()
    item = f"PyTuple_GET_ITEM(args, {n})"
    if plain.endswith("*"):
        return f"auto a{n} = static_cast<{plain}>(data_ptr({item}));"
    if plain not in _SCALARS:
        raise ValueError(f"kernel argument type {argtype!r} has no conversion")
    return f"auto a{n} = {_SCALARS[plain].replace('item', item)};"


def _binding(kernel: Pending) -> str:
    """The Python function of one kernel: arguments checked and converted, C++ exceptions raised in Python."""
    count = len(kernel.argtypes)
    declarations = "\n".join(f"        {_argument(t, n)}" for n, t in enumerate(kernel.argtypes))
    call = ", ".join(f"a{n}" for n in range(count))
    return f"""static PyObject* {kernel.name}_py(PyObject*, PyObject* args) {{
    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {count}) {{
        PyErr_SetString(PyExc_TypeError, "{kernel.name} takes {count} arguments");
        return nullptr;
    }}
    try {{
{declarations}
        if (PyErr_Occurred()) return nullptr;
        {kernel.name}({call});
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }}
    Py_RETURN_NONE;
}}
"""


_MODULE = """
static PyMethodDef methods[] = {{
{methods}    {{nullptr, nullptr, 0, nullptr}}}};
static struct PyModuleDef module_def = {{PyModuleDef_HEAD_INIT, "kernels", nullptr, -1, methods}};

PyMODINIT_FUNC PyInit_kernels(void) {{
    // Inductor's loader names the address of torch's tensor-to-data-pointer function in this variable
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (!address || !*address) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }}
    data_ptr = reinterpret_cast<void* (*)(PyObject*)>(std::strtoull(address, nullptr, 10));
    return PyModule_Create(&module_def);
}}
"""


def library_source(kernels: list[Pending]) -> str:
    """One translation unit: the kernels' includes once, each kernel renamed to its `name`, and a Python module
    `kernels` with a function per kernel taking the arguments Inductor's module passes."""
    includes = dict.fromkeys(line for kernel in kernels for line in _INCLUDE.findall(kernel.source))
    bodies = []
    for kernel in kernels:
        body, count = _DEFINITION.subn(f"void {kernel.name}(", _INCLUDE.sub("", kernel.source), count=1)
        if count != 1:
            raise ValueError(f"no `void kernel(` definition in the source of {kernel.name}")
        bodies.append(body)
    head = "\n".join([*includes, "#define PY_SSIZE_T_CLEAN", "#include <Python.h>", "#include <cstdlib>",
                      "#include <exception>", "static void* (*data_ptr)(PyObject*);"])
    methods = "".join(f'    {{"{k.name}", {k.name}_py, METH_VARARGS, nullptr}},\n' for k in kernels)
    return "\n".join([head, *bodies, *map(_binding, kernels), _MODULE.format(methods=methods)])


def groups(kernels: list[Pending], count: int) -> list[list[Pending]]:
    """kernels in `count` groups of about equal source size (largest first into the smallest group), each in
    definition order; no empty group."""
    bins: list[list[Pending]] = [[] for _ in range(max(1, min(count, len(kernels))))]
    sizes = [0] * len(bins)
    for kernel in sorted(kernels, key=lambda k: -len(k.source)):
        smallest = sizes.index(min(sizes))
        bins[smallest].append(kernel)
        sizes[smallest] += len(kernel.source)
    order = {id(k): i for i, k in enumerate(kernels)}
    return [sorted(group, key=lambda k: order[id(k)]) for group in bins]


class BatchedKernels(inductor_async.AsyncCompile):
    """AsyncCompile whose CPU kernels are built together at `wait` (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[Pending] = []

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Pending:
        kernel = Pending(len(self._pending), tuple(argtypes), source_code)
        self._pending.append(kernel)
        return kernel

    def wait(self, scope: dict[str, Any]) -> None:
        if self._pending:
            built = self._build(self._pending)
            for name, value in list(scope.items()):
                if isinstance(value, Pending):
                    scope[name] = built[value.name]
            self._pending = []
        super().wait(scope)

    def _build(self, kernels: list[Pending]) -> dict[str, Any]:
        submit = self.submit if get_compile_threads() > 1 else None
        loads = []
        for group in groups(kernels, get_compile_threads()):
            try:
                loads.append((group, _Library.load_async(library_source(group), "cpu", submit_fn=submit)))
            except ValueError as exc:
                log.info("building kernels one by one: %s", exc)
                loads.append((group, None))
        built: dict[str, Any] = {}
        for group, load in loads:
            built.update(self._loaded(group, load))
        return built

    @staticmethod
    def _loaded(group: list[Pending], load: Any) -> dict[str, Any]:
        if load is not None:
            try:
                module = load()
                return {kernel.name: getattr(module, kernel.name) for kernel in group}
            except Exception as exc:    # a compiler error in the joined source: build them one by one
                log.info("the joined build of %d kernels failed (%s); building them one by one", len(group), exc)
        return {k.name: CppPythonBindingsCodeCache.load_pybinding(list(k.argtypes), k.source) for k in group}


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def building_batched() -> Iterator[None]:
    """Inside, Inductor modules loaded by this process create BatchedKernels for their `async_compile` (the name
    they import from torch._inductor.async_compile when they run), so that a compile builds the libraries its
    module's rewritten source loads later. One compile at a time; the name is restored on exit."""
    with _PATCH_LOCK:
        original = inductor_async.AsyncCompile
        inductor_async.AsyncCompile = BatchedKernels
        try:
            yield
        finally:
            inductor_async.AsyncCompile = original
