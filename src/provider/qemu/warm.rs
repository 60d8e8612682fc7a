//! The qemu provider's warm VMs (`qemu.warm`): booted from the default image
//! in the pool's directory (`warm/<id>/vm/`, named `dormant-<id>`), each with
//! its own key and seed. Handing one to an environment moves its directory
//! into the environment's (`environments/<env>/vm/`): the running QEMU keeps
//! its open files, its QMP socket moves with the directory, and its command
//! line, which cannot change, is recorded as `Launch::running_as` so the
//! process is still recognised as this VM's. Its disks, which QEMU opens
//! again by name while it runs, are given through an alias that follows the
//! directory (`alias.rs`). The next start of the VM uses the environment's
//! own name and paths. See docs/qemu.md, "Warm machines".

use std::time::Duration;

use anyhow::{Context, Result};
use async_trait::async_trait;

use super::process::Pid;
use super::vm::{RunningAs, VmDir};
use super::{alias, field, power, power_off, process, tools, QemuProvider};
use crate::context::Ctx;
use crate::model::{EnvPaths, Machine};
use crate::provider::warm::{WarmKind, WarmMachines};
use crate::provider::MachineSpec;
use crate::settings::boot_image::BootImage;
use crate::state::pool::WarmPaths;

impl QemuProvider {
    fn warm_vm(&self, warm: &WarmPaths) -> VmDir {
        VmDir::new(&warm.paths)
    }

    fn default_image(&self) -> Result<BootImage> {
        self.settings
            .image
            .clone()
            .context("qemu.image is not set: warm VMs boot the default image")
    }

    /// A warm VM's files, its alias and its QEMU, started (its guest not
    /// waited for: `launch`).
    async fn boot_warm(
        &self,
        warm: &WarmPaths,
        ssh_public_key: &str,
        ctx: &Ctx,
    ) -> Result<(VmDir, Pid, u16)> {
        let image = self.default_image()?;
        let vm = self.warm_vm(warm);
        vm.ensure()?;
        let user_data = crate::provider::cloud_init::user_data(
            warm.id,
            Some(ssh_public_key),
            &self.settings.ssh_user,
        )?;
        tools::create_seed(&vm, &user_data, &super::vm::meta_data(warm.id))?;
        // Pinned like any VM's: a hand-over moves `image.json` with the VM.
        let image = self.pins().for_new_vm(&vm, &image, ctx).await?;
        if !vm.overlay().exists() {
            tools::create_overlay(
                &self.settings.qemu_img,
                image.disk(),
                self.settings.disk_size.as_deref(),
                &vm,
            )?;
        }
        // One slot less than max_environments: a refill never takes the
        // last slot a job could need.
        let limit = match self.settings.max_environments {
            0 => 0,
            max => max.saturating_sub(1).max(1),
        };
        // Its disks through an alias that follows the VM when it is handed
        // over (QEMU opens them again by these paths: `alias.rs`).
        let alias = alias::point(self.store.root(), warm.id, &vm.dir)?;
        let booted = power::boot_within(
            self,
            &vm,
            &image,
            None,
            limit,
            super::capacity::Waiter::Warm,
            Some(&alias),
            ctx,
        )
        .await;
        let (pid, port) = match booted {
            Ok(b) => b,
            Err(e) => {
                let _ = power_off::quit(&vm, ctx).await;
                return Err(e);
            }
        };
        Ok((vm, pid, port))
    }
}

/// What of a base image file says it was replaced (a new build written over
/// the old path): its size and modification time.
fn file_stamp(path: &std::path::Path) -> String {
    match std::fs::metadata(path) {
        Ok(m) => {
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            format!("{}@{mtime}", m.len())
        }
        Err(_) => "missing".into(),
    }
}

#[async_trait]
impl WarmMachines for QemuProvider {
    fn wanted(&self) -> u32 {
        self.settings.warm
    }

    fn max_age(&self) -> Duration {
        self.settings.warm_max_age.get()
    }

    async fn no_room(&self, _ctx: &Ctx) -> Result<Option<String>> {
        let max = self.settings.max_environments;
        let running = super::capacity::running(self.store.root());
        Ok((max > 0 && running + 1 >= max as usize).then(|| {
            format!(
                "{running} of qemu.max_environments = {max} VMs run: a warm VM would take the last \
                 slot a job may need"
            )
        }))
    }

    async fn job_must_wait(&self, _ctx: &Ctx) -> Result<bool> {
        let max = self.settings.max_environments;
        Ok(max > 0 && super::capacity::running(self.store.root()) >= max as usize)
    }

    fn kind(&self) -> Result<WarmKind> {
        let image = self.default_image()?;
        let s = &self.settings;
        let stamp = |p: Option<&std::path::Path>| p.map(file_stamp).unwrap_or_default();
        let fingerprint = format!(
            "image={image:?} disk={} kernel={} initrd={} size={:?} cpus={} memory={} cpu={:?} accel={:?} user={} \
             restrict={} qemu={} file_ram={}",
            file_stamp(image.disk()),
            stamp(image.kernel()),
            stamp(image.initrd()),
            s.disk_size,
            s.cpus,
            s.memory_mib,
            s.cpu,
            s.accel,
            s.ssh_user,
            s.restrict_network,
            s.qemu_binary.display(),
            // A hibernate-mode VM keeps its RAM in a file (`ram.rs`): one
            // booted without it would restore the slow way.
            s.suspend_mode == crate::settings::qemu::QemuSuspendMode::Hibernate
        );
        Ok(WarmKind {
            fingerprint,
            made_from: format!("default image {}", image.disk().display()),
        })
    }

    fn fits(&self, spec: &MachineSpec) -> bool {
        let default_image = spec
            .image
            .as_deref()
            .map(str::trim)
            .is_none_or(|i| i.is_empty() || i == "default");
        // A volume-mode environment's data disk is hot-plugged into the VM
        // it takes (`hotplug.rs`): every VM has the port for it.
        default_image && self.settings.image.is_some()
    }

    async fn launch(
        &self,
        warm: &WarmPaths,
        _zone: Option<&str>,
        ssh_public_key: &str,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let (vm, pid, port) = self.boot_warm(warm, ssh_public_key, ctx).await?;
        if let Err(e) = self.wait_ready(&vm, pid, port, ctx).await {
            let _ = power_off::quit(&vm, ctx).await;
            return Err(e);
        }
        Ok(self.machine(warm.id, port, "default"))
    }

    async fn find_launched(&self, warm: &WarmPaths, _ctx: &Ctx) -> Result<Option<Machine>> {
        let vm = self.warm_vm(warm);
        if !vm.dir.exists() {
            return Ok(None);
        }
        let port = vm.read_launch().ok().flatten().map(|l| l.port).unwrap_or(0);
        Ok(Some(self.machine(warm.id, port, "default")))
    }

    async fn hand_over(
        &self,
        warm: &WarmPaths,
        machine: &Machine,
        env: &EnvPaths,
        _ctx: &Ctx,
    ) -> Result<Machine> {
        let from = self.warm_vm(warm);
        let to = VmDir::new(env);
        if from.dir.exists() {
            let mut launch = from
                .read_launch()?
                .with_context(|| format!("warm VM {} has no launch.json", from.name()))?;
            if launch.running_as.is_none() {
                // The next start is the environment's: its name, its paths.
                // (Its disks were given through the alias: the next start
                // opens them by the environment's own path.)
                let (old_dir, new_dir) =
                    (from.dir.display().to_string(), to.dir.display().to_string());
                let alias_dir = alias::path(self.store.root(), warm.id)
                    .display()
                    .to_string();
                launch.argv = launch
                    .argv
                    .iter()
                    .map(|a| {
                        a.replace(&old_dir, &new_dir)
                            .replace(&alias_dir, &new_dir)
                            .replace(&from.name(), &to.name())
                    })
                    .collect();
                launch.running_as = Some(RunningAs {
                    id: warm.id,
                    dir: from.dir.clone(),
                });
                from.write_launch(&launch)?;
            }
            crate::failpoint!("warm:qemu-relabelled");
            std::fs::rename(&from.dir, &to.dir).with_context(|| {
                format!(
                    "moving warm VM {} to {}",
                    from.dir.display(),
                    to.dir.display()
                )
            })?;
            for dir in [&warm.dir, &env.dir] {
                crate::state::store::sync_dir(dir)
                    .with_context(|| format!("syncing {}", dir.display()))?;
            }
        }
        // The running QEMU opens its disks through the alias: it follows the
        // directory (also when a killed hand-over is finished here).
        if to
            .read_launch()?
            .and_then(|l| l.running_as)
            .is_some_and(|r| r.id == warm.id)
        {
            alias::follow(self.store.root(), warm.id, &to.dir)?;
        }
        let launch = to
            .read_launch()?
            .with_context(|| format!("VM {} has no launch.json", to.name()))?;
        let port = machine
            .field(field::PORT)
            .and_then(|p| p.parse().ok())
            .unwrap_or(launch.port);
        Ok(self.machine(env.id, port, "default"))
    }

    async fn handed_over(&self, warm: &WarmPaths, env: &EnvPaths, _ctx: &Ctx) -> Result<bool> {
        Ok(!self.warm_vm(warm).dir.exists()
            && VmDir::new(env)
                .read_launch()
                .ok()
                .flatten()
                .and_then(|l| l.running_as)
                .is_some_and(|r| r.id == warm.id))
    }

    async fn retire(&self, warm: &WarmPaths, _machine: Option<&Machine>, ctx: &Ctx) -> Result<()> {
        let vm = self.warm_vm(warm);
        power_off::quit(&vm, ctx).await?;
        vm.remove()?;
        alias::remove(self.store.root(), warm.id)
    }

    async fn alive(&self, warm: &WarmPaths, _machine: &Machine, _ctx: &Ctx) -> Result<bool> {
        // A look at this host's /proc: always a definite answer.
        Ok(process::find(&self.warm_vm(warm)).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::qemu::process::fake::FakeQemu;
    use crate::provider::qemu::vm::Launch;
    use crate::settings::Settings;
    use crate::state::pool::Pool;
    use crate::state::StateStore;

    fn provider(dir: &std::path::Path) -> (StateStore, QemuProvider) {
        let store = StateStore::open(&dir.join("state")).unwrap();
        let mut settings = Settings::default();
        let disk = dir.join("base.qcow2");
        std::fs::write(&disk, b"an image").unwrap();
        settings.qemu.image = Some(BootImage::Path(disk));
        settings.qemu.warm = 1;
        (store.clone(), QemuProvider::new(&settings, &store))
    }

    #[tokio::test]
    async fn a_refill_never_takes_the_last_slot_of_max_environments() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = provider(dir.path());
        let with_max = |max: u32| {
            let mut settings = Settings::default();
            settings.qemu.image = Some(BootImage::Path(dir.path().join("base.qcow2")));
            settings.qemu.warm = 1;
            settings.qemu.max_environments = max;
            QemuProvider::new(&settings, &store)
        };
        let ctx = Ctx::new(
            crate::context::JobLog::stderr(),
            Default::default(),
            Duration::from_secs(30),
        );
        let p = with_max(3);
        assert_eq!(p.no_room(&ctx).await.unwrap(), None, "nothing runs");
        // A job's VM: two of three slots free, a warm VM may boot.
        let job = VmDir::new(&store.env_paths(uuid::Uuid::new_v4()));
        let _job = FakeQemu::start(dir.path(), &job);
        assert_eq!(p.no_room(&ctx).await.unwrap(), None, "one of three runs");
        // And a warm VM: the last slot stays free for a job.
        let pool = Pool::new(&store);
        let (wp, _entry, _lock) = pool.begin_launch("qemu", "fp", "default", None).unwrap();
        let _warm = FakeQemu::start(dir.path(), &p.warm_vm(&wp));
        let why = p
            .no_room(&ctx)
            .await
            .unwrap()
            .expect("no room for a third VM");
        assert!(
            why.contains("2 of qemu.max_environments = 3 VMs run"),
            "{why}"
        );
        // Room enough with a higher limit, and no limit at all.
        assert_eq!(with_max(4).no_room(&ctx).await.unwrap(), None);
        assert_eq!(with_max(0).no_room(&ctx).await.unwrap(), None);
        // A job's own VM: waits only once every slot is taken.
        assert!(!p.job_must_wait(&ctx).await.unwrap(), "two of three run");
        assert!(
            with_max(2).job_must_wait(&ctx).await.unwrap(),
            "two of two run"
        );
        assert!(!with_max(0).job_must_wait(&ctx).await.unwrap(), "no limit");
    }

    #[tokio::test]
    async fn a_handed_over_vm_is_the_environments_and_its_qemu_is_still_found() {
        let dir = tempfile::tempdir().unwrap();
        let (store, p) = provider(dir.path());
        let pool = Pool::new(&store);
        let (wp, _entry, _lock) = pool.begin_launch("qemu", "fp", "default", None).unwrap();
        let from = p.warm_vm(&wp);
        from.ensure().unwrap();
        let qemu = FakeQemu::start(dir.path(), &from);
        std::fs::write(from.pidfile(), qemu.0.id().to_string()).unwrap();
        let argv = vec![
            "qemu".to_string(),
            "-name".into(),
            from.name(),
            "-drive".into(),
            format!("file={}/overlay.qcow2", from.dir.display()),
            "-pidfile".into(),
            from.pidfile().display().to_string(),
        ];
        from.write_launch(&Launch {
            version: 2,
            argv,
            port: 2222,
            running_as: None,
        })
        .unwrap();
        assert_eq!(super::super::capacity::running(store.root()), 1);

        let env = store.env_paths(uuid::Uuid::new_v4());
        std::fs::create_dir_all(&env.dir).unwrap();
        let ctx = Ctx::new(
            crate::context::JobLog::stderr(),
            Default::default(),
            Duration::from_secs(30),
        );
        assert!(!p.handed_over(&wp, &env, &ctx).await.unwrap());
        // The environment's record, as its prepare made it (no machine yet).
        crate::state::testing::place(
            &store,
            env.id,
            crate::state::EnvStatus::Creating,
            None,
            0,
            None,
        )
        .unwrap();
        use crate::provider::Provider;
        assert_eq!(p.find(env.id, &ctx).await.unwrap(), None, "no VM yet");
        let warm_machine = p.machine(wp.id, 2222, "default");
        let m = p.hand_over(&wp, &warm_machine, &env, &ctx).await.unwrap();
        // What a retried prepare asks before taking a warm VM (the killed
        // attempt never recorded this one): found, so none is taken and
        // create adopts this running QEMU (`process::find`, below).
        assert_eq!(
            p.find(env.id, &ctx).await.unwrap().map(|f| f.id),
            Some(m.id.clone()),
            "a retried prepare finds the handed-over VM"
        );
        assert_eq!(m.field(field::ENV), Some(env.id.to_string().as_str()));
        assert_eq!(m.field(field::PORT), Some("2222"));
        assert!(p.handed_over(&wp, &env, &ctx).await.unwrap());
        // Retried (a killed hand-over): the same answer, nothing moved twice.
        let again = p.hand_over(&wp, &warm_machine, &env, &ctx).await.unwrap();
        assert_eq!(again, m);

        let to = VmDir::new(&env);
        assert_eq!(
            process::find(&to).map(|pid| pid.0 as u32),
            Some(qemu.0.id()),
            "the running QEMU is found as the environment's"
        );
        assert_eq!(
            super::super::capacity::running(store.root()),
            1,
            "counted once"
        );
        let launch = to.read_launch().unwrap().unwrap();
        let joined = launch.argv.join(" ");
        assert!(
            joined.contains(&to.name()) && !joined.contains(&from.name()),
            "{joined}"
        );
        assert!(joined.contains(&to.dir.display().to_string()), "{joined}");
        assert!(
            !joined.contains(&from.dir.display().to_string()),
            "{joined}"
        );

        // A QEMU started under another name is not taken for it.
        let other = VmDir::new(&store.env_paths(uuid::Uuid::new_v4()));
        other.ensure().unwrap();
        std::fs::write(other.pidfile(), qemu.0.id().to_string()).unwrap();
        assert_eq!(process::find(&other), None);
    }

    #[test]
    fn a_replaced_base_image_or_other_settings_make_another_kind() {
        let dir = tempfile::tempdir().unwrap();
        let (store, p) = provider(dir.path());
        let before = p.kind().unwrap();
        assert_eq!(p.kind().unwrap(), before, "stable");
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(dir.path().join("base.qcow2"), b"a new build").unwrap();
        assert_ne!(p.kind().unwrap().fingerprint, before.fingerprint);
        let mut settings = Settings::default();
        settings.qemu = p.settings.clone();
        settings.qemu.memory_mib += 512;
        let bigger = QemuProvider::new(&settings, &store);
        assert_ne!(
            bigger.kind().unwrap().fingerprint,
            p.kind().unwrap().fingerprint
        );
    }

    #[test]
    fn only_a_default_image_spec_fits() {
        let dir = tempfile::tempdir().unwrap();
        let (store, p) = provider(dir.path());
        let id = uuid::Uuid::new_v4();
        let mut spec = MachineSpec {
            env_id: id,
            name: MachineSpec::machine_name(id),
            runner_id: "1".into(),
            system_id: "s".into(),
            project_id: 1,
            job_id: 1,
            image: None,
            variables: Default::default(),
            ssh_public_key: None,
            paths: store.env_paths(id),
            volume: None,
        };
        assert!(p.fits(&spec));
        spec.image = Some("default".into());
        assert!(p.fits(&spec));
        spec.image = Some("ubuntu".into());
        assert!(!p.fits(&spec));
        spec.image = None;
        spec.volume = Some(crate::model::Volume::new("v"));
        assert!(
            p.fits(&spec),
            "a volume-mode one too: its disk is hot-plugged"
        );
    }
}

#[cfg(test)]
#[path = "warm_qemu_tests.rs"]
mod qemu_tests;
