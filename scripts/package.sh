#!/usr/bin/env bash
# The Debian package (cargo-deb; scripts/install-test-deps.sh installs the pinned version).
#
#   scripts/package.sh           the package to ship: a release build with fat LTO
#                                (10-20 min cold on 2 cores), stripped, in target/debian/.
#   scripts/package.sh --check   what CI runs: packages the debug binary the test
#                                suite already built (no second build), then checks
#                                the file list, the control data, the units
#                                (systemd-analyze verify), that the shipped
#                                /etc/dormant/config.toml parses, and the metrics
#                                writer. A release build would add 10-20 min to
#                                every CI run and check nothing more about the
#                                package: the binary's code is what the tests test.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" != "--check" ]; then
  # Fat LTO for the shipped binary only: a cold build costs the same with it
  # (729 s against 737 s on 2 cores) and the binary is 28 % smaller (16.9 MB
  # against 23.6 MB); a developer's rebuild after a change would be 8x slower
  # (233 s against 29 s), so the release profile itself keeps it off. See
  # docs/performance.md.
  CARGO_PROFILE_RELEASE_LTO=fat cargo deb
  exit
fi

fail() { echo "package check: $*" >&2; exit 1; }

# A no-op after `cargo test --all-features` (same profile and features).
cargo build --quiet --all-features --bin dormant
# cargo-deb maps `target/release/` in the asset list to the profile's
# directory; a profile name of our own points it at this staging dir.
stage=target/deb-check
rm -rf "$stage"
mkdir -p "$stage"
cp target/debug/dormant "$stage/"
cp -r target/debug/dormant-assets "$stage/"
cargo deb --quiet --no-build --profile deb-check --fast --output "$stage/dormant.deb"
deb=$stage/dormant.deb

# 1. The file list: exactly these paths (directories left out), with modes.
expected="-rw-r--r-- ./etc/dormant/config.toml
-rwxr-xr-x ./usr/bin/dormant
-rw-r--r-- ./usr/lib/systemd/system/dormant-metrics.service
-rw-r--r-- ./usr/lib/systemd/system/dormant-metrics.timer
-rw-r--r-- ./usr/lib/systemd/system/dormant-sweep.service
-rw-r--r-- ./usr/lib/systemd/system/dormant-sweep.timer
-rw-r--r-- ./usr/lib/systemd/system/dormant-warm.service
-rw-r--r-- ./usr/lib/systemd/system/dormant-warm.timer
-rwxr-xr-x ./usr/libexec/dormant/metrics-textfile
-rw-r--r-- ./usr/share/bash-completion/completions/dormant
-rw-r--r-- ./usr/share/doc/dormant/README.md
-rw-r--r-- ./usr/share/doc/dormant/copyright
-rw-r--r-- ./usr/share/doc/dormant/examples/gitlab-runner-config.toml
-rw-r--r-- ./usr/share/fish/vendor_completions.d/dormant.fish
$(for c in "" -adopt -attach -cleanup -config -events -inspect -list -metrics -pause -prepare -release -run -shell -sweep -try -warm; do
    echo "-rw-r--r-- ./usr/share/man/man1/dormant$c.1.gz"; done)
-rw-r--r-- ./usr/share/zsh/vendor-completions/_dormant"
actual=$(dpkg-deb -c "$deb" | awk '$1 !~ /^d/ {print $1, $6}' | sort -k2)
expected=$(echo "$expected" | sort -k2)
if [ "$actual" != "$expected" ]; then
  diff <(echo "$expected") <(echo "$actual") >&2 || true
  fail "the file list differs from the expected one (< expected, > in $deb)"
fi

# 2. Control data: the config is a conffile; dependencies; the postinst
#    enables the timers.
ctl=$stage/control
dpkg-deb -e "$deb" "$ctl"
[ "$(cat "$ctl/conffiles")" = "/etc/dormant/config.toml" ] ||
  fail "conffiles is not exactly /etc/dormant/config.toml: $(cat "$ctl/conffiles")"
dpkg-deb -f "$deb" Depends | grep -q 'openssh-client' || fail "Depends lacks openssh-client"
for unit in dormant-sweep.timer dormant-metrics.timer dormant-warm.timer; do
  grep -q "deb-systemd-helper enable $unit" "$ctl/postinst" || fail "postinst does not enable $unit"
done
dpkg-deb -x "$deb" "$stage/root"
root=$(cd "$stage/root" && pwd)
# Stripped: no symbol table (cargo-deb strips with binutils' strip).
if readelf -S "$root/usr/bin/dormant" | grep -q '\.symtab'; then
  fail "usr/bin/dormant is not stripped"
fi

# 3. The units: verified against the extracted tree (ExecStart paths, man
#    pages of Documentation=), with the host's own units (timers.target ...)
#    beside them. Any message is a failure, warnings included.
cp -rn /usr/lib/systemd/system/. "$root/usr/lib/systemd/system/"
units="dormant-sweep.service dormant-sweep.timer dormant-metrics.service dormant-metrics.timer dormant-warm.service dormant-warm.timer"
# shellcheck disable=SC2086
out=$(MANPATH="$root/usr/share/man" systemd-analyze verify --root="$root" $units 2>&1) ||
  fail "systemd-analyze verify failed: $out"
[ -z "$out" ] || fail "systemd-analyze verify complained: $out"

# 4. The shipped config parses, and runs the local provider like no file at all.
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
DORMANT_STATE_DIR=$state "$root/usr/bin/dormant" --config "$root/etc/dormant/config.toml" list >/dev/null ||
  fail "the shipped /etc/dormant/config.toml does not load"
"$root/usr/bin/dormant" --version | grep -q "^dormant " || fail "the packaged binary does not run"
zcat "$root/usr/share/man/man1/dormant.1.gz" | grep -q '^\.TH dormant 1' || fail "dormant.1 is not a man page"
bash -n "$root/usr/share/bash-completion/completions/dormant" || fail "the bash completion does not parse"

# 5. The metrics writer: writes dormant.prom atomically and keeps the last good
#    file when `dormant metrics` fails.
textfile=$state/textfile
mkdir -p "$textfile"
cat >"$state/dormant" <<EOF
#!/bin/sh
exec "$root/usr/bin/dormant" --config "$root/etc/dormant/config.toml" "\$@"
EOF
chmod 755 "$state/dormant"
DORMANT_STATE_DIR=$state/s DORMANT_BIN=$state/dormant "$root/usr/libexec/dormant/metrics-textfile" "$textfile" ||
  fail "metrics-textfile failed"
grep -q '^dormant_' "$textfile/dormant.prom" || fail "dormant.prom holds no dormant_ metric"
[ "$(stat -c %a "$textfile/dormant.prom")" = 644 ] || fail "dormant.prom is not world-readable"
good=$(cat "$textfile/dormant.prom")
if DORMANT_BIN=/bin/false "$root/usr/libexec/dormant/metrics-textfile" "$textfile" 2>/dev/null; then
  fail "metrics-textfile succeeded although dormant metrics failed"
fi
[ "$(cat "$textfile/dormant.prom")" = "$good" ] || fail "a failed run replaced dormant.prom"
[ "$(ls -A "$textfile")" = "dormant.prom" ] || fail "temp files left in the textfile dir: $(ls -A "$textfile")"

echo "package check: $deb ok ($(dpkg-deb -c "$deb" | grep -vc '^d') files, units verified)"
