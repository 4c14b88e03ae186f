"""The pinned torch_npu / torchair signatures the NPU program is written against (not run on hardware).

Pinned release: torch_npu 7.3.0 (op-plugin docs `docs/context/torch_npu-*.md`) with torchair from the same
release (hiascend.com "torchair.scope" reference for PyTorch 7.3.0). Every entry records where its signature
was read. `npu_lightning_indexer` and `npu_sparse_flash_attention` changed across releases: the first
DeepSeek-V3.2 recipes (cann-recipes-infer, 2025-09) built them as `torch.ops.custom.npu_*` custom ops taking
positional arguments and no `return_value` / `attention_mode` / `return_softmax_lse`; from torch_npu 7.2 they
are `torch_npu.npu_*` with the keyword-only options below. The program targets only the pinned form.

A parameter is "positional" (before the `*` of the torch_npu prototype) or "keyword" (keyword-only). `dtypes`
lists the tensor dtypes the pinned docs accept on Atlas A2/A3 unless `notes` says otherwise; `choices` the
accepted values of an option (layouts, modes); `bounds` an inclusive integer range.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

TORCH_NPU_VERSION = "7.3.0"
TORCHAIR_VERSION = "7.3.0"
ACL_FORMAT_FRACTAL_NZ = 29
HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_OP_PLUGIN = "https://gitcode.com/Ascend/op-plugin/blob/master/docs/context/"
_TORCHAIR = "https://www.hiascend.com/document/detail/zh/Pytorch/730/modthirdparty/torchairuseguide/"
_TORCHAIR_720 = "https://www.hiascend.com/document/detail/zh/Pytorch/720/modthirdparty/torchairuseguide/"


@dataclass(frozen=True)
class Param:
    """One argument of a pinned signature."""

    name: str
    kind: str                      # "positional" or "keyword"
    type: str                      # "Tensor", "Tensor?", "Tensor[]", "int", "float", "str", "bool", "dtype", "int[]"
    required: bool = False
    dtypes: tuple[torch.dtype, ...] | None = None
    choices: tuple[object, ...] | None = None
    bounds: tuple[int, int] | None = None


@dataclass(frozen=True)
class Signature:
    """A torch_npu / torchair callable as the pinned release documents it."""

    name: str                      # how the program calls it, e.g. "torch_npu.npu_rms_norm"
    params: tuple[Param, ...]
    source: str
    version: str = TORCH_NPU_VERSION
    notes: str = ""
    context_manager: bool = False
    same_dtype: tuple[str, ...] = ()   # tensor arguments that must share one dtype
    by_name: dict[str, Param] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {p.name: p for p in self.params})


def _pos(name: str, type_: str, **kw: object) -> Param:
    return Param(name, "positional", type_, required=kw.pop("required", True), **kw)  # type: ignore[arg-type]


def _kw(name: str, type_: str, **kw: object) -> Param:
    return Param(name, "keyword", type_, **kw)  # type: ignore[arg-type]


_LENGTHS = (_kw("actual_seq_lengths_query", "Tensor?", dtypes=(torch.int32,)),)
_I64_MAX = (0, 2**63 - 1)
# MC2 (npu_moe_distribute_*): EP sizes are A3's 8..288 (A2 takes 16, 32, 64); group_ep is the HCCL
# communicator name, `group._get_backend(torch.device("npu")).get_hccl_comm_name(global_rank)` (HCCL_COMM_NAME_SOURCE),
# not the torch group_name.
HCCL_COMM_NAME_SOURCE = "https://gitcode.com/Ascend/op-plugin/blob/7.3.0/docs/context/torch-distributed-distributed_c10d.md"
MC2_EP_SIZES = (8, 16, 32, 64, 128, 144, 256, 288)
MC2_MAX_EXPERTS = 512
MC2_MAX_HIDDEN = 7168
MC2_MAX_TOP_K = 16
MC2_MAX_TOKENS = 512
_MC2_GROUP = (_pos("group_ep", "str"), _pos("ep_world_size", "int", choices=MC2_EP_SIZES),
              _pos("ep_rank_id", "int", bounds=(0, MC2_EP_SIZES[-1] - 1)),
              _pos("moe_expert_num", "int", bounds=(1, MC2_MAX_EXPERTS)))
_MC2_OPTIONS = (_kw("group_tp", "str"), _kw("tp_world_size", "int", choices=(0, 1, 2)),
                _kw("tp_rank_id", "int", choices=(0, 1)), _kw("expert_shard_type", "int", choices=(0,)),
                _kw("shared_expert_num", "int", choices=(1,)), _kw("shared_expert_rank_num", "int", bounds=(0, 287)))
_MC2_NOTES = ("inference only; A2: H in (0, 7168] and a multiple of 32, BS <= 256, K <= 16, "
              "moe_expert_num / ep_world_size <= 24; A3: H = 7168, BS <= 512, K <= 8; the K experts of a token "
              "are distinct")

_ENTRIES = (
    Signature("torch_npu.npu_lightning_indexer", (
        _pos("query", "Tensor", dtypes=HALF), _pos("key", "Tensor", dtypes=HALF),
        _pos("weights", "Tensor", dtypes=HALF), *_LENGTHS,
        _kw("actual_seq_lengths_key", "Tensor?", dtypes=(torch.int32,)),
        _kw("block_table", "Tensor?", dtypes=(torch.int32,)),
        _kw("layout_query", "str", choices=("BSND", "TND")),
        _kw("layout_key", "str", choices=("BSND", "PA_BSND", "TND")),
        _kw("sparse_count", "int", bounds=(1, 2048)), _kw("sparse_mode", "int", choices=(0, 3)),
        _kw("pre_tokens", "int", choices=(2**63 - 1,)), _kw("next_tokens", "int", choices=(2**63 - 1,)),
        _kw("return_value", "bool")),
        _OP_PLUGIN + "torch_npu-npu_lightning_indexer.md",
        notes="N1 = 64, D = 128, N2 = 1 on Atlas A2/A3; return_value=True only in training and not with PA_BSND",
        same_dtype=("query", "key", "weights")),
    Signature("torch_npu.npu_quant_lightning_indexer", (
        _pos("query", "Tensor", dtypes=(torch.int8,)), _pos("key", "Tensor", dtypes=(torch.int8,)),
        _pos("weights", "Tensor", dtypes=(torch.float16,)),
        _pos("query_dequant_scale", "Tensor", dtypes=(torch.float16,)),
        _pos("key_dequant_scale", "Tensor", dtypes=(torch.float16,)), *_LENGTHS,
        _kw("actual_seq_lengths_key", "Tensor?", dtypes=(torch.int32,)),
        _kw("block_table", "Tensor?", dtypes=(torch.int32,)),
        _kw("query_quant_mode", "int", choices=(0,)), _kw("key_quant_mode", "int", choices=(0,)),
        _kw("layout_query", "str", choices=("BSND", "TND")), _kw("layout_key", "str", choices=("PA_BSND",)),
        _kw("sparse_count", "int", bounds=(1, 2048)), _kw("sparse_mode", "int", choices=(0, 3))),
        "https://gitcode.com/Ascend/op-plugin/blob/master/test/test_custom_ops/test_npu_quant_lightning_indexer.py "
        "(and op_plugin/ops/opapi/QuantLightningIndexerKernelNpuOpApi.cpp)",
        version="op-plugin master, after 7.3.0",
        notes="A2/A3: int8 query [B,S1,N1,D] and paged key [blocks,block,1,D] with per-token-head fp16 dequant "
              "scales [B,S1,N1] and [blocks,block,1] (mode 0); N1 = 64, D = 128; returns sparse_indices only "
              "(Ascend 950 takes float8_e4m3fn codes instead)"),
    Signature("torch_npu.npu_sparse_flash_attention", (
        _pos("query", "Tensor", dtypes=HALF), _pos("key", "Tensor", dtypes=HALF),
        _pos("value", "Tensor", dtypes=HALF), _pos("sparse_indices", "Tensor", dtypes=(torch.int32,)),
        _pos("scale_value", "float"), _kw("block_table", "Tensor?", dtypes=(torch.int32,)), *_LENGTHS,
        _kw("actual_seq_lengths_kv", "Tensor?", dtypes=(torch.int32,)),
        _kw("query_rope", "Tensor?", dtypes=HALF), _kw("key_rope", "Tensor?", dtypes=HALF),
        _kw("sparse_block_size", "int", choices=(1, 2, 4, 8, 16, 32, 64, 128)),
        _kw("layout_query", "str", choices=("BSND", "TND")),
        _kw("layout_kv", "str", choices=("BSND", "PA_BSND", "TND")), _kw("sparse_mode", "int", choices=(0, 3)),
        _kw("pre_tokens", "int", choices=(2**63 - 1,)), _kw("next_tokens", "int", choices=(2**63 - 1,)),
        _kw("attention_mode", "int", choices=(2,)), _kw("return_softmax_lse", "bool")),
        _OP_PLUGIN + "torch_npu-npu_sparse_flash_attention.md",
        notes="D = 512 (+ rope 64), KV heads 1; softmax_max/sum are [B,N2,S1,N1/N2]; return_softmax_lse only in "
              "training",
        same_dtype=("query", "key", "value")),
    Signature("torch_npu.npu_dynamic_mx_quant", (
        _pos("x", "Tensor", dtypes=HALF), _kw("axis", "int"), _kw("round_mode", "str", choices=("rint",)),
        _kw("dst_type", "dtype", choices=(torch.float8_e4m3fn, torch.float8_e5m2)),
        _kw("block_size", "int", choices=(32,)), _kw("scale_alg", "int", choices=(0,))),
        "https://gitcode.com/Ascend/op-plugin/blob/26.0.0/op_plugin/ops/opapi/DynamicMxQuantKernelNpuOpApi.cpp",
        notes="Ascend 950 only; mxscale is float8_e8m0 of shape [..., ceil(n/64), 2] along `axis`"),
    Signature("torch_npu.npu_dynamic_block_quant", (
        _pos("x", "Tensor", dtypes=HALF), _kw("min_scale", "float"), _kw("round_mode", "str", choices=("rint",)),
        _kw("dst_type", "dtype", choices=(torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)),
        _kw("row_block_size", "int", choices=(1, 128, 256, 512)),
        _kw("col_block_size", "int", choices=(64, 128, 192, 256)), _kw("dst_type_max", "float")),
        _OP_PLUGIN + "torch_npu-npu_dynamic_block_quant.md",
        notes="x 2-D or 3-D; fp8 dst_type on Ascend 950 only (A2/A3: int8, col_block_size 128); scale fp32"),
    Signature("torch_npu.npu_moe_gating_top_k", (
        _pos("x", "Tensor", dtypes=FLOATS), _pos("k", "int", bounds=(1, 2048)), _kw("bias", "Tensor?", dtypes=FLOATS),
        _kw("k_group", "int", bounds=(1, 2048)), _kw("group_count", "int", bounds=(1, 2048)),
        _kw("group_select_mode", "int", choices=(0, 1)), _kw("renorm", "int", choices=(0,)),
        _kw("norm_type", "int", choices=(0, 1)), _kw("out_flag", "bool"), _kw("routed_scaling_factor", "float"),
        _kw("eps", "float")),
        _OP_PLUGIN + "torch_npu-npu_moe_gating_top_k.md", notes="experts (x.shape[-1]) <= 2048",
        same_dtype=("x", "bias")),
    Signature("torch_npu.npu_moe_init_routing_v2", (
        _pos("x", "Tensor", dtypes=(*FLOATS, torch.int8)), _pos("expert_idx", "Tensor", dtypes=(torch.int32,)),
        _kw("scale", "Tensor?", dtypes=(torch.float32,)), _kw("offset", "Tensor?", dtypes=(torch.float32,)),
        _kw("active_num", "int"), _kw("expert_capacity", "int"), _kw("expert_num", "int", bounds=(0, 10240)),
        _kw("drop_pad_mode", "int", choices=(0,)), _kw("expert_tokens_num_type", "int", choices=(1, 2)),
        _kw("expert_tokens_num_flag", "bool", choices=(True,)), _kw("quant_mode", "int", choices=(-1, 1)),
        _kw("active_expert_range", "int[]"), _kw("row_idx_type", "int", choices=(0, 1))),
        _OP_PLUGIN + "torch_npu-npu_moe_init_routing_v2.md"),
    Signature("torch_npu.npu_grouped_matmul", (
        _pos("x", "Tensor[]", dtypes=(*FLOATS, torch.int8)), _pos("weight", "Tensor[]", dtypes=(*FLOATS, torch.int8)),
        _kw("bias", "Tensor[]"), _kw("scale", "Tensor[]"), _kw("offset", "Tensor[]"),
        _kw("antiquant_scale", "Tensor[]"), _kw("antiquant_offset", "Tensor[]"), _kw("per_token_scale", "Tensor[]"),
        _kw("group_list", "Tensor?", dtypes=(torch.int64,)), _kw("activation_input", "Tensor[]"),
        _kw("activation_quant_scale", "Tensor[]"), _kw("activation_quant_offset", "Tensor[]"),
        _kw("split_item", "int", choices=(0, 1, 2, 3)), _kw("group_type", "int", choices=(-1, 0)),
        _kw("group_list_type", "int", choices=(0, 1, 2)), _kw("act_type", "int", bounds=(0, 5)),
        _kw("output_dtype", "dtype"), _kw("tuning_config", "int[]")),
        _OP_PLUGIN + "torch_npu-npu_grouped_matmul.md"),
    Signature("torch_npu.npu_swiglu", (_pos("input", "Tensor", dtypes=FLOATS), _pos("dim", "int", required=False)),
              "https://www.hiascend.com/document/detail/zh/Pytorch/720/apiref/torchnpuCustomsapi/context/"
              "%EF%BC%88beta%EF%BC%89torch_npu-npu_swiglu.md", notes="silu(first half) * second half along dim"),
    Signature("torch_npu.npu_moe_finalize_routing", (
        _pos("expanded_permuted_rows", "Tensor", dtypes=FLOATS), _pos("skip1", "Tensor?"), _pos("skip2", "Tensor?"),
        _pos("bias", "Tensor?"), _pos("scales", "Tensor?", dtypes=FLOATS),
        _pos("expanded_src_to_dst_row", "Tensor", dtypes=(torch.int32,)),
        _pos("export_for_source_row", "Tensor?", dtypes=(torch.int32,)),
        _pos("drop_pad_mode", "int", required=False, choices=(0, 1, 2, 3))),
        _OP_PLUGIN + "torch_npu-npu_moe_finalize_routing.md", same_dtype=("expanded_permuted_rows", "scales")),
    Signature("torch_npu.npu_moe_distribute_dispatch", (
        _pos("x", "Tensor", dtypes=HALF), _pos("expert_ids", "Tensor", dtypes=(torch.int32,)),
        *_MC2_GROUP, _kw("scales", "Tensor?", dtypes=(torch.float32,)), _kw("x_active_mask", "Tensor?"),
        _kw("expert_scales", "Tensor?", dtypes=(torch.float32,)), *_MC2_OPTIONS,
        _kw("quant_mode", "int", choices=(0, 2)), _kw("global_bs", "int", bounds=_I64_MAX),
        _kw("expert_token_nums_type", "int", choices=(0, 1))),
        _OP_PLUGIN + "torch_npu-npu_moe_distribute_dispatch.md",
        notes=_MC2_NOTES + "; returns (expand_x, dynamic_scales, expand_idx [BS·K], expert_token_nums, "
              "ep_recv_counts, tp_recv_counts, expand_scales); expand_idx and ep_recv_counts hold MC2's own "
              "bookkeeping (ep_recv_counts as prefix sums; A2: moe_expert_num + 2·global_bs·K·server_num long) "
              "and are for combine only; expert_scales / expand_scales: A2 only. The _v2 form replaces "
              "expand_idx by assist_info_for_combine [A·128] (" + _OP_PLUGIN
              + "torch_npu-npu_moe_distribute_dispatch_v2.md); this table pins the v1 pair, whose expand_idx "
              "[BS·K] is ascend_dsa::moe_dispatch's"),
    Signature("torch_npu.npu_moe_distribute_combine", (
        _pos("expand_x", "Tensor", dtypes=HALF), _pos("expert_ids", "Tensor", dtypes=(torch.int32,)),
        _pos("expand_idx", "Tensor", dtypes=(torch.int32,)), _pos("ep_send_counts", "Tensor", dtypes=(torch.int32,)),
        _pos("expert_scales", "Tensor", dtypes=(torch.float32,)), *_MC2_GROUP,
        _kw("tp_send_counts", "Tensor?", dtypes=(torch.int32,)), _kw("x_active_mask", "Tensor?"),
        _kw("activation_scale", "Tensor?"), _kw("weight_scale", "Tensor?"), _kw("group_list", "Tensor?"),
        _kw("expand_scales", "Tensor?", dtypes=(torch.float32,)), _kw("shared_expert_x", "Tensor?"),
        *_MC2_OPTIONS, _kw("global_bs", "int", bounds=_I64_MAX), _kw("out_dtype", "int", choices=(0,)),
        _kw("comm_quant_mode", "int", choices=(0, 2)), _kw("group_list_type", "int", choices=(0,))),
        _OP_PLUGIN + "torch_npu-npu_moe_distribute_combine.md",
        notes=_MC2_NOTES + "; returns x [BS,H] in expand_x's dtype; A2 requires expand_scales (dispatch's "
              "output 6, given expert_scales), A3 takes none; group_ep, ep_world_size, moe_expert_num and "
              "global_bs must equal dispatch's"),
    Signature("torch_npu.npu_rms_norm", (
        _pos("self", "Tensor", dtypes=FLOATS), _pos("gamma", "Tensor", dtypes=FLOATS),
        _pos("epsilon", "float", required=False)),
        "https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000860.html",
        same_dtype=("self", "gamma")),
    Signature("torch_npu.npu_add_rms_norm", (
        _pos("x1", "Tensor", dtypes=FLOATS), _pos("x2", "Tensor", dtypes=FLOATS),
        _pos("gamma", "Tensor", dtypes=FLOATS), _pos("epsilon", "float", required=False)),
        "https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ (torch_npu.npu_add_rms_norm)",
        notes="returns (y, rstd, x)", same_dtype=("x1", "x2", "gamma")),
    Signature("torch_npu.npu_rotary_mul", (
        _pos("input", "Tensor", dtypes=FLOATS), _pos("r1", "Tensor", dtypes=FLOATS),
        _pos("r2", "Tensor", dtypes=FLOATS),
        _pos("rotary_mode", "str", required=False, choices=("half", "interleave"))),
        _OP_PLUGIN + "torch_npu-npu_rotary_mul.md (7.3.0)", same_dtype=("input", "r1", "r2"),
        notes="4-D input (BNSD, BSND or SBND), even D < 896; r1/r2 broadcast to input"),
    Signature("torch_npu.npu_format_cast", (_pos("input", "Tensor"), _pos("acl_format", "int", choices=(2, 29))),
              "https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ (torch_npu.npu_format_cast)",
              notes="29 = ACL_FORMAT_FRACTAL_NZ, 2 = ND"),
    Signature("torchair.scope.npu_stream_switch", (
        _pos("stream_tag", "str"), _pos("stream_priority", "int", required=False, choices=(0,))),
        _TORCHAIR + "torchair_00113.html", version=TORCHAIR_VERSION, context_manager=True),
    Signature("torchair.scope.npu_wait_tensor", (_pos("self", "Tensor"), _pos("dependency", "Tensor")),
              _TORCHAIR + "torchair_00114.html", version=TORCHAIR_VERSION, notes="max-autotune mode only"),
    Signature("torchair.scope.super_kernel", (_pos("scope", "str"), _pos("options", "str", required=False)),
              "https://www.hiascend.com/document/detail/zh/Pytorch/710/modthirdparty/torchairuseguide/"
              "torchair_00090.html", version=TORCHAIR_VERSION, context_manager=True,
              notes="static graphs on Atlas A3 only"),
    Signature("torchair.get_npu_backend", (_kw("compiler_config", "CompilerConfig"),
                                           _kw("custom_decompositions", "dict")),
              _TORCHAIR + "torchair_00084.html", version=TORCHAIR_VERSION),
    Signature("torchair.CompilerConfig", (), _TORCHAIR + "torchair_00084.html (CompilerConfig() in its example)",
              version=TORCHAIR_VERSION, notes="config.mode: 'max-autotune' (GE graph, default) or 'reduce-overhead' "
              "(aclgraph capture and replay), " + _TORCHAIR + "torchair_00079.html"),
    Signature("torchair.ops.npu_create_tagged_event", (_pos("tag", "str"),),
              _TORCHAIR_720 + "torchair_00096.html", version=TORCHAIR_VERSION,
              notes="reduce-overhead mode only; a tag may be created once per process"),
    Signature("torchair.ops.npu_tagged_event_record", (_pos("event", "Event"),),
              _TORCHAIR_720 + "torchair_00097.html", version=TORCHAIR_VERSION, notes="reduce-overhead mode only"),
    Signature("torchair.ops.npu_tagged_event_wait", (_pos("event", "Event"),),
              _TORCHAIR_720 + "torchair_00098.html", version=TORCHAIR_VERSION, notes="reduce-overhead mode only"),
    Signature("torch.npu.stream", (_pos("stream", "Stream"),), "torch_npu 7.3.0 torch.npu (mirrors torch.cuda.stream)",
              context_manager=True),
)

SIGNATURES: dict[str, Signature] = {s.name: s for s in _ENTRIES}

NO_COUNTERPART: dict[str, str] = {
    "attn_res": "no torch_npu op for Kimi attention residuals",
    "causal_lengths": "a mask-to-lengths check of this project, not a torch_npu op",
    "dequant_mx": "torch_npu 7.3.0 documents no MX dequant op for A2/A3",
    "dequant_block": "no standalone block dequant op in torch_npu 7.3.0",
}
