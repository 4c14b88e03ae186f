"""Per-rank programs for the expert-parallel model tests: a model sharded over the world (eager or compiled with
ascend_dsa) against the same model whole in the same process (importable by name in spawned ranks)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from npu_graph.models.hybrid import HybridConfig, HybridLM
from npu_graph.models.tiny_transformers import build_tiny
from npu_graph.parallel import shard_experts
from npu_graph.parallel.ep_layer import EPExperts
from npu_graph.parallel.ep_placement import balanced_placement, record_expert_loads


def build(name: str, skew: bool = False) -> torch.nn.Module:
    """"reference" (the tiny HybridLM) or a tiny transformers model; `skew` biases the reference router so
    every token picks experts of EP rank 0 (the first half of the experts)."""
    if name != "reference":
        return build_tiny(name)
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.named("tiny")).eval()
    if skew:
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias[: module.n_experts // 2] = 10.0
    return model


def _logits(output: object) -> torch.Tensor:
    return getattr(output, "logits", output)


def _expert_params(model: torch.nn.Module) -> int:
    """Parameters of the routed experts (stacked or per-expert lists)."""
    return sum(param.numel() for name, param in model.named_parameters() if ".experts." in name)


def _ep_summary(dump: str | None) -> list[dict]:
    """The expert_parallel entries of every summary.json under `dump` (none when not compiled)."""
    paths = sorted(Path(dump).rglob("summary.json")) if dump else []
    return [layer for path in paths for layer in json.loads(path.read_text()).get("expert_parallel", [])]


def model_check(names: list[str], compiled: bool, quant_mode: int = 0, skew: bool = False,
                balanced: bool = False) -> dict:
    """Per model: relative max logits difference, cosine, parameter and expert-parameter ratios, EP layers;
    `balanced`: experts placed by the loads the whole model's router produced on these inputs."""
    ids = torch.randint(3, 250, (1, 24), generator=torch.Generator().manual_seed(1))
    results = {}
    for name in names:
        whole = build(name, skew)
        with torch.no_grad(), record_expert_loads(whole) as loads:
            want = _logits(whole(ids))
        world = dist.get_world_size()
        placement = {block: balanced_placement(load, world) for block, load in loads.items()} if balanced else None
        model = build(name, skew)
        params, experts = sum(p.numel() for p in model.parameters()), _expert_params(model)
        layers = shard_experts(model, dist.group.WORLD, quant_mode=quant_mode, placement=placement)
        routed: list[torch.Tensor] = []
        for module in model.modules():
            if isinstance(module, EPExperts):
                module.register_forward_pre_hook(lambda _, args, seen=routed: seen.append(args[1].flatten()))
        local = sum(p.numel() for m in model.modules() if isinstance(m, EPExperts) for p in m.parameters())
        torch._dynamo.reset()
        dump = tempfile.mkdtemp(prefix="ep_dump_") if compiled else None
        run = model if dump is None else torch.compile(model, backend="ascend_dsa",
                                                        options={"cache": False, "dump_dir": dump})
        with torch.no_grad():
            got = _logits(run(ids))
        results[name] = {
            "rel": ((got - want).abs().max() / want.abs().max()).item(),
            "cosine": F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item(),
            "params": sum(p.numel() for p in model.parameters()) / params,
            "experts": local / experts, "layers": [(layer.name, layer.local_experts) for layer in layers],
            "routed": torch.cat(routed).bincount(minlength=8).tolist() if routed else None,
            "loads": {block: load.tolist() for block, load in loads.items()}, "placement": placement,
            "summary": _ep_summary(dump)}
    return results


def reference_checks(compiled: bool) -> dict:
    """The reference model sharded, eager: plain, skewed to one rank, int8 dispatch; compiled when asked."""
    results = {"eager": model_check(["reference"], False)["reference"],
               "skew": model_check(["reference"], False, skew=True)["reference"],
               "quant": model_check(["reference"], False, quant_mode=2)["reference"],
               "placed": model_check(["reference"], False, skew=True, balanced=True)["reference"]}
    if compiled:
        results["compiled"] = model_check(["reference"], True)["reference"]
    return results
