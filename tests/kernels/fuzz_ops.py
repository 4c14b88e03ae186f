"""Fuzzes the fused ops that have native kernels: hypothesis draws shapes, strides, dtypes, index ranges and special
values; each case runs once through the native kernels (at the level ASCEND_DSA_CPU_ISA selects) and once through
the torch path (ASCEND_DSA_NATIVE=0), which must agree: both raise the same kind of clear error, or both return
results within the op's tolerance. Run as a program (tests/kernels/test_fuzz_native.py runs it in a subprocess, so
that a crash or a hang is counted, not suffered): before each case it writes the case to stderr, so the last line
names the case that crashed. Exits 1 on a disagreement, printing it.

    python tests/kernels/fuzz_ops.py --examples 30 [--random]
"""
import argparse
import os
import sys
from collections.abc import Callable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npu_graph  # noqa: F401  (registers the ops)
from npu_graph.kernels.aten import skinny_bmm, skinny_mm

OPS = torch.ops.ascend_dsa
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]
SPECIAL = [*NON_FINITE, 0.0, 1e30, -1e30]
# (DL, DR) of sparse attention that the amx_bf16 level multiplies on tiles (bf16, DL and DL + DR multiples of 32).
TILE_DIMS = [(32, 0), (32, 32), (64, 32)]


def _case(name: str, **params: object) -> None:
    print(f"CASE {name} {params}", file=sys.stderr, flush=True)


def _values(data: st.DataObject, shape: tuple[int, ...], dtype: torch.dtype,
            special: list[float] | bool = True) -> torch.Tensor:
    """Random values, sometimes with a few special values planted, sometimes a strided view of a larger tensor."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), label="seed"))
    wide = data.draw(st.booleans(), label="strided") and len(shape) > 0
    full = (*shape[:-1], shape[-1] * 2 + 1) if wide else shape
    x = torch.randn(full, generator=gen)
    x = x[..., :shape[-1]] if wide else x
    if special and x.numel() and data.draw(st.booleans(), label="special"):
        flat = x.view(-1) if x.is_contiguous() else x.flatten()
        for _ in range(data.draw(st.integers(1, 3))):
            kinds = special if isinstance(special, list) else SPECIAL
            flat[data.draw(st.integers(0, flat.numel() - 1))] = data.draw(st.sampled_from(kinds))
        x = flat.view(shape) if not x.is_contiguous() else x
    return x.to(dtype)


def _both(fn: Callable[[], object]) -> tuple[object, object]:
    """(native result, torch-path result); an exception is the result's class and first line."""
    results = []
    for switch in ("1", "0"):
        os.environ["ASCEND_DSA_NATIVE"] = switch
        try:
            results.append(fn())
        except (ValueError, RuntimeError, IndexError, TypeError) as e:
            results.append((type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
    os.environ["ASCEND_DSA_NATIVE"] = "1"
    return results[0], results[1]


def _close(a: object, b: object, tol: float) -> None:
    if isinstance(a, tuple) and a and isinstance(a[0], str):           # an error on the native side
        assert a == b, f"native raised {a}, the torch path gave {b if isinstance(b, tuple) else 'a result'}"
        return
    assert not (isinstance(b, tuple) and b and isinstance(b[0], str)), f"the torch path raised {b}, native did not"
    for x, y in zip(a if isinstance(a, (tuple, list)) else [a], b if isinstance(b, (tuple, list)) else [b]):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        if x.dtype.is_floating_point:
            scale = 1.0 + y.float().nan_to_num(0, 0, 0).abs().max().item() if y.numel() else 1.0
            torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol * scale, equal_nan=True)
        else:
            assert torch.equal(x, y)


def fuzz_sparse_attention(data: st.DataObject) -> None:
    b, s1, h = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.integers(0, 20))
    dl, dr = data.draw(st.tuples(st.integers(1, 40), st.integers(0, 12)) | st.sampled_from(TILE_DIMS))
    s2 = data.draw(st.integers(1, 120))
    kk, block = data.draw(st.integers(1, 24)), data.draw(st.sampled_from([1, 2, 4, 16, 2 ** 40]))
    dtype, mode = data.draw(st.sampled_from(DTYPES)), data.draw(st.sampled_from([0, 3]))
    paged = data.draw(st.booleans())
    _case("sfa", b=b, s1=s1, h=h, dl=dl, dr=dr, s2=s2, k=kk, block=block, dtype=dtype, mode=mode, paged=paged)
    q, kv = _values(data, (b, s1, h, dl), dtype), _values(data, (b, s2, 1, dl), dtype, special=False)
    qr = _values(data, (b, s1, h, dr), dtype) if dr else None
    kr = _values(data, (b, s2, 1, dr), dtype, special=False) if dr else None
    top = max(1, -(-s2 // min(block, s2)))
    idx = torch.tensor(data.draw(st.lists(st.integers(-1, top + 2) | st.sampled_from([2 ** 60, 2 ** 62]),
                                          min_size=b * s1 * kk, max_size=b * s1 * kk))).view(b, s1, 1, kk)
    table, layout = None, "BSND"
    if paged:
        bs = data.draw(st.integers(1, 8))
        blocks = -(-s2 // bs)
        kv, kr = (None if t is None else t.contiguous().view(b, blocks * bs if s2 % bs == 0 else s2, 1, -1)
                  for t in (kv, kr))
        kv, kr = (None if t is None else torch.nn.functional.pad(t, (0, 0, 0, 0, 0, blocks * bs - s2))
                  .reshape(b * blocks, bs, 1, -1) for t in (kv, kr))
        table, layout = torch.arange(b * blocks, dtype=torch.int32).view(b, blocks), "PA_BSND"
    _close(*_both(lambda: OPS.sparse_flash_attention(q, kv, kv, idx, 0.3, table, query_rope=qr, key_rope=kr,
                                                     sparse_block_size=block, layout_kv=layout, sparse_mode=mode)),
           tol=3e-2 if dtype != torch.float32 else 1e-4)


def fuzz_indexer(data: st.DataObject) -> None:
    b, s1, n1 = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 20))
    d, s2 = data.draw(st.integers(1, 40) | st.sampled_from([32, 64])), data.draw(st.integers(1, 300))
    k = data.draw(st.integers(1, 64))
    dtype, mode = data.draw(st.sampled_from(DTYPES)), data.draw(st.sampled_from([0, 3]))
    _case("indexer", b=b, s1=s1, n1=n1, d=d, s2=s2, k=k, dtype=dtype, mode=mode)
    q, key = _values(data, (b, s1, n1, d), dtype, special=False), _values(data, (b, s2, 1, d), dtype)
    w = _values(data, (b, s1, n1), dtype, special=False)
    native, torch_path = _both(lambda: OPS.lightning_indexer(q, key, w, sparse_count=k, sparse_mode=mode))
    if isinstance(native, tuple) and isinstance(native[0], str):
        return _close(native, torch_path, 0)
    (ni, nv), (ti, tv) = native, torch_path
    torch.testing.assert_close(nv, tv, rtol=1e-4, atol=1e-3 * (1 + tv.nan_to_num(0, 0, 0).abs().max().item()),
                               equal_nan=True)
    assert torch.equal(ni == -1, ti == -1)
    clear = nv.isnan() | (nv > nv.nan_to_num(0, 0, 0).amin(-1, keepdim=True) + 1e-2)   # above any tie at the edge
    for row_n, row_t, keep in zip(ni.flatten(0, 2), ti.flatten(0, 2), clear.flatten(0, 2)):
        if not row_n[keep].isnan().any():
            assert set(row_n[keep].tolist()) <= set(row_t.tolist())


def fuzz_chunk_kda(data: st.DataObject) -> None:
    b, t, h = data.draw(st.integers(1, 2)), data.draw(st.integers(0, 40)), data.draw(st.integers(1, 3))
    dk, dv, dtype = data.draw(st.integers(1, 20)), data.draw(st.integers(0, 20)), data.draw(st.sampled_from(DTYPES))
    with_state = data.draw(st.booleans())
    _case("chunk_kda", b=b, t=t, h=h, dk=dk, dv=dv, dtype=dtype, state=with_state)
    # Non-finite values, not huge finite ones: where intermediates overflow fp32 depends on the algorithm.
    q, k, v = (_values(data, (b, t, h, n), dtype, special=NON_FINITE) for n in (dk, dk, dv))
    g = -_values(data, (b, t, h, dk), torch.float32, special=False).abs().to(dtype)
    beta = _values(data, (b, t, h), torch.float32, special=False).sigmoid().to(dtype)
    s0 = _values(data, (b, h, dk, dv), torch.float32, special=False) if with_state and dv else None
    _close(*_both(lambda: OPS.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)),
           tol=2e-2 if dtype != torch.float32 else 1e-4)


def fuzz_rms_norm(data: st.DataObject) -> None:
    rows, n, dtype = data.draw(st.integers(0, 6)), data.draw(st.integers(1, 700)), data.draw(st.sampled_from(DTYPES))
    _case("rms_norm", rows=rows, n=n, dtype=dtype)
    x, gamma = _values(data, (rows, n), dtype), _values(data, (n,), dtype, special=False)
    _close(*_both(lambda: OPS.rms_norm(x, gamma, 1e-6)), tol=2e-2 if dtype != torch.float32 else 1e-5)


def fuzz_rotary_mul(data: st.DataObject) -> None:
    shape = (*tuple(data.draw(st.integers(1, 4)) for _ in range(3)), 2 * data.draw(st.integers(1, 16)))
    mode = data.draw(st.sampled_from(["half", "interleave"]))
    broadcast = (*tuple(1 if data.draw(st.booleans()) else n for n in shape[:3]), shape[3])
    _case("rotary_mul", shape=shape, broadcast=broadcast, mode=mode)
    x, c, s = _values(data, shape, torch.float32), *(_values(data, broadcast, torch.float32) for _ in range(2))
    _close(*_both(lambda: OPS.rotary_mul(x, c, s, mode)), tol=1e-6)


def fuzz_causal_lengths(data: st.DataObject) -> None:
    b, s1, s2 = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 6)), data.draw(st.integers(0, 40))
    additive, causal, windows = data.draw(st.booleans()), data.draw(st.booleans()), data.draw(st.booleans())
    start = data.draw(st.integers(0, s2))
    _case("causal_lengths", b=b, s1=s1, s2=s2, additive=additive, causal=causal, windows=windows, start=start)
    seen = torch.arange(s2) <= (torch.arange(s1) + max(s2 - s1, 0)).unsqueeze(1)
    mask = (seen & (torch.arange(s2) >= start)).expand(b, s1, s2).clone()
    if not causal and mask.numel():
        mask.view(-1)[data.draw(st.integers(0, mask.numel() - 1))] ^= True
    mask = torch.zeros(mask.shape).masked_fill(~mask, -1e38) if additive else mask
    _close(*_both(lambda: OPS.causal_lengths(mask, additive, windows)), tol=0)


def fuzz_skinny_mm(data: st.DataObject) -> None:
    m, k, n = data.draw(st.integers(0, 6)), data.draw(st.integers(0, 70)), data.draw(st.integers(0, 70))
    k_w, transposed = k + data.draw(st.sampled_from([0, 0, 0, 1, -1])), data.draw(st.booleans())
    _case("skinny_mm", m=m, k=k, n=n, k_w=k_w, transposed=transposed)
    if k_w < 0:
        return
    x = _values(data, (m, k), torch.float32)
    w = _values(data, (n, k_w) if transposed else (k_w, n), torch.float32)
    _close(*_both(lambda: skinny_mm.linear(x, w) if transposed else skinny_mm.mm(x, w)), tol=1e-4)


def fuzz_skinny_bf16(data: st.DataObject) -> None:
    """bf16 mm (batch 0) and bmm, the weight row-major or the transposed view of a stored [N, K] one (which
    skinny_mm.linear takes as stored)."""
    batch, m, k, n = (data.draw(st.integers(0, 3)), data.draw(st.integers(0, 6)), data.draw(st.integers(0, 70)),
                      data.draw(st.integers(0, 70)))
    transposed = data.draw(st.booleans())
    _case("skinny_bf16", batch=batch, m=m, k=k, n=n, transposed=transposed)
    lead = (batch,) if batch else ()
    x = _values(data, (*lead, m, k), torch.bfloat16)
    w = _values(data, (*lead, n, k) if transposed else (*lead, k, n), torch.bfloat16)
    if transposed and not batch and data.draw(st.booleans(), label="linear"):
        _close(*_both(lambda: skinny_mm.linear(x, w)), tol=1e-2)
        return
    w = w.transpose(-1, -2) if transposed else w
    _close(*_both(lambda: skinny_bmm.bmm(x, w) if batch else skinny_mm.mm(x, w)), tol=1e-2)


FUZZERS = [fuzz_sparse_attention, fuzz_indexer, fuzz_chunk_kda, fuzz_rms_norm, fuzz_rotary_mul, fuzz_causal_lengths,
           fuzz_skinny_mm, fuzz_skinny_bf16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=30, help="cases per op")
    parser.add_argument("--random", action="store_true", help="new random cases (default: derandomized, repeatable)")
    args = parser.parse_args()
    config = settings(max_examples=args.examples, deadline=None, database=None, derandomize=not args.random,
                      suppress_health_check=list(HealthCheck), print_blob=True)
    for fuzzer in FUZZERS:
        config(given(st.data())(fuzzer))()
        print(f"ok {fuzzer.__name__} {args.examples} cases", flush=True)


if __name__ == "__main__":
    main()
