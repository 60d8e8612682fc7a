//! Test seams (unit tests, and integration tests built with the `testing`
//! feature): put an environment in any status, at any age, held by anyone,
//! without going through a job — to test what meets such a record.

use anyhow::Result;
use uuid::Uuid;

use super::record::{Claim, EnvStatus, EnvironmentRecord, Holder, NewEnvironment};
use super::{now_unix, registry, store, StateStore};
use crate::model::Machine;

/// Creates (or overwrites) environment `id` with this status, holder and age
/// (seconds since it was created, suspended and last active).
pub fn place(
    store: &StateStore,
    id: Uuid,
    status: EnvStatus,
    holder: Option<Holder>,
    age: u64,
    machine: Option<Machine>,
) -> Result<EnvironmentRecord> {
    let then = now_unix().saturating_sub(age);
    let mut rec = EnvironmentRecord::new(
        NewEnvironment {
            id,
            provider: "local",
            runner_id: "1",
            system_id: "s",
            project_id: 5,
            project_path: None,
            job_id: 9,
            storage: crate::model::StorageMode::Machine,
            image: None,
        },
        Holder::Operator {
            pid: 0,
            what: "test".into(),
        },
    );
    rec.status = status;
    rec.claim = holder.map(|holder| Claim {
        holder,
        since: then,
        last_activity: then,
    });
    rec.created_at = then;
    rec.suspended_at = (status == EnvStatus::Suspended).then_some(then);
    rec.machine = machine;
    if !registry::create(store, &rec)? {
        store::write_json(&store.env_paths(id).record, &rec)?;
    }
    Ok(rec)
}

/// Rewrites an existing record's status and claim (e.g. to make a claim look old).
pub fn rewrite(
    store: &StateStore,
    id: Uuid,
    change: impl FnOnce(&mut EnvStatus, &mut Option<Claim>, &mut EnvironmentRecord),
) -> Result<()> {
    let path = store.env_paths(id).record;
    let mut rec = registry::peek(&store.env_paths(id))?
        .ok_or_else(|| anyhow::anyhow!("no record for {id}"))?;
    let (mut status, mut claim) = (rec.status, rec.claim.clone());
    change(&mut status, &mut claim, &mut rec);
    rec.status = status;
    rec.claim = claim;
    store::write_json(&path, &rec)
}

/// Moves an existing record's times `secs` into the past (made, suspended,
/// resumed): it looks as old as a TTL needs, without a test waiting for it.
pub fn backdate(store: &StateStore, id: Uuid, secs: u64) -> Result<()> {
    rewrite(store, id, |_, _, rec| {
        rec.created_at -= secs;
        rec.suspended_at = rec.suspended_at.map(|t| t - secs);
        rec.resumed_at = rec.resumed_at.map(|t| t - secs);
    })
}
