#!/usr/bin/env bash
# Installs what the test suite needs, if it is missing:
#   - OpenSSH server and client (tests start a private sshd on 127.0.0.1),
#   - moto's EC2 emulator in .venv (tests start it on 127.0.0.1),
#   - prometheus_client in .venv (a test parses `dormant metrics` with its parser),
#   - cargo-deb (the package check builds the .deb) and systemd-analyze
#     (it verifies the package's units).
#   - QEMU from bookworm-backports, debootstrap, cloud-image-utils, genisoimage
#     and cloud-init (the qemu provider's tests boot real VMs; cloud-init's
#     `schema` command validates the user-data dormant builds).
# Idempotent and quick when everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else
    echo "install-test-deps: need root to run: $*" >&2
    echo "  install it by hand: apt-get install -y openssh-server openssh-client" >&2
    exit 1
  fi
}

if [ ! -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null 2>&1 || ! command -v ssh-keygen >/dev/null 2>&1; then
  echo "install-test-deps: installing openssh-server and openssh-client"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq openssh-server openssh-client >/dev/null
fi
# Debian's sshd refuses to start without its privilege-separation directory.
[ -d /run/sshd ] || as_root mkdir -p /run/sshd

if [ ! -x .venv/bin/moto_server ]; then
  echo "install-test-deps: installing moto (EC2 emulator) into .venv"
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check 'moto[ec2]==5.2.5' 'flask==3.1.3' 'flask-cors==6.0.5'
fi
# Pinned: the metrics test reads the samples its text parser returns.
PROMETHEUS_CLIENT_VERSION=0.26.0
if [ "$(.venv/bin/python -c 'import prometheus_client.parser, importlib.metadata as m; print(m.version("prometheus-client"))' 2>/dev/null)" != "$PROMETHEUS_CLIENT_VERSION" ]; then
  echo "install-test-deps: installing prometheus_client $PROMETHEUS_CLIENT_VERSION into .venv"
  .venv/bin/pip install --quiet --disable-pip-version-check "prometheus-client==$PROMETHEUS_CLIENT_VERSION"
fi
# Pinned: the package check reads cargo-deb's output and metadata keys.
CARGO_DEB_VERSION=3.8.0
if [ "$(cargo deb --version 2>/dev/null)" != "cargo-deb $CARGO_DEB_VERSION" ]; then
  echo "install-test-deps: installing cargo-deb $CARGO_DEB_VERSION (about 2 minutes, once)"
  cargo install cargo-deb --locked --version "$CARGO_DEB_VERSION" --quiet
fi
if ! command -v systemd-analyze >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
  echo "install-test-deps: installing systemd (for systemd-analyze) and dpkg"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq systemd dpkg >/dev/null
fi
# QEMU comes from bookworm-backports: bookworm's own 7.2 would replace the
# newer qemu-utils some machines already carry. The backports line reuses the
# mirror of the machine's own bookworm source, in a file of its own.
QEMU_VERSION="1:10.0.2+ds-2+deb13u1~bpo12+1"
need_qemu=0
for pkg in qemu-system-x86 qemu-utils; do
  [ "$(dpkg-query -W -f='${Status} ${Version}' "$pkg" 2>/dev/null)" = "install ok installed $QEMU_VERSION" ] || need_qemu=1
done
for tool in debootstrap cloud-localds genisoimage cloud-init; do
  command -v "$tool" >/dev/null 2>&1 || need_qemu=1
done
if [ "$need_qemu" -eq 1 ]; then
  src=/etc/apt/sources.list.d/dormant-bookworm-backports.sources
  if [ ! -f "$src" ]; then
    mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
      | grep -v '^ *#' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ' || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    echo "install-test-deps: adding bookworm-backports from $mirror"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$mirror" | as_root tee "$src" >/dev/null
  fi
  echo "install-test-deps: installing QEMU $QEMU_VERSION, debootstrap, cloud-image-utils, genisoimage, cloud-init"
  as_root apt-get update -qq
  # cloud-init is only used on the host to validate user-data (`cloud-init schema`):
  # never let it configure this machine at boot.
  as_root mkdir -p /etc/cloud
  [ -f /etc/cloud/cloud-init.disabled ] || as_root touch /etc/cloud/cloud-init.disabled
  # -t: QEMU's dependencies (seabios, ...) must come from backports as well.
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
    -t bookworm-backports "qemu-system-x86=$QEMU_VERSION" "qemu-utils=$QEMU_VERSION" >/dev/null
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
    debootstrap cloud-image-utils genisoimage cloud-init >/dev/null
fi
echo "install-test-deps: sshd $(/usr/sbin/sshd -V 2>&1 | head -1 || true); moto $(.venv/bin/python -c 'import moto; print(moto.__version__)'); prometheus_client $PROMETHEUS_CLIENT_VERSION; $(qemu-system-x86_64 --version | head -1)"
