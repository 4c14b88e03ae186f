"""What one step of a long-context layer must move and compute, and the roofline floor that follows.

A step's work is counted per operation (`Work`: bytes read from memory, floating-point operations), from the
layer's sizes alone — never from a measurement:
- `weights`: every weight matrix the step uses is read once; each multiplies every token (2 flops a weight a token).
- `indexer`: the lightning indexer reads every visible key (bf16: 2 bytes a dim; the FP8 policy's int8 keys: 1 byte
  a dim and one fp32 scale a key) and scores it against its 64 heads x 128 dims (2 flops each).
- `attention`: DSA reads at most `index_topk` latent + RoPE rows per query (FP8: each with its fp32 scales); dense
  MLA reads every visible row. Each row read costs 2 flops per head and dim for the logits (latent + RoPE) and 2
  per head and latent dim for the probability-weighted sum.
The floor of a step is max(total bytes / bandwidth, total flops / GEMM rate): what the machine cannot beat even
with the memory-bound and the compute-bound parts overlapped. `op_floor_sum` adds the per-operation floors, the
floor of the same work run one operation after another.

A chunked prefill's floor is the sum of its chunks' floors (`prefill_work`: chunk i is `step_work` of its tokens
after the i chunks before it).

The KDA core (`kda_work`) reads its bf16 q, k, v, g and beta once and writes its bf16 outputs; per token and
head its recurrence does three multiply-adds per state element (K x V): k's projection of the decayed state,
the rank-one update and the output's read-out (6·K·V flops; the per-channel decay is folded into them). The
two-pass sequence split (`kda_split_work`) runs each rank's tokens once with V + K value columns (the slice's
transition) and once with V (its outputs), reading the inputs twice.
"""
from __future__ import annotations

from dataclasses import dataclass

from npu_graph.models.config import HybridConfig

KV_TILE = 128


@dataclass(frozen=True)
class Work:
    """Bytes read and flops of one operation (or a whole step)."""

    bytes: float
    flops: float

    def __add__(self, other: Work) -> Work:
        return Work(self.bytes + other.bytes, self.flops + other.flops)

    def floor_s(self, bandwidth: float, gemm_rate: float) -> float:
        """Seconds this work needs at least: bytes at `bandwidth` (bytes/s) or flops at `gemm_rate` (flops/s)."""
        return max(self.bytes / bandwidth, self.flops / gemm_rate)


@dataclass(frozen=True)
class Rates:
    """The machine's measured streaming-read bandwidth (bytes/s) and large-GEMM rate (flops/s)."""

    bandwidth: float
    gemm_rate: float


def cache_row_bytes(config: HybridConfig, fp8: bool) -> dict[str, int]:
    """Stored bytes per token of the latent (with its scales), RoPE key and indexer key (with its scales)."""
    if fp8:
        return {"latent": config.kv_lora_rank + 4 * (config.kv_lora_rank // KV_TILE),
                "k_rope": config.qk_rope_head_dim + 4,
                "index_k": config.index_head_dim + 4}       # per-token int8 with its fp32 scale
    return {"latent": 2 * config.kv_lora_rank, "k_rope": 2 * config.qk_rope_head_dim,
            "index_k": 2 * config.index_head_dim}


def step_work(config: HybridConfig, weight_params: int, index_params: int, context: int, tokens: int,
              sparse: bool, fp8: bool) -> dict[str, Work]:
    """Per-operation work of `tokens` new tokens after `context` cached ones (decode: tokens=1; a verify step:
    2..4; a prefill chunk: its length). `weight_params` counts every weight of the layer, `index_params` those of
    the indexer (dense MLA does not read them)."""
    rows = cache_row_bytes(config, fp8)
    params = weight_params if sparse else weight_params - index_params
    work = {"weights": Work(2.0 * params, 2.0 * params * tokens)}
    visible = [context + t + 1 for t in range(tokens)]
    heads, latent, rope = config.num_heads, config.kv_lora_rank, config.qk_rope_head_dim
    per_row_flops = 2.0 * heads * (latent + rope) + 2.0 * heads * latent
    if sparse:
        index_flops = 2.0 * config.index_n_heads * config.index_head_dim * sum(visible)
        work["indexer"] = Work(rows["index_k"] * (context + tokens), index_flops)
        selected = [min(config.index_topk, v) for v in visible]
        read = min(config.index_topk * tokens, context + tokens)   # rows the queries share are read once
        work["attention"] = Work((rows["latent"] + rows["k_rope"]) * read, per_row_flops * sum(selected))
    else:
        work["attention"] = Work((rows["latent"] + rows["k_rope"]) * (context + tokens), per_row_flops * sum(visible))
    return work


def floors(work: dict[str, Work], rates: Rates) -> tuple[float, float]:
    """(floor of the whole step, sum of the per-operation floors), in seconds."""
    total = sum(work.values(), Work(0.0, 0.0))
    whole = total.floor_s(rates.bandwidth, rates.gemm_rate)
    return whole, sum(w.floor_s(rates.bandwidth, rates.gemm_rate) for w in work.values())


def cache_bytes_read(work: dict[str, Work]) -> float:
    """Bytes of cache a step reads (everything but the weights)."""
    return sum(w.bytes for name, w in work.items() if name != "weights")


def prefill_work(config: HybridConfig, weight_params: int, index_params: int, tokens: int, chunk: int,
                 sparse: bool, fp8: bool) -> list[dict[str, Work]]:
    """Per-chunk work of prefilling `tokens` tokens `chunk` at a time into an empty cache."""
    return [step_work(config, weight_params, index_params, start, min(chunk, tokens - start), sparse, fp8)
            for start in range(0, tokens, chunk)]


def kda_work(tokens: int, heads: int, dim_k: int, dim_v: int) -> Work:
    """Bytes and flops of the KDA core over `tokens` tokens (module docstring)."""
    moved = 2 * tokens * heads * (3 * dim_k + 2 * dim_v + 1)
    return Work(float(moved), 6.0 * dim_k * dim_v * tokens * heads)


def kda_split_work(tokens: int, heads: int, dim_k: int, dim_v: int) -> Work:
    """Work of every rank of the two-pass split together (the exchange and the fold are negligible): the
    transition pass reads its values [v | 0] and keeps no outputs."""
    transition = kda_work(tokens, heads, dim_k, dim_v + dim_k)
    outputs = kda_work(tokens, heads, dim_k, dim_v)
    read_only = Work(transition.bytes - 2.0 * tokens * heads * (dim_v + dim_k), transition.flops)
    return read_only + outputs
