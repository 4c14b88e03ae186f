"""Stateful differential fuzzing of the fused ops: a hypothesis state machine interleaves calls of every op that
keeps state between calls (per-signature plans, measured dispatch choices, static checks passed once, loaded
kernel libraries) with changes that state must not outlive: buffers changed in place (a cache, a block table, a
weight, a bias, a state), aliasing (value is key, views of one buffer, expanded and strided inputs), a growing
cache length, the native mode (ASCEND_DSA_NATIVE 1 / 0 / auto) and the instruction-set level. After every call
the op's result, its torch path's and its readable reference's must agree (or all raise a ValueError).

Run as a program (tests/kernels/test_call_sequences.py runs it in a subprocess, so that a crash or a hang is
counted, not suffered); before each call it writes the call to stderr, so the last line names the call that
crashed. Exits 1 on a difference, printing the sequence that found it.

    python tests/kernels/call_sequences.py --examples 20 --steps 40 [--random]
"""
import argparse
import os
import sys

import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from sequence_attention import Indexer, SparseAttention
from sequence_ops import Call
from sequence_rowwise import DepthAttention, Experts, Gating, Kda, Lengths, Norm, Products, Rotary

import npu_graph  # noqa: F401  (registers the ops)
from npu_graph.kernels.native import call_plans, cpu_isa
from npu_graph.kernels.native import loader as native

FAMILIES = [SparseAttention, Indexer, Gating, Norm, Rotary, Experts, Kda, Lengths, Products, DepthAttention]
LEVELS = cpu_isa.supported()
SETTINGS = (native.ENV_SWITCH, cpu_isa.ENV_ISA)
STEPS = {"calls": 0}


def _outcome(fn: object) -> object:
    """The call's result, or the ValueError it raised (a clear error is a result to compare too)."""
    try:
        return fn()
    except ValueError as e:
        return e


def check(call: Call) -> None:
    """The call through the settings in force and through its torch path, each against the reference."""
    print(f"CALL {call.op} {call.what} native={os.environ.get(native.ENV_SWITCH)} "
          f"isa={os.environ.get(cpu_isa.ENV_ISA)}", file=sys.stderr, flush=True)
    want = _outcome(call.reference)
    got = _outcome(call.run)
    with native.disabled():
        torch_path = _outcome(call.run)
    for name, result in (("the op", got), ("its torch path", torch_path)):
        if isinstance(want, ValueError) or isinstance(result, ValueError):
            assert type(result) is type(want), f"{call.op}: {name} gave {result!r}, the reference {want!r}"
            continue
        try:
            call.compare(result, want)
        except AssertionError as e:
            raise AssertionError(f"{call.op} {call.what}: {name} differs from the reference: {e}") from None
    STEPS["calls"] += 1


class CallSequences(RuleBasedStateMachine):
    """One sequence: a family of operands for each of a few ops (shapes fixed, buffers persistent), then calls
    and changes."""

    @initialize(data=st.data())
    def make_families(self, data: st.DataObject) -> None:
        self.saved = {name: os.environ.get(name) for name in SETTINGS}
        call_plans.clear_all()          # each sequence starts from no plans: a failing one replays the same
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), label="seed"))
        chosen = data.draw(st.lists(st.sampled_from(FAMILIES), min_size=1, max_size=3, unique=True), label="ops")
        self.families = [cls(data, gen) for cls in chosen]      # a few ops a sequence: each called many times

    @rule(data=st.data())
    def call(self, data: st.DataObject) -> None:
        family = data.draw(st.sampled_from(self.families), label="op")
        made = family.draw_call(data)
        note(f"{made.op} {made.what}")
        check(made)

    @rule(data=st.data())
    def change_a_buffer(self, data: st.DataObject) -> None:
        data.draw(st.sampled_from(self.families), label="op").mutate(data)

    @rule(mode=st.sampled_from(["1", "0", "auto"]))
    def native_mode(self, mode: str) -> None:
        os.environ[native.ENV_SWITCH] = mode

    @rule(level=st.sampled_from(LEVELS))
    def isa_level(self, level: str) -> None:
        os.environ[cpu_isa.ENV_ISA] = level

    def teardown(self) -> None:
        for name, value in getattr(self, "saved", {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20, help="sequences")
    parser.add_argument("--steps", type=int, default=40, help="steps per sequence")
    parser.add_argument("--random", action="store_true", help="new random sequences (default: derandomized)")
    args = parser.parse_args()
    config = settings(max_examples=args.examples, stateful_step_count=args.steps, deadline=None, database=None,
                      derandomize=not args.random, suppress_health_check=list(HealthCheck), print_blob=True)
    run_state_machine_as_test(CallSequences, settings=config)
    print(f"ok {STEPS['calls']} calls compared", flush=True)


if __name__ == "__main__":
    main()
