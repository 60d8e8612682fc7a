//! The `ssh` provider: an environment is a workspace directory
//! `<ssh.workspace_root>/<environment id>` on one of the `[[ssh.hosts]]`.
//!
//! - Slots: each host runs at most `slots` active environments. Slots are
//!   counted in `<state>/ssh-slots.json` under `ssh-slots.lock`; prepare waits
//!   (bounded by `ssh.slot_wait`, with progress) when every host is full.
//! - Suspend keeps the workspace and **frees the slot**: a suspended workspace
//!   costs disk, not CPU, so it should not block other jobs. Resume returns to
//!   the same host and takes a slot there again (waiting if it is full).
//! - Release removes the workspace and frees the slot.
//!
//! Remote calls go through the environment's own ControlMaster (the one the
//! transport uses), so creating, resuming and releasing cost no extra SSH
//! handshake within a job.

mod slots;

use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use async_trait::async_trait;
use uuid::Uuid;

use super::{
    Machine, MachineGone, MachineSpec, MachineState, ManagedMachine, Provider, SshTarget,
    Suspended, Target,
};
use crate::context::Ctx;
use crate::settings::ssh::{SshHost, SshSettings};
use crate::state::{EnvPaths, EnvStatus, StateStore};
use crate::text::shell_quote;
use crate::transport::ssh::{Master, Purpose};

/// Remote housekeeping commands (mkdir, test, rm) finish in well under this.
const REMOTE_CALL_TIMEOUT: Duration = Duration::from_secs(120);

pub struct SshHostsProvider {
    settings: SshSettings,
    store: StateStore,
}

impl SshHostsProvider {
    pub fn new(settings: SshSettings, store: StateStore) -> Self {
        SshHostsProvider { settings, store }
    }

    fn host(&self, name: &str) -> Result<&SshHost> {
        self.settings
            .hosts
            .iter()
            .find(|h| h.name() == name)
            .ok_or_else(|| {
                anyhow!(
                    "SSH host {} is no longer in the [[ssh.hosts]] settings; add it back to reach its workspaces",
                    crate::text::quoted(name)
                )
            })
    }

    fn env_of(machine: &Machine) -> Result<Uuid> {
        machine
            .field("env")
            .and_then(|e| Uuid::parse_str(e).ok())
            .with_context(|| format!("ssh machine {} has no environment id", machine.id))
    }

    /// The recorded workspace, checked to be `<workspace_root>/<env id>`
    /// before anything removes it.
    fn workspace(&self, machine: &Machine) -> Result<String> {
        let env = Self::env_of(machine)?;
        let ws = machine
            .field("workspace")
            .with_context(|| format!("ssh machine {} has no workspace", machine.id))?;
        let expected = self.settings.workspace(&self.store.env_paths(env));
        if ws != expected {
            bail!(
                "the workspace {ws} of environment {env} is not {expected} (ssh.workspace_root changed?): \
                 refusing to touch it"
            );
        }
        Ok(ws.to_string())
    }

    fn machine(&self, host: &SshHost, paths: &EnvPaths) -> Machine {
        let ws = self.settings.workspace(paths);
        Machine::new(format!("{}:{ws}", host.name()))
            .with("host", host.name())
            .with("workspace", ws)
            .with("env", paths.id.to_string())
    }

    fn master(&self, host: &SshHost, paths: &EnvPaths, workdir: Option<String>) -> Master {
        Master::new(
            ssh_target(host, workdir),
            paths.clone(),
            self.settings.clone(),
        )
    }

    /// Runs a short shell command over the environment's master; returns stdout.
    async fn remote(&self, master: &Master, ctx: &Ctx, what: &str, cmd: &str) -> Result<String> {
        let session = master.session(ctx, Purpose::Connect).await?;
        let out = tokio::time::timeout(REMOTE_CALL_TIMEOUT, session.raw_command(cmd).output())
            .await
            .with_context(|| format!("{what} on {} timed out", master.destination()))?
            .with_context(|| format!("{what} on {}", master.destination()))?;
        if !out.status.success() {
            bail!(
                "{what} on {} failed ({}): {}",
                master.destination(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

fn ssh_target(host: &SshHost, workdir: Option<String>) -> SshTarget {
    SshTarget {
        host: host.address.clone(),
        port: host.port,
        user: host.user.clone(),
        identity_file: Some(host.identity_file.clone()),
        workdir,
        on_login: None,
    }
}

#[async_trait]
impl Provider for SshHostsProvider {
    fn name(&self) -> &'static str {
        "ssh"
    }

    async fn create_or_reclaim(&self, spec: &MachineSpec, ctx: &Ctx) -> Result<Machine> {
        let host = self.acquire_slot(spec.env_id, None, ctx).await?;
        let machine = self.machine(&host, &spec.paths);
        let ws = self.workspace(&machine)?;
        let master = self.master(&host, &spec.paths, None);
        let q = shell_quote(&ws);
        let out = self
            .remote(
                &master,
                ctx,
                "creating the workspace",
                &format!("if [ -d {q} ]; then echo reused; fi; mkdir -p {q}"),
            )
            .await?;
        ctx.log.info(format!(
            "{} workspace {ws} on SSH host {}",
            if out.contains("reused") {
                "reusing"
            } else {
                "created"
            },
            host.name()
        ));
        Ok(machine)
    }

    async fn start(&self, machine: &Machine, ctx: &Ctx) -> Result<Machine> {
        let env = Self::env_of(machine)?;
        let name = machine.field("host").context("ssh machine has no host")?;
        let ws = self.workspace(machine)?;
        let host = self.acquire_slot(env, Some(name), ctx).await?;
        let master = self.master(&host, &self.store.env_paths(env), None);
        let out = self
            .remote(
                &master,
                ctx,
                "checking the workspace",
                &format!("[ -d {} ] && echo present; true", shell_quote(&ws)),
            )
            .await?;
        if !out.contains("present") {
            return Err(MachineGone(format!(
                "the workspace {ws} of environment {env} is gone from SSH host {name}: its files cannot be resumed"
            ))
            .into());
        }
        Ok(machine.clone())
    }

    async fn stop(&self, machine: &Machine, ctx: &Ctx) -> Result<Suspended> {
        let env = Self::env_of(machine)?;
        self.release_slot(env, ctx).await?;
        ctx.log.info(format!(
            "workspace {} kept on SSH host {}; its slot is free while the environment is suspended",
            machine.field("workspace").unwrap_or("?"),
            machine.field("host").unwrap_or("?")
        ));
        // The host stays up: what the job left waiting on it (a paused
        // script) waits on.
        Ok(Suspended::kept())
    }

    async fn delete(&self, machine: &Machine, ctx: &Ctx) -> Result<()> {
        let env = Self::env_of(machine)?;
        let ws = self.workspace(machine)?;
        let name = machine.field("host").context("ssh machine has no host")?;
        let host = self.host(name)?;
        let master = self.master(host, &self.store.env_paths(env), None);
        self.remote(
            &master,
            ctx,
            "removing the workspace",
            // A script paused in the environment (docs/pause.md) goes with it.
            &format!(
                "{}; rm -rf -- {}",
                crate::transport::ssh::release_command(&env.simple().to_string()),
                shell_quote(&ws)
            ),
        )
        .await?;
        // The sweep and `dormant release` delete without a transport that
        // would close the master afterwards.
        let _ = master.close().await;
        self.release_slot(env, ctx).await
    }

    async fn describe(&self, machine: &Machine, _ctx: &Ctx) -> Result<MachineState> {
        // No SSH call: a held slot means a job is using it, else it waits suspended.
        let env = Self::env_of(machine)?;
        let held = self
            .with_slots(_ctx, |s| s.hosts.values().any(|ids| ids.contains(&env)))
            .await?;
        Ok(if held {
            MachineState::Running
        } else {
            MachineState::Stopped
        })
    }

    async fn list(&self, _ctx: &Ctx) -> Result<Vec<ManagedMachine>> {
        // Workspaces are listed from the registry: reaching every host would
        // cost a connection each and needs host keys no environment pinned.
        let mut out = Vec::new();
        for id in self.store.environment_ids()? {
            let paths = self.store.env_paths(id);
            if let Ok(Some(rec)) = crate::state::registry::peek(&paths) {
                let status = rec.status();
                if let Some(m) = rec.machine.filter(|m| m.field("workspace").is_some()) {
                    let state = if status == EnvStatus::Suspended {
                        MachineState::Stopped
                    } else {
                        MachineState::Running
                    };
                    out.push(ManagedMachine {
                        machine: m,
                        env_id: Some(id),
                        state,
                        launched_at: Some(rec.created_at),
                        warm: None,
                    });
                }
            }
        }
        Ok(out)
    }

    fn target(&self, machine: &Machine) -> Result<Target> {
        let name = machine.field("host").context("ssh machine has no host")?;
        let host = self.host(name)?;
        Ok(Target::Ssh(ssh_target(
            host,
            Some(self.workspace(machine)?),
        )))
    }

    fn key_fields(&self, machine: &Machine) -> Vec<(String, String)> {
        machine
            .field("host")
            .map(|h| vec![("host".to_string(), h.to_string())])
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn provider(slots: u32) -> (tempfile::TempDir, SshHostsProvider) {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let mut settings = SshSettings::default();
        for name in ["a", "b"] {
            settings.hosts.push(SshHost {
                name: Some(name.into()),
                address: "127.0.0.1".into(),
                user: "root".into(),
                identity_file: "/id".into(),
                slots,
                ..Default::default()
            });
        }
        (dir, SshHostsProvider::new(settings, store))
    }

    pub(super) fn active_env(p: &SshHostsProvider) -> Uuid {
        let id = Uuid::new_v4();
        crate::state::testing::place(&p.store, id, EnvStatus::Active, None, 0, None).unwrap();
        id
    }

    #[test]
    fn a_workspace_outside_the_root_is_never_touched() {
        let (_d, p) = provider(1);
        let env = Uuid::new_v4();
        let m = Machine::new("a:/")
            .with("env", env.to_string())
            .with("workspace", "/")
            .with("host", "a");
        assert!(p.workspace(&m).is_err());
        let good = p.machine(&p.settings.hosts[0].clone(), &p.store.env_paths(env));
        assert_eq!(
            p.workspace(&good).unwrap(),
            format!("/var/lib/dormant-workspaces/{env}")
        );
        assert_eq!(p.key_fields(&good), vec![("host".into(), "a".into())]);
    }
}
