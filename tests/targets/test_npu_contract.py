"""The contract checker against the pinned torch_npu table: every kind of mismatch is a clear error, and every
table entry says where its signature was read."""
import pytest
import torch

from npu_graph.targets.npu_contract import Arg, NpuCall, NpuContractError, check_call
from npu_graph.targets.npu_signatures import SIGNATURES, TORCH_NPU_VERSION


def indexer_call(**overrides):
    args = [Arg.tensor("q", torch.bfloat16), Arg.tensor("k", torch.bfloat16), Arg.tensor("w", torch.bfloat16)]
    kwargs = {"layout_query": Arg.literal("BSND"), "layout_key": Arg.literal("PA_BSND"),
              "block_table": Arg.tensor("bt", torch.int32), "sparse_count": Arg.literal(2048)}
    kwargs.update(overrides)
    return NpuCall("torch_npu.npu_lightning_indexer", args, kwargs, node="li")


def test_a_valid_call_passes():
    assert check_call(indexer_call()).name == "torch_npu.npu_lightning_indexer"


@pytest.mark.parametrize("overrides, message", [
    ({"sparse_top_k": Arg.literal(8)}, "unknown argument 'sparse_top_k'"),
    ({"layout_key": Arg.literal("BNSD")}, "layout_key='BNSD' is not supported"),
    ({"sparse_count": Arg.literal(4096)}, "outside [1, 2048]"),
    ({"block_table": Arg.tensor("bt", torch.int64)}, "'block_table' has dtype int64"),
    ({"sparse_mode": Arg.tensor("m", torch.int32)}, "not a tensor"),
])
def test_mismatches_name_the_argument(overrides, message):
    with pytest.raises(NpuContractError, match=r"npu_lightning_indexer \(lowering node 'li'\)") as info:
        check_call(indexer_call(**overrides))
    assert message in str(info.value)


def test_missing_required_and_keyword_only_by_position():
    with pytest.raises(NpuContractError, match=r"missing required arguments \['weights'\]"):
        check_call(NpuCall("torch_npu.npu_lightning_indexer", [Arg.tensor("q", torch.float16)] * 2))
    too_many = [Arg.tensor("q", torch.float16)] * 3 + [Arg.tensor("l", torch.int32)]
    with pytest.raises(NpuContractError, match=r"pass \['actual_seq_lengths_query'\] by keyword"):
        check_call(NpuCall("torch_npu.npu_lightning_indexer", too_many))


def test_dtypes_the_pinned_op_rejects():
    fp32 = [Arg.tensor(n, torch.float32) for n in ("q", "k", "w")]
    with pytest.raises(NpuContractError, match=r"dtype float32; the pinned op takes \['float16', 'bfloat16'\]"):
        check_call(NpuCall("torch_npu.npu_lightning_indexer", fp32))
    mixed = [Arg.tensor("x1", torch.float16), Arg.tensor("x2", torch.bfloat16), Arg.tensor("g", torch.float16)]
    with pytest.raises(NpuContractError, match="must share one dtype"):
        check_call(NpuCall("torch_npu.npu_add_rms_norm", mixed))


def test_unknown_op_and_unsupported_modes():
    with pytest.raises(NpuContractError, match="not in the pinned signature table"):
        check_call(NpuCall("torch_npu.npu_fused_infer_attention_score", []))
    router = NpuCall("torch_npu.npu_moe_gating_top_k", [Arg.tensor("x", torch.float32), Arg.literal(2)],
                     {"renorm": Arg.literal(1)})
    with pytest.raises(NpuContractError, match=r"renorm=1 is not supported; choices \[0\]"):
        check_call(router)


def test_every_entry_is_pinned_and_sourced():
    assert TORCH_NPU_VERSION == "7.3.0"
    for name, sig in SIGNATURES.items():
        assert sig.source.startswith("http") or sig.source.startswith("torch_npu"), name
        assert sig.version and name.split(".")[0] in ("torch_npu", "torchair", "torch")
        kinds = [p.kind for p in sig.params]
        assert kinds == sorted(kinds, key=lambda k: k == "keyword"), f"{name}: keyword-only before positional"
