#!/usr/bin/env bash
# Several "hosts" on one Linux box (root only): each host is a network namespace with its own address
# on a bridge, plus its own PID and mount namespaces, so `ray stop`, `pkill` and a host's death touch
# only that host's processes, and each host has its own /tmp/ray. The filesystem (and so the checkout,
# the Python environment and ~/.ray/auth_token) is shared, as the file mounts of a `ray up` config
# would make it.
#
#   experiments/netns_cluster.sh up [WORKERS]     # head + WORKERS worker hosts (default 2)
#   experiments/netns_cluster.sh run HOST CMD...  # run CMD on HOST (head, w1, w2, ...)
#   experiments/netns_cluster.sh ray-up           # `ray start` on every host (head first), token auth on
#   experiments/netns_cluster.sh sshd HOST KEYS [NAME=VALUE...]  # sshd on HOST (keys only), NAME=VALUE in its sessions
#   experiments/netns_cluster.sh kill HOST        # SIGKILL every process of HOST (the host dies)
#   experiments/netns_cluster.sh shape HOST PEER [rate 100mbit] [loss 1%]  # HOST -> PEER traffic only
#   experiments/netns_cluster.sh partition A B    # nothing passes between A and B (iptables, both ways)
#   experiments/netns_cluster.sh heal HOST...     # remove every shaping and partition of these hosts
#   experiments/netns_cluster.sh address HOST     # the host's IP address
#   experiments/netns_cluster.sh down             # remove every host, bridge and process it made
#
# Addresses: the bridge (this root namespace) is 198.51.100.1, the head .10, worker i .1i. Only that
# documentation range and loopback carry traffic. Worker i offers the Ray resource `tandem_host_wi`
# and, as the GPU node types of the `ray up` configs do, w1 offers `tandem_prefill` and every other
# worker host `tandem_decode`.
set -euo pipefail

STATE=${TANDEM_NETNS_STATE:-/run/tandem-netns}
BRIDGE=tnd-br0
PREFIX=198.51.100

hosts() { cat "$STATE/hosts" 2>/dev/null || true; }
address() { case $1 in head) echo "$PREFIX.10" ;; w*) echo "$PREFIX.1${1#w}" ;; *) echo "unknown host $1" >&2; exit 2 ;; esac; }
anchor() { cat "$STATE/$1/anchor"; }

run() {  # run CMD on HOST: its network, PID and mount namespaces, its own TMPDIR
    local host=$1; shift
    [ -f "$STATE/$host/anchor" ] || { echo "no host $host (run: $0 up)" >&2; exit 2; }
    nsenter -t "$(anchor "$host")" -n -p -m -- env TMPDIR="$STATE/$host/tmp" TANDEM_HOST="$host" "$@"
}

up_host() {
    local host=$1 ns=tnd-$1 ip
    ip=$(address "$host")
    mkdir -p "$STATE/$host/tmp" "$STATE/$host/ray"
    ip netns add "$ns"
    ip link add "tnd-$host" type veth peer name eth0 netns "$ns"
    ip link set "tnd-$host" master "$BRIDGE" up
    ip -n "$ns" addr add "$ip/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" route add default via "$PREFIX.1"
    # The anchor is PID 1 of the host's PID namespace: when it dies, the kernel kills the whole host.
    ip netns exec "$ns" unshare --pid --fork --mount --propagation private --mount-proc \
        bash -c "mkdir -p /tmp/ray && mount --bind '$STATE/$host/ray' /tmp/ray && exec sleep infinity" </dev/null >/dev/null 2>>"$STATE/$host/unshare.log" &
    local unshare=$! child=""
    for _ in $(seq 100); do
        child=$(pgrep -P "$unshare" sleep || true)
        [ -n "$child" ] && break
        sleep 0.05
    done
    [ -n "$child" ] || { echo "host $host did not start" >&2; exit 1; }
    echo "$child" > "$STATE/$host/anchor"
    echo "$host" >> "$STATE/hosts"
}

up() {
    local workers=${1:-2}
    [ -z "$(hosts)" ] || { echo "already up (run: $0 down)" >&2; exit 1; }
    mkdir -p "$STATE"
    ip link add "$BRIDGE" type bridge
    ip addr add "$PREFIX.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    up_host head
    for i in $(seq "$workers"); do up_host "w$i"; done
    echo "hosts: $(hosts | tr '\n' ' ')"
}

ray_up() {
    local head_ip
    head_ip=$(address head)
    [ -f ~/.ray/auth_token ] || ray get-auth-token --generate >/dev/null
    run head env RAY_AUTH_MODE=token RAY_worker_niceness=0 RAY_USAGE_STATS_ENABLED=0 \
        ray start --head --node-ip-address="$head_ip" --port=6379 --num-cpus="${TANDEM_HEAD_CPUS:-4}" \
        --include-dashboard=false --disable-usage-stats </dev/null >"$STATE/head/ray-start.log" 2>&1 \
        || { cat "$STATE/head/ray-start.log" >&2; exit 1; }
    for host in $(hosts); do
        [ "$host" = head ] && continue
        local extra=""
        case $host in w1) extra=', "tandem_prefill": 1' ;; *) extra=', "tandem_decode": 1' ;; esac
        run "$host" env RAY_AUTH_MODE=token RAY_worker_niceness=0 RAY_USAGE_STATS_ENABLED=0 \
            ray start --address="$head_ip:6379" --node-ip-address="$(address "$host")" \
            --num-cpus="${TANDEM_WORKER_CPUS:-4}" --resources="{\"tandem_host_$host\": 1$extra}" \
            --disable-usage-stats </dev/null >"$STATE/$host/ray-start.log" 2>&1 \
            || { cat "$STATE/$host/ray-start.log" >&2; exit 1; }
    done
    echo "ray: head $head_ip:6379 and $(($(hosts | wc -l) - 1)) worker hosts"
}

sshd_up() {  # HOST AUTHORIZED_KEYS [NAME=VALUE...]: sshd on HOST's address; its sessions run on HOST
    # with a home of their own (what `ray up` writes there, ~/.bashrc included, stays on the host), in
    # which only this box's Python and tools (~/.pyenv, ~/.cargo) and shell profiles are the real ones.
    local host=$1 keys=$2 dir home; shift 2
    dir=$STATE/$host/sshd
    home=$STATE/$host/home
    mkdir -p "$dir" /run/sshd "$home"
    for f in .bashrc .profile; do [ -f "$HOME/$f" ] && cp "$HOME/$f" "$home/"; done
    for d in .pyenv .cargo; do  # what the shell profiles put on PATH
        [ -d "$HOME/$d" ] || continue
        mkdir -p "$home/$d"
        run "$host" mount --bind "$HOME/$d" "$home/$d"
    done
    run "$host" mount --rbind "$home" "$HOME"
    [ -f "$dir/host_key" ] || ssh-keygen -q -t ed25519 -N '' -f "$dir/host_key"
    {
        echo "ListenAddress $(address "$host")"
        echo "HostKey $dir/host_key"
        echo "AuthorizedKeysFile $keys"
        echo "PermitRootLogin prohibit-password"
        echo "PasswordAuthentication no"
        echo "KbdInteractiveAuthentication no"
        echo "UsePAM no"
        echo "StrictModes no"
        echo "PidFile $dir/sshd.pid"
        if [ $# -gt 0 ]; then echo "SetEnv $*"; fi
    } >"$dir/sshd_config"
    run "$host" "$(command -v sshd)" -f "$dir/sshd_config" -E "$dir/sshd.log"
}

shape() {  # HOST PEER [rate RATE] [loss PERCENT]: HOST's packets to PEER only; the rest is untouched
    local host=$1 peer=$2 ip; shift 2
    ip=$(address "$peer")
    while [ $# -gt 0 ]; do
        case $1 in
            rate)  # an HTB class for PEER's traffic (this kernel has no netem: no delay emulation)
                if ! run "$host" tc qdisc show dev eth0 | grep -q "qdisc htb 1:"; then
                    run "$host" tc qdisc add dev eth0 root handle 1: htb default 20
                    run "$host" tc class add dev eth0 parent 1: classid 1:20 htb rate 100gbit quantum 60000
                fi
                run "$host" tc class replace dev eth0 parent 1: classid 1:10 htb rate "$2" quantum 60000
                run "$host" tc filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst "$ip/32" flowid 1:10
                shift 2 ;;
            loss)  # random loss, as a fraction of packets dropped by iptables
                run "$host" iptables -A OUTPUT -d "$ip" -m statistic --mode random \
                    --probability "$(awk "BEGIN { print ${2%\%} / 100 }")" -j DROP
                shift 2 ;;
            *) echo "shape: unknown option $1 (rate RATE | loss PERCENT)" >&2; exit 2 ;;
        esac
    done
}

partition() {  # A B: nothing passes between them, in either direction
    run "$1" iptables -A OUTPUT -d "$(address "$2")" -j DROP
    run "$1" iptables -A INPUT -s "$(address "$2")" -j DROP
}

heal() {
    for host in "$@"; do
        run "$host" tc qdisc del dev eth0 root 2>/dev/null || true
        run "$host" iptables -F
    done
}

kill_host() {  # a crash: every process dies and the host falls silent (packets to it go nowhere)
    kill -9 "$(anchor "$1")"
    ip link set "tnd-$1" down
}

down() {
    for host in $(hosts); do
        [ -f "$STATE/$host/anchor" ] && kill -9 "$(anchor "$host")" 2>/dev/null || true
        ip netns del "tnd-$host" 2>/dev/null || true
        ip link del "tnd-$host" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -rf "$STATE"
}

cmd=${1:-}; shift || true
case $cmd in
    up) up "$@" ;;
    run) run "$@" ;;
    ray-up) ray_up ;;
    sshd) sshd_up "$@" ;;
    kill) kill_host "$1" ;;
    shape) shape "$@" ;;
    partition) partition "$1" "$2" ;;
    heal) heal "$@" ;;
    address) address "$1" ;;
    down) down ;;
    *) sed -n '2,22p' "$0"; exit 2 ;;
esac
