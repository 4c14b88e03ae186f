"""Context and expert parallelism beyond one card (CP×TP and EP on torch.distributed: gloo on CPU, HCCL on Ascend).

- zigzag.py: the balanced causal layout (rank r holds chunks r and 2·cp − 1 − r of 2·cp).
- groups.py: DP×CP×TP process groups (TP inner, splits heads; CP splits the sequence) and an EP group over any
  of those dimensions.
- cp_gather.py: all-gathers over a CP group and a rank's zigzag chunk bookkeeping.
- cp_indexer.py, cp_attention.py: the DSA lightning indexer and sparse attention on zigzag slices.
- cp_dsa.py: prefill of the reference model's DSA layer under CP×TP.
- kda_split.py: KDA over contiguous slices, exact output correction from one all-gather of transitions; for
  long prompts held as time blocks, two passes (the slice's transition, then its outputs from the folded state).
- ep_dispatch.py: `ascend_dsa::moe_dispatch` / `moe_combine`, MoE expert parallelism on all_to_all (MC2 pair).
- ep_quant.py: dynamic per-token int8 quantization of dispatched rows.
- ep_layer.py, ep_shard.py: expert-parallel MoE modules and `shard_experts(model, ep_group)`.
- ep_placement.py: which experts each EP rank holds: contiguous blocks, or packed by observed loads (EPLB-style).
- launch.py: run a function on the ranks of one machine through torch.distributed.elastic's launcher, with a
  deadline; a failing or dying rank fails the run with an error naming it (rank_failures.py).
- rank_process.py: one launched rank: its process in a session of its own (killed with all it started), and the
  files it leaves in the run's folder.
"""
from npu_graph.parallel.cp_attention import cp_sparse_attention
from npu_graph.parallel.cp_dsa import cp_dsa_prefill
from npu_graph.parallel.cp_gather import gather_parts, gather_zigzag, zigzag_chunks
from npu_graph.parallel.cp_indexer import cp_lightning_indexer
from npu_graph.parallel.ep_dispatch import moe_combine, moe_dispatch
from npu_graph.parallel.ep_placement import balanced_placement, record_expert_loads
from npu_graph.parallel.ep_shard import EPLayer, shard_experts
from npu_graph.parallel.groups import ParallelGroups, group_size_rank, init_cp_tp, init_parallel
from npu_graph.parallel.kda_split import kda_split
from npu_graph.parallel.launch import default_backend, launch
from npu_graph.parallel.rank_failures import DistributedLaunchError
from npu_graph.parallel.zigzag import zigzag_restore, zigzag_split

__all__ = [
    "DistributedLaunchError",
    "EPLayer",
    "ParallelGroups",
    "balanced_placement",
    "cp_dsa_prefill",
    "cp_lightning_indexer",
    "cp_sparse_attention",
    "default_backend",
    "gather_parts",
    "gather_zigzag",
    "group_size_rank",
    "init_cp_tp",
    "init_parallel",
    "kda_split",
    "launch",
    "moe_combine",
    "moe_dispatch",
    "record_expert_loads",
    "shard_experts",
    "zigzag_chunks",
    "zigzag_restore",
    "zigzag_split",
]
