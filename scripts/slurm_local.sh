#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for nbdist's tests and for trying
# `%dist_start N --launcher slurm` without a cluster:
#
#   bash scripts/slurm_local.sh start    # install (Debian slurm-wlm + munge) if needed, start
#   bash scripts/slurm_local.sh status   # daemons, node and queue
#   bash scripts/slurm_local.sh stop     # cancel every job, stop the daemons, remove the files
#
# The cluster: one node (this machine, by its short host name) with as many CPUs as
# the machine has, one partition `debug`, one account `local` (other accounts are
# refused, as a site with an accounting database refuses them), tasks counted by CPU.
# munged, slurmctld and slurmd run as root from $NBDIST_SLURM_DIR (default
# /tmp/nbdist-slurm): configuration, spool, logs and the PID of every daemon started
# here. `stop` ends those PIDs and nothing else. Clients (sbatch, squeue, ...) find the
# configuration through /etc/slurm/slurm.conf, linked here when no other exists (and
# unlinked by `stop`); otherwise `export SLURM_CONF=$NBDIST_SLURM_DIR/slurm.conf`.
# Ports: $NBDIST_SLURM_PORT (slurmctld, default 6817) and the next one (slurmd).
set -euo pipefail

DIR="${NBDIST_SLURM_DIR:-/tmp/nbdist-slurm}"
PORT="${NBDIST_SLURM_PORT:-6817}"
CONF="$DIR/slurm.conf"
ETC_CONF=/etc/slurm/slurm.conf
NODE="$(hostname -s)"
SUDO=""
[[ "$(id -u)" != 0 ]] && SUDO="sudo"

log() { echo "== slurm_local: $*"; }

pid_alive() {  # pid_alive FILE: the PID in FILE names a live process
  [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    return
  fi
  log "installing Debian slurm-wlm and munge (apt-get)"
  $SUDO apt-get update -qq
  # policy-rc.d keeps the packages' own services from starting: this script starts
  # the daemons it needs, from its own directory, and records their PIDs.
  local policy=/usr/sbin/policy-rc.d placed=""
  if [[ ! -e "$policy" ]]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
    placed=1
  fi
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurm-wlm munge >/dev/null
  if [[ -n "$placed" ]]; then
    $SUDO rm -f "$policy"
  fi
}

write_config() {
  mkdir -p "$DIR/munge" "$DIR/state" "$DIR/spool" "$DIR/log"
  chmod 700 "$DIR" "$DIR/munge"
  if [[ ! -s "$DIR/munge/munge.key" ]]; then
    # A key of this cluster's own: the machine's /etc/munge key (if any) is left alone.
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$DIR/munge/munge.key"
  fi
  local cpus
  cpus="$(nproc)"
  cat >"$CONF" <<EOF
# One-node Slurm cluster written by scripts/slurm_local.sh (nbdist).
ClusterName=nbdist-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# No cgroups needed (containers often have none to delegate).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
JobSubmitPlugins=lua
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# Cancelled tasks get SIGKILL 2 s after SIGTERM; finished jobs leave the records after 30 s.
KillWait=2
MinJobAge=30
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  # Without an accounting database Slurm accepts any --account; a site refuses
  # unknown ones. This cluster has one account, "local", and refuses the others
  # with Slurm's own words.
  cat >"$DIR/job_submit.lua" <<'EOF'
local ACCOUNTS = { ["local"] = true }

function slurm_job_submit(job_desc, part_list, submit_uid)
  if job_desc.account ~= nil and not ACCOUNTS[job_desc.account] then
    slurm.log_user("Invalid account or account/partition combination specified: "
      .. job_desc.account .. " (this cluster's account: local)")
    return slurm.ESLURM_INVALID_ACCOUNT
  end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end
EOF
  if [[ ! -e "$ETC_CONF" ]]; then
    $SUDO mkdir -p /etc/slurm
    $SUDO ln -s "$CONF" "$ETC_CONF"
  fi
}

start_daemon() {  # start_daemon NAME PIDFILE CMD...: start, wait for its PID file
  local name="$1" pidfile="$2"
  shift 2
  if pid_alive "$pidfile"; then
    log "$name already running (pid $(cat "$pidfile"))"
    return
  fi
  rm -f "$pidfile"
  "$@"
  for _ in $(seq 100); do
    pid_alive "$pidfile" && { log "$name started (pid $(cat "$pidfile"))"; return; }
    sleep 0.1
  done
  echo "slurm_local: $name did not start; its log:" >&2
  tail -n 20 "$DIR/log/$name.log" >&2 || true
  exit 1
}

client_env() {
  # The clients read the configuration linked at /etc/slurm, or the one named here.
  if [[ "$(readlink "$ETC_CONF" 2>/dev/null)" != "$CONF" ]]; then
    export SLURM_CONF="$CONF"
  fi
}

start() {
  install_packages
  if pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid" \
    && pid_alive "$DIR/munged.pid"; then
    log "already running"
    status
    return
  fi
  write_config
  start_daemon munged "$DIR/munged.pid" munged --force \
    --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
  start_daemon slurmctld "$DIR/slurmctld.pid" slurmctld -f "$CONF" -L "$DIR/log/slurmctld.log"
  start_daemon slurmd "$DIR/slurmd.pid" slurmd -f "$CONF" -N "$NODE" -L "$DIR/log/slurmd.log"
  client_env
  for _ in $(seq 150); do
    if sinfo -h -o '%t' 2>/dev/null | grep -qx 'idle'; then
      log "node $NODE idle: $(nproc) CPUs, partition debug, account local"
      if [[ -n "${SLURM_CONF:-}" ]]; then
        log "clients need: export SLURM_CONF=$CONF"
      fi
      return 0
    fi
    sleep 0.2
  done
  echo "slurm_local: node $NODE did not become idle; sinfo says:" >&2
  sinfo >&2 || true
  exit 1
}

stop_pid() {  # stop_pid NAME PIDFILE: SIGTERM, wait up to 10 s, then SIGKILL
  local name="$1" pidfile="$2" pid
  pid_alive "$pidfile" || return 0
  pid="$(cat "$pidfile")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || { log "$name stopped (pid $pid)"; return; }
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  log "$name killed (pid $pid)"
}

stop() {
  if [[ -d "$DIR" ]] && pid_alive "$DIR/slurmctld.pid"; then
    client_env
    # Every job of this cluster ends first: its tasks run under slurmstepd, not under
    # the daemons, and would outlive them.
    scancel --full --partition=debug 2>/dev/null || true
    for _ in $(seq 150); do
      [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break
      sleep 0.2
    done
    if [[ -n "$(squeue -h -o %i 2>/dev/null)" ]]; then
      echo "slurm_local: jobs still listed after 30 s:" >&2
      squeue >&2 || true
    fi
  fi
  stop_pid slurmd "$DIR/slurmd.pid"
  stop_pid slurmctld "$DIR/slurmctld.pid"
  stop_pid munged "$DIR/munged.pid"
  if [[ "$(readlink "$ETC_CONF" 2>/dev/null)" == "$CONF" ]]; then
    $SUDO rm -f "$ETC_CONF"
  fi
  rm -rf "$DIR"
  log "stopped; $DIR removed"
}

status() {
  local name running=0
  for name in munged slurmctld slurmd; do
    if pid_alive "$DIR/$name.pid"; then
      echo "$name: running (pid $(cat "$DIR/$name.pid"))"
      running=$((running + 1))
    else
      echo "$name: not running"
    fi
  done
  if [[ $running == 3 ]]; then
    client_env
    sinfo
    squeue
  fi
  [[ $running == 3 ]]
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  -h | --help)
    # The header comment above, without its '#' marks.
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed -E 's/^# ?//' | sed '1i usage: bash scripts/slurm_local.sh start|stop|status\n'
    ;;
  "")
    echo "usage: bash scripts/slurm_local.sh start|stop|status (--help says more)" >&2
    exit 2
    ;;
  *)
    echo "scripts/slurm_local.sh: '$1' is not start, stop or status; see --help" >&2
    exit 2
    ;;
esac
