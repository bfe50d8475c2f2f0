#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for tests: `start|stop|status BASE_DIR`.
#
# Nodes n1 and n2 are two slurmd daemons on 127.0.0.1 with their own ports (SlurmdParameters=
# config_overrides lets each declare CPUs=2 whatever the host has), so a `--nodes=2 --ntasks-per-node=1`
# job gets SLURM_NODEID 0 and 1 as on a real cluster. Everything lives under BASE_DIR (config, state,
# spool, logs, pid files, and a private munged with its own socket and key), so it neither needs nor
# touches /etc/slurm or a system munged. Point clients at it with SLURM_CONF=BASE_DIR/slurm.conf.
# Ports (override to run beside another copy): SLURMCTLD_PORT (16817), SLURMD_PORT_BASE (17001 -> n1,
# 17002 -> n2). Needs root and the Debian packages slurmd slurmctld slurm-client munge.
set -euo pipefail

usage() { echo "usage: $0 start|stop|status BASE_DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1
base=$(mkdir -p -m 0755 "$2" && cd "$2" && pwd)
conf=$base/slurm.conf
ctld_port=${SLURMCTLD_PORT:-16817}
slurmd_port_base=${SLURMD_PORT_BASE:-17001}
nodes=(n1 n2)
export SLURM_CONF=$conf

# Every daemon's pid file, in the order they are stopped.
pid_files() {
    local node
    for node in "${nodes[@]}"; do echo "$base/run/slurmd.$node.pid"; done
    echo "$base/run/slurmctld.pid"
    echo "$base/munge/munged.pid"
}

write_config() {
    local host i
    host=$(hostname -s)
    cat > "$conf" <<EOF
# Written by scripts/slurm_test_cluster.sh: a two-node test cluster on one machine.
ClusterName=scalerltest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$base/munge/munged.sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
KillWait=2
StateSaveLocation=$base/state
SlurmdSpoolDir=$base/spool/slurmd.%n
SlurmctldPidFile=$base/run/slurmctld.pid
SlurmdPidFile=$base/run/slurmd.%n.pid
SlurmctldLogFile=$base/log/slurmctld.log
SlurmdLogFile=$base/log/slurmd.%n.log
EOF
    for i in "${!nodes[@]}"; do
        echo "NodeName=${nodes[$i]} NodeHostname=$host NodeAddr=127.0.0.1 Port=$((slurmd_port_base + i)) CPUs=2 RealMemory=1000 State=UNKNOWN" >> "$conf"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE State=UP" >> "$conf"
}

start_munged() {
    # munged refuses to run as root, checks that its key and directories belong to its user, and wants
    # every directory above its socket searchable by all (clients of any user connect to it).
    local dir=$base
    while [ "$dir" != / ]; do
        [ "$(( $(stat -c '%#a' "$dir") & 1 ))" = 1 ] || {
            echo "slurm_test_cluster: $dir is not searchable by all (chmod o+x it, or pick a BASE_DIR under /tmp)" >&2
            return 1; }
        dir=$(dirname "$dir")
    done
    install -d -m 0755 -o munge -g munge "$base/munge"
    if [ ! -s "$base/munge/munge.key" ]; then
        head -c 1024 /dev/urandom > "$base/munge/munge.key"
        chown munge:munge "$base/munge/munge.key"
        chmod 0400 "$base/munge/munge.key"
    fi
    runuser -u munge -- munged --socket="$base/munge/munged.sock" --key-file="$base/munge/munge.key" \
        --pid-file="$base/munge/munged.pid" --log-file="$base/munge/munged.log" \
        --seed-file="$base/munge/munged.seed"
}

# Print the logs and fail: a daemon that does not come up should say why.
fail_with_logs() {
    echo "slurm_test_cluster: $1" >&2
    local log
    for log in "$base"/munge/munged.log "$base"/log/*.log; do
        [ -f "$log" ] && { echo "--- $log" >&2; tail -n 20 "$log" >&2; }
    done
    exit 1
}

start() {
    local cmd node
    for cmd in munged slurmctld slurmd sbatch sinfo; do
        command -v "$cmd" > /dev/null || { echo "slurm_test_cluster: $cmd not found (apt-get install slurmd slurmctld slurm-client munge)" >&2; exit 3; }
    done
    mkdir -p "$base/state" "$base/spool" "$base/run" "$base/log"
    write_config
    start_munged || fail_with_logs "munged did not start"
    slurmctld -f "$conf" -i || fail_with_logs "slurmctld did not start"
    for node in "${nodes[@]}"; do
        slurmd -f "$conf" -N "$node" || fail_with_logs "slurmd $node did not start"
    done
    # Both nodes idle means the controller heard from each slurmd (usually well under a second).
    local deadline=$((SECONDS + 30)) states
    while [ $SECONDS -lt $deadline ]; do
        states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ' || true)
        if [ "$states" = "n1 idle n2 idle " ]; then
            echo "slurm_test_cluster: up (SLURM_CONF=$conf): $states"
            return 0
        fi
        sleep 0.2
    done
    fail_with_logs "nodes not idle after 30 s: ${states:-no answer from slurmctld}"
}

stop() {
    local pid_file pid
    for pid_file in $(pid_files); do
        [ -f "$pid_file" ] || continue
        pid=$(cat "$pid_file")
        kill "$pid" 2> /dev/null || true
    done
    # Wait (bounded) for each to exit; an exited daemon can linger as a zombie for a moment.
    for pid_file in $(pid_files); do
        [ -f "$pid_file" ] || continue
        pid=$(cat "$pid_file")
        for _ in $(seq 50); do
            state=$(ps -o stat= -p "$pid" 2> /dev/null || true)
            [ -z "$state" ] || [ "${state:0:1}" = Z ] && break
            sleep 0.1
        done
        if [ -n "$(ps -o stat= -p "$pid" 2> /dev/null | grep -v '^Z' || true)" ]; then
            kill -9 "$pid" 2> /dev/null || true
        fi
        rm -f "$pid_file"
    done
    echo "slurm_test_cluster: stopped ($base)"
}

status() {
    sinfo -N -o '%N %t %c' || exit 1
}

case $action in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) usage ;;
esac
