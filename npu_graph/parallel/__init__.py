"""Context parallelism beyond one card (CP×TP on torch.distributed: gloo on CPU, HCCL on Ascend).

This slice provides the zigzag sequence layout that balances causal attention work across CP ranks.
"""
from npu_graph.parallel.zigzag import zigzag_restore, zigzag_split

__all__ = ["zigzag_restore", "zigzag_split"]
