"""`ascend-dsa train`: train the reference model on the stdlib's bytes (npu_graph.training) and save the
checkpoint that `demo` and `bench quant` use."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from npu_graph.tools.units import positive_int


def add_parser(sub: Any) -> None:
    train = sub.add_parser("train", help="train the reference model on the Python standard library's sources",
                           description=__doc__)
    train.add_argument("--config", default="stdlib", help="HybridConfig name (default: stdlib)")
    train.add_argument("--minutes", type=float, default=10.0, help="time budget (default: 10)")
    train.add_argument("--steps", type=positive_int, default=None, help="train exactly this many steps instead "
                       "(reproducible for a seed)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--batch", type=positive_int, default=8, help="sequences per step (default: 8)")
    train.add_argument("--seq-len", type=positive_int, default=256, help="bytes per sequence (default: 256)")
    train.add_argument("--out", default=None, help="checkpoint folder (default: under the cache directory, "
                       "ASCEND_DSA_CACHE_DIR)")
    train.add_argument("--json", action="store_true", help="print the training record as JSON")
    train.add_argument("--mtp-minutes", type=float, default=0.0, help="then train an MTP head (speculative "
                       "decoding's draft head) on the frozen model for this many minutes, saved beside it as "
                       "<checkpoint>-mtp (default: 0, none)")


def run_train(args: argparse.Namespace) -> int:
    from npu_graph.models.hybrid import CONFIGS
    from npu_graph.training.loop import TrainSettings, train

    if args.config not in CONFIGS:
        print(f"ascend-dsa train: unknown config {args.config!r}; use one of {sorted(CONFIGS)}", file=sys.stderr)
        return 2
    if not args.minutes > 0:
        print(f"ascend-dsa train: --minutes must be positive, got {args.minutes}", file=sys.stderr)
        return 2
    settings = TrainSettings(config=args.config, seed=args.seed, minutes=args.minutes, max_steps=args.steps,
                             batch=args.batch, seq_len=args.seq_len)
    record = train(settings, out=args.out)
    if args.mtp_minutes > 0:
        record["mtp"] = _train_mtp(args, record["path"])
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        print(f"trained {record['steps']} steps in {record['seconds']:.0f} s: held-out "
              f"{record['heldout_bits_per_byte']:.3f} bits per byte; checkpoint {record['path']} "
              f"(loss curve: loss.svg)")
        if "mtp" in record:
            mtp = record["mtp"]
            print(f"MTP head: {mtp['steps']} steps, held-out {mtp['heldout_mtp_bits_per_byte']:.3f} bits per byte "
                  f"two ahead (top-1 {mtp['heldout_mtp_top1']:.2f}); {mtp['path']}")
    return 0


def _train_mtp(args: argparse.Namespace, main_path: str) -> dict[str, Any]:
    """Train the MTP head of the checkpoint just saved; its folder is the main one's + "-mtp"."""
    from pathlib import Path

    from npu_graph.models.hybrid import HybridLM
    from npu_graph.training.mtp_head import base_digest, train_mtp_head, with_mtp_head

    out = Path(main_path).with_name(Path(main_path).name + "-mtp")
    model = with_mtp_head(HybridLM.from_pretrained(main_path))
    record = train_mtp_head(model, args.mtp_minutes, out, args.seed,
                            extra={"base_record_sha256": base_digest(Path(main_path))})
    return {**record, "path": str(out)}
