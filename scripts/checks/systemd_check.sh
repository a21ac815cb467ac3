#!/usr/bin/env bash
# Real-systemd check of systemd/README.md: boots Debian bookworm (systemd as PID 1) in
# systemd-nspawn, installs this checkout exactly as the guide says, and prints one
# PASS/FAIL/SKIP line per promise the guide makes. Not part of `make test` (needs root,
# minutes, and network for debootstrap and PyPI).
#
#   sudo scripts/checks/systemd_check.sh            # as root; ~10 min with a warm cache
#
# Environment:
#   DFLASH_CHECK_CACHE   rootfs and pip cache, kept between runs
#                        (default /var/cache/dflash-systemd-check)
#   DFLASH_CHECK_MIRROR  Debian archive for debootstrap (default http://deb.debian.org/debian)
#   TORCH_WHEEL          a local CPU torch wheel for cp311 (default: /opt/wheels/torch-*cpu*cp311*
#                        if present, else `pip install torch --index-url .../whl/cpu` as the
#                        guide says)
#   DFLASH_CHECK_KEEP=1  leave the container's root folder for inspection
#
# The checkout's HEAD is what gets installed (as `git clone` would): commit first.
# On hosts without a systemd of their own (containers, CI sandboxes) nspawn needs
# --keep-unit --register=no, and machinectl is unavailable: the container is driven with
# nsenter into its PID 1. Exit status: 0 if nothing failed, 1 if a check failed, 2 if the
# container could not be set up.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CACHE=${DFLASH_CHECK_CACHE:-/var/cache/dflash-systemd-check}
MIRROR=${DFLASH_CHECK_MIRROR:-http://deb.debian.org/debian}
# What the guide's install steps need (git, a compiler and headers for the C extensions,
# python3-venv) plus what the check itself uses (sudo, procps, util-linux's runuser).
PACKAGES=systemd,systemd-sysv,dbus,sudo,git,gcc,python3,python3-venv,python3-dev,python3-pip,ca-certificates,util-linux,procps,iproute2

setup_fail() {
    echo "FAIL setup: $*"
    exit 2
}

[ "$(id -u)" = 0 ] || setup_fail "must run as root (debootstrap, systemd-nspawn, nsenter)"
for tool in systemd-nspawn debootstrap nsenter git; do
    command -v "$tool" >/dev/null || setup_fail "$tool not found (apt-get install systemd-container debootstrap git util-linux)"
done
if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
    echo "note: uncommitted changes in $REPO are not part of the check (HEAD is installed)" >&2
fi

mkdir -p "$CACHE/pip"
BASE=$CACHE/base
if [ ! -f "$BASE/.dflash-packages" ] || [ "$(cat "$BASE/.dflash-packages")" != "$PACKAGES" ]; then
    echo "debootstrap bookworm from $MIRROR into $BASE (once; cached)" >&2
    rm -rf "$BASE.tmp"
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$BASE.tmp" "$MIRROR" \
        >"$CACHE/debootstrap.log" 2>&1 || setup_fail "debootstrap failed, see $CACHE/debootstrap.log"
    echo "$PACKAGES" >"$BASE.tmp/.dflash-packages"
    rm -rf "$BASE"
    mv "$BASE.tmp" "$BASE"
fi

MACHINE=$CACHE/machine
NSPAWN_PID=
cleanup() {
    if [ -n "$NSPAWN_PID" ] && kill -0 "$NSPAWN_PID" 2>/dev/null; then
        kill -TERM "$NSPAWN_PID" 2>/dev/null || true  # nspawn asks the container to power off
        for _ in $(seq 100); do kill -0 "$NSPAWN_PID" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$NSPAWN_PID" 2>/dev/null || true
    fi
    [ "${DFLASH_CHECK_KEEP:-0}" = 1 ] || rm -rf "$MACHINE"
}
trap cleanup EXIT

rm -rf "$MACHINE"
cp -a --reflink=auto "$BASE" "$MACHINE"
# Network from inside: the host's CA certificates (pip over TLS, proxies with their own CA),
# its resolver, and a hosts file that knows localhost (torchrun's rendezvous binds it).
cp /etc/ssl/certs/ca-certificates.crt "$MACHINE/etc/ssl/certs/ca-certificates.crt"
cp -L /etc/resolv.conf "$MACHINE/etc/resolv.conf"
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tdflash-check\n' \
    >"$MACHINE/etc/hosts"
echo dflash-check >"$MACHINE/etc/hostname"

# What `git clone <repo>` would fetch: HEAD, as a bundle the guest clones from.
mkdir -p "$MACHINE/root/check"
git -C "$REPO" bundle create "$MACHINE/root/check/repo.bundle" HEAD 2>/dev/null
cp "$HERE/systemd_check_guest.sh" "$MACHINE/root/check/guest.sh"
WHEEL=${TORCH_WHEEL:-$(ls /opt/wheels/torch-*cpu*cp311*.whl 2>/dev/null | head -1 || true)}
if [ -n "$WHEEL" ]; then
    cp "$WHEEL" "$MACHINE/root/check/"
fi

systemd-nspawn -D "$MACHINE" --keep-unit --register=no --boot --console=passive \
    --machine=dflash-check --bind="$CACHE/pip:/root/.cache/pip" \
    >"$CACHE/nspawn.log" 2>&1 &
NSPAWN_PID=$!
LEADER=
for _ in $(seq 150); do
    LEADER=$(pgrep -P "$NSPAWN_PID" | head -1 || true)
    [ -n "$LEADER" ] && [ "$(cat "/proc/$LEADER/comm" 2>/dev/null)" = systemd ] && break
    sleep 0.2
done
[ -n "$LEADER" ] || setup_fail "the container did not boot, see $CACHE/nspawn.log"
inside() {
    nsenter -t "$LEADER" -a -- /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root LANG=C.UTF-8 TERM=dumb "$@"
}
state=$(inside timeout 120 systemctl is-system-running --wait || true)
case "$state" in
    running | degraded) ;;
    *) setup_fail "systemd in the container is '$state', see $CACHE/nspawn.log" ;;
esac
echo "PASS boot: systemd $(inside systemctl --version | head -1 | cut -d' ' -f2) is PID 1 in Debian $(cat "$MACHINE/etc/debian_version"), system state $state"

set +e
inside bash /root/check/guest.sh | tee "$CACHE/results.txt"
set -e
if grep -q '^FAIL' "$CACHE/results.txt"; then
    exit 1
fi
