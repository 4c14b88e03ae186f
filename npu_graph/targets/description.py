"""The TargetDescription each target gives the passes: its cost profile, how it realises weight layouts, how
its streams are switched, which convolution layout it prefers.

Profiles: "cpu" was measured on the development machine with `python -m npu_graph.targets.description` (that
command re-measures and prints a new table; the constants stay fixed so plans and cache keys are reproducible);
"npu" (Ascend 910B, Atlas 800T A2) and "cuda" (H200 SXM) use published peak figures.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from npu_graph.pass_api import DeviceProfile, TargetDescription
from npu_graph.targets.cpu_gemm_profile import preferred_form

PROFILES: dict[str, DeviceProfile] = {
    # measured: `python -m npu_graph.targets.description`, best of 3 runs (2 shared cores, torch 2.13 CPU, fp32)
    "cpu": DeviceProfile("cpu", flops_per_s=1.9e11, bytes_per_s=4.6e10, launch_s=2.0e-6, event_s=1.1e-5),
    # Ascend 910B: 313 TFLOPS fp16/bf16, 1.6 TB/s HBM2e; ~5 us host launch, ~10 us event sync
    "npu": DeviceProfile("npu", flops_per_s=3.13e14, bytes_per_s=1.6e12, launch_s=5.0e-6, event_s=1.0e-5),
    # H200 SXM: 989 TFLOPS dense bf16, 4.8 TB/s HBM3e; ~4 us launch, ~5 us event sync
    "cuda": DeviceProfile("cuda", flops_per_s=9.89e14, bytes_per_s=4.8e12, launch_s=4.0e-6, event_s=5.0e-6),
}


def describe(target: str, device: str = "cpu") -> TargetDescription:
    """The description of compile target `target` ("cpu" | "npu") for a graph whose tensors live on `device`
    (a device string such as "cpu", "cuda:0", "npu:0"; the profile follows the tensors' device when it is an
    accelerator, else the target)."""
    device_type = torch.device(device).type
    profile = PROFILES[device_type] if device_type in ("cuda", "npu") else PROFILES["npu" if target == "npu" else "cpu"]
    on_cpu = target == "cpu"
    return TargetDescription(name=target, cost=profile, weight_form=preferred_form if on_cpu else None,
                             stream_device=None if device_type == "cpu" else device,
                             channels_last_depthwise_conv=on_cpu, dsa_key_starts=on_cpu)


def _best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _event_round_trip(rounds: int = 200) -> float:
    """One hand-off to another thread and back: what a cross-'stream' dependency costs with CPU threads."""
    ping, pong = threading.Event(), threading.Event()

    def worker() -> None:
        for _ in range(rounds):
            ping.wait()
            ping.clear()
            pong.set()

    thread = threading.Thread(target=worker)
    thread.start()
    start = time.perf_counter()
    for _ in range(rounds):
        ping.set()
        pong.wait()
        pong.clear()
    thread.join()
    return (time.perf_counter() - start) / rounds / 2


def measure_cpu_profile() -> DeviceProfile:
    """Measure this machine: fp32 GEMM rate, copy bandwidth, per-operator launch cost, thread hand-off."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = 2 * 1024 ** 3 / _best_of(lambda: torch.mm(a, b), 5)
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / _best_of(lambda: dst.copy_(src), 5)
    x = torch.ones(8)
    add = torch.ops.aten.add.Tensor
    launch = _best_of(lambda: [add(x, x) for _ in range(1000)], 5) / 1000
    return DeviceProfile("cpu", flops_per_s=flops, bytes_per_s=bandwidth, launch_s=launch,
                         event_s=_event_round_trip())


if __name__ == "__main__":
    print(measure_cpu_profile())
