#!/usr/bin/env bash
# A single-node Slurm cluster for the tests (tests/test_slurm.py): Debian 12's Slurm 22.05, on loopback only,
# everything (configs, state, logs, pid files, database) under one folder.
#   scripts/slurm_cluster.sh missing            one line naming what is not installed (nothing: all there)
#   scripts/slurm_cluster.sh install            apt-get install the Debian packages (root)
#   scripts/slurm_cluster.sh start DIR [PID]    start munged, MariaDB, slurmdbd, slurmctld and slurmd (root);
#                                               stopped by itself when process PID (default: the caller)
#                                               ends or after D3S_SLURM_MAX_S seconds (default 1800)
#   scripts/slurm_cluster.sh stop DIR           cancel the cluster's jobs, stop its daemons by their pid files
# Clients: `export SLURM_CONF=DIR/etc/slurm.conf`. The cluster "d3s" has accounting (slurmdbd on a private
# MariaDB: the executor plugin checks accounts with sacctmgr and reads job states with sacct where squeue no
# longer lists a job, as on a real cluster) with the account d3s-test for root; partitions d3s-gpu (default) and d3s-cpu on one node "localhost"
# with 2 CPUs, 64000 MB (declared; memory is not a consumable here) and two GPUs of type "fake" (gres.conf
# points at /dev/null: jobs get CUDA_VISIBLE_DEVICES and run on the CPU).
set -euo pipefail

# MariaDB's core packages only: the server and its bootstrap, no service, no system database
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server-core mariadb-client-core)
COMMANDS=(munged slurmctld slurmd slurmdbd sbatch sacct sacctmgr mariadbd mariadb-install-db mariadb)
DAEMONS=(slurmd slurmctld slurmdbd mariadbd munged) # stopped in this order
START_TIMEOUT_S=${D3S_SLURM_START_TIMEOUT_S:-120}

missing() {
  local absent=()
  for command in "${COMMANDS[@]}"; do
    command -v "$command" >/dev/null 2>&1 || absent+=("$command")
  done
  if [ ${#absent[@]} -gt 0 ]; then
    echo "Slurm test cluster: not installed: ${absent[*]} (Debian 12, as root:" \
      "apt-get install -y ${PACKAGES[*]})"
  fi
}

install() {
  [ -z "$(missing)" ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    missing >&2
    return 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_for SECONDS WHAT COMMAND...: run COMMAND every 0.2 s until it succeeds; fail naming WHAT after SECONDS
wait_for() {
  local limit=$1 what=$2
  shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      echo "slurm_cluster: $what not ready within ${limit}s; its log is in $DIR" >&2
      return 1
    fi
    sleep 0.2
  done
}

start() {
  DIR=$(realpath -m "$1")
  local owner=${2:-$PPID}
  [ -z "$(missing)" ] || { missing >&2; return 1; }
  [ "$(id -u)" = 0 ] || { echo "slurm_cluster: start needs root (the daemons run as root)" >&2; return 1; }
  [ ! -e "$DIR/etc" ] || { echo "slurm_cluster: $DIR holds a cluster already" >&2; return 1; }
  mkdir -p "$DIR"/{etc,munge,db,spool,state,dev}
  chmod 711 "$DIR" # munged, running as munge, must reach its socket below
  export SLURM_CONF="$DIR/etc/slurm.conf"

  # The daemons bind to the address their host name resolves to (NoInAddrAny) and the job steps' srun reads
  # /etc/slurm/slurm.conf (the jobstep plugin drops SLURM_CONF): the daemons run in namespaces of their own,
  # named localhost, with DIR/etc mounted on /etc/slurm. Without namespaces, this machine's name must resolve
  # to loopback and /etc/slurm/slurm.conf must be free for a link to DIR's.
  local host
  if unshare --mount --uts true 2>/dev/null; then
    host=localhost
    on_node() {
      unshare --mount --uts sh -c \
        'mkdir -p /etc/slurm && mount --bind "$0" /etc/slurm && hostname localhost && exec "$@"' \
        "$DIR/etc" "$@"
    }
  else
    host=$(hostname -s)
    local address
    address=$(getent ahostsv4 "$host" | awk 'NR == 1 {print $1}')
    if [[ $address != 127.* ]] || [ -e /etc/slurm/slurm.conf ]; then
      echo "slurm_cluster: unshare (mount and UTS namespaces) is not permitted here, and the host name $host" \
        "resolves to ${address:-nothing}, not loopback, or /etc/slurm/slurm.conf exists" >&2
      return 1
    fi
    mkdir -p /etc/slurm
    ln -s "$SLURM_CONF" /etc/slurm/slurm.conf
    echo /etc/slurm/slurm.conf >"$DIR/linked"
    on_node() { "$@"; }
  fi

  # munge: a fresh key, a private socket
  local socket="$DIR/munge/munge.socket"
  chown munge: "$DIR/munge"
  chmod 711 "$DIR/munge"
  dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chown munge: "$DIR/munge/munge.key"
  chmod 400 "$DIR/munge/munge.key"
  runuser -u munge -- munged --socket="$socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
  ln -s "$DIR/munge/munged.pid" "$DIR/munged.pid"
  wait_for 10 munged munge --socket="$socket" -n

  # MariaDB for slurmdbd: its own data folder and socket, TCP on loopback
  local db_port dbd_port ctld_port slurmd_port
  db_port=$(free_port)
  dbd_port=$(free_port)
  ctld_port=$(free_port)
  slurmd_port=$(free_port)
  mariadb-install-db --no-defaults --user=root --datadir="$DIR/db/data" --skip-test-db \
    --auth-root-authentication-method=socket >"$DIR/db/install.log" 2>&1
  mariadbd --no-defaults --user=root --datadir="$DIR/db/data" --socket="$DIR/db/mysql.sock" \
    --bind-address=127.0.0.1 --port="$db_port" --pid-file="$DIR/mariadbd.pid" \
    --log-error="$DIR/db/mariadb.log" --innodb-buffer-pool-size=32M --skip-name-resolve \
    </dev/null >/dev/null 2>&1 &
  local db=(mariadb --no-defaults --socket="$DIR/db/mysql.sock")
  wait_for 60 MariaDB "${db[@]}" -e 'SELECT 1'
  local db_password
  db_password=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')
  "${db[@]}" <<SQL
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$db_password';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
SQL

  cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$socket
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$dbd_port
CommunicationParameters=NoInAddrAny
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=$db_password
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"

  # Slurm wants character devices for GPUs: /dev/null stands in for both
  ln -s /dev/null "$DIR/dev/nvidia0"
  ln -s /dev/null "$DIR/dev/nvidia1"
  cat >"$DIR/etc/gres.conf" <<EOF
AutoDetect=off
NodeName=$host Name=gpu Type=fake File=$DIR/dev/nvidia[0-1]
EOF
  cat >"$DIR/etc/slurm.conf" <<EOF
ClusterName=d3s
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
AuthInfo=socket=$socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$host
AccountingStoragePort=$dbd_port
AccountingStoragePass=$socket
AccountingStorageEnforce=associations
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
SchedulerParameters=sched_interval=1
ReturnToService=2
KillWait=10
MinJobAge=300
NodeName=$host NodeAddr=127.0.0.1 CPUs=2 RealMemory=64000 Gres=gpu:fake:2 State=UNKNOWN
PartitionName=d3s-gpu Nodes=$host Default=YES MaxTime=60 State=UP
PartitionName=d3s-cpu Nodes=$host MaxTime=60 State=UP
EOF

  on_node slurmdbd # reads slurmdbd.conf beside SLURM_CONF
  wait_for "$START_TIMEOUT_S" slurmdbd sacctmgr -i list cluster
  sacctmgr -i add cluster d3s >/dev/null
  sacctmgr -i add account d3s-test cluster=d3s description=tests organization=d3s >/dev/null
  sacctmgr -i add user root account=d3s-test defaultaccount=d3s-test cluster=d3s >/dev/null
  on_node slurmctld -f "$SLURM_CONF"
  wait_for "$START_TIMEOUT_S" slurmctld scontrol ping
  on_node slurmd -f "$SLURM_CONF"
  wait_for "$START_TIMEOUT_S" "the node (slurmd)" sh -c 'sinfo -h -N -o %t | grep -qx idle'

  # the watchdog: stops the cluster when its owner ends or its time is up, whichever comes first
  setsid bash -c '
    deadline=$((SECONDS + $3))
    while kill -0 "$2" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 2; done
    exec "$1" stop "$4"
  ' watchdog "$(realpath "$0")" "$owner" "${D3S_SLURM_MAX_S:-1800}" "$DIR" </dev/null >>"$DIR/watchdog.log" 2>&1 &
  echo $! >"$DIR/watchdog.pid"
}

# stop_pid FILE NAME: end the process whose pid FILE holds, if it still is NAME (pids are reused)
stop_pid() {
  [ -s "$1" ] || return 0
  local pid
  pid=$(cat "$1")
  case "$(basename "$(readlink "/proc/$pid/exe" 2>/dev/null)")" in
    "$2" | "$2-wlm") ;; # Debian links slurmd to slurmd-wlm
    *) return 0 ;;
  esac
  kill "$pid" 2>/dev/null || return 0
  local deadline=$((SECONDS + 20))
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
}

stop() {
  DIR=$(realpath -m "$1")
  export SLURM_CONF="$DIR/etc/slurm.conf"
  # the jobs first (their processes are slurmstepd's, not the daemons' children), for up to 30 s
  if [ -s "$DIR/slurmctld.pid" ] && timeout 10 scontrol ping >/dev/null 2>&1; then
    timeout 10 scancel --user=root --quiet || true
    local deadline=$((SECONDS + 30))
    while [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
  fi
  for daemon in "${DAEMONS[@]}"; do
    stop_pid "$DIR/$daemon.pid" "$daemon"
  done
  if [ -s "$DIR/linked" ]; then
    rm -f "$(cat "$DIR/linked")" "$DIR/linked"
  fi
  # the watchdog last, unless it is this process (it stops the cluster by exec-ing this script)
  if [ -s "$DIR/watchdog.pid" ] && [ "$(cat "$DIR/watchdog.pid")" != $$ ]; then
    kill "$(cat "$DIR/watchdog.pid")" 2>/dev/null || true
  fi
}

case "${1:-}" in
  missing) missing ;;
  install) install ;;
  start) start "${2:?usage: $0 start DIR [PID]}" "${3:-}" ;;
  stop) stop "${2:?usage: $0 stop DIR}" ;;
  *)
    echo "usage: $0 missing | install | start DIR [PID] | stop DIR" >&2
    exit 2
    ;;
esac
