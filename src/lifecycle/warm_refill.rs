//! The warm pool's **refill** (`dormant warm`, started detached by the
//! prepare that took a machine, and by the package's timer; `sweep` runs it
//! without booting): retires what must go, boots what is missing one at a
//! time, pins each new machine's host key at its boot. `lifecycle::warm`
//! holds the take and the retire this builds on. See docs/architecture.md,
//! "Warm machines".

use std::time::Duration;

use anyhow::{Context, Result};

use super::warm_steps::{event, retire};
use super::World;
use crate::context::Ctx;
use crate::model::{EnvPaths, Machine, Target};
use crate::provider::warm::WarmMachines;
use crate::state::pool::{Pool, WarmEntry, WarmPaths, WarmStatus};
use crate::state::{now_unix, FileLock};
use crate::transport::Transport;

/// What a refill or tidy-up did.
#[derive(Debug, Default)]
pub struct RefillReport {
    pub launched: Vec<uuid::Uuid>,
    pub retired: Vec<(uuid::Uuid, String)>,
    pub ready: usize,
    pub skipped: Option<String>,
    pub errors: Vec<String>,
}

/// Retires what must go, and (with `launch`) boots warm machines until each
/// zone has `wanted` ready or booting. One at a time per state dir
/// (`warm/refill.lock`): a second caller returns at once, saying so.
///
/// Each entry is decided on what it says when read under its own lock (a
/// prepare may take one, or a retirement finish, between the listing and
/// the lock). One entry that cannot be read or retired is reported in
/// `errors` and the rest of the pool is still served: the caller fails at
/// the end (`dormant warm` and `sweep` exit non-zero), never half-way.
pub async fn refill(
    w: World<'_>,
    warm: &dyn WarmMachines,
    open: &dyn OpenTransport,
    launch: bool,
    ctx: &Ctx,
) -> Result<RefillReport> {
    let pool = Pool::new(w.store);
    let mut report = RefillReport::default();
    crate::state::store::ensure_private_dir(pool.dir())?;
    let Some(_refill) = FileLock::try_acquire(&pool.refill_lock())? else {
        report.skipped = Some("another refill of this pool is running".into());
        return Ok(report);
    };
    for stray in pool.stray_staging() {
        if let Err(e) = w.store.delete_dir(&stray) {
            report.errors.push(format!(
                "removing {} (a killed launch's staging dir, nothing booted from it): {e:#}",
                stray.display()
            ));
        }
    }
    let kind = warm.kind();
    let now = now_unix();
    let max_age = warm.max_age().as_secs();
    let mut kept: Vec<WarmEntry> = Vec::new();
    for id in pool.ids()? {
        match visit(w, warm, &pool, id, &kind, now, max_age, ctx).await {
            Ok(Visit::Counts(entry)) => kept.push(entry),
            Ok(Visit::Retired(why)) => report.retired.push((id, why)),
            Ok(Visit::Other) => {}
            Ok(Visit::Unsure(entry, e)) => {
                kept.push(entry);
                report.errors.push(format!(
                    "warm machine {id} kept as it is: could not tell whether it still runs ({e:#}); the \
                     next refill asks again"
                ));
            }
            Err(e) => report.errors.push(format!(
                "warm machine {id}: {e:#} (the rest of the pool is served; fix or remove {} by hand if this \
                 repeats)",
                pool.paths(id).dir.display()
            )),
        }
    }
    // More than wanted (warm lowered, or 0): the newest go first.
    kept.sort_by_key(|e| std::cmp::Reverse(e.launched_at));
    let zones = match warm.zones(ctx).await {
        Ok(z) => z,
        Err(e) => {
            report.errors.push(format!("{e:#}"));
            return Ok(report);
        }
    };
    let wanted = warm.wanted() as usize;
    let mut per_zone: Vec<(Option<String>, usize)> = zones.iter().map(|z| (z.clone(), 0)).collect();
    for entry in kept {
        let slot = per_zone.iter_mut().find(|(z, _)| *z == entry.zone);
        match slot {
            Some((_, n)) if *n < wanted => *n += 1,
            _ if entry.status == WarmStatus::Ready => {
                let id = entry.id;
                let why = format!("not wanted: warm = {wanted}");
                match retire_if_ready(w, warm, &pool, id, &why, ctx).await {
                    Ok(true) => report.retired.push((id, why)),
                    Ok(false) => {}
                    Err(e) => report
                        .errors
                        .push(format!("retiring warm machine {id}: {e:#}")),
                }
            }
            _ => {}
        }
    }
    report.ready = per_zone.iter().map(|(_, n)| n).sum();
    if !launch {
        return Ok(report);
    }
    let kind = match kind {
        Ok(k) => k,
        Err(e) => {
            report.errors.push(format!("{e:#}"));
            return Ok(report);
        }
    };
    for (zone, have) in per_zone {
        for _ in have..wanted {
            match warm.no_room(ctx).await {
                Ok(None) => {}
                Ok(Some(why)) => {
                    report.skipped = Some(why);
                    return Ok(report);
                }
                // Not knowing whether there is room is an error, not a
                // reason to skip: the operator must hear of it.
                Err(e) => {
                    report.errors.push(format!("{e:#}"));
                    return Ok(report);
                }
            }
            match launch_one(w, warm, open, &pool, &kind, zone.clone(), ctx).await {
                Ok(id) => report.launched.push(id),
                Err(e) => {
                    // This zone waits for the next refill; the others are served.
                    report.errors.push(format!("{e:#}"));
                    break;
                }
            }
        }
    }
    Ok(report)
}

/// What one entry of the pool is to this refill.
enum Visit {
    /// Ready or booting: counts toward `wanted`.
    Counts(WarmEntry),
    /// Retired now, for this reason.
    Retired(String),
    /// Gone, handed over, or on its way out under someone else's lock.
    Other,
    /// Kept and counted, but whether its machine still runs could not be
    /// told (the provider's look failed): reported, asked again next time.
    Unsure(WarmEntry, anyhow::Error),
}

/// Decides one entry on what it says under its lock, and retires it if it
/// must go.
#[allow(clippy::too_many_arguments)]
async fn visit(
    w: World<'_>,
    warm: &dyn WarmMachines,
    pool: &Pool,
    id: uuid::Uuid,
    kind: &Result<crate::provider::warm::WarmKind>,
    now: u64,
    max_age: u64,
    ctx: &Ctx,
) -> Result<Visit> {
    let Some(lock) = pool.try_lock(id)? else {
        // Held by someone else. Its launcher (`launching`) will make it
        // ready: it counts. A `ready` one is held only by a prepare taking
        // it or a retirement (qemu's `yield_slot`): it will not stay in the
        // pool, so it does not count, and a replacement is booted now.
        return Ok(match pool.peek(id)? {
            Some(e) if e.status == WarmStatus::Launching => Visit::Counts(e),
            _ => Visit::Other,
        });
    };
    // Read again under the lock: the listing may be stale.
    let Some(entry) = pool.peek(id)? else {
        return Ok(Visit::Other); // removed meanwhile
    };
    let wp = pool.paths(id);
    let why = match &entry.status {
        WarmStatus::Launching => Some("its launch was killed".to_string()),
        WarmStatus::Retiring { why } => Some(why.clone()),
        WarmStatus::Taken { env } => {
            let env_paths = w.store.env_paths(*env);
            if warm.handed_over(&wp, &env_paths, ctx).await? {
                // The machine is the environment's now: only the entry goes.
                pool.remove(w.store, lock, id)?;
                return Ok(Visit::Other);
            }
            Some(format!(
                "the prepare taking it for environment {env} died before the hand-over"
            ))
        }
        WarmStatus::Ready => {
            let machine = entry.machine.clone();
            match kind {
                Err(e) => Some(format!("warm machines cannot be made now: {e:#}")),
                Ok(k) if k.fingerprint != entry.fingerprint => Some(format!(
                    "made from settings that changed (was {}, now {})",
                    entry.made_from, k.made_from
                )),
                Ok(_) if entry.age_secs(now) >= max_age => Some(format!(
                    "older than warm_max_age ({} s)",
                    entry.age_secs(now)
                )),
                Ok(_) => match machine {
                    None => Some("ready without a machine".into()),
                    Some(m) => match warm.alive(&wp, &m, ctx).await {
                        Ok(true) => None,
                        Ok(false) => Some("it stopped running while it waited".into()),
                        // No answer is not "gone": kept (and counted, so none
                        // is booted in its place); the next refill asks again.
                        Err(e) => return Ok(Visit::Unsure(entry, e)),
                    },
                },
            }
        }
    };
    match why {
        Some(why) => {
            retire(w, warm, pool, lock, entry, &why, ctx)
                .await
                .context("retiring it")?;
            Ok(Visit::Retired(why))
        }
        None => Ok(Visit::Counts(entry)),
    }
}

/// Retires entry `id` if, read under its lock, it is still `ready` (a
/// prepare may have taken it since it was counted). `false`: left alone.
async fn retire_if_ready(
    w: World<'_>,
    warm: &dyn WarmMachines,
    pool: &Pool,
    id: uuid::Uuid,
    why: &str,
    ctx: &Ctx,
) -> Result<bool> {
    let Some(lock) = pool.try_lock(id)? else {
        return Ok(false);
    };
    match pool.peek(id)? {
        Some(entry) if entry.status == WarmStatus::Ready => {
            retire(w, warm, pool, lock, entry, why, ctx).await?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Boots one warm machine: `launching` (with its lock held throughout), the
/// provider's launch, the host key pinned over a first connection, `ready`.
async fn launch_one(
    w: World<'_>,
    warm: &dyn WarmMachines,
    open: &dyn OpenTransport,
    pool: &Pool,
    kind: &crate::provider::warm::WarmKind,
    zone: Option<String>,
    ctx: &Ctx,
) -> Result<uuid::Uuid> {
    let (wp, mut entry, lock) = pool.begin_launch(
        w.provider.name(),
        &kind.fingerprint,
        &kind.made_from,
        zone.clone(),
    )?;
    crate::failpoint!("warm:launching");
    w.events
        .record(event(w, "launched", Some(&entry)), ctx)
        .await;
    let made = async {
        let key = crate::transport::keys::ensure_keypair(&wp.paths)?;
        let machine = warm.launch(&wp, zone.as_deref(), &key, ctx).await?;
        entry.machine = Some(machine.clone());
        pool.set(&lock, &entry)?;
        crate::failpoint!("warm:launched");
        pin_host_key(w, open, &wp, &machine, ctx).await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    match made {
        Ok(()) => {
            entry.status = WarmStatus::Ready;
            entry.ready_at = Some(now_unix());
            pool.set(&lock, &entry)?;
            crate::failpoint!("warm:ready");
            let booted = Duration::from_secs(
                entry
                    .ready_at
                    .unwrap_or(0)
                    .saturating_sub(entry.launched_at),
            );
            w.events
                .record(event(w, "ready", Some(&entry)).duration(booted), ctx)
                .await;
            Ok(entry.id)
        }
        Err(e) => {
            let id = entry.id;
            let why = format!("its launch failed: {e:#}");
            if let Err(e2) = retire(w, warm, pool, lock, entry, &why, ctx).await {
                return Err(e.context(format!("and retiring warm machine {id} failed too: {e2:#}")));
            }
            Err(e.context(format!("launching warm machine {id}")))
        }
    }
}

/// Opens a transport to a warm machine (the stages' transports are theirs;
/// a refill runs outside any job).
pub trait OpenTransport: Send + Sync {
    fn open(&self, target: &Target, paths: &EnvPaths) -> Result<Box<dyn Transport>>;
}

/// The SSH transport with the operator's `[ssh]` settings: how every warm
/// machine (a VM, an instance) is reached.
pub struct OverSsh(pub crate::settings::ssh::SshSettings);

impl OpenTransport for OverSsh {
    fn open(&self, target: &Target, paths: &EnvPaths) -> Result<Box<dyn Transport>> {
        match target {
            Target::Ssh(t) => Ok(Box::new(crate::transport::ssh::SshTransport::new(
                t.clone(),
                paths.clone(),
                self.0.clone(),
            ))),
            Target::Local { .. } => anyhow::bail!("warm machines are reached over SSH"),
        }
    }
}

/// The first connection to a new warm machine pins its host key in the
/// entry's known_hosts (it moves to the environment that takes it: no host
/// key is ever taken on trust later).
async fn pin_host_key(
    w: World<'_>,
    open: &dyn OpenTransport,
    wp: &WarmPaths,
    machine: &Machine,
    ctx: &Ctx,
) -> Result<()> {
    let transport = open.open(&w.provider.target(machine)?, &wp.paths)?;
    transport.connect(ctx).await?;
    let _ = transport.close(ctx).await;
    Ok(())
}

/// Starts `dormant warm` detached: its own session (the runner's signals to
/// the job's process group do not reach it), no stdin or stdout (the runner
/// reads the stage's output until it closes: an inherited pipe would hold the
/// stage open), its errors in `warm/refill.log`. Returns its pid. The same
/// `--config` as this process's is passed on; the environment is inherited.
pub fn start_refill(store: &crate::state::StateStore) -> Result<u32> {
    use std::process::Command;
    let exe = std::env::current_exe().context("finding dormant's own executable")?;
    let mut cmd = Command::new(exe);
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    for (i, a) in args.iter().enumerate() {
        if a == "--config" {
            if let Some(v) = args.get(i + 1) {
                cmd.arg("--config").arg(v);
            }
        } else if a.to_str().is_some_and(|s| s.starts_with("--config=")) {
            cmd.arg(a);
        }
    }
    cmd.arg("warm");
    let pool = Pool::new(store);
    crate::state::store::ensure_private_dir(pool.dir())?;
    let mut log = refill_log(pool.dir())?;
    {
        use std::io::Write;
        // Appended runs are told apart by this line (one write: whole).
        let _ = log.write_all(
            format!(
                "--- dormant warm started by a prepare at {} (unix time)\n",
                now_unix()
            )
            .as_bytes(),
        );
    }
    super::spawn_detached(cmd, log, "dormant warm")
}

/// `refill.log` rotates to `refill.log.1` once it is this big.
const REFILL_LOG_MAX: u64 = 1024 * 1024;

/// Opens `warm/refill.log` for a detached refill's stderr: appended to, never
/// truncated (a refill started earlier may still be writing it, and its
/// errors are what an operator reads), created 0600 (it may name machines,
/// paths and cloud errors). Once past [`REFILL_LOG_MAX`] it is renamed to
/// `refill.log.1` (replacing the older one) and a new one started; a refill
/// still writing the old file goes on writing it under its new name.
pub fn refill_log(pool_dir: &std::path::Path) -> Result<std::fs::File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let path = pool_dir.join("refill.log");
    if std::fs::metadata(&path).is_ok_and(|m| m.len() > REFILL_LOG_MAX) {
        match std::fs::rename(&path, pool_dir.join("refill.log.1")) {
            // Another prepare rotated it first.
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("rotating {}", path.display()))
            }
            _ => {}
        }
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // One made by an older dormant (0644) is made private too.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} private", path.display()))?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn mode(path: &std::path::Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    /// Every prepare that took a warm machine opens the log for the refill it
    /// starts, while an earlier refill may still be writing it: what that one
    /// wrote stays (appended to, never truncated), and the file is private.
    #[test]
    fn the_refill_log_is_appended_to_private_and_rotated_when_big() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("refill.log");
        std::fs::write(&path, "an earlier refill's error\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        refill_log(dir.path())
            .unwrap()
            .write_all(b"the next refill\n")
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "an earlier refill's error\nthe next refill\n"
        );
        assert_eq!(
            mode(&path),
            0o600,
            "private, also when an older one made it"
        );

        let fresh = tempfile::tempdir().unwrap();
        refill_log(fresh.path()).unwrap();
        assert_eq!(
            mode(&fresh.path().join("refill.log")),
            0o600,
            "made private"
        );

        // Past its size: kept as refill.log.1, and a new one started.
        std::fs::File::options()
            .append(true)
            .open(&path)
            .unwrap()
            .set_len(REFILL_LOG_MAX + 1)
            .unwrap();
        refill_log(dir.path())
            .unwrap()
            .write_all(b"after rotation\n")
            .unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "after rotation\n");
        let old = dir.path().join("refill.log.1");
        assert!(std::fs::read_to_string(&old)
            .unwrap()
            .starts_with("an earlier refill's error\n"));
    }
}
