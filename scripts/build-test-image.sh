#!/usr/bin/env bash
# Builds the small Debian VM image the qemu provider's tests boot, and prints
# the directory holding it (last line of stdout):
#   base.qcow2   root filesystem (ext4 on the whole disk, no partition table)
#   vmlinuz      kernel and initrd, copied out for direct kernel boot
#   initrd.img
#   packages.txt the exact package versions the image holds
#
# The image is cached outside the repository, keyed by a hash of this script:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/dormant/test-image-<hash>/
# so a second run (or a second worktree) reuses it in a fraction of a second;
# editing this script builds a new one.
#
# What is in it and why (see docs/qemu.md, "Images"):
#   - Debian bookworm from the machine's own Debian mirror, systemd, the stock
#     kernel, OpenSSH and cloud-init (installed with apt inside the chroot:
#     `debootstrap --include=cloud-init` fails on a dependency).
#   - cloud-init reads only the NoCloud datasource (the seed ISO dormant
#     attaches), makes only ed25519 and ECDSA host keys (RSA costs 15-20 s
#     without KVM), and skips modules that only cost time here.
#   - systemd-networkd configures the NIC by DHCP; cloud-init's own network
#     rendering is off.
#   - No host keys and an empty machine-id: every VM made from it gets its own.
# Needs root, debootstrap, mke2fs and qemu-img (scripts/install-test-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=bookworm
hash=$(sha256sum "$0" | cut -c1-16)
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/dormant"
out="$cache_root/test-image-$hash"
if [ -f "$out/done" ]; then
  echo "build-test-image: reusing $out" >&2
  echo "$out"
  exit 0
fi

for tool in debootstrap mke2fs qemu-img; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "build-test-image: $tool is missing: run scripts/install-test-deps.sh" >&2
    exit 1
  }
done
[ "$(id -u)" -eq 0 ] || { echo "build-test-image: debootstrap needs root" >&2; exit 1; }

# The machine's own Debian mirror (the first non-comment `.../debian` URI).
mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
  | grep -v '^ *#' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ' || true)
mirror=${mirror:-http://deb.debian.org/debian}

mkdir -p "$cache_root"
work=$(mktemp -d "$cache_root/build-XXXXXX")
root="$work/root"
mounted=()
cleanup() {
  for m in "${mounted[@]}"; do umount -l "$m" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

start=$(date +%s)
echo "build-test-image: debootstrap $SUITE from $mirror" >&2
debootstrap --variant=minbase "$SUITE" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
  tail -30 "$work/debootstrap.log" >&2
  exit 1
}

for fs in proc sys dev; do
  mount --bind "/$fs" "$root/$fs"
  mounted=("$root/$fs" "${mounted[@]}")
done
# No service may start inside the chroot.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod +x "$root/usr/sbin/policy-rc.d"

in_root() { chroot "$root" env DEBIAN_FRONTEND=noninteractive LC_ALL=C "$@"; }
echo "build-test-image: installing systemd, kernel, openssh-server, cloud-init" >&2
in_root apt-get update -qq >>"$work/apt.log" 2>&1
in_root apt-get install -y -qq --no-install-recommends \
  systemd-sysv udev dbus linux-image-amd64 openssh-server cloud-init sudo iproute2 procps \
  >>"$work/apt.log" 2>&1 || { tail -30 "$work/apt.log" >&2; exit 1; }
in_root apt-get clean
rm -f "$root/usr/sbin/policy-rc.d"

# cloud-init: NoCloud only, cheap host keys, no network rendering, no slow modules.
cat >"$root/etc/cloud/cloud.cfg.d/90-dormant-test.cfg" <<'EOF'
datasource_list: [ NoCloud, None ]
ssh_genkeytypes: [ ed25519, ecdsa ]
ssh_deletekeys: true
network: { config: disabled }
# The hostname from meta-data resolves without DNS (sudo looks it up).
manage_etc_hosts: localhost
EOF
sed -i -e '/^ - grub-dpkg$/d' -e '/^ - locale$/d' -e '/^ - keys-to-console$/d' \
  -e '/^ - ssh-authkey-fingerprints$/d' -e '/^ - apt-configure$/d' -e '/^ - ntp$/d' \
  -e '/^ - snap$/d' -e '/^ - byobu$/d' -e '/^ - package-update-upgrade-install$/d' \
  "$root/etc/cloud/cloud.cfg"

# The NIC by DHCP through systemd-networkd.
cat >"$root/etc/systemd/network/20-dhcp.network" <<'EOF'
[Match]
Name=en* eth*

[Network]
DHCP=ipv4
EOF
in_root systemctl enable systemd-networkd >/dev/null 2>&1
# sshd starts after cloud-init made its host keys and installed the user's key.
mkdir -p "$root/etc/systemd/system/ssh.service.d"
printf '[Unit]\nAfter=cloud-init.service\n' >"$root/etc/systemd/system/ssh.service.d/after-cloud-init.conf"
in_root systemctl mask e2scrub_reap.service apt-daily.timer apt-daily-upgrade.timer >/dev/null 2>&1 || true

# Root filesystem on the whole disk; the console on the first serial port.
echo '/dev/vda / ext4 rw,errors=remount-ro 0 1' >"$root/etc/fstab"
echo dormant-test >"$root/etc/hostname"

# Every VM gets its own identity.
rm -f "$root"/etc/ssh/ssh_host_*
: >"$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id"
rm -rf "$root/var/lib/cloud"/* "$root/var/log/cloud-init"*

in_root dpkg-query -W -f='${Package} ${Version}\n' >"$work/packages.txt"
kernel=$(ls "$root"/boot/vmlinuz-* | sort -V | tail -1)
initrd=$(ls "$root"/boot/initrd.img-* | sort -V | tail -1)
cp "$kernel" "$work/vmlinuz"
cp "$initrd" "$work/initrd.img"

for m in "${mounted[@]}"; do umount -l "$m"; done
mounted=()

echo "build-test-image: making the disk" >&2
mke2fs -q -t ext4 -L root -d "$root" "$work/root.img" 2G >&2
qemu-img convert -c -f raw -O qcow2 "$work/root.img" "$work/base.qcow2"
rm -f "$work/root.img"

mkdir -p "$out.tmp"
mv "$work/base.qcow2" "$work/vmlinuz" "$work/initrd.img" "$work/packages.txt" "$out.tmp/"
chmod 0444 "$out.tmp/base.qcow2"
date -u +%FT%TZ >"$out.tmp/done"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "build-test-image: built $out in $(( $(date +%s) - start )) s" >&2
echo "$out"
