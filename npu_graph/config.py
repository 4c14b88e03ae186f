"""CompilerConfig: every setting of the ascend_dsa backend, in torchair-style nested groups.

Three sources, applied in this order: defaults, then `ASCEND_DSA_*` environment variables, then the
`options={...}` a user passes to torch.compile (flat keys from FLAT_OPTIONS, or dotted nested paths such as
"debug.graph_dump.path") and torch.compile's `mode=` (the `mode` setting, one of MODES).
`ASCEND_DSA_DISABLE_CACHE=1` is a kill switch and wins over options.
Unknown keys and attributes raise an error that lists the valid ones; `validate` checks every value.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """An option name or value the backend does not accept."""


class _StrictGroup:
    """Dataclass mixin: setting an attribute that is not a field raises, listing the valid fields."""

    def __setattr__(self, name: str, value: Any) -> None:
        fields = {f.name for f in dataclasses.fields(self)}
        if name not in fields:
            raise ConfigError(f"{type(self).__name__} has no setting {name!r}; valid: {sorted(fields)}")
        object.__setattr__(self, name, value)


@dataclass
class GraphDumpConfig(_StrictGroup):
    path: str | None = None


@dataclass
class DebugConfig(_StrictGroup):
    graph_dump: GraphDumpConfig = field(default_factory=GraphDumpConfig)


@dataclass
class ExperimentalConfig(_StrictGroup):
    frozen_parameter: bool = False
    keep_inference_input_mutations: bool = True


@dataclass
class PassesConfig(_StrictGroup):
    disabled: tuple[str, ...] = ()


@dataclass
class QuantConfig(_StrictGroup):
    mode: str = "none"
    indexer: str | None = None
    kv: str | None = None
    scale_fmt: str = "fp32"


@dataclass
class LayoutConfig(_StrictGroup):
    nz: str = "auto"


@dataclass
class StreamsConfig(_StrictGroup):
    count: int = 3


@dataclass
class SuperKernelConfig(_StrictGroup):
    enabled: bool = True
    compiler: str = "auto"      # "auto": "measured" under the max-autotune modes, else "python"


@dataclass
class CpuConfig(_StrictGroup):
    glue: str = "auto"          # code for the work between fused ops: npu_graph.targets.cpu / runtime.inductor_glue


@dataclass
class CacheConfig(_StrictGroup):
    enabled: bool = True
    dir: str | None = None
    max_size: int = 2 << 30


@dataclass
class VerifyConfig(_StrictGroup):
    enabled: bool = False
    atol: float = 1e-3
    rtol: float = 1e-3


@dataclass
class CompilerConfig(_StrictGroup):
    target: str = "cpu"
    mode: str = "default"
    strict: bool = False
    debug: DebugConfig = field(default_factory=DebugConfig)
    experimental_config: ExperimentalConfig = field(default_factory=ExperimentalConfig)
    passes: PassesConfig = field(default_factory=PassesConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    streams: StreamsConfig = field(default_factory=StreamsConfig)
    superkernel: SuperKernelConfig = field(default_factory=SuperKernelConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)

    @classmethod
    def from_options(cls, options: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                     mode: str | None = None) -> CompilerConfig:
        """Defaults, then environment, then options (flat or dotted keys), then torch.compile's `mode`;
        validated."""
        config = cls()
        env = os.environ if env is None else env
        for path, value in _env_settings(env).items():
            config.set(path, value)
        for key, value in (options or {}).items():
            config.set(resolve_option(key), value)
        if mode is not None:
            config.mode = mode
        return config.checked(env)

    def checked(self, env: dict[str, str] | None = None) -> CompilerConfig:
        """A validated copy, with the `ASCEND_DSA_DISABLE_CACHE` kill switch applied."""
        config = copy.deepcopy(self)
        env = os.environ if env is None else env
        if env.get("ASCEND_DSA_DISABLE_CACHE", "") not in ("", "0"):
            config.cache.enabled = False
        config.validate()
        return config

    def set(self, path: str, value: Any) -> None:
        """Set a dotted path such as "debug.graph_dump.path"."""
        *groups, leaf = path.split(".")
        target: Any = self
        for g in groups:
            target = getattr(target, g)
        if leaf == "disabled" and isinstance(value, str):
            value = (value,)
        elif isinstance(value, list):
            value = tuple(value)
        setattr(target, leaf, value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def key(self) -> str:
        """Canonical JSON of every setting: equal configs give equal keys."""
        return json.dumps(self.to_dict(), sort_keys=True, default=str)

    def validate(self) -> None:
        """Raise ConfigError naming the first setting whose value is not accepted."""
        if self.mode not in MODES:
            raise ConfigError(f"torch.compile mode={self.mode!r} is not supported by ascend_dsa; use one of "
                              f"{list(MODES)} (docs/options.md, Modes: what each mode does here)")
        _validate_types(self)
        for path, allowed in _CHOICES.items():
            value = self.get(path)
            if value not in allowed:
                raise ConfigError(f"option {path}={value!r} is not valid; use one of {list(allowed)}")
        if not isinstance(self.streams.count, int) or self.streams.count < 1:
            raise ConfigError(f"option streams={self.streams.count!r} must be an integer >= 1")
        _validate_disabled(self.passes.disabled)

    def get(self, path: str) -> Any:
        target: Any = self
        for part in path.split("."):
            target = getattr(target, part)
        return target

    def superkernel_compiler(self) -> str:
        """How CPU SuperKernel regions are compiled: the setting, or for "auto" the mode's choice."""
        if self.superkernel.compiler != "auto":
            return self.superkernel.compiler
        return "measured" if self.mode in AUTOTUNE_MODES else "python"


# torch.compile's modes (torch passes `mode` to a backend other than Inductor; docs/options.md, "Modes").
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")


FLAT_OPTIONS: dict[str, str] = {
    "dump_dir": "debug.graph_dump.path",
    "cache": "cache.enabled",
    "cache_dir": "cache.dir",
    "max_cache_size": "cache.max_size",
    "verify": "verify.enabled",
    "verify_atol": "verify.atol",
    "verify_rtol": "verify.rtol",
    "strict": "strict",
    "target": "target",
    "disabled_passes": "passes.disabled",
    "quant": "quant.mode",
    "streams": "streams.count",
    "superkernel": "superkernel.enabled",
    "superkernel_compiler": "superkernel.compiler",
    "cpu_glue": "cpu.glue",
    "nz": "layout.nz",
    "frozen_parameter": "experimental_config.frozen_parameter",
    "mode": "mode",
}

_CHOICES: dict[str, tuple[Any, ...]] = {
    "target": ("cpu", "npu"),
    "strict": (True, False),
    "quant.mode": ("none", "dsa"),
    "quant.indexer": (None, "none", "mxfp8", "int8"),
    "quant.kv": (None, "none", "fp8_block128"),
    "quant.scale_fmt": ("fp32", "ue8m0"),
    "layout.nz": ("auto", "off"),
    "superkernel.enabled": (True, False),
    "superkernel.compiler": ("auto", "python", "inductor", "measured"),
    "cpu.glue": ("auto", "python", "inductor", "background"),
    "cache.enabled": (True, False),
    "verify.enabled": (True, False),
    "experimental_config.frozen_parameter": (True, False),
    "experimental_config.keep_inference_input_mutations": (True, False),
}


def _nested_paths(obj: Any = None, prefix: str = "") -> list[str]:
    obj = CompilerConfig() if obj is None else obj
    paths = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            paths += _nested_paths(value, f"{prefix}{f.name}.")
        else:
            paths.append(prefix + f.name)
    return paths


def valid_option_names() -> list[str]:
    """Every name `options` accepts: the flat keys, then the dotted nested paths."""
    return sorted(FLAT_OPTIONS) + _nested_paths()


def resolve_option(key: str) -> str:
    """Map a user's option key to its nested path, or raise listing the valid keys."""
    if key in FLAT_OPTIONS:
        return FLAT_OPTIONS[key]
    if key in _nested_paths():
        return key
    raise ConfigError(
        f"unknown ascend_dsa option {key!r}. Valid flat options: {', '.join(sorted(FLAT_OPTIONS))}; "
        f"nested paths: {', '.join(_nested_paths())}")


def _env_settings(env: dict[str, str]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if env.get("ASCEND_DSA_DUMP_DIR"):
        settings["debug.graph_dump.path"] = env["ASCEND_DSA_DUMP_DIR"]
    if env.get("ASCEND_DSA_CACHE_DIR"):
        settings["cache.dir"] = env["ASCEND_DSA_CACHE_DIR"]
    if env.get("ASCEND_DSA_CPU_GLUE"):
        settings["cpu.glue"] = env["ASCEND_DSA_CPU_GLUE"]
    return settings


def _kind(default: Any) -> tuple[tuple[type, ...], str]:
    """The types a setting whose default is `default` accepts, and how to name them."""
    if isinstance(default, bool):
        return (bool,), "True or False"
    if isinstance(default, int):
        return (int,), "an integer"
    if isinstance(default, float):
        return (int, float), "a number"
    if isinstance(default, tuple):
        return (tuple,), "a list of names"
    return (str, type(None)) if default is None else (str,), "a string"


def _validate_types(config: CompilerConfig) -> None:
    defaults = CompilerConfig()
    for path in _nested_paths(defaults):
        value, default = config.get(path), defaults.get(path)
        types, name = _kind(default)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ConfigError(f"option {path}={value!r} must be {name}")


def _validate_disabled(disabled: tuple[str, ...]) -> None:
    from npu_graph.pipeline import pass_names

    unknown = [name for name in disabled if name not in pass_names()]
    if unknown:
        raise ConfigError(f"disabled_passes names unknown passes {unknown}; passes are {pass_names()}")
