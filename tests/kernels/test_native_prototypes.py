"""The ctypes prototypes of the native kernels against their C declarations (kernels/native/prototypes.py).

The C compiler is the judge: every source is compiled together with re-declarations written from the argtypes and
restype Python sets (`extern int64_t ...` from c_int64, and so on; gcc reports conflicting types on any
difference), an alias per function (an error when the source does not define it) and static asserts of every
registered struct layout (size, and each field's offset and size). Then the kernel modules are read: no
hand-written argtypes, every function they bind is declared, and every call passes as many arguments as the C
takes (tests/kernels/native_call_sites.py). Each check is shown to fail on a deliberate drift.
"""
import ast
import ctypes
import importlib
import subprocess
import types
from pathlib import Path
from typing import Any

import native_call_sites
import pytest

from npu_graph.kernels.native import loader as native
from npu_graph.kernels.native import prototypes as native_prototypes
from npu_graph.kernels.native.prototypes import Param, PrototypeError

KERNELS = Path(native_prototypes.__file__).parents[1]
SOURCES = sorted(path.stem for path in native_prototypes.SOURCE_DIR.glob("*.c"))
# Every kernel module, by its name relative to npu_graph.kernels ("rowwise.rms_norm").
MODULES = sorted(".".join(path.relative_to(KERNELS).with_suffix("").parts) for path in KERNELS.rglob("*.py")
                 if path.stem != "__init__")
_C_NAMES = {ctypes.c_int: "int", ctypes.c_int64: "int64_t", ctypes.c_uint32: "uint32_t", ctypes.c_uint64: "uint64_t",
            ctypes.c_float: "float", ctypes.c_double: "double"}
Signature = tuple[Any, list[Any]]     # (restype, argtypes)


class _FakeLib:
    """Stands in for a loaded library: one object per function, on which typed() sets argtypes and restype."""

    def __init__(self) -> None:
        self.functions: dict[str, types.SimpleNamespace] = {}

    def __getattr__(self, name: str) -> types.SimpleNamespace:
        return self.functions.setdefault(name, types.SimpleNamespace())


def _python_side(source: str) -> dict[str, Signature]:
    """What typed() sets on each function of `source`: the prototypes the kernels call with."""
    lib = _FakeLib()
    typed = {name: native_prototypes.typed(lib, source, name) for name in native_prototypes.declarations(source)}
    return {name: (fn.restype, list(fn.argtypes)) for name, fn in typed.items()}


def _c_type(ctype: Any, declared: Param | None) -> str:
    """The C type a ctypes type stands for; a pointer keeps the pointee the C declares (ctypes passes any pointer
    alike), so only a pointer where the C takes one agrees."""
    if ctype is None:
        return "void"
    if ctype is ctypes.c_void_p or issubclass(ctype, ctypes._Pointer):
        return declared.c_type if declared is not None and declared.is_pointer else "void *"
    return _C_NAMES[ctype]


def _unit(source: str, signatures: dict[str, Signature], structs: dict[str, type[ctypes.Structure]]) -> str:
    """A translation unit: the source, then the Python side re-declared, each function aliased (so it must be
    defined) and each struct layout asserted."""
    declared = native_prototypes.declarations(source)
    lines = ["#include <stddef.h>", f'#include "{native_prototypes.SOURCE_DIR / source}.c"']
    for name, (restype, argtypes) in signatures.items():
        c_params = declared[name].params if name in declared else ()
        params = [_c_type(t, c_params[i] if i < len(c_params) else None) for i, t in enumerate(argtypes)]
        result = _c_type(restype, declared[name].result if name in declared else None)
        lines += [f"extern {result} {name}({', '.join(params) or 'void'});",
                  f'extern __typeof__({name}) checked_{name} __attribute__((alias("{name}")));']
    for tag, layout in structs.items():
        lines.append(f'_Static_assert(sizeof(struct {tag}) == {ctypes.sizeof(layout)}, "struct {tag}: size");')
        for field, _ in layout._fields_:
            where = getattr(layout, field)
            lines.append(f"_Static_assert(offsetof(struct {tag}, {field}) == {where.offset} && "
                         f'sizeof(((struct {tag} *)0)->{field}) == {where.size}, "struct {tag}: {field}");')
    return "\n".join(lines) + "\n"


def _compile(units: dict[str, str], folder: Path) -> subprocess.CompletedProcess:
    """All units compiled (not linked) by the kernels' C compiler in one run; it reports every unit's errors."""
    cc = native.compiler()
    if cc is None:
        pytest.skip(native.NO_COMPILER)
    paths = []
    for name, text in units.items():
        (folder / f"{name}.c").write_text(text)
        paths.append(f"{name}.c")
    return subprocess.run([cc, "-c", "-O0", "-std=gnu11", "-fopenmp", "-w", *paths], cwd=folder,
                          capture_output=True, text=True, timeout=120, check=False)


def _structs(source: str) -> dict[str, type[ctypes.Structure]]:
    for module in MODULES:      # every layout registers itself when its module is imported
        importlib.import_module(f"npu_graph.kernels.{module}")
    return {tag: layout for (src, tag), layout in native_prototypes.registered_structs().items() if src == source}


def test_every_prototype_matches_its_c_declaration(tmp_path: Path) -> None:
    units = {f"check_{s}": _unit(s, _python_side(s), _structs(s)) for s in SOURCES}
    done = _compile(units, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]


def _drifted(source: str, name: str, change: Any) -> dict[str, Signature]:
    signatures = _python_side(source)
    restype, argtypes = signatures[name]
    signatures[name] = change(restype, list(argtypes))
    return signatures


def _replace(argtypes: list[Any], old: Any, new: Any) -> list[Any]:
    i = argtypes.index(old)
    return [*argtypes[:i], new, *argtypes[i + 1:]]


_DRIFTS = {   # each a change that would corrupt memory or read garbage, and compile without a complaint in ctypes
    "int64_as_int": ("causal_lengths", "cl_lengths", lambda r, a: (r, _replace(a, ctypes.c_int64, ctypes.c_int))),
    "pointer_as_int64": ("causal_lengths", "cl_lengths", lambda r, a: (r, [ctypes.c_int64, *a[1:]])),
    "int_as_pointer": ("causal_lengths", "cl_lengths", lambda r, a: (r, _replace(a, ctypes.c_int, ctypes.c_void_p))),
    "one_argument_less": ("causal_lengths", "cl_lengths", lambda r, a: (r, a[:-1])),
    "one_argument_more": ("rms_norm", "rn_rows", lambda r, a: (r, [*a, ctypes.c_int64])),
    "float_as_double": ("rms_norm", "rn_rows", lambda r, a: (r, _replace(a, ctypes.c_float, ctypes.c_double))),
    "void_as_int": ("rms_norm", "rn_rows", lambda r, a: (ctypes.c_int, a)),
    "renamed": ("rms_norm", "rn_rows", None),
}


def test_the_compiler_check_catches_every_drift(tmp_path: Path) -> None:
    units = {}
    for drift, (source, name, change) in _DRIFTS.items():
        if change is None:      # Python binds a function the source no longer defines
            signatures = {**_python_side(source), "rn_rows_v1": _python_side(source)[name]}
        else:
            signatures = _drifted(source, name, change)
        units[drift] = _unit(source, signatures, {})
    done = _compile(units, tmp_path)
    assert done.returncode != 0
    assert {drift for drift in units if f"{drift}.c:" in done.stderr} == set(units), done.stderr[-4000:]


class _Drifted(ctypes.Structure):
    """struct attention_args with `scale` a double: every later field read at the wrong offset."""
    _fields_ = [(name, ctypes.c_double if name == "scale" else ctype)
                for name, ctype in _structs("dense_attention")["attention_args"]._fields_]


def test_the_compiler_check_catches_a_struct_drift(tmp_path: Path) -> None:
    units = {"good": _unit("dense_attention", {}, _structs("dense_attention")),
             "drifted": _unit("dense_attention", {}, {"attention_args": _Drifted})}
    done = _compile(units, tmp_path)
    assert "drifted.c:" in done.stderr and "struct attention_args: scale" in done.stderr, done.stderr[-2000:]
    assert "good.c:" not in done.stderr


def test_every_struct_a_kernel_takes_has_a_registered_layout() -> None:
    for source in SOURCES:
        for proto in native_prototypes.declarations(source).values():
            for param in proto.params:
                if param.struct:
                    assert param.struct in _structs(source), f"{source}.c {proto.name}: struct {param.struct}"
                    assert native_prototypes.argtypes(source, proto)[proto.params.index(param)] is \
                        ctypes.POINTER(_structs(source)[param.struct])


def _arity_problems(found: native_call_sites.Found) -> list[str]:
    problems = []
    for module, line, fn in sorted(found.typed, key=str):
        if fn.source not in SOURCES or fn.name not in native_prototypes.declarations(fn.source):
            problems.append(f"{_path(module)}:{line}: kernels/native/{fn.source}.c declares no {fn.name}")
    for site in sorted(found.calls, key=str):
        declared = native_prototypes.declarations(site.fn.source).get(site.fn.name) if site.fn.source in SOURCES \
            else None
        if declared is None:
            continue    # reported above
        expected = len(declared.params)
        if site.args > expected or (site.args != expected and not site.open_ended):
            problems.append(f"{_path(site.module)}:{site.line}: {site.fn.name} takes {expected} arguments, "
                            f"{'at least ' if site.open_ended else ''}{site.args} passed")
    return problems


def _path(module: str) -> Path:
    return KERNELS / f"{module.replace('.', '/')}.py"


def _kernel_modules() -> dict[str, str]:
    return {module: _path(module).read_text() for module in MODULES}


def test_every_call_passes_the_arguments_its_c_function_takes() -> None:
    found = native_call_sites.find(_kernel_modules())
    assert _arity_problems(found) == []
    bound = {fn for _, _, fn in found.typed}
    called = {site.fn for site in found.calls}
    assert bound - called == set(), "native functions bound but no call found: the reader of call sites missed one"
    assert len(bound) >= 15     # the analysis is not vacuous: it sees the kernels' functions


def test_the_call_site_check_catches_a_drift() -> None:
    module = _path("rowwise.rms_norm").read_text()
    extra = module.replace("rows, n, x_stride, g.data_ptr()", "rows, n, n, x_stride, g.data_ptr()")
    renamed = module.replace('"rn_rows"', '"rn_rows_v1"')
    assert extra != module and renamed != module
    assert any("rn_rows takes 9 arguments, 10 passed" in p
               for p in _arity_problems(native_call_sites.find({"rowwise.rms_norm": extra})))
    assert any("declares no rn_rows_v1" in p
               for p in _arity_problems(native_call_sites.find({"rowwise.rms_norm": renamed})))


def test_no_kernel_module_types_a_native_function_by_hand() -> None:
    exported = {name for source in SOURCES for name in native_prototypes.declarations(source)}
    for module, text in _kernel_modules().items():
        if module == native_call_sites.PROTOTYPES:
            continue
        assert ".argtypes" not in text and ".restype" not in text, f"{_path(module)} sets a prototype by hand"
        attributes = {node.attr for node in ast.walk(ast.parse(text))
                      if isinstance(node, ast.Attribute)}
        assert not attributes & exported, f"{_path(module)} reaches {attributes & exported} around typed()"


def test_typed_sets_the_declared_prototype_and_refuses_unknown_names() -> None:
    lib = _FakeLib()
    fn = native_prototypes.typed(lib, "rms_norm", "rn_rows")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    assert fn.argtypes == [ptr, ctypes.c_int, i64, i64, i64, ptr, ctypes.c_float, ptr, ptr] and fn.restype is None
    with pytest.raises(PrototypeError, match="declares no exported function rn_missing"):
        native_prototypes.typed(lib, "rms_norm", "rn_missing")


_SAMPLE = r"""
#include <stdint.h>
#define TWICE(x) \
    ((x) * 2)
struct pair { int64_t a, b; };
typedef struct { float x; } vec;
typedef float vf __attribute__((vector_size(32)));
static const float table[] = {1.0f, 2.0f};
static int helper(int a) { return a; }
static inline void other(void) {}
MAKE_HELPER(h1, 1)
int fwd(void);  /* int commented(int x); */
#if defined(X)
int fwd(void) { return 1; }
#else
int fwd(void) { const char *s = "{"; return s[0] == '}'; }
#endif
void f(const float *x, int64_t n, float eps, double d, int32_t *idx, int64_t dims[4], const struct pair *p) {
    if (n) { }
}
// int commented(int x);
"""


def test_the_reader_takes_our_c() -> None:
    found = native_prototypes.parse(_SAMPLE)
    assert sorted(found) == ["f", "fwd"]
    assert found["fwd"].params == () and found["fwd"].result.ctype is ctypes.c_int
    f = found["f"]
    assert f.result.ctype is None
    assert [p.c_type for p in f.params] == ["const float *", "int64_t", "float", "double", "int32_t *", "int64_t *",
                                            "const struct pair *"]
    assert [p.ctype for p in f.params] == [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    assert f.params[-1].struct == "pair"


@pytest.mark.parametrize(("text", "message"), [
    ("struct pair { int a; };\nint f(struct pair p) { return 0; }", "passed by value"),
    ("int f(long x) { return 0; }", "passed by value"),
    ("int f(void);\nint f(int x) { return x; }", "declared twice with different types"),
    ("__attribute__((visibility(\"default\"))) int f(int x) { return x; }", "cannot read the declaration"),
])
def test_the_reader_refuses_what_it_cannot_map(text: str, message: str) -> None:
    with pytest.raises(PrototypeError, match=message):
        native_prototypes.parse(text)
