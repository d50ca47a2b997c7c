#!/usr/bin/env bash
# A single-node SLURM on this machine, for tests/slurm/: install (Debian's slurm-wlm and munge), start, stop.
#
#   sudo bash scripts/slurm_cluster.sh start    # prints nothing on success; exit 0 once `sinfo` shows the node idle
#   sudo bash scripts/slurm_cluster.sh stop
#
# As root, without systemd or cgroups: munged, slurmctld and slurmd are started directly, with the process tracking
# and task plugins that need neither (proctrack/linuxproc, task/none), no accounting, and the node's real CPU count.
# MinJobAge=600: without accounting a finished job is visible to `scontrol show job` only that long.
set -euo pipefail

action=${1:-start}
state=${SLURM_TEST_STATE:-/var/lib/unet-ddp-slurm}
conf=/etc/slurm/slurm.conf

stop() {  # the daemons this script started, by their pid files
    for daemon in slurmd slurmctld; do
        pid=$(cat "$state/$daemon.pid" 2>/dev/null) || continue
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    done
}

if [[ $action == stop ]]; then
    stop
    exit 0
fi
[[ $action == start ]] || { echo "Error: usage: $0 start|stop" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "Error: $0 needs root (it installs packages and starts daemons)" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; }
fi

host=$(hostname -s)
# At least 4 CPUs (config_overrides: more than the machine has), so that two 2-task jobs of the tests run at once.
cpus=$(( $(nproc) < 4 ? 4 : $(nproc) ))
mkdir -p "$state/ctld" "$state/d" /etc/slurm /run/munge /var/log/munge /var/lib/munge
cat >"$conf" <<EOF
ClusterName=unetddp
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=600
KillWait=10
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

if ! munge -n </dev/null >/dev/null 2>&1; then
    [[ -s /etc/munge/munge.key ]] || mungekey --create >/dev/null 2>&1 || create-munge-key -f >/dev/null
    chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
    chmod 0700 /etc/munge
    chmod 0400 /etc/munge/munge.key
    su -s /bin/sh munge -c /usr/sbin/munged
fi
stop
# -c: a fresh state (no jobs of an earlier session); jobs inherit slurmd's nice value, so start it at 0.
nice -n 0 slurmctld -c
nice -n 0 slurmd
for _ in $(seq 60); do
    if sinfo -h -o %t 2>/dev/null | grep -qx idle; then
        exit 0
    fi
    scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
    sleep 0.5
done
echo "Error: the SLURM node did not become idle; see $state/slurmctld.log and $state/slurmd.log" >&2
exit 1
