#!/usr/bin/env bash
# The GPU check: the tests marked `cuda` and the generation benchmark in bf16, on one CUDA machine,
# in well under 10 minutes; everything lands in $OUT (default: gpu_check_out/) with gpu_check.json
# summarising it. Run from anywhere:  bash scripts/gpu_check.sh
#
# The cuda extra (flash-attn) is installed when pip can reach an index; without it the flash tests
# skip with their reason and the SDPA path is checked. Exit status: that of the cuda tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
START=$(date +%s)

python - <<'PY' > "$OUT/env.json"
import json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["capability"] = list(torch.cuda.get_device_capability(0))
try:
    import flash_attn
    info["flash_attn"] = flash_attn.__version__
except ImportError:
    info["flash_attn"] = None
print(json.dumps(info))
PY
cat "$OUT/env.json"

python -c "import transformers, accelerate, pytest" 2>/dev/null || timeout 300 python -m pip install -q -e ".[test]" || true
if python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    python -c "import flash_attn" 2>/dev/null || timeout 300 python -m pip install -q --no-build-isolation -e ".[cuda]" \
        > "$OUT/flash_install.log" 2>&1 || echo "flash-attn not installed (see $OUT/flash_install.log)"
else
    echo "no CUDA device: the cuda tests will skip and the benchmark will fail; this run only checks the script"
fi

timeout 360 python -m pytest -q -m cuda -rs --junitxml "$OUT/cuda_tests.xml" tests 2>&1 | tee "$OUT/cuda_tests.log"
TESTS_RC=${PIPESTATUS[0]}

timeout 240 python -m rollout.benchmarks.generation --device cuda --dtype bfloat16 \
    --workload gsm8k-greedy gsm8k-grpo --systems rollout rollout-async hf-static --json "$OUT/bench.json" \
    > "$OUT/bench.log" 2>&1 || echo "benchmark failed (see $OUT/bench.log)"

python - "$OUT" "$TESTS_RC" "$START" <<'PY'
import json, subprocess, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path
out, rc, start = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
summary = {"env": json.loads((out / "env.json").read_text()), "cuda_tests_exit_code": rc,
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "seconds": round(time.time() - start)}
if (out / "cuda_tests.xml").exists():
    suite = ET.parse(out / "cuda_tests.xml").getroot().find("testsuite")
    summary["cuda_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None]
if (out / "bench.json").exists():
    summary["bench"] = json.loads((out / "bench.json").read_text()).get("workloads")
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({k: v for k, v in summary.items() if k != "bench"}, indent=2))
PY
exit "$TESTS_RC"
