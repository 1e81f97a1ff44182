#!/usr/bin/env bash
# The GPU check of issue 11: on one CUDA machine, in under 10 minutes,
#   1. install the `cuda` extra (flash-attn) when it is missing,
#   2. run the tests marked `cuda` (decode fast path = varlen path, flash = SDPA in bf16, ...),
#   3. run the generation benchmark in bf16: every system whose name starts with "rollout" (read from
#      `rollout-bench --help`, so columns added later are included) and hf-static, then hf-cb (transformers'
#      generate_batch) with its compile level 3 and CUDA graphs, in a second run of its own,
#   4. write $OUT/gpu_check.json: the machine, the test counts and failures, the benchmark's tokens/s and
#      ratios (each rollout system over hf-static and over hf-cb).
# Usage, from anywhere:  bash scripts/gpu_check.sh      (OUT=dir to choose the output folder)
#
# Time: the stages share GPU_CHECK_BUDGET_S (570 s); each has a cap (GPU_CHECK_{INSTALL,TESTS,BENCH,HFCB}_S)
# and gets no more than the budget has left. A stage that runs out is recorded as timed out; what it wrote
# so far (the benchmark writes its JSON after each workload) is kept. Nothing but pip is fetched: flash-attn
# comes as a wheel from pip's cache or GPU_CHECK_FLASH_ATTN_WHEEL=path, else pip builds it from source,
# which takes longer than the 120 s cap (15-30 min on 16 cores): run once with GPU_CHECK_INSTALL_S=2400
# to build and cache it. Without flash-attn the flash tests skip with their reason and SDPA is measured.
# Without a CUDA device (a dry run) the tests skip and the benchmark is skipped, with a message.
# Where the machine has no copy of the model (no network, files limited in size), GPU_CHECK_SHAPES=dir names a
# folder with the model's config and tokenizer only (`python scripts/random_weights.py --export-shapes --out dir`):
# the benchmark then runs a model of those shapes with random weights (scripts/random_weights.py says what that
# measures and what it does not). GPU_CHECK_SYSTEMS="a b" picks the benchmark's rollout systems (default: every
# rollout* system but rollout-mkl, and hf-static); GPU_CHECK_HFCB_OPTIONS="k=v ..." hf-cb's options.
# The tests run from the files that hold tests marked `cuda` (so a test module needing a package the GPU machine
# lacks, e.g. the server's, is not collected); GPU_CHECK_TEST_PATHS overrides the list.
# Exit status: that of the cuda tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
rm -f "$OUT"/bench_rollout.json "$OUT"/bench_hf_cb.json "$OUT"/cuda_tests.xml "$OUT"/stages.jsonl
START=$(date +%s)
BUDGET_S="${GPU_CHECK_BUDGET_S:-570}"
SUMMARY_RESERVE_S=15

# stage_timeout CAP: CAP, or less when the budget has less left (after the summary's reserve); 0: no time.
stage_timeout() {
    local left=$((START + BUDGET_S - SUMMARY_RESERVE_S - $(date +%s)))
    if ((left < 10)); then echo 0; elif ((left < $1)); then echo "$left"; else echo "$1"; fi
}
# record NAME STATUS SECONDS [NOTE]: one line per stage for the summary.
record() {
    python -c 'import json, sys; print(json.dumps(dict(zip(["stage", "status", "seconds", "note"], sys.argv[1:]))))' \
        "$1" "$2" "$3" "${4:-}" >> "$OUT/stages.jsonl"
}
# run_stage NAME CAP LOG COMMAND...: run under the stage's timeout, log to LOG, record how it ended.
run_stage() {
    local name=$1 cap=$2 log=$3
    shift 3
    local t rc began=$(date +%s)
    t=$(stage_timeout "$cap")
    if ((t == 0)); then
        echo "[$name] skipped: the ${BUDGET_S}s budget is spent"
        record "$name" skipped 0 "budget spent"
        return 125
    fi
    echo "[$name] up to ${t}s: $*"
    # -k: a stage that ignores SIGTERM (a test blocked in a CUDA call or a thread join) is killed 10 s later.
    timeout -k 10 "$t" "$@" > "$log" 2>&1
    rc=$?
    local status=ok
    if ((rc == 124)); then status="timed out after ${t}s"; elif ((rc != 0)); then status="exit $rc"; fi
    echo "[$name] $status ($(($(date +%s) - began))s; log: $log)"
    record "$name" "$status" $(($(date +%s) - began)) "$log"
    return "$rc"
}

HAS_CUDA=0
python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" && HAS_CUDA=1

# 1. What the project needs to run its tests (non-editable: the checkout itself is what runs, from its root).
if ! python -c "import rollout, pytest, pytest_timeout" 2> /dev/null; then
    python - > "$OUT/requirements.txt" << 'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
PY
    run_stage install-test-deps 180 "$OUT/test_deps_install.log" python -m pip install -q -r "$OUT/requirements.txt"
fi
if ((HAS_CUDA)) && ! python -c "import flash_attn" 2> /dev/null; then
    if [[ -n "${GPU_CHECK_FLASH_ATTN_WHEEL:-}" ]]; then
        cuda_reqs=("$GPU_CHECK_FLASH_ATTN_WHEEL")
    else
        mapfile -t cuda_reqs < <(python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["cuda"]))')
    fi
    # A source build (no wheel cached) compiles only for this GPU's architecture, on every core.
    arch=$(python -c "import torch; print(''.join(map(str, torch.cuda.get_device_capability())))")
    MAX_JOBS="${MAX_JOBS:-$(nproc)}" FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS:-$arch}" \
        run_stage install-flash-attn "${GPU_CHECK_INSTALL_S:-120}" "$OUT/flash_install.log" \
        python -m pip install --no-build-isolation "${cuda_reqs[@]}" \
        || echo "flash-attn not installed (see $OUT/flash_install.log): the flash tests skip, the benchmark runs SDPA"
fi

timeout -k 5 120 python - > "$OUT/env.json" << 'PY'
import json, platform, torch, transformers
info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
try:
    import flash_attn
    info["flash_attn"] = flash_attn.__version__
except Exception as e:  # noqa: BLE001 - any failure means "not usable"
    info["flash_attn"] = None
    info["flash_attn_import_error"] = f"{type(e).__name__}: {e}"[:300]
if torch.cuda.is_available():
    from rollout.engine.attention.flash import flash_support
    gpu = torch.device("cuda", 0)
    info["gpu"] = torch.cuda.get_device_name(gpu)
    info["capability"] = list(torch.cuda.get_device_capability(gpu))
    # What the benchmark's engine will run: SmolLM2-135M (head dim 64) in bf16 with 256-token pages.
    info["rollout_flash_unsupported_reason"] = flash_support([gpu], torch.bfloat16, 64, 256)
print(json.dumps(info))
PY
cat "$OUT/env.json"

# 2. The cuda tests (on a CPU machine they are collected and skipped: the dry run).
read -r -a TEST_PATHS <<< "${GPU_CHECK_TEST_PATHS:-$(grep -l 'pytest.mark.cuda' tests/test_*.py | tr '\n' ' ')}"
run_stage cuda-tests "${GPU_CHECK_TESTS_S:-200}" "$OUT/cuda_tests.log" \
    python -m pytest -q -m cuda -rs -p no:cacheprovider --continue-on-collection-errors -v --timeout "${GPU_CHECK_TEST_TIMEOUT_S:-90}" --timeout-method thread --junitxml "$OUT/cuda_tests.xml" "${TEST_PATHS[@]}"
TESTS_RC=$?
tail -n 15 "$OUT/cuda_tests.log"

# 3. The benchmark, bf16. The systems are whatever this checkout's benchmark offers.
read -r -a ALL_SYSTEMS < <(timeout -k 5 120 python - << 'PY'
import re, subprocess, sys
text = subprocess.run([sys.executable, "-m", "benchmarks.generation", "--help"],
                      capture_output=True, text=True).stdout
match = re.search(r"--systems \{([^}]*)\}", text)
print(" ".join(match.group(1).split(",")) if match else "")
PY
)
ROLLOUT_SYSTEMS=()
if [[ -n "${GPU_CHECK_SYSTEMS:-}" ]]; then
    read -r -a ROLLOUT_SYSTEMS <<< "$GPU_CHECK_SYSTEMS"
else
    for s in "${ALL_SYSTEMS[@]}"; do
        # rollout-mkl differs from rollout only on CPU (oneDNN linear layers): not worth GPU seconds.
        if [[ ($s == rollout* && $s != rollout-mkl) || $s == hf-static ]]; then ROLLOUT_SYSTEMS+=("$s"); fi
    done
fi
MODEL_ARGS=()
if [[ -n "${GPU_CHECK_SHAPES:-}" ]] && ((HAS_CUDA)); then
    timeout -k 5 180 python scripts/random_weights.py --shapes-of "$GPU_CHECK_SHAPES" --out "${TMPDIR:-/tmp}/rollout_random_model" \
        && MODEL_ARGS=(--model "${TMPDIR:-/tmp}/rollout_random_model") && record random-weights ok 0 "shapes of $GPU_CHECK_SHAPES"
fi
BENCH=(python -m benchmarks.generation --device cuda --dtype bfloat16 --workload gsm8k-greedy gsm8k-grpo
    "${MODEL_ARGS[@]}")
HF_CB_OPTIONS=()
for option in ${GPU_CHECK_HFCB_OPTIONS:-default_compile_level=3 use_cuda_graph=true}; do
    HF_CB_OPTIONS+=(--hf-cb-option "$option")
done
if ((!HAS_CUDA)); then
    echo "[bench] skipped: no CUDA device (a dry run); it would run: ${ROLLOUT_SYSTEMS[*]}, then hf-cb ${HF_CB_OPTIONS[*]}"
    record bench skipped 0 "no CUDA device"
elif ((${#ROLLOUT_SYSTEMS[@]} == 0)); then
    echo "[bench] skipped: no rollout system found in the benchmark's --help"
    record bench skipped 0 "no systems in --help"
else
    run_stage bench-rollout "${GPU_CHECK_BENCH_S:-150}" "$OUT/bench_rollout.log" \
        "${BENCH[@]}" --systems "${ROLLOUT_SYSTEMS[@]}" --json "$OUT/bench_rollout.json"
    if [[ " ${ALL_SYSTEMS[*]} " == *" hf-cb "* ]]; then
        run_stage bench-hf-cb "${GPU_CHECK_HFCB_S:-150}" "$OUT/bench_hf_cb.log" \
            "${BENCH[@]}" --systems hf-cb --decode-batch-size 0 "${HF_CB_OPTIONS[@]}" --json "$OUT/bench_hf_cb.json"
    fi
fi

# 4. One JSON.
python - "$OUT" "$TESTS_RC" "$START" "$BUDGET_S" "${ROLLOUT_SYSTEMS[*]}" << 'PY'
import json, subprocess, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, tests_rc, start, budget, systems = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout
summary = {
    "commit": git + ("+changes" if dirty.strip() else ""),
    "seconds": round(time.time() - start),
    "budget_s": budget,
    "env": json.loads((out / "env.json").read_text()),
    "stages": [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
    if (out / "stages.jsonl").exists() else [],
    "cuda_tests": {"exit_code": tests_rc},
}
xml = out / "cuda_tests.xml"
if xml.exists():
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    summary["cuda_tests"].update(counts)
    cases = list(suite.iter("testcase"))
    name = lambda c: f"{c.get('classname')}::{c.get('name')}"  # noqa: E731
    summary["cuda_tests"]["failed"] = [name(c) for c in cases if c.find("failure") is not None or c.find("error") is not None]
    reasons = {}
    for c in cases:
        if (s := c.find("skipped")) is not None:
            reasons[s.get("message", "")] = reasons.get(s.get("message", ""), 0) + 1
    summary["cuda_tests"]["skip_reasons"] = reasons

bench = {"rollout_systems": systems.split(), "workloads": {}}
for label in ("bench_rollout", "bench_hf_cb"):
    path = out / f"{label}.json"
    if not path.exists():
        continue
    report = json.loads(path.read_text())
    bench.setdefault("model", report.get("model"))
    for wname, w in report.get("workloads", {}).items():
        row = bench["workloads"].setdefault(wname, {"tokens_per_s": {}, "greedy_match": {}, "hf_cb_options": None})
        for sname, s in w.get("systems", {}).items():
            row["tokens_per_s"][sname] = s.get("tokens_per_s")
            if sname == "hf-cb":
                row["hf_cb_options"] = s.get("hf_cb_options")
        row["greedy_match"].update(w.get("greedy_match", {}))
        if w.get("decode_step"):
            row["decode_step"] = w["decode_step"]
for row in bench["workloads"].values():
    tps = row["tokens_per_s"]
    row["ratios"] = {
        f"{a}/{b}": tps[a] / tps[b]
        for a in tps if a.startswith("rollout")
        for b in ("hf-static", "hf-cb") if b in tps and tps[a] and tps[b]
    }
summary["bench"] = bench
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({k: summary[k] for k in ("commit", "seconds", "cuda_tests")}, indent=2))
for wname, row in bench["workloads"].items():
    print(wname, "ratios:", ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items()) or "none")
print(f"wrote {out / 'gpu_check.json'}")
PY
exit "$TESTS_RC"
