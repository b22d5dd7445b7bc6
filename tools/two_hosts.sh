#!/usr/bin/env bash
# Two hosts inside this machine: network, UTS, mount and PID namespaces `a` and `b`, joined by a
# veth pair (both ends named $TWO_HOSTS_IFACE, default wire0), 198.18.0.1 on a and 198.18.0.2 on
# b (198.18.0.0/15 is reserved for benchmarking: no real network is named), loopback up, no
# IPv6 and no route out of the pair. Each host has its own hostname (`a`, `b`), its own
# /etc/hosts (its name -> 127.0.1.1, as Debian writes it, and the peer's name -> its address),
# /dev/shm (a tmpfs) and /tmp/ray (Ray's default temp dir); the rest of the file system is
# shared, like a cluster's shared disk. Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN), iproute2
# and util-linux.
#
#   tools/two_hosts.sh up DIR          make the hosts and hold them until stdin closes or a
#                                      signal (Ctrl-C); then remove everything. DIR (created,
#                                      or empty) keeps their state; nothing else is written.
#   tools/two_hosts.sh run DIR a|b CMD [ARG...]   CMD on host a or b (its cwd: this one; it
#                                                 gets SIGTERM if this command dies)
#   tools/two_hosts.sh link DIR down|up           pull b's end of the cable, or plug it back
#   tools/two_hosts.sh kill DIR a|b    SIGKILL every process on the host (but the harness's
#                                      init); its network stays, and it can run more
#   tools/two_hosts.sh ps DIR a|b      the processes on the host, as it sees them
#
# Nothing outlives `up`: every process a host runs is in its PID namespace, whose init dies
# with `up` (the kernel then kills the rest), also when `up` itself is killed with -9 (the
# holders ask for a parent-death signal); the namespaces are anonymous, held only by those
# processes, so the kernel removes them and the veth pair with the last of them.
set -euo pipefail

IFACE=${TWO_HOSTS_IFACE:-wire0}
declare -A ADDR=([a]=198.18.0.1 [b]=198.18.0.2)
declare -A PEER=([a]=b [b]=a)
PREFIX=30  # the two addresses and nothing else

die() { echo "two_hosts.sh: $*" >&2; exit 1; }

need_tools() {
  local t
  for t in ip unshare nsenter setpriv; do
    command -v "$t" >/dev/null || die "$t is not installed (apt-get install iproute2 util-linux)"
  done
}

host_arg() {
  [[ ${1:-} == a || ${1:-} == b ]] || die "no host '${1:-}': the hosts are a and b"
}

pid_of() {  # pid_of DIR a|b machine|init
  local file=$1/$2.$3
  [[ -s $file ]] || die "$1 holds no hosts (is \`two_hosts.sh up $1\` running?)"
  cat "$file"
}

init_of() {  # the child of `unshare` that is pid 1 of its new PID namespace
  local child
  for child in $(cat "/proc/$1/task/$1/children" 2>/dev/null); do
    if grep -qE '^NSpid:.*[[:space:]]1$' "/proc/$child/status" 2>/dev/null; then
      echo "$child"
      return
    fi
  done
}

# One host's machine: its network, hostname and mounts, held by a `sleep` that dies with its
# parent (`up`). Runs inside the new namespaces.
machine_setup() {
  local dir=$1 h=$2
  hostname "$h"
  mount --bind "$dir/$h/hosts" /etc/hosts
  mount -t tmpfs -o size=1g,mode=1777 "two-hosts-$h-shm" /dev/shm
  mount --bind "$dir/$h/ray" /tmp/ray
  ip link set lo up
  echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6
  echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6
  touch "$dir/$h.ready"
  exec sleep infinity
}

up() {
  local dir=${1:?usage: two_hosts.sh up DIR}
  need_tools
  [[ $(id -u) == 0 ]] || die "needs root (network namespaces and veth pairs)"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [[ -z $(ls -A "$dir") ]] || die "$dir is not empty"
  mkdir -p /tmp/ray  # the mount point each host's own /tmp/ray goes on
  STATE=$dir  # (a global: the EXIT trap runs after `up` has returned)
  trap teardown EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM HUP
  local h
  for h in a b; do
    mkdir -p "$dir/$h/ray"
    printf '127.0.0.1 localhost\n127.0.1.1 %s\n%s %s\n' \
        "$h" "${ADDR[${PEER[$h]}]}" "${PEER[$h]}" > "$dir/$h/hosts"
    setpriv --pdeathsig KILL unshare --net --uts --mount --propagation private \
        bash -c "$(declare -f machine_setup); machine_setup '$dir' $h" &
    echo $! > "$dir/$h.machine"
  done
  local waited=0
  until [[ -e $dir/a.ready && -e $dir/b.ready ]]; do
    sleep 0.05
    (( ++waited < 200 )) || die "the hosts' namespaces did not come up"
  done
  ip link add "$IFACE" netns "$(cat "$dir/a.machine")" type veth \
      peer name "$IFACE" netns "$(cat "$dir/b.machine")"
  for h in a b; do
    nsenter -t "$(cat "$dir/$h.machine")" -n ip addr add "${ADDR[$h]}/$PREFIX" dev "$IFACE"
    nsenter -t "$(cat "$dir/$h.machine")" -n ip link set "$IFACE" up
    # Its processes: a PID namespace whose init dies with `up`. The init is bash, which reaps
    # orphans, idle on a pipe it holds both ends of (no child of its own to tell from the run's).
    setpriv --pdeathsig KILL nsenter -t "$(cat "$dir/$h.machine")" -n -u -m \
        unshare --pid --fork --kill-child --mount-proc \
        bash -c 'trap "" INT TERM HUP; exec 3<> <(:); while :; do read -t 1 -u 3 || :; done' \
        </dev/null >/dev/null 2>&1 &
    local holder=$! init=
    waited=0
    until init=$(init_of "$holder") && [[ -n $init ]]; do
      sleep 0.05
      (( ++waited < 200 )) || die "host $h's PID namespace did not start"
    done
    echo "$init" > "$dir/$h.init"
  done
  echo "two hosts up: a ${ADDR[a]}, b ${ADDR[b]} (interface $IFACE); state in $dir"
  # Held until stdin closes (a caller's pipe, or Ctrl-D in a terminal) or a signal.
  while read -r _; do :; done
}

teardown() {
  local dir=$STATE h kind pid
  trap - EXIT INT TERM HUP
  exec 2>/dev/null
  for h in a b; do  # every process of the host, then its namespaces
    for kind in init machine; do
      pid=$(cat "$dir/$h.$kind" 2>/dev/null) || continue
      kill -KILL "$pid" 2>/dev/null || true
    done
  done
  wait 2>/dev/null || true  # (the shell's notes on jobs it killed go nowhere)
  rm -rf "${dir:?}/a" "${dir:?}/b" "$dir"/{a,b}.{machine,init,ready}
}

run() {
  local dir=${1:?usage: two_hosts.sh run DIR a|b CMD...} h=${2:-}
  host_arg "$h"
  shift 2
  (( $# )) || die "usage: two_hosts.sh run DIR a|b CMD [ARG...]"
  # CMD gets SIGTERM if this wrapper dies (nsenter forks it, and passes no signal on)
  exec nsenter -t "$(pid_of "$dir" "$h" init)" -n -u -m -p --wd="$PWD" -- \
      setpriv --pdeathsig TERM -- "$@"
}

link() {
  local dir=${1:?usage: two_hosts.sh link DIR down|up} state=${2:-}
  [[ $state == down || $state == up ]] || die "link: down or up, not '$state'"
  nsenter -t "$(pid_of "$dir" b machine)" -n ip link set "$IFACE" "$state"
}

kill_host() {  # kill(-1) in a PID namespace: every process there but its init and the caller
  local dir=${1:?usage: two_hosts.sh kill DIR a|b} h=${2:-}
  host_arg "$h"
  nsenter -t "$(pid_of "$dir" "$h" init)" -p -m -- bash -c 'kill -KILL -1'
}

ps_host() {
  local dir=${1:?usage: two_hosts.sh ps DIR a|b} h=${2:-}
  host_arg "$h"
  nsenter -t "$(pid_of "$dir" "$h" init)" -p -m -- ps -o pid,ppid,stat,args -e
}

case ${1:-} in
  up) shift; up "$@" ;;
  run) shift; run "$@" ;;
  link) shift; link "$@" ;;
  kill) shift; kill_host "$@" ;;
  ps) shift; ps_host "$@" ;;
  *) die "usage: two_hosts.sh up|run|link|kill|ps DIR ... (see the top of this file)" ;;
esac
