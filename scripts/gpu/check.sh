#!/usr/bin/env bash
# The GPU check in one command, on a CUDA machine, from the repository root (about 9 minutes at most):
#
#     bash scripts/gpu/check.sh
#
# 1. installs the wheels from .whl/ (scripts/gpu/prepare_wheels.sh; skipped when there is no .whl/,
#    e.g. on a cluster node where `pip install -e .` already ran) into /tmp/site, on PYTHONPATH;
# 2. records the machine: nvidia-smi, torch / CUDA / cuDNN / transformers versions;
# 3. runs every gpu-marked test (pytest -m gpu, which replaces pyproject's `-m 'not slow'`);
# 4. runs scripts/bench/bench_gpu_vs_hf.py (this project vs transformers on the 1.88B shape) with
#    whatever time is left, and writes its table to gpu_bench.md.
# Results go to $OUT when it is set (the device tool brings that folder back), else to
# scripts/gpu/results/. Each part has its own time limit; a failed part does not stop the next, and
# the exit status is non-zero if any part failed. Environment knobs: PYTHON (interpreter, default
# python3), GPU_CHECK_BUDGET_S (total seconds, default 540: the device tool allows 600 a call),
# GPU_TESTS_TIMEOUT_S (default 360 beside the benchmark, else all the budget left), BENCH_ARGS (extra
# arguments for the benchmark, e.g. "--rounds 1"), GPU_CHECK_PARTS (default
# "tests,bench"; "memory" runs scripts/bench/bench_gpu_memory.py instead: measured peak memory against
# the planner's prediction for several plans as rank 0 of a pretend world of 8, into gpu_memory.md, with
# MEMORY_ARGS passed on, e.g. "--compile off,on" for compiled blocks too; "predict" runs train.py on the
# benchmark's shape for the planner's one-GPU recheck (predicted against measured step time and peak
# memory), with PREDICT_ARGS as extra overrides; "fused" runs scripts/bench/bench_fused.py --device cuda (each
# fused op against its eager reference on the GPU: the measurement model.fused=auto has on CPU only),
# into gpu_fused.md, with FUSED_ARGS passed on (default "--variants eager,fused --no-model"), after the
# benchmark, which leaves it FUSED_RESERVE_S (default 150); "kernels" runs
# scripts/bench/bench_engine_kernels.py (amsp.fuse_wgrad's GEMM and amsp.optimizer_kernel=csrc's AdamW op
# by op, into gpu_kernels.md) after the tests. One device call brings back at most 8 files: with
# several parts, send $OUT elsewhere and pack it, e.g.
#     R=/tmp/res; mkdir -p $R; OUT=$R GPU_CHECK_PARTS=predict,memory,bench bash scripts/gpu/check.sh
#     tar czf $OUT/r.tgz -C $R .
# ).
#
# Time on a fresh machine: the gpu tests build the CPU extension (g++) and the CUDA kernels (nvcc) on first
# use, prepare the built-in corpus, and start five train.py processes (two compile their blocks), so
# they get 360 s where the benchmark follows (which then has at least ~130 s: enough for a partial
# table; GPU_CHECK_PARTS=bench in a call of its own gives it the whole budget), and the whole budget with
# GPU_CHECK_PARTS=tests.
set -u -o pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
RESULTS=${OUT:-scripts/gpu/results}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT_S:-}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
START=$SECONDS
SUMMARY=()
FAILED=0

# run_part NAME TIMEOUT_S COMMAND...: runs COMMAND with a time limit, its output to the terminal and to
# $RESULTS/NAME.log; records the outcome.
run_part() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "==== $name (limit ${limit}s) ===="
  timeout --signal=TERM --kill-after=20 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
  local rc=${PIPESTATUS[0]}
  local what="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    what="TIMED OUT after ${limit}s"
  elif [ "$rc" -ne 0 ]; then
    what="FAILED (exit $rc)"
  fi
  [ "$what" = ok ] || FAILED=1
  SUMMARY+=("$(printf '%-10s %-28s %4ds' "$name" "$what" $((SECONDS - t0)))")
}

# ---- 1. wheels
if ls .whl/*.whl >/dev/null 2>&1; then
  run_part wheels 120 "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/ here: using the packages already installed (run scripts/gpu/prepare_wheels.sh to make it)"
fi

# ---- 2. the machine
run_part env 120 "$PY" scripts/gpu/env_report.py

PARTS=",${GPU_CHECK_PARTS:-tests,bench},"

# ---- 3. gpu-marked tests
if [ -z "$TESTS_TIMEOUT" ]; then
  if [[ $PARTS == *,bench,* ]]; then
    TESTS_TIMEOUT=360
  else
    TESTS_TIMEOUT=$((BUDGET - (SECONDS - START) - 15))
  fi
fi
[[ $PARTS == *,tests,* ]] && run_part gpu_tests "$TESTS_TIMEOUT" "$PY" -m pytest -m gpu -q -rs \
  --continue-on-collection-errors -p no:cacheprovider tests

# ---- 3b. the engine's opt-in GPU paths op by op (GPU_CHECK_PARTS=kernels, about a minute): the cuBLAS
# weight-gradient GEMM (amsp.fuse_wgrad) and csrc's one-pass AdamW (amsp.optimizer_kernel=csrc) against what
# they replace, into gpu_kernels.md
[[ $PARTS == *,kernels,* ]] && run_part kernels "${KERNELS_TIMEOUT_S:-150}" "$PY" \
  scripts/bench/bench_engine_kernels.py --markdown "$RESULTS/gpu_kernels.md" --json "$RESULTS/gpu_kernels.json"

# ---- 4. train.py on the benchmark's shape (GPU_CHECK_PARTS=predict): the planner's recheck after 20 steps
# logs its predicted step time and peak memory beside the measured ones (issue 15's one-GPU check); the
# log also has the startup time (construction to first step, torch.compile apart), the MFU the training
# log prints (to compare with the benchmark's) and the final checkpoint's time. No cluster is named: the
# planner sees what a user's first run sees.
if [[ $PARTS == *,predict,* ]]; then
  rm -rf /tmp/amsp_predict
  # shellcheck disable=SC2086  # PREDICT_ARGS is a list of Hydra overrides
  run_part predict "${PREDICT_TIMEOUT_S:-240}" "$PY" train.py model=llama2_7b model.n_layers=8 data.seq_len=4096 \
    trainer.micro_batch_size=1 trainer.global_batch_size=4 trainer.device=cuda trainer.max_steps=30 \
    trainer.log_interval=5 trainer.val_samples=4 amsp.planner.recheck_steps=20 logging.wandb.mode=disabled \
    trainer.output_dir=/tmp/amsp_predict ${PREDICT_ARGS:-}
fi

# ---- 5. planner memory against measured peaks (its own call: GPU_CHECK_PARTS=memory)
if [[ $PARTS == *,memory,* ]]; then
  # shellcheck disable=SC2086  # MEMORY_ARGS is a list of arguments (e.g. "--compile off,on --plans 1/1/8")
  run_part memory $((BUDGET - (SECONDS - START) - 15)) env AMSP_PRETEND_WORLD=8 "$PY" \
    scripts/bench/bench_gpu_memory.py --out "$RESULTS/gpu_memory" ${MEMORY_ARGS:-}
fi

# ---- 6. benchmark with the time that is left (the script stops starting rounds before its budget), less
# FUSED_RESERVE_S (default 150) when the fused part follows
reserve=0
[[ $PARTS == *,fused,* ]] && reserve=${FUSED_RESERVE_S:-150}
left=$((BUDGET - (SECONDS - START) - 15 - reserve))
if [[ $PARTS != *,bench,* ]]; then
  :
elif [ "$left" -lt 90 ]; then
  SUMMARY+=("$(printf '%-10s %-28s %4ds' bench "NOT RUN (${left}s left)" 0)")
  FAILED=1
else
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
  run_part bench "$left" "$PY" scripts/bench/bench_gpu_vs_hf.py --markdown "$RESULTS/gpu_bench.md" \
    --json "$RESULTS/gpu_bench.json" --time-budget-s $((left - 30)) ${BENCH_ARGS:-}
fi

# ---- 7. fused ops against their eager references on the GPU (GPU_CHECK_PARTS=fused), after the benchmark
left=$((BUDGET - (SECONDS - START) - 15))
if [[ $PARTS != *,fused,* ]]; then
  :
elif [ "$left" -lt 30 ]; then
  SUMMARY+=("$(printf '%-10s %-28s %4ds' fused "NOT RUN (${left}s left)" 0)")
  FAILED=1
else
  # shellcheck disable=SC2086  # FUSED_ARGS is a list of arguments
  run_part fused "$left" "$PY" scripts/bench/bench_fused.py --device cuda \
    ${FUSED_ARGS:---variants eager,fused --no-model}
  grep '^|\|^- \|^model' "$RESULTS/fused.log" > "$RESULTS/gpu_fused.md" || true
fi

{
  echo "==== summary ($((SECONDS - START))s; results in $RESULTS) ===="
  printf '%s\n' "${SUMMARY[@]}"
} | tee "$RESULTS/summary.txt"
exit "$FAILED"
