#!/usr/bin/env bash
# A real one-host Slurm on this machine, for the `slurm` tests and for trying the sbatch scripts.
#
#   scripts/slurm/local_cluster.sh start    # install slurm-wlm + munge if missing, start, wait for idle
#   scripts/slurm/local_cluster.sh status   # daemons, sinfo, and the SLURM_CONF line to export
#   scripts/slurm/local_cluster.sh env      # prints `export SLURM_CONF=...` (eval "$(... env)")
#   scripts/slurm/local_cluster.sh stop     # stops what `start` started, by pid file
#   scripts/slurm/local_cluster.sh --help   # prints this text
#
# Example: start it, point the clients at it, submit a tiny CPU run, stop it:
#
#   scripts/slurm/local_cluster.sh start && eval "$(scripts/slurm/local_cluster.sh env)"
#   NPROC_PER_NODE=2 sbatch --nodes=1 --gpus-per-node=0 scripts/slurm/pretrain.sbatch model=debug \
#       model.vocab_size=8192 trainer.max_steps=20
#   scripts/slurm/local_cluster.sh stop
#
# Everything (config, munge key and socket, controller state, spool, logs, pid files) lives under
# $AMSP_SLURM_DIR (default /tmp/amsp-local-slurm), so nothing in /etc is touched and a stop leaves
# no daemon behind. Clients find the cluster through SLURM_CONF, which jobs inherit from sbatch.
# Needs root: slurmd runs jobs as the submitting user and SlurmUser is root here.
#
# Environment: AMSP_SLURM_DIR (default /tmp/amsp-local-slurm), AMSP_SLURMCTLD_PORT (default 6817),
# AMSP_SLURMD_PORT (default 6818), AMSP_SLURM_PARTITION (default test), AMSP_SLURM_WAIT_S (seconds
# `start` waits for the node to be idle; default 60).
set -euo pipefail

DIR=${AMSP_SLURM_DIR:-/tmp/amsp-local-slurm}
CTLD_PORT=${AMSP_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${AMSP_SLURMD_PORT:-6818}
PARTITION=${AMSP_SLURM_PARTITION:-test}
CONF=$DIR/slurm.conf
MUNGE_DIR=$DIR/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
WAIT_S=${AMSP_SLURM_WAIT_S:-60}

die() { echo "local_cluster.sh: error: $*" >&2; exit 1; }
say() { echo "local_cluster.sh: $*"; }

# pid from a pid file if that process is alive, else nothing.
live_pid() {
    local f=$1 pid
    [[ -s $f ]] || return 1
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

need_root() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd/slurmctld run as SlurmUser=root and munged as the munge user)"
}

install_if_missing() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v munged >/dev/null || missing+=(munge)
    # The lint test in tests/slurm runs shellcheck on these scripts; install it alongside so CI
    # machines really run it instead of skipping.
    command -v shellcheck >/dev/null || missing+=(shellcheck)
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them (Debian/Ubuntu expected)"
    say "installing ${missing[*]} (apt-get)"
    local log=/tmp/amsp-local-slurm-apt.log
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        die "apt-get could not install ${missing[*]} (full log: $log)"
    fi
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        die "slurm-wlm/munge still missing after apt-get install"
    fi
}

write_config() {
    local node_line host
    host=$(hostname -s)
    # slurmd -C reports this machine's CPUs, sockets, cores, threads and memory in slurm.conf syntax.
    node_line=$(slurmd -C | head -n 1)
    [[ $node_line == NodeName=* ]] || die "slurmd -C did not describe this node: $node_line"
    [[ $node_line == "NodeName=$host "* ]] || die "slurmd -C names the node differently from hostname -s ($host): $node_line"
    cat >"$CONF" <<EOF
# Written by scripts/slurm/local_cluster.sh: a one-host cluster on $host for tests.
ClusterName=amsp-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s);
# releasing it earlier races slurmd's revoked credential ("Job credential revoked"), so keep it short.
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# No cgroups needed: processes are tracked through /proc, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
# CPUs are the consumable; memory is reported but not reserved, so jobs need no --mem.
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
# Finished jobs stay visible to 'scontrol show job' (state, exit code, restarts) for 30 minutes:
# there is no accounting database, so sacct is not available.
MinJobAge=1800
KillWait=30
InactiveLimit=0
SlurmdTimeout=300
${node_line% UpTime=*} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    if live_pid "$MUNGE_DIR/munged.pid" >/dev/null; then return 0; fi
    id munge >/dev/null 2>&1 || die "no 'munge' user (the munge package creates it)"
    mkdir -p "$MUNGE_DIR"
    chown munge: "$MUNGE_DIR"
    chmod 755 "$MUNGE_DIR"  # munged requires others to be able to reach its socket
    # A private key for this cluster: munged and every client on this host share it through the socket.
    if [[ ! -s $MUNGE_DIR/munge.key ]]; then
        runuser -u munge -- mungekey --create --keyfile="$MUNGE_DIR/munge.key" \
            || die "mungekey could not create $MUNGE_DIR/munge.key"
    fi
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed" \
        || { tail -n 20 "$MUNGE_DIR/munged.log" >&2 || true; die "munged did not start (log: $MUNGE_DIR/munged.log)"; }
    munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET" >/dev/null \
        || die "munged started but a credential round trip failed (log: $MUNGE_DIR/munged.log)"
}

node_state() {
    SLURM_CONF=$CONF sinfo -h -N -o '%T' 2>/dev/null | head -n 1
}

start() {
    need_root
    if live_pid "$DIR/slurmctld.pid" >/dev/null && live_pid "$DIR/slurmd.pid" >/dev/null; then
        say "already running ($(node_state))"
        print_env
        return 0
    fi
    # A half-started cluster (one daemon dead) is restarted from scratch rather than patched.
    stop_daemons quiet
    install_if_missing
    rm -rf "$DIR/ctld" "$DIR/spool" "$DIR/log"
    mkdir -p "$DIR/ctld" "$DIR/spool" "$DIR/log"
    write_config
    start_munge
    slurmctld -f "$CONF" || die "slurmctld did not start (log: $DIR/log/slurmctld.log)"
    slurmd -f "$CONF" || die "slurmd did not start (log: $DIR/log/slurmd.log)"
    local waited=0 state=""
    while ((waited < WAIT_S)); do
        state=$(node_state)
        [[ $state == idle ]] && break
        sleep 1
        waited=$((waited + 1))
    done
    if [[ $state != idle ]]; then
        echo "--- slurmctld.log" >&2; tail -n 15 "$DIR/log/slurmctld.log" >&2 || true
        echo "--- slurmd.log" >&2; tail -n 15 "$DIR/log/slurmd.log" >&2 || true
        stop_daemons quiet
        die "node not idle after ${WAIT_S}s (state: '${state:-no answer from slurmctld}'); daemons stopped"
    fi
    say "node $(hostname -s) idle in partition '$PARTITION' after ${waited}s"
    print_env
}

# Stops each daemon by its pid file and waits for it to exit (SIGKILL after 15 s).
stop_one() {
    local name=$1 pidfile=$2 pid i
    pid=$(live_pid "$pidfile") || { rm -f "$pidfile"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "local_cluster.sh: $name ($pid) ignored SIGTERM for 15s; sending SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
    [[ ${3:-} == quiet ]] || say "stopped $name ($pid)"
}

stop_daemons() {
    # slurmd first, so running steps are torn down by their own slurmstepd before the controller goes.
    stop_one slurmd "$DIR/slurmd.pid" "${1:-}"
    stop_one slurmctld "$DIR/slurmctld.pid" "${1:-}"
    stop_one munged "$MUNGE_DIR/munged.pid" "${1:-}"
}

# Jobs still queued or running are cancelled first and waited for: a job's slurmstepd and its
# processes do not belong to slurmd, so stopping the daemons alone would leave them running.
cancel_jobs() {
    local jobs i
    live_pid "$DIR/slurmctld.pid" >/dev/null || return 0
    jobs=$(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    [[ -n ${jobs// /} ]] || return 0
    say "cancelling jobs: $jobs"
    # shellcheck disable=SC2086  # one argument per job id
    SLURM_CONF=$CONF scancel $jobs || true
    for ((i = 0; i < 90; i++)); do
        [[ -z $(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null) ]] && return 0
        sleep 1
    done
    echo "local_cluster.sh: jobs still listed after 90s: $(SLURM_CONF=$CONF squeue -h 2>&1)" >&2
}

stop() {
    need_root
    if [[ -d $DIR ]]; then
        cancel_jobs
        stop_daemons
    fi
    say "stopped (state kept in $DIR until the next start)"
}

print_env() {
    echo "export SLURM_CONF=$CONF"
}

status() {
    local rc=0 name pidfile pid
    for name in munged slurmctld slurmd; do
        pidfile=$DIR/$name.pid
        [[ $name == munged ]] && pidfile=$MUNGE_DIR/munged.pid
        if pid=$(live_pid "$pidfile"); then
            say "$name running (pid $pid)"
        else
            say "$name not running"
            rc=3
        fi
    done
    if ((rc == 0)); then
        SLURM_CONF=$CONF sinfo
        print_env
    fi
    return "$rc"
}

# The usage is the comment block at the top of this file: one text to keep.
usage() { awk 'NR == 1 {next} !/^#/ {exit} {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; }

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) print_env ;;
    -h | --help) usage ;;  # asked for: the usage on stdout, and success
    *) echo "usage: $0 start|stop|status|env (--help: what each does and the environment it reads)" >&2; exit 2 ;;
esac
