# shellcheck shell=bash
# Shared by pretrain.sbatch and pretrain_srun.sbatch (sourced, not run): the Python to use, the
# run directory, and the launch step with SIGUSR1 forwarding and requeue.
#
# Signals, and why they are routed this way:
# - The scripts ask for `--signal=B:USR1@120`: 120 s before the time limit Slurm signals the batch
#   shell only, the same as `scancel --batch --signal=USR1 <job>`. The shell remembers that a stop
#   was asked for and passes SIGUSR1 to srun, which forwards it to every process of the step on
#   every node. train.py finishes its step, saves a checkpoint and exits 0; the shell then
#   requeues the job (same job id, so the same run directory) and the next start auto-resumes.
# - `scancel --signal=USR1 <job>` (no --batch) signals the step's processes directly: the ranks
#   checkpoint and exit 0 and the job ends COMPLETED without requeue ("checkpoint and stop").
# - torchrun's agent has no SIGUSR1 handler (the default action would kill it and orphan its
#   workers), so it is started with SIGUSR1 ignored, as are the srun variant's ranks; train.py
#   installs its own handler, so the ranks still act on it once they are up (and a stop request
#   is repeated until they do, see run_step).

die() { echo "$(basename "${SCRIPT_PATH:-slurm}"): error: $*" >&2; exit 2; }
note() { echo "[$(date +%H:%M:%S)] $(basename "${SCRIPT_PATH:-slurm}"): $*"; }

# PYTHON if given, else the repository's .venv, else python3 from PATH (an activated environment
# is exported to the job by sbatch). The choice is printed, never guessed silently.
pick_python() {
    if [[ -n ${PYTHON:-} ]]; then
        [[ -x $PYTHON ]] || PYTHON=$(command -v "$PYTHON") || die "PYTHON=$PYTHON is not executable"
    elif [[ -x $REPO_DIR/.venv/bin/python ]]; then
        PYTHON=$REPO_DIR/.venv/bin/python
    else
        PYTHON=$(command -v python3) || die "no PYTHON given, no $REPO_DIR/.venv and no python3 on PATH"
    fi
    # find_spec looks the packages up without importing them (importing torch costs seconds).
    "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("torch", "hydra")))' \
        || die "$PYTHON has no torch or no hydra; run 'make venv' in $REPO_DIR or set PYTHON"
}

# The run directory name comes from the job, so every rank on every node agrees on it without
# talking, and a requeued job (same id) finds its own checkpoints. A trainer.run_name=... override
# given after the script name comes later on the command line and wins.
default_run_name() {
    echo "${RUN_NAME:-${SLURM_JOB_NAME}-${SLURM_JOB_ID}}"
}

_stop_requested=0
_step_pid=""

_on_usr1() {
    _stop_requested=1
    note "received SIGUSR1: asking the ranks to checkpoint and exit"
    if [[ -n $_step_pid ]]; then
        kill -USR1 "$_step_pid" 2>/dev/null || true
    fi
}

# Installed as soon as this file is sourced: a SIGUSR1 that lands while the script is still
# setting up would otherwise kill the batch shell (bash's default action) and lose the requeue.
trap _on_usr1 USR1

_requeue() {
    # Ends this batch script: Slurm kills it and queues the job again with the same id.
    scontrol requeue "$SLURM_JOB_ID" || die "scontrol requeue $SLURM_JOB_ID failed; resubmit with trainer.run_name=$(default_run_name) to resume"
    sleep 60
    exit 0
}

# run_step CMD...: runs the srun step in the background so the shell can take SIGUSR1 while it
# runs (bash runs traps only between commands, and `wait` is interruptible), then requeues the
# job if a stop was asked for and the ranks exited cleanly. Exits with the step's status.
run_step() {
    if ((_stop_requested)); then
        note "SIGUSR1 arrived before the ranks started; requeueing job $SLURM_JOB_ID"
        _requeue
    fi
    "$@" &
    _step_pid=$!
    # A trapped signal makes `wait` return early; keep waiting while the step is alive. After a
    # stop request, poll instead and repeat SIGUSR1 every 30 s: ranks that are still starting up
    # (before train.py installs its handler) ignore it, and a repeat reaches them once they can act.
    local polls=0
    while kill -0 "$_step_pid" 2>/dev/null; do
        if ((_stop_requested)); then
            sleep 2 || true
            polls=$((polls + 1))
            if ((polls % 15 == 0)) && kill -0 "$_step_pid" 2>/dev/null; then
                note "ranks still running $((polls * 2)) s after SIGUSR1; sending it again"
                kill -USR1 "$_step_pid" 2>/dev/null || true
            fi
        else
            wait "$_step_pid" || true
        fi
    done
    local rc=0
    wait "$_step_pid" || rc=$?
    if ((_stop_requested)); then
        if ((rc == 0)); then
            note "ranks checkpointed and exited; requeueing job $SLURM_JOB_ID to resume from the checkpoint"
            _requeue
        fi
        note "step exited with status $rc after SIGUSR1; not requeueing"
    fi
    rc=$(worker_exit_code "$rc")
    note "step finished with status $rc"
    exit "$rc"
}

# worker_exit_code RC: the step's status, or the code the ranks recorded in AMSP_EXIT_CODE_DIR when the
# step failed (torchrun exits 1 whatever its workers' codes: amsp/errors.py record_exit_code). An input
# error (2) anywhere wins, then a bug (1: its traceback is in torchrun's summary), then a fault (3): the
# ranks that lost a peer to an input error or a bug exit 3, and rerunning the same command cannot help.
worker_exit_code() {
    local rc=$1 codes
    if ((rc == 0)) || [[ -z ${AMSP_EXIT_CODE_DIR:-} || ! -d $AMSP_EXIT_CODE_DIR ]]; then
        echo "$rc"
        return
    fi
    codes=$(cat "$AMSP_EXIT_CODE_DIR"/rank* 2>/dev/null | sort -un | tr '\n' ' ')
    if [[ " $codes" == *" 2 "* ]]; then
        note "ranks exited with code(s) ${codes% } (launcher status $rc): exiting 2 (input error)" >&2
        echo 2
    elif [[ " $codes" == *" 1 "* ]]; then
        note "ranks exited with code(s) ${codes% } (launcher status $rc): exiting 1 (an unexpected error: see the" \
            "traceback in torchrun's failure summary)" >&2
        echo 1
    elif [[ " $codes" == *" 3 "* ]]; then
        note "ranks exited with code(s) ${codes% } (launcher status $rc): exiting 3 (fault)" >&2
        echo 3
    else
        echo "$rc"
    fi
}

print_header() {
    note "job ${SLURM_JOB_ID} (${SLURM_JOB_NAME}), restart ${SLURM_RESTART_COUNT:-0}, nodes ${SLURM_JOB_NODELIST} (${SLURM_JOB_NUM_NODES})"
    note "repository $REPO_DIR, python $PYTHON, working directory $(pwd)"
}
