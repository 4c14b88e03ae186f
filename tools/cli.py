"""The `ascend-dsa` command line (also `python -m npu_graph`): demo, bench, train, inspect and cache.

Building the parser imports neither torch nor the compiler (`ascend-dsa --help` answers at once); each
command imports what it needs when it runs.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from npu_graph.tools import inspect_cli, train_cli
from npu_graph.tools.cache_cli import add_cache_parser, run_cache_command
from npu_graph.tools.units import positive_int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ascend-dsa", description="ascend_dsa torch.compile backend tools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile the reference model on CPU and show what the compiler did")
    demo.add_argument("--config", default="stdlib", help="reference model config: stdlib (the trained "
                      "checkpoint, with text), tiny, small, ctx16k (random weights)")
    demo.add_argument("--random-weights", action="store_true", help="run --config stdlib untrained")
    demo.add_argument("--prompt-len", type=positive_int, default=None,
                      help="prefill length (default: half the model's context, at most 512)")
    demo.add_argument("--steps", type=positive_int, default=16, help="decode steps")
    demo.add_argument("--dump-dir", default=None, help="dump folder (default: a new temporary folder)")
    demo.add_argument("--json", action="store_true", help="print the results as JSON")
    demo.add_argument("--no-cache", action="store_true", help="do not use the on-disk compile cache")
    bench = sub.add_parser("bench", help="benchmarks measured side by side (ours vs eager vs Inductor)")
    bench.add_argument("suite", help="suite name: e2e, kernels, cache, cp, quant, generate "
                       "(transformers generate(): prefill ms, decode tokens/s, cold first call, recompiles), spec "
                       "(speculative vs plain greedy decoding of the reference model, k = 1..4), ep (MoE expert "
                       "parallelism: bytes per token, per-rank load, per-rank expert memory, one MoE layer at EP=2 "
                       "vs one process on two gloo ranks), fleet (4 ranks under torchrun, 2 simulated nodes, cold "
                       "on one shared compile cache vs one rank alone: first-output seconds, compile CPU-seconds, "
                       "outputs equal), fusion (per fusion family: spellings drawn, fused, exact; the indexer and "
                       "rotary fused beside Inductor at S=2048), context (one DeepSeek-V3.2-sized layer's decode "
                       "cost from 4K to 128K tokens: dense MLA and DSA, eager, Inductor, ascend_dsa, against the "
                       "roofline floor), serve (vLLM's default compile vs ascend_dsa as its compile backend; in the "
                       "environment tools/vllm_env.sh builds)")
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--repeat", type=positive_int, default=None, help="timed rounds per case")
    bench.add_argument("--spellings", type=positive_int, default=12,
                       help="fusion only: spellings drawn per family (each compiled static and dynamic)")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, for a fast look")
    bench.add_argument("--busy", action="store_true",
                       help="generate only: keep one core busy in a separate process while measuring")
    bench.add_argument("--cold", action="store_true",
                       help="generate only: also each compiled backend's first generate() in a fresh process with "
                            "empty compile caches, then warm (the caches it left); fleet: the native kernels' "
                            "build folder starts empty too")
    bench.add_argument("--isa", default=None, metavar="LEVEL",
                       help="run the native kernels at this instruction-set level (generic, avx2, avx512, "
                            "avx512_bf16, amx_bf16; default: the best this CPU has), as ASCEND_DSA_CPU_ISA does")
    bench.add_argument("--context", type=positive_int, default=None,
                       help="spec only: tokens of context, prompt and new tokens (default 4096; 256 with --quick)")
    bench.add_argument("--wide", type=positive_int, default=None, metavar="UNITS",
                       help="spec only: widen each decoder layer's MLP to UNITS by zero units (the same function, "
                            "large weights: a weight-bound step, as at real size)")
    bench.add_argument("--random-weights", action="store_true",
                       help="quant only: measure accuracy on the untrained model instead of the trained checkpoint")
    bench.add_argument("--plot", default=None, metavar="FILE",
                       help="context only: write ms/token against context for every row, and the floor, as SVG")
    bench.add_argument("--toy", action="store_true", help=argparse.SUPPRESS)     # context: tiny sizes, for tests
    bench.add_argument("--rows", default=None, metavar="ROW,...",
                       help="context only: time only these rows (ascend_dsa brings its verify rows)")
    bench.add_argument("--contexts", default=None, metavar="TOKENS,...",
                       help="context only: time only these contexts, e.g. 4096,131072")
    train_cli.add_parser(sub)
    inspect_cli.add_parser(sub)
    add_cache_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(inspect_cli.default_view(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=os.environ.get("ASCEND_DSA_LOG_LEVEL", "WARNING").upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "cache":
        return run_cache_command(args)
    if args.command == "demo":
        from npu_graph.tools.demo import run_demo

        return run_demo(args)
    if args.command == "inspect":
        return inspect_cli.run_inspect(args)
    if args.command == "train":
        return train_cli.run_train(args)
    from npu_graph.tools.bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
