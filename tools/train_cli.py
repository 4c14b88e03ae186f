"""`ascend-dsa train`: train the reference model on the stdlib's bytes (npu_graph.training) and save the
checkpoint that `demo` and `bench quant` use; with `--config stdlib-mtp`, the model and its multi-token-prediction
head trained together (the MTP loss reported beside the main loss), the checkpoint `bench spec` uses."""
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
    train.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP loss when the config has "
                       "an MTP head, e.g. --config stdlib-mtp, trained with the model (default: 0.3, DeepSeek-V3's)")


def run_train(args: argparse.Namespace) -> int:
    from npu_graph.models.hybrid import CONFIGS
    from npu_graph.training.loop import TrainSettings, train

    if args.config not in CONFIGS:
        print(f"ascend-dsa train: unknown config {args.config!r}; use one of {sorted(CONFIGS)}", file=sys.stderr)
        return 2
    if not args.minutes > 0:
        print(f"ascend-dsa train: --minutes must be positive, got {args.minutes}", file=sys.stderr)
        return 2
    if args.mtp_weight < 0:
        print(f"ascend-dsa train: --mtp-weight must be >= 0, got {args.mtp_weight}", file=sys.stderr)
        return 2
    settings = TrainSettings(config=args.config, seed=args.seed, minutes=args.minutes, max_steps=args.steps,
                             batch=args.batch, seq_len=args.seq_len, mtp_weight=args.mtp_weight)
    record = train(settings, out=args.out)
    if args.json:
        print(json.dumps(record, indent=1))
        return 0
    mtp = (f" (MTP head: {record['heldout_mtp_bits_per_byte']:.3f} bits per byte two ahead, top-1 "
           f"{record['heldout_mtp_top1']:.2f})" if "heldout_mtp_top1" in record else "")
    print(f"trained {record['steps']} steps in {record['seconds']:.0f} s: held-out "
          f"{record['heldout_bits_per_byte']:.3f} bits per byte{mtp}; checkpoint {record['path']} "
          f"(loss curve: loss.svg)")
    return 0
