//! Volume mode inside the machine: mounting the data volume after a
//! connection, and syncing and unmounting it before it is detached. Both are
//! one shell command each, run through the environment's transport
//! (`Transport::exec`: over the job's SSH master, no new handshake), the same
//! for every provider: the provider only says where the device and the mount
//! point are (`Volumes::guest_mount`).
//!
//! The mount never starts a job on a blank or foreign volume: the first
//! mount writes the environment's id into `.dormant-volume` at the volume's
//! root, and every later mount must find it there. A volume that lost its
//! filesystem (wiped, replaced) is refused, not formatted: formatting happens
//! only on the environment's first mount, and only on a device with no
//! filesystem at all (`blkid -p` finds nothing).

use std::time::Duration;

use anyhow::{bail, Result};
use uuid::Uuid;

use crate::context::Ctx;
use crate::model::GuestMount;
use crate::text::shell_quote;
use crate::transport::{ExecOutput, Transport};

/// The mount waits up to [`DEVICE_WAIT`] for the device to show; formatting
/// a fresh volume takes seconds. Past this the command is given up.
const MOUNT_LIMIT: Duration = Duration::from_secs(180);
/// How long the mount waits for the data volume's device to show: an EBS
/// attach is reported before the guest's kernel has the disk, and udev makes
/// the `/dev/disk/by-id` link after that.
const DEVICE_WAIT: Duration = Duration::from_secs(60);
/// Sync and unmount: writing back what the job left in the page cache may
/// take a while on a slow disk.
pub const UNMOUNT_LIMIT: Duration = Duration::from_secs(300);
/// The filesystem label of a data volume formatted by dormant.
pub use crate::provider::volume::FS_LABEL as LABEL;
/// The file at the volume's root naming the environment it belongs to.
pub const MARK: &str = ".dormant-volume";
/// Lines of the commands' output meant for the log start with this.
const SAY: &str = "dormant-volume: ";

/// The first lines of both commands: how they speak, and `sudo` when not root.
fn preamble() -> String {
    format!(
        r#"say() {{ echo "{SAY}$*"; }}
fail() {{ say "error: $*"; exit 1; }}
if [ "$(id -u)" = 0 ]; then S=; else S="sudo -n"; fi
"#
    )
}

/// The mount command's device part: sets `D` to the first of `devices`
/// that exists, waiting up to `wait` for one to appear, and fails if none
/// does or the one found is not a block device. Never any other device: a
/// disk that shows under a name not in the list is not taken for the
/// volume, however it looks. No devices: `D` is empty (nothing to mount).
fn find_device(devices: &[String], wait: Duration) -> String {
    if devices.is_empty() {
        return "D=\n".into();
    }
    let names: Vec<String> = devices.iter().map(|d| shell_quote(d)).collect();
    format!(
        r#"D=
set -- {names}
pick() {{ for c in "$@"; do [ -e "$c" ] && {{ D=$c; return 0; }}; done; return 1; }}
i=0
until pick "$@"; do
  [ "$i" -ge {tenths} ] && fail "the data volume's device did not appear in the machine within {secs} s as any of: $* (no other device is taken for it)"
  sleep 0.1; i=$((i+1))
done
[ -b "$D" ] || fail "$D is not a block device: refusing to take it for the data volume"
"#,
        names = names.join(" "),
        tenths = wait.as_millis() / 100,
        secs = wait.as_secs(),
    )
}

/// The mount command: waits for the device, formats it on the first mount
/// only, mounts it, checks the mark (writes it on the first mount), and
/// makes the builds and cache dirs the login user's.
pub fn mount_script(m: &GuestMount, env_id: Uuid, first: bool) -> String {
    mount_script_waiting(m, env_id, first, DEVICE_WAIT)
}

/// [`mount_script`], waiting `device_wait` for the device.
fn mount_script_waiting(
    m: &GuestMount,
    env_id: Uuid,
    first: bool,
    device_wait: Duration,
) -> String {
    let dirs: Vec<String> = m.user_dirs.iter().map(|d| shell_quote(d)).collect();
    format!(
        r#"M={m}; ID={id}; FIRST={first}
{preamble}{find}if [ -n "$D" ]; then
  if ! mountpoint -q "$M" 2>/dev/null; then
    $S blkid -p "$D" >/dev/null 2>&1; rc=$?
    if [ "$rc" = 2 ]; then
      [ "$FIRST" = 1 ] || fail "the data volume $D has no filesystem: it is not this environment's data (wiped or replaced); refusing to start on an empty one"
      $S mkfs.ext4 -q -L {LABEL} "$D" || fail "formatting $D failed"
      say "formatted the data volume $D (ext4)"
    fi
    $S mkdir -p "$M" && $S mount "$D" "$M" || fail "mounting $D on $M failed"
  fi
  src=$(findmnt -n -o SOURCE --mountpoint "$M") || fail "nothing is mounted on $M"
  [ "$(readlink -f "$src")" = "$(readlink -f "$D")" ] || fail "$M holds $src, not the data volume $D"
fi
[ -d "$M" ] || fail "$M does not exist"
[ -w "$M" ] && S=
if [ -f "$M/{MARK}" ]; then
  mark=$(head -c 100 "$M/{MARK}")
  [ "$mark" = "$ID" ] || fail "the volume on $M belongs to environment $mark, not to $ID"
elif [ "$FIRST" = 1 ]; then
  echo "$ID" | $S tee "$M/{MARK}.tmp" >/dev/null && $S mv "$M/{MARK}.tmp" "$M/{MARK}" && sync || fail "marking the volume on $M failed"
else
  fail "the volume on $M has no {MARK} naming environment $ID: it was wiped or replaced; refusing to start on it"
fi
u=$(id -u); g=$(id -g)
for dir in {dirs}; do
  [ -d "$dir" ] || $S install -d -o "$u" -g "$g" "$dir" || fail "creating $dir failed"
done
say "mounted $M ($(df -h --output=size,avail "$M" 2>/dev/null | tail -1 | awk '{{print $1 " size, " $2 " free"}}'))"
"#,
        m = shell_quote(&m.mountpoint),
        id = env_id,
        first = u8::from(first),
        preamble = preamble(),
        find = find_device(&m.devices, device_wait),
        dirs = dirs.join(" "),
    )
}

/// The unmount command: everything written goes to disk, then the volume is
/// unmounted. Processes the job left running on it are ended (the machine is
/// deleted right after, which would end them anyway). Says `unmounted`.
pub fn unmount_script(m: &GuestMount) -> String {
    format!(
        r#"BLOCK={block}; M={m}
{preamble}cd / || exit 1
sync
[ "$BLOCK" = 1 ] || {{ say unmounted; exit 0; }}
mountpoint -q "$M" 2>/dev/null || {{ say unmounted; exit 0; }}
$S umount "$M" 2>/dev/null && {{ say unmounted; exit 0; }}
$S sh -c 'for p in /proc/[0-9]*; do n=${{p#/proc/}}; [ "$n" = "$$" ] && continue;
  if ls -l "$p/cwd" "$p/root" "$p/fd" 2>/dev/null | grep -q -e "-> $1/" -e "-> $1\$"; then kill -KILL "$n" 2>/dev/null && echo "$n"; fi; done' sh "$M" |
  while read -r n; do say "ended process $n, which the job left running on $M"; done
sleep 0.5
$S umount "$M" && {{ say unmounted; exit 0; }}
say "error: $M is still in use"; exit 1
"#,
        block = u8::from(!m.devices.is_empty()),
        m = shell_quote(&m.mountpoint),
        preamble = preamble(),
    )
}

/// The log lines of a command's output, and its error if it failed.
fn said(out: &ExecOutput, ctx: &Ctx) -> Result<()> {
    let mut error = None;
    for line in out.stdout.lines() {
        let Some(text) = line.strip_prefix(SAY) else {
            continue;
        };
        match text.strip_prefix("error: ") {
            Some(e) => error = Some(crate::text::excerpt(e)),
            None => ctx.log.info(crate::text::excerpt(text)),
        }
    }
    match (out.code, error) {
        (Some(0), None) => Ok(()),
        (_, Some(e)) => bail!("{e}"),
        (code, None) => bail!(
            "the command ended with {} and said: {}",
            code.map_or("a signal".to_string(), |c| format!("exit code {c}")),
            crate::text::excerpt(out.stderr.trim())
        ),
    }
}

/// Mounts (and on the first mount formats and marks) the volume.
pub async fn mount(
    t: &dyn Transport,
    m: &GuestMount,
    env_id: Uuid,
    first: bool,
    ctx: &Ctx,
) -> Result<()> {
    let out = t
        .exec(&mount_script(m, env_id, first), MOUNT_LIMIT, ctx)
        .await?;
    said(&out, ctx)
}

/// Syncs and unmounts the volume; `Ok` once the guest said it is unmounted.
pub async fn unmount(t: &dyn Transport, m: &GuestMount, ctx: &Ctx) -> Result<()> {
    let out = t.exec(&unmount_script(m), UNMOUNT_LIMIT, ctx).await?;
    said(&out, ctx)
}

#[cfg(test)]
#[path = "guest_tests.rs"]
mod tests;
