"""Which rank made a launched run fail, and the error that says so (npu_graph.parallel.launch).

The events of a run: ranks that raised (their traceback and the time, from the run's folder), and ranks that
ended without a result and without raising (`os._exit`, a kill, a crash: from the launcher's exit watch, or the
elastic agent's report for a worker that died before it could write anything). A rank that ended without a
result is the cause ahead of any exception: its peers' collectives fail on the connections it dropped, often
before its end is seen. Ranks stopped after the first failure, by the launcher or by the agent (SIGTERM, or
SIGKILL well after it), are not causes.
"""
from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from npu_graph.parallel.rank_process import Exit

if TYPE_CHECKING:
    from npu_graph.parallel.launch import _Run

_GRACE_S = 1.0      # a SIGKILL this long after the first event is the agent's (or the deadline's), not a cause


class DistributedLaunchError(RuntimeError):
    """A rank of a launched run failed, died, or the run went past its timeout."""


def _deaths(run: _Run, agent_failures: dict[int, Any]) -> dict[int, Exit]:
    """Ranks that ended without a result and without raising."""
    folder, deaths = run.folder, {}
    for rank, failure in agent_failures.items():     # a worker may die before writing anything
        if failure.exitcode is not None:
            deaths[rank] = Exit(failure.exitcode, float(failure.timestamp))
    deaths.update(run.watch.exits)
    return {rank: end for rank, end in deaths.items() if not folder.done(rank) and folder.failure(rank) is None}


def _causes(deaths: dict[int, Exit], first: float, stopped_at: float | None) -> dict[int, Exit]:
    """The deaths that are not the launcher's or the agent's stopping of the other ranks."""
    def stopped(end: Exit) -> bool:
        if stopped_at is not None and end.at >= stopped_at:
            return True
        return end.code == -signal.SIGTERM or (end.code == -signal.SIGKILL and end.at > first + _GRACE_S)

    return {rank: end for rank, end in deaths.items() if not stopped(end)}


def _death_text(run: _Run, rank: int, end: Exit) -> str:
    if not run.folder.started(rank):
        return (f"rank {rank} died ({end.how()}) while starting up, before fn ran: the fresh process could not import "
                f"fn's module or unpickle fn and args (its traceback, if any, is on stderr)")
    text = f"rank {rank} died ({end.how()}) before reporting a result"
    crash = run.folder.crash_report(rank)
    return f"{text}\n{crash}" if crash else text


def _timeout_error(run: _Run) -> DistributedLaunchError:
    waiting = [rank for rank in range(run.folder.world_size) if not run.folder.done(rank)]
    text = f"distributed run timed out after {run.timeout_s:g} s: ranks {waiting} did not finish"
    starting = [rank for rank in waiting if not run.folder.started(rank)]
    if starting:
        text += f" (ranks {starting} were still starting up)"
    return DistributedLaunchError(text + "; raise timeout_s if the work needs longer")


def run_error(run: _Run, agent_failures: dict[int, Any]) -> DistributedLaunchError:
    """The error of a run that failed (`agent_failures`: the elastic agent's, by global rank) or timed out."""
    if run.timed_out:
        return _timeout_error(run)
    raised = {rank: info for rank in range(run.folder.world_size) if (info := run.folder.failure(rank)) is not None}
    deaths = _deaths(run, agent_failures)
    times = [info["at"] for info in raised.values()] + [end.at for end in deaths.values()]
    causes = _causes(deaths, min(times), run.stopped_at) if times else {}
    first_raised = min(raised, key=lambda rank: raised[rank]["at"]) if raised else None
    if causes:
        rank = min(causes, key=lambda r: causes[r].at)
        text = f"{_death_text(run, rank, causes[rank])}; the other ranks were stopped"
        if first_raised is not None:
            text += f"\nrank {first_raised} then failed:\n{raised[first_raised]['traceback']}"
        return DistributedLaunchError(text)
    if first_raised is None:
        return DistributedLaunchError(f"the ranks were stopped without saying why (the elastic agent reported "
                                      f"{sorted(agent_failures)})")
    info = raised[first_raised]
    end = run.watch.exits.get(first_raised, Exit(1, info["at"]))
    if info["stage"] == "start":
        return DistributedLaunchError(
            f"rank {first_raised} died ({end.how()}) while starting up, before fn ran: the fresh process could not "
            f"import fn's module or unpickle fn and args; the other ranks were stopped:\n{info['traceback']}")
    return DistributedLaunchError(f"rank {first_raised} raised an exception; the other ranks were stopped:\n"
                                  f"{info['traceback']}")
