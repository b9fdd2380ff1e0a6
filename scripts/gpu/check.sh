#!/usr/bin/env bash
# The GPU check in one command, on a CUDA machine, from the repository root (about 9 minutes at most):
#
#     bash scripts/gpu/check.sh
#
# 1. installs the wheels from .whl/ (scripts/gpu/prepare_wheels.sh; skipped when there is no .whl/,
#    e.g. on a cluster node where `pip install -e '.[test]'` already ran) into /tmp/site, on PYTHONPATH;
# 2. records the machine: nvidia-smi, torch / CUDA / cuDNN / transformers versions;
# 3. runs every gpu-marked test (pytest -m gpu, which replaces pyproject's `-m 'not slow'`);
# 4. runs scripts/bench/bench_gpu_vs_hf.py (this project vs transformers on the 1.88B shape) with
#    whatever time is left, and writes its table to gpu_bench.md.
# Results go to $OUT when it is set (the device tool brings that folder back), else to
# scripts/gpu/results/. GPU_CHECK_PARTS (default "tests,bench") picks the parts, which run in this order
# whatever the order named (an unknown name is an error, exit 2):
#   tests    every gpu-marked test;
#   kernels  scripts/bench/bench_engine_kernels.py: amsp.fuse_wgrad's GEMM and amsp.optimizer_kernel=csrc's
#            AdamW op by op against what they replace, into gpu_kernels.md;
#   predict  train.py on the benchmark's shape: the planner's recheck (predicted against measured step time
#            and peak memory), PREDICT_ARGS as extra overrides;
#   memory   scripts/bench/bench_gpu_memory.py: measured peak memory against the planner's prediction for
#            several plans as rank 0 of a pretend world of 8, into gpu_memory.md, MEMORY_ARGS passed on
#            (e.g. "--compile off,on --plans 1/1/8");
#   bench    the benchmark above with all the time the parts after it do not need, BENCH_ARGS passed on
#            (e.g. "--rounds 1");
#   fused    scripts/bench/bench_fused.py --device cuda (each fused op against its eager reference on the
#            GPU), into gpu_fused.md, FUSED_ARGS passed on (default "--variants eager,fused --no-model").
# Time: GPU_CHECK_BUDGET_S (default 540: the device tool allows 600 a call) bounds the whole script. Each part
# gets what it asks for (GPU_TESTS_TIMEOUT_S: default 360 when other parts follow, else all;
# KERNELS_TIMEOUT_S 150, PREDICT_TIMEOUT_S 240, MEMORY_TIMEOUT_S 180; bench and fused: the rest) capped by
# what is left less the minimum each later part needs (tests 120 s, kernels 45, predict 90, memory 45,
# bench 90, fused FUSED_RESERVE_S, default 150); a part whose share is under its own minimum is NOT RUN.
# A failed part does not stop the next, except the environment report: without the project's
# dependencies (.whl/ missing) every later part would only fail. The exit status is non-zero if any part
# failed or did not run. PYTHON: the interpreter (default python3). One device call brings back at most 8
# files: with several parts, send $OUT elsewhere and pack it, e.g.
#     R=/tmp/res; mkdir -p $R; OUT=$R GPU_CHECK_PARTS=predict,memory,bench bash scripts/gpu/check.sh
#     tar czf $OUT/r.tgz -C $R .
# (.whl/ is git-ignored: a device call must carry it.) On the last H200 run (2026-11-26) the tests took 197 s
# on a fresh machine (40 of them then; both extensions built, blocks compiled in two train.py runs); there
# are 51 now and a third extension (csrc/wgrad_gemm_cuda.cu), so expect 235-250 s: with every part in one
# call, the later ones get little more than their minimums. A second call gets what the session has left
# of its device time, not 540 s: set GPU_CHECK_BUDGET_S from the device tool's budget_left_s less about
# 40 s, or the bench (which takes the rest) runs into the call's limit and nothing is packed.
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 1

PY=${PYTHON:-python3}
RESULTS=${OUT:-scripts/gpu/results}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
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
  LAST_RC=$rc
  local what="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    what="TIMED OUT after ${limit}s"
  elif [ "$rc" -ne 0 ]; then
    what="FAILED (exit $rc)"
  fi
  [ "$what" = ok ] || FAILED=1
  SUMMARY+=("$(printf '%-10s %-28s %4ds' "$name" "$what" $((SECONDS - t0)))")
}

# Parts, in the order they run, and the seconds each needs to be worth starting: a part's limit is what is
# left of the budget less these minimums for the parts still to come (and 20 s each for timeout's
# --kill-after), so no part starves the later ones to nothing and the whole script ends within the budget.
ORDER=(tests kernels predict memory bench fused)
declare -A NEED=([tests]=120 [kernels]=45 [predict]=90 [memory]=45 [bench]=90 [fused]=${FUSED_RESERVE_S:-150})
IFS=, read -ra ASKED <<< "${GPU_CHECK_PARTS:-tests,bench}"
PARTS=","
for p in "${ASKED[@]}"; do
  p=${p// /}
  [ -z "$p" ] && continue
  if [ -z "${NEED[$p]:-}" ]; then
    echo "check.sh: unknown part '$p' in GPU_CHECK_PARTS (known: ${ORDER[*]})" >&2
    exit 2
  fi
  PARTS+="$p,"
done
asked() { [[ $PARTS == *,$1,* ]]; }

# limit_for NAME WANT: sets LIMIT to NAME's time limit (WANT, or all that may be used when WANT is empty,
# capped by what the later parts need); returns 1 (and records NOT RUN) when that is under NAME's own minimum.
# Not called in $(...): the summary it records must stay in this shell.
limit_for() {
  local name=$1 want=$2 later=0 after=0 p
  for p in "${ORDER[@]}"; do
    if ((after)) && asked "$p"; then later=$((later + NEED[$p] + 20)); fi
    [ "$p" = "$name" ] && after=1
  done
  local left=$((BUDGET - (SECONDS - START) - 15 - later - 20))
  LIMIT=$left
  if [ -n "$want" ] && ((want < left)); then LIMIT=$want; fi
  if ((LIMIT < NEED[$name])); then
    SUMMARY+=("$(printf '%-10s %-28s %4ds' "$name" "NOT RUN (${LIMIT}s left)" 0)")
    FAILED=1
    return 1
  fi
}

# A part killed while torch compiled an extension leaves its lock file, and every later build of that
# extension would wait on it forever (torch's FileBaton has no timeout): remove the ones left behind.
clear_build_locks() {
  find .cache/torch_extensions "$HOME/.cache/amsp_csrc" -name lock -type f -delete 2>/dev/null || true
}

# ---- 1. wheels
if ls .whl/*.whl >/dev/null 2>&1; then
  run_part wheels 120 "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/ here: using the packages already installed (run scripts/gpu/prepare_wheels.sh to make it;"
  echo "through the device tool, .whl/ is git-ignored: name it in the call's carry)"
fi

# ---- 2. the machine; without the project's dependencies every later part would only fail, slowly
run_part env 120 "$PY" scripts/gpu/env_report.py
ENV_RC=$LAST_RC
if [ "$ENV_RC" -ne 0 ]; then
  SUMMARY+=("$(printf '%-10s %-28s %4ds' rest "NOT RUN (env failed)" 0)")
fi

# ---- 3. gpu-marked tests: 360 s when other parts follow (a fresh machine builds both extensions and compiles
# blocks in two of its train.py runs), else all the budget
if [ "$ENV_RC" -eq 0 ] && asked tests; then
  want=${GPU_TESTS_TIMEOUT_S:-}
  [ -z "$want" ] && [ "$PARTS" != ",tests," ] && want=360
  if limit_for tests "$want"; then
    run_part gpu_tests "$LIMIT" "$PY" -m pytest -m gpu -q -rs --continue-on-collection-errors \
      -p no:cacheprovider tests
    clear_build_locks
  fi
fi

# ---- 3b. the engine's opt-in GPU paths op by op (about a minute): the cuBLAS weight-gradient GEMM
# (amsp.fuse_wgrad) and csrc's one-pass AdamW (amsp.optimizer_kernel=csrc) against what they replace, into
# gpu_kernels.md
if [ "$ENV_RC" -eq 0 ] && asked kernels && limit_for kernels "${KERNELS_TIMEOUT_S:-150}"; then
  run_part kernels "$LIMIT" "$PY" scripts/bench/bench_engine_kernels.py --markdown "$RESULTS/gpu_kernels.md" \
    --json "$RESULTS/gpu_kernels.json"
  clear_build_locks
fi

# ---- 4. train.py on the benchmark's shape: the planner's recheck after 20 steps logs its predicted step time
# and peak memory beside the measured ones (issue 15's one-GPU check); the log also has the startup time
# (construction to first step, torch.compile apart), the MFU the training log prints (to compare with the
# benchmark's) and the final checkpoint's time. No cluster is named: the planner sees what a user's first run
# sees.
if [ "$ENV_RC" -eq 0 ] && asked predict && limit_for predict "${PREDICT_TIMEOUT_S:-240}"; then
  rm -rf /tmp/amsp_predict
  # shellcheck disable=SC2086  # PREDICT_ARGS is a list of Hydra overrides
  run_part predict "$LIMIT" "$PY" train.py model=llama2_7b model.n_layers=8 data.seq_len=4096 \
    trainer.micro_batch_size=1 trainer.global_batch_size=4 trainer.device=cuda trainer.max_steps=30 \
    trainer.log_interval=5 trainer.val_samples=4 amsp.planner.recheck_steps=20 logging.wandb.mode=disabled \
    trainer.output_dir=/tmp/amsp_predict ${PREDICT_ARGS:-}
  clear_build_locks
fi

# ---- 5. planner memory against measured peaks as rank 0 of a pretend world of 8
if [ "$ENV_RC" -eq 0 ] && asked memory && limit_for memory "${MEMORY_TIMEOUT_S:-180}"; then
  # shellcheck disable=SC2086  # MEMORY_ARGS is a list of arguments (e.g. "--compile off,on --plans 1/1/8")
  run_part memory "$LIMIT" env AMSP_PRETEND_WORLD=8 "$PY" \
    scripts/bench/bench_gpu_memory.py --out "$RESULTS/gpu_memory" ${MEMORY_ARGS:-}
fi

# ---- 6. benchmark with the time that is left (the script stops starting rounds before its budget), less what
# the fused part needs when it follows
if [ "$ENV_RC" -eq 0 ] && asked bench && limit_for bench ""; then
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
  run_part bench "$LIMIT" "$PY" scripts/bench/bench_gpu_vs_hf.py --markdown "$RESULTS/gpu_bench.md" \
    --json "$RESULTS/gpu_bench.json" --time-budget-s $((LIMIT - 30)) ${BENCH_ARGS:-}
  clear_build_locks
fi

# ---- 7. fused ops against their eager references on the GPU, after the benchmark
if [ "$ENV_RC" -eq 0 ] && asked fused && limit_for fused ""; then
  # shellcheck disable=SC2086  # FUSED_ARGS is a list of arguments
  run_part fused "$LIMIT" "$PY" scripts/bench/bench_fused.py --device cuda \
    ${FUSED_ARGS:---variants eager,fused --no-model}
  grep '^|\|^- \|^model' "$RESULTS/fused.log" > "$RESULTS/gpu_fused.md" || true
fi

{
  echo "==== summary ($((SECONDS - START))s; results in $RESULTS) ===="
  printf '%s\n' "${SUMMARY[@]}"
} | tee "$RESULTS/summary.txt"
exit "$FAILED"
