"""The ctypes prototypes of the native kernels, declared once: read from the C declarations themselves.

`typed(lib, source, name)` returns the library's function `name` with its argtypes and restype set from the
declaration of `name` in kernels/native/<source>.c, so a changed C signature changes what Python passes with it
(no hand-written `argtypes` list to drift: a stale one would pass an int where the kernel reads an int64_t, or
shift every argument after a new one, and corrupt memory without an error). The reader covers the C we write for
exported (non-static) functions: scalar parameters of the types in C_SCALARS, pointers and arrays (c_void_p), and
pointers to structs, which take POINTER(cls) when Python registered a layout for the struct with `struct`.
Static functions, preprocessor lines, comments and top-level macro calls (`NAME(...)` on a line of its own:
they expand to static helpers) are skipped; an exported function must be declared in plain C to be seen.

tests/kernels/test_native_prototypes.py has the C compiler check every prototype (and every registered struct
layout) against the sources, and that every function the kernels call is declared with as many arguments as
they pass.
"""
import ctypes
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE_DIR = Path(__file__).parent     # the C sources sit beside this package's modules
C_SCALARS: dict[str, Any] = {
    "void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
    "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t,
    "float": ctypes.c_float, "double": ctypes.c_double,
}
_QUALIFIERS = {"const", "volatile", "restrict", "__restrict", "__restrict__", "extern"}
_HEAD = re.compile(r"^(?P<ret>[\w\s*]+?[\s*])(?P<name>[A-Za-z_]\w*)\s*\((?P<params>[^()]*)\)$")
_MACRO_LINE = re.compile(r"^[A-Z][A-Z0-9_]*\(.*\)\s*;?\s*$", re.MULTILINE)
_STRUCTS: dict[tuple[str, str], type[ctypes.Structure]] = {}


class PrototypeError(ValueError):
    """A C declaration this reader does not take, or a function the source does not declare."""


@dataclass(frozen=True)
class Param:
    """One parameter (or the return value): its C type without the name, and the ctypes type it maps to."""
    c_type: str             # normalised: "const float *", "int64_t", "const struct attention_args *"
    ctype: Any              # a ctypes type, or None for void
    struct: str | None      # the struct tag of a pointer to a struct

    @property
    def is_pointer(self) -> bool:
        return self.c_type.endswith("*")


@dataclass(frozen=True)
class Prototype:
    """An exported function of a native source as its C declaration states it."""
    name: str
    result: Param
    params: tuple[Param, ...]


def _strip(text: str) -> str:
    """The C text without comments, string and character literals, preprocessor lines and macro-call lines."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.DOTALL)
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', text)
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", "", text, flags=re.MULTILINE)
    return _MACRO_LINE.sub("", text)


def _top_level_heads(text: str) -> list[str]:
    """The text before each top-level `{` or `;` (a definition's head or a declaration), whitespace collapsed."""
    heads, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                heads.append(text[start:i])
            depth += 1
        elif ch == "}":
            depth -= 1
            start = i + 1
        elif ch == ";" and depth == 0:
            heads.append(text[start:i])
            start = i + 1
        if depth < 0:
            raise PrototypeError("unbalanced braces")
    return [" ".join(head.split()) for head in heads]


def _param(text: str, where: str) -> Param:
    """A parameter's (or return value's) type; its name, if any, is dropped."""
    tokens = re.findall(r"[A-Za-z_]\w*|\*|\[[^\]]*\]", text)
    words = [t for t in tokens if t[0].isalpha() or t[0] == "_"]
    pointer = any(t == "*" or t.startswith("[") for t in tokens)
    named = [w for w in words if w not in _QUALIFIERS]
    struct = named[1] if named[:1] == ["struct"] and len(named) > 1 else None
    base = named[:2] if struct else named[:1]
    if not base:
        raise PrototypeError(f"{where}: no type in `{text.strip()}`")
    const = "const " if "const" in words[:words.index(base[0])] else ""
    if pointer:
        return Param(f"{const}{' '.join(base)} *", ctypes.c_void_p, struct)
    if struct or base[0] not in C_SCALARS:
        raise PrototypeError(f"{where}: `{text.strip()}` is passed by value with a type ctypes is not told about "
                             f"(add it to C_SCALARS in kernels/native/prototypes.py, or pass a pointer)")
    return Param(base[0], C_SCALARS[base[0]], None)


def _prototype(head: str, where: str) -> Prototype | None:
    """The prototype a top-level head declares, None when it declares no exported function."""
    if "(" not in head or re.match(r"(?:static|typedef)\b", head) or head.startswith(("struct ", "enum ")):
        return None
    match = _HEAD.match(head)
    if match is None or re.search(r"\bstatic\b", match["ret"]):
        if match is None:
            raise PrototypeError(f"{where}: cannot read the declaration `{head[:120]}` (declare exported functions "
                                 f"in plain C: `type name(type a, ...)`)")
        return None
    name = match["name"]
    params = match["params"].strip()
    items = () if params in ("", "void") else tuple(_param(p, f"{where}: {name}") for p in params.split(","))
    return Prototype(name, _param(match["ret"], f"{where}: {name}"), items)


def parse(text: str, where: str = "<text>") -> dict[str, Prototype]:
    """The exported functions a C source declares (module docstring); a function declared twice (a forward
    declaration, or one definition per #if branch) must be declared alike."""
    found: dict[str, Prototype] = {}
    for head in _top_level_heads(_strip(text)):
        proto = _prototype(head, where)
        if proto is None:
            continue
        if found.setdefault(proto.name, proto) != proto:
            raise PrototypeError(f"{where}: {proto.name} is declared twice with different types")
    return found


@functools.cache
def declarations(source: str) -> dict[str, Prototype]:
    """The exported functions of kernels/native/<source>.c."""
    path = SOURCE_DIR / f"{source}.c"
    return parse(path.read_text(), path.name)


def struct(source: str, tag: str) -> Callable[[type[ctypes.Structure]], type[ctypes.Structure]]:
    """Class decorator: the ctypes layout of `struct <tag>` of kernels/native/<source>.c (same field names, in
    order); a parameter pointing to that struct then takes POINTER(cls), and the prototype test checks the
    layout's size and every field's offset against the C."""
    def register(cls: type[ctypes.Structure]) -> type[ctypes.Structure]:
        _STRUCTS[(source, tag)] = cls
        return cls
    return register


def registered_structs() -> dict[tuple[str, str], type[ctypes.Structure]]:
    """{(source, tag): layout} of every struct registered so far."""
    return dict(_STRUCTS)


def argtypes(source: str, proto: Prototype) -> list[Any]:
    """The ctypes argtypes of `proto` (a function of kernels/native/<source>.c)."""
    def one(param: Param) -> Any:
        layout = _STRUCTS.get((source, param.struct)) if param.struct else None
        return ctypes.POINTER(layout) if layout is not None else param.ctype
    return [one(param) for param in proto.params]


def prototype(source: str, name: str) -> Prototype:
    """The declaration of `name` in kernels/native/<source>.c; PrototypeError when it declares none."""
    found = declarations(source).get(name)
    if found is None:
        raise PrototypeError(f"kernels/native/{source}.c declares no exported function {name} "
                             f"(declared: {', '.join(sorted(declarations(source))) or 'none'})")
    return found


@functools.cache
def typed(lib: ctypes.CDLL, source: str, name: str) -> Any:
    """lib's function `name` (lib being kernels/native/<source>.c built) with the argtypes and restype of its C
    declaration."""
    proto = prototype(source, name)
    fn = getattr(lib, name)
    fn.argtypes = argtypes(source, proto)
    fn.restype = proto.result.ctype
    return fn
