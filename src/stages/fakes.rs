//! In-memory fakes of the provider and the transports, so stage logic is
//! tested without processes or clouds, including failures real backends
//! rarely produce on demand (a stop that fails, a SIGTERM mid-suspension).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::context::{Ctx, JobLog};
use crate::job::{Job, JobInput, SuspendRequest};
use crate::provider::{
    GuestMount, Machine, MachineSpec, MachineState, ManagedMachine, ManagedVolume, Provider,
    SshTarget, StorageMode, Suspended, Target, Volume, VolumeGone, VolumeSpec, Volumes,
};
use crate::settings::Settings;
use crate::state::{EnvPaths, StateStore};
use crate::transport::{ExecOutput, Ran, Script, ScriptExit, Transport};

use super::{Session, Transports};

#[derive(Default)]
pub struct FakeCloud {
    pub machines: BTreeMap<String, MachineState>,
    pub calls: Vec<String>,
    pub fail_start: bool,
    pub fail_stop: bool,
    pub fail_delete: bool,
    /// create_or_reclaim makes the machine, then fails (a crash before state is saved).
    pub fail_after_create: bool,
    /// Fired while a stop is in progress (a SIGTERM arriving mid-suspension).
    pub cancel_during_stop: Option<CancellationToken>,
    /// The storage mode of new environments.
    pub storage: StorageMode,
    /// Volume mode: volume id → "available", "attached to <machine>", "deleted".
    pub volumes: BTreeMap<String, String>,
    pub fail_detach: bool,
    /// A stop that loses the machine's memory (a hibernation that fell back
    /// to a power-off), and why.
    pub memory_lost: Option<String>,
    /// Every slot is taken (`running_slots_full`).
    pub slots_full: bool,
}

#[derive(Clone, Default)]
pub struct FakeProvider {
    pub cloud: Arc<Mutex<FakeCloud>>,
}

impl FakeProvider {
    pub fn calls(&self) -> Vec<String> {
        self.cloud.lock().unwrap().calls.clone()
    }
    pub fn state(&self, id: &str) -> Option<MachineState> {
        self.cloud.lock().unwrap().machines.get(id).cloned()
    }
    fn call(&self, what: String) {
        self.cloud.lock().unwrap().calls.push(what);
    }
}

#[async_trait]
impl Provider for FakeProvider {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn storage(&self) -> StorageMode {
        self.cloud.lock().unwrap().storage
    }

    async fn running_slots_full(&self, _ctx: &Ctx) -> Result<bool> {
        Ok(self.cloud.lock().unwrap().slots_full)
    }

    fn volumes(&self) -> Option<&dyn Volumes> {
        Some(self)
    }

    async fn create_or_reclaim(&self, spec: &MachineSpec, _ctx: &Ctx) -> Result<Machine> {
        self.call(format!("create {}", spec.name));
        let mut c = self.cloud.lock().unwrap();
        c.machines.insert(spec.name.clone(), MachineState::Running);
        if c.fail_after_create {
            bail!("fake failure after the machine was made");
        }
        Ok(Machine::new(spec.name.clone()).with("address", "fake"))
    }

    async fn start(&self, m: &Machine, _ctx: &Ctx) -> Result<Machine> {
        self.call(format!("start {}", m.id));
        let mut c = self.cloud.lock().unwrap();
        if c.fail_start {
            bail!("fake start failure");
        }
        c.machines.insert(m.id.clone(), MachineState::Running);
        Ok(m.clone())
    }

    async fn stop(&self, m: &Machine, ctx: &Ctx) -> Result<Suspended> {
        self.call(format!("stop {}", m.id));
        let (fail, cancel) = {
            let c = self.cloud.lock().unwrap();
            (c.fail_stop, c.cancel_during_stop.clone())
        };
        if let Some(token) = cancel {
            token.cancel();
        }
        // A real stop waits; it must not be cut short by the SIGTERM above.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        ctx.check("stopping the fake machine")?;
        if fail {
            bail!("fake stop failure");
        }
        self.cloud
            .lock()
            .unwrap()
            .machines
            .insert(m.id.clone(), MachineState::Stopped);
        let lost = self.cloud.lock().unwrap().memory_lost.clone();
        Ok(Suspended { memory_lost: lost })
    }

    async fn delete(&self, m: &Machine, _ctx: &Ctx) -> Result<()> {
        self.call(format!("delete {}", m.id));
        let mut c = self.cloud.lock().unwrap();
        if c.fail_delete {
            bail!("fake delete failure");
        }
        c.machines.insert(m.id.clone(), MachineState::Gone);
        Ok(())
    }

    async fn describe(&self, m: &Machine, _ctx: &Ctx) -> Result<MachineState> {
        Ok(self.state(&m.id).unwrap_or(MachineState::Gone))
    }

    async fn list(&self, _ctx: &Ctx) -> Result<Vec<ManagedMachine>> {
        let c = self.cloud.lock().unwrap();
        Ok(c.machines
            .iter()
            .map(|(name, state)| ManagedMachine {
                machine: Machine::new(name.clone()),
                env_id: name
                    .strip_prefix("dormant-")
                    .and_then(|id| uuid::Uuid::parse_str(id).ok()),
                state: state.clone(),
                launched_at: None,
                warm: None,
            })
            .collect())
    }

    fn target(&self, _m: &Machine) -> Result<Target> {
        Ok(Target::Ssh(SshTarget {
            host: "fake".into(),
            port: 22,
            user: "u".into(),
            identity_file: None,
            workdir: None,
            on_login: None,
        }))
    }

    fn key_fields(&self, m: &Machine) -> Vec<(String, String)> {
        vec![("machine".into(), m.id.clone())]
    }
}

impl FakeProvider {
    pub fn volume(&self, id: &str) -> Option<String> {
        self.cloud.lock().unwrap().volumes.get(id).cloned()
    }
    fn set_volume(&self, id: &str, state: String) {
        self.cloud
            .lock()
            .unwrap()
            .volumes
            .insert(id.to_string(), state);
    }
}

#[async_trait]
impl Volumes for FakeProvider {
    async fn create_volume(&self, spec: &VolumeSpec, _ctx: &Ctx) -> Result<Volume> {
        let id = format!("vol-{}", spec.env_id.simple());
        self.call(format!("create_volume {id}"));
        if self.volume(&id).is_none() {
            self.set_volume(&id, "available".into());
        }
        Ok(Volume::new(id).with("zone", "fake-1a"))
    }
    async fn find_volume(&self, env_id: uuid::Uuid, _ctx: &Ctx) -> Result<Option<Volume>> {
        let id = format!("vol-{}", env_id.simple());
        Ok(self
            .volume(&id)
            .filter(|s| s != "deleted")
            .map(|_| Volume::new(id)))
    }
    async fn attach(&self, v: &Volume, m: &Machine, _ctx: &Ctx) -> Result<()> {
        self.call(format!("attach {} {}", v.id, m.id));
        match self.volume(&v.id).as_deref() {
            None | Some("deleted") => {
                Err(VolumeGone(format!("fake volume {} is gone", v.id)).into())
            }
            _ => {
                self.set_volume(&v.id, format!("attached to {}", m.id));
                Ok(())
            }
        }
    }
    async fn detach(&self, v: &Volume, m: &Machine, unmounted: bool, _ctx: &Ctx) -> Result<()> {
        self.call(format!("detach {} {} unmounted={unmounted}", v.id, m.id));
        if self.cloud.lock().unwrap().fail_detach {
            bail!("fake detach failure");
        }
        self.set_volume(&v.id, "available".into());
        Ok(())
    }
    async fn delete_volume(&self, v: &Volume, _ctx: &Ctx) -> Result<()> {
        self.call(format!("delete_volume {}", v.id));
        self.set_volume(&v.id, "deleted".into());
        Ok(())
    }
    async fn list_volumes(&self, _ctx: &Ctx) -> Result<Vec<ManagedVolume>> {
        let c = self.cloud.lock().unwrap();
        Ok(c.volumes
            .iter()
            .filter(|(_, s)| *s != "deleted")
            .map(|(id, s)| ManagedVolume {
                volume: Volume::new(id.clone()),
                env_id: id
                    .strip_prefix("vol-")
                    .and_then(|u| uuid::Uuid::parse_str(u).ok()),
                state: s.clone(),
            })
            .collect())
    }
    fn guest_mount(&self, _v: &Volume) -> GuestMount {
        GuestMount {
            devices: vec!["/dev/fake".into()],
            mountpoint: "/dormant".into(),
            user_dirs: vec!["/dormant/builds".into()],
        }
    }
    fn key_fields(&self, v: &Volume) -> Vec<(String, String)> {
        vec![("volume".into(), v.id.clone())]
    }
}

/// Transports whose scripts all exit with `exit_code`.
#[derive(Clone, Default)]
pub struct FakeTransports {
    pub exit_code: i32,
    pub fail_connect: bool,
    /// Every stage's transport breaks (a lost connection).
    pub fail_run: bool,
    /// The guest does not manage to unmount the volume.
    pub fail_unmount: bool,
    /// dormant's own commands (`Transport::exec`), first line of each.
    pub execs: Arc<Mutex<Vec<String>>>,
    /// A connection left by the job before answers (`Transport::take_live`).
    pub live: bool,
    /// Prepare's connections: `connect` (a login and the probe) or `take`
    /// (a live one taken), in order.
    pub connects: Arc<Mutex<Vec<&'static str>>>,
}

struct FakeTransport(FakeTransports);

impl Transports for FakeTransports {
    fn open(&self, _t: &Target, _p: &EnvPaths) -> Result<Box<dyn Transport>> {
        Ok(Box::new(FakeTransport(self.clone())))
    }
}

#[async_trait]
impl Transport for FakeTransport {
    async fn connect(&self, _ctx: &Ctx) -> Result<()> {
        self.0.connects.lock().unwrap().push("connect");
        if self.0.fail_connect {
            bail!("fake connection failure");
        }
        Ok(())
    }
    async fn take_live(&self, _ctx: &Ctx) -> Result<bool> {
        if self.0.live {
            self.0.connects.lock().unwrap().push("take");
        }
        Ok(self.0.live)
    }
    async fn run_script(&self, _s: &Script<'_>, _ctx: &Ctx) -> Result<Ran> {
        if self.0.fail_run {
            bail!("fake: the connection was lost");
        }
        Ok(Ran::unwatched(ScriptExit::Code(self.0.exit_code)))
    }
    async fn close(&self, _ctx: &Ctx) -> Result<()> {
        Ok(())
    }
    async fn exec(
        &self,
        line: &str,
        _limit: std::time::Duration,
        _ctx: &Ctx,
    ) -> Result<ExecOutput> {
        // The guest's mount and unmount commands: recognised by what they say.
        let unmount = line.contains("say unmounted");
        self.0
            .execs
            .lock()
            .unwrap()
            .push(if unmount { "unmount" } else { "mount" }.to_string());
        let (code, said) = match (unmount, self.0.fail_unmount) {
            (true, true) => (1, "dormant-volume: error: /dormant is still in use"),
            (true, false) => (0, "dormant-volume: unmounted"),
            (false, _) => (0, "dormant-volume: mounted /dormant"),
        };
        Ok(ExecOutput {
            code: Some(code),
            stdout: format!("{said}\n"),
            stderr: String::new(),
        })
    }
}

/// A session for job `job_id` of project 5 on runner "1", system "s_test".
pub fn session(
    store: &StateStore,
    provider: &FakeProvider,
    transports: FakeTransports,
    job_id: u64,
    suspend: SuspendRequest,
    job_status: &str,
) -> (Session, Arc<Mutex<Vec<u8>>>) {
    let settings = Settings {
        system_id: Some("s_test".into()),
        ..Settings::default()
    };
    let (log, buf) = JobLog::capture();
    let job = Job::from_map([("CUSTOM_ENV_CI_JOB_STATUS", job_status)]);
    let input = JobInput {
        job_id,
        project_id: 5,
        project_path: Some("g/p".into()),
        payload_runner_id: Some("1".into()),
        image: None,
        suspend,
        job_url: Some(format!("https://gitlab.example.com/g/p/-/jobs/{job_id}")),
    };
    let events = crate::events::EventLog::new(store.root(), &settings.events);
    let s = Session {
        settings,
        job,
        input,
        runner_id: "1".into(),
        store: store.clone(),
        events,
        provider: Arc::new(provider.clone()),
        transports: Arc::new(transports),
        log,
        cancel: CancellationToken::new(),
    };
    (s, buf)
}
