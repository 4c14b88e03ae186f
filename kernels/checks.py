"""Input validation shared by the fused operators: each check raises ValueError naming the argument,
what was given and what is expected, so a user can fix the call without reading kernel code."""
import contextlib
import functools
import inspect
import threading
import typing
from collections.abc import Callable, Hashable, Iterable, Iterator

import torch


class _ThreadState(threading.local):
    trusted = False         # a class default: a missing thread-local attribute costs an exception inside getattr


_STATE = _ThreadState()


class FusedPreconditionError(ValueError):
    """A fused op found at run time that its inputs break a condition the fusion relied on (e.g. a mask
    that is not causal). The backend catches it and runs that graph eagerly from then on."""


@contextlib.contextmanager
def shapes_checked_at_trace() -> Iterator[None]:
    """Inside, the fused ops skip their static argument checks (ranks, dtypes, layouts, shape relations).
    A compiled graph runs inside it: its fake implementations made those checks when the graph was traced,
    and Dynamo's guards keep them true for every call. Checks on data (index ranges, block tables, a
    mask's form) still run. Saves ~0.4 ms of Python per decode step of the reference model."""
    previous = _STATE.trusted
    _STATE.trusted = True
    try:
        yield
    finally:
        _STATE.trusted = previous


def static_checks_needed() -> bool:
    """False inside `shapes_checked_at_trace`: the call comes from a traced, guarded graph."""
    return not _STATE.trusted


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition holds."""
    if not condition:
        raise ValueError(message)


# Each helper tests first and formats its message only on failure: a fused op called eagerly runs ~20 of them a call,
# and formatting every message cost sparse attention's checks ~65 us a call.
def require_rank(op: str, name: str, t: torch.Tensor, ranks: int | Iterable[int]) -> None:
    allowed = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if t.dim() not in allowed:
        raise ValueError(f"{op}: `{name}` must have rank {' or '.join(map(str, allowed))}, got shape "
                         f"{tuple(t.shape)} (rank {t.dim()})")


def require_dtype(op: str, name: str, t: torch.Tensor, dtypes: Iterable[torch.dtype]) -> None:
    allowed = tuple(dtypes)
    if t.dtype not in allowed:
        raise ValueError(f"{op}: `{name}` has dtype {t.dtype}; expected one of {', '.join(str(d) for d in allowed)}")


def require_choice(op: str, name: str, value: object, choices: Iterable[object]) -> None:
    allowed = tuple(choices)
    if value not in allowed:
        raise ValueError(f"{op}: `{name}`={value!r} is not supported; use one of {list(allowed)}")


def require_positive(op: str, name: str, value: int) -> None:
    if not value > 0:
        raise ValueError(f"{op}: `{name}` must be > 0, got {value}")


def require_divisible(op: str, name: str, size: int, block: int, block_name: str = "block_size") -> None:
    if size % block != 0:
        raise ValueError(f"{op}: `{name}` size {size} is not divisible by `{block_name}`={block}; pad it to a "
                         f"multiple of {block}")


def require_same(op: str, what: str, a: object, b: object) -> None:
    if a != b:
        raise ValueError(f"{op}: {what} disagree: {a} vs {b}")


MAX_SIGNATURES = 4096       # signatures a check remembers as passed (then it starts over)


def _signature_of(value: object) -> Hashable:
    """What a static check reads of one argument: a tensor's shape, dtype and device; any other value itself."""
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype, value.device
    return value


def once_per_signature(check: Callable[..., None]) -> Callable[..., None]:
    """`check`, a static argument check (it reads its tensors' shapes, dtypes and devices and its other arguments,
    never tensor data), skipped for a signature of its arguments that passed it before: an op called eagerly
    repeats one signature call after call, and its checks cost tens of microseconds. Symbolic sizes (a trace) do
    not hash, and a nested tensor has no sizes: those calls are checked every time."""
    passed: set[Hashable] = set()

    @functools.wraps(check)
    def checked(*args: object) -> None:
        try:
            signature: Hashable | None = tuple(map(_signature_of, args))
            if signature in passed:
                return
        except (TypeError, RuntimeError):
            signature = None
        check(*args)
        if signature is not None:
            if len(passed) >= MAX_SIGNATURES:
                passed.clear()
            passed.add(signature)

    return checked


def tensors_given(op: Callable[..., object]) -> Callable[..., object]:
    """`op` (a fused op's implementation, under `torch.library.custom_op`) refusing a missing or non-tensor value
    for a parameter annotated `Tensor`, with TypeError naming the parameter: torch's dispatcher passes None on to
    a Python implementation, where it would surface as an AttributeError deep inside. Optional tensors are not
    touched. Skipped inside `shapes_checked_at_trace`, like the static checks."""
    hints = typing.get_type_hints(op)
    names = list(inspect.signature(op).parameters)
    required = {name for name in names if hints.get(name) is torch.Tensor}
    positions = [(i, name) for i, name in enumerate(names) if name in required]

    def refuse(name: str, value: object) -> None:
        raise TypeError(f"{op.__name__}: `{name}` must be a tensor, got {type(value).__name__}")

    @functools.wraps(op)
    def checked(*args: object, **kwargs: object) -> object:
        if not _STATE.trusted:
            for i, name in positions:
                if i < len(args) and not isinstance(args[i], torch.Tensor):
                    refuse(name, args[i])
            for name, value in kwargs.items():
                if name in required and not isinstance(value, torch.Tensor):
                    refuse(name, value)
        return op(*args, **kwargs)
    checked.__signature__ = inspect.signature(op, eval_str=True)    # what custom_op reads the schema from
    return checked
