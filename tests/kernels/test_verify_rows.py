"""A speculative verify step's sparse attention as the compiled DSA model calls it: the T new tokens of each sequence
folded into the batch (B·T rows of one token, each sequence's block table repeated, each row's own position bounding
its keys), through the native kernel at every instruction-set level and through the torch path, against the
fp32 reference of the same call and of the unfolded causal call (T query rows per sequence, bottom-right aligned)."""
import pytest
import torch
from native_paths import native_and_torch

from npu_graph.kernels.sparse_attention import sparse_flash_attention as sfa

OP = torch.ops.ascend_dsa.sparse_flash_attention
REFERENCE = sfa.reference_sparse_flash_attention
B, T, H, C, R, K, BLOCK, BLOCKS = 2, 4, 8, 64, 16, 24, 16, 6
LENGTHS = (9, 70)            # cached tokens before the step: fewer than K visible in the first sequence

path = native_and_torch(sfa.NATIVE_SOURCE)


def verify_inputs(dtype: torch.dtype, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    table = torch.randperm(B * BLOCKS, generator=generator).view(B, BLOCKS).to(torch.int32)
    latent = torch.randn(B * BLOCKS, BLOCK, 1, C, generator=generator).to(dtype)
    rope = torch.randn(B * BLOCKS, BLOCK, 1, R, generator=generator).to(dtype)
    positions = torch.tensor(LENGTHS).unsqueeze(1) + torch.arange(T)                     # [B, T]
    picks = torch.stack([torch.randperm(max(LENGTHS[b] + T, K), generator=generator)[:K]
                         for b in range(B) for _ in range(T)])
    picks = picks.view(B, T, K).to(torch.int32)              # some past a token's position: masked for it
    picks[0, :, -3:] = -1                                    # padding, as the indexer leaves it
    q = torch.randn(B, T, H, C, generator=generator).to(dtype)
    qr = torch.randn(B, T, H, R, generator=generator).to(dtype)
    return {"table": table, "latent": latent, "rope": rope, "positions": positions, "picks": picks, "q": q, "qr": qr}


def folded_call(op, x: dict) -> torch.Tensor:
    table = x["table"].unsqueeze(1).expand(B, T, BLOCKS).reshape(B * T, BLOCKS)
    lengths = (x["positions"].reshape(B * T) + 1).to(torch.int32)
    out = op(x["q"].reshape(B * T, 1, H, C), x["latent"], x["latent"], x["picks"].reshape(B * T, 1, 1, K), 0.125,
             table, None, lengths, x["qr"].reshape(B * T, 1, H, R), x["rope"], layout_kv="PA_BSND", sparse_mode=3)
    return out[0].view(B, T, H, C)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_tokens_equal_the_reference(dtype, path):
    x = verify_inputs(dtype)
    got = folded_call(OP, x)
    want = folded_call(REFERENCE, x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_folding_equals_the_causal_rows_of_each_sequence(path):
    x = verify_inputs(torch.float32, seed=1)
    lengths = (x["positions"][:, -1] + 1).to(torch.int32)
    rows = REFERENCE(x["q"], x["latent"], x["latent"], x["picks"].unsqueeze(2), 0.125, x["table"], None, lengths,
                     x["qr"], x["rope"], layout_kv="PA_BSND", sparse_mode=3)[0]
    torch.testing.assert_close(folded_call(OP, x), rows, rtol=1e-5, atol=1e-5)
