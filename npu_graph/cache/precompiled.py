"""A compiled graph as torch's precompile / AOT path stores it: `PrecompiledGraph` is what the backend hands back to
Dynamo, a `torch._dynamo.aot_compile.SerializableCallable`, so `torch.compile(...).aot_compile(...)` (and vLLM's AOT
compile, which is built on it) can save the whole compiled program and load it in a new process without Dynamo's
tracing, AOT capture, our passes or lowering.

What is serialized is the cache entry's artifact (npu_graph.cache.entry: generated source, allowlisted globals by
name, tensor constants as safetensors, JSON records), never a pickled closure or an arbitrary object, together with
the versions and the compiler-source digest it was made with; loading refuses an artifact made by another version
(torch then recompiles, as for any incompatible precompiled program). The artifact follows the graph: when a
background glue compile lands (runtime.glue_upgrade), the serialized form holds the code that then runs.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from torch._dynamo.aot_compile_types import SerializableCallable

from npu_graph.cache.entry import Artifact, artifact_files, artifact_from, artifact_record
from npu_graph.cache.folder import CorruptEntry
from npu_graph.cache.key import source_digest, versions

FORMAT = 1


class NotSerializable(RuntimeError):
    """This compiled graph cannot be saved by torch's precompile path; the reason says why."""


class PrecompiledGraph(SerializableCallable):
    """A compiled graph callable as Dynamo calls a backend's result (`fn(*args)`), serializable through torch's
    precompile path. `artifact` is None when the graph cannot be stored (`reason` says why): it still runs, and
    saving it raises NotSerializable with that reason. `key` names the compile-cache entry holding the graph."""

    def __init__(self, run: Callable[..., Any], name: str, artifact: Artifact | None, reason: str = "",
                 key: str | None = None):
        self.run = run
        self.name = name
        self.artifact = artifact
        self.reason = reason
        self.key = key      # the compile-cache entry that holds the graph, when it was stored

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def finalize_loading(self, *_: Any) -> None:
        """What vLLM calls on a loaded program before running it: the graph is complete once deserialized."""

    def __repr__(self) -> str:
        return f"PrecompiledGraph({self.name!r}, serializable={self.artifact is not None})"

    @classmethod
    def serialize_compile_artifacts(cls, fn: PrecompiledGraph) -> bytes:
        return serialized(fn.name, fn.artifact, fn.reason)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> PrecompiledGraph:
        name, artifact = deserialized(data)
        graph = artifact.load(name)

        def run(*args: Any) -> Any:
            return graph(list(args))

        return cls(run, name, artifact)


def serialized(name: str, artifact: Artifact | None, reason: str) -> bytes:
    """The bytes of one artifact: a JSON header (format, name, versions, source digest, the artifact's record),
    a newline, then its files, each as a decimal length line, a name line and the bytes."""
    if artifact is None:
        raise NotSerializable(f"ascend_dsa: {name} cannot be serialized: {reason or 'no artifact'}")
    if artifact.param_fqns:
        raise NotSerializable(f"ascend_dsa: {name} reads module attributes {artifact.param_fqns[:3]} that a "
                              "precompiled program does not carry")
    files = artifact_files(artifact)
    header = {"format": FORMAT, "name": name, "versions": versions(), "sources": source_digest(),
              "artifact": artifact_record(artifact), "summary": artifact.summary, "files": sorted(files)}
    parts = [json.dumps(header, sort_keys=True).encode(), b"\n"]
    for file_name in sorted(files):
        parts += [f"{len(files[file_name])}\n".encode(), files[file_name]]
    return b"".join(parts)


def deserialized(data: bytes) -> tuple[str, Artifact]:
    """(name, artifact) from `serialized` bytes; raises NotSerializable when they were made by another version of
    torch or of this compiler, or are damaged."""
    try:
        head, rest = data.split(b"\n", 1)
        header = json.loads(head)
        files = {}
        for file_name in header["files"]:
            size, rest = rest.split(b"\n", 1)
            files[file_name], rest = rest[:int(size)], rest[int(size):]
            if len(files[file_name]) != int(size):
                raise ValueError(f"{file_name} is cut short")
        if rest:
            raise ValueError("bytes after the last file")
    except (ValueError, KeyError, TypeError) as exc:
        raise NotSerializable(f"ascend_dsa: damaged precompiled graph ({exc})") from exc
    if header.get("format") != FORMAT or header.get("versions") != versions() or \
            header.get("sources") != source_digest():
        raise NotSerializable("ascend_dsa: the precompiled graph was made by another version of torch or of "
                              "ascend-dsa; compile again")
    try:
        return header["name"], artifact_from({"artifact": header["artifact"], "summary": header["summary"]}, files)
    except CorruptEntry as exc:
        raise NotSerializable(f"ascend_dsa: damaged precompiled graph ({exc})") from exc
