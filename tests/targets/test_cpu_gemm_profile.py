"""The CPU's matmul weight forms: small weights and fp32 ones pre-transposed, large bf16 weights kept [N, K]
(their one-row products stream the weight's rows near the machine's bandwidth)."""
import torch

from npu_graph.pass_api import PRE_TRANSPOSED
from npu_graph.targets.cpu_gemm_profile import BF16_KEEP_BYTES, preferred_form


def test_fp32_weights_of_every_size_are_pre_transposed():
    assert preferred_form(torch.float32, (576, 512)) == PRE_TRANSPOSED
    assert preferred_form(torch.float32, (7168, 16384)) == PRE_TRANSPOSED


def test_bf16_weights_are_pre_transposed_below_the_size_that_streams_faster_as_rows():
    below = BF16_KEEP_BYTES // 2 // 512 - 1
    assert preferred_form(torch.bfloat16, (below, 512)) == PRE_TRANSPOSED
    assert preferred_form(torch.bfloat16, (BF16_KEEP_BYTES // 2 // 512, 512)) is None
    assert preferred_form(torch.bfloat16, (7168, 16384)) is None


def test_other_dtypes_and_ranks_are_left_alone():
    assert preferred_form(torch.float16, (64, 64)) is None
    assert preferred_form(torch.float32, (4, 64, 64)) is None
