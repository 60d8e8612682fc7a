//! The `adopted` events of `dormant adopt`: the reason that names a
//! take-over by its epoch, and the events a killed run left pending (the
//! `adopted.pending` marker beside a record it wrote), written by the next
//! run unless the log already has them. The take-over itself is `mod.rs`.

use anyhow::Result;

use super::PENDING_EVENT;
use crate::context::Ctx;
use crate::events::{Event, EventLog, Kind};
use crate::state::{registry, store, StateStore};

/// The reason of an `adopted` event; the epoch makes it that take-over's
/// (a later adopt looks for it before writing one it finds pending).
pub(super) fn adopted_reason(resource: &str, epoch: &str) -> String {
    format!("taken over from the cloud: {resource} (ownership epoch {epoch})")
}

/// Writes the `adopted` events an earlier run was killed before writing:
/// every environment here with an `adopted.pending` marker gets its
/// event, unless the log already has it (that run was killed between the
/// event and the marker's removal); then the marker goes. A failure is a
/// warning: the marker stays for the next run.
pub(super) async fn record_pending_events(store: &StateStore, events: &EventLog, ctx: &Ctx) {
    let ids = match store.environment_ids() {
        Ok(ids) => ids,
        Err(e) => {
            ctx.log.warn(format!(
                "looking for adopted events still to be recorded: {e:#}"
            ));
            return;
        }
    };
    for id in ids {
        let paths = store.env_paths(id);
        let marker = paths.dir.join(PENDING_EVENT);
        let Ok(text) = std::fs::read_to_string(&marker) else {
            continue;
        };
        let mut lines = text.lines();
        let (Some(epoch), resource) = (
            lines
                .next()
                .map(str::trim)
                .filter(|l| crate::provider::ec2::handover::epoch_number(l).is_some()),
            lines.next().unwrap_or("?").trim().to_string(),
        ) else {
            // Cut short by a power loss (markers are not fsynced): what
            // is lost is at most this one event.
            ctx.log.warn(format!(
                "{} is not an epoch and a resource: removed; the adopted event of environment {id} \
                 may be missing from the event log",
                marker.display()
            ));
            let _ = store::remove_file(&marker);
            continue;
        };
        let reason = adopted_reason(&resource, epoch);
        let written = match already_recorded(events, id, &reason) {
            Ok(w) => w,
            Err(e) => {
                ctx.log.warn(format!(
                    "reading the event log for environment {id}'s adopted event: {e:#}"
                ));
                continue;
            }
        };
        if !written {
            let rec = match registry::peek(&paths) {
                Ok(Some(rec)) => rec,
                _ => continue, // released meanwhile, or unreadable: nothing to say it of
            };
            let event = Event::about(Kind::Adopted, "operator", &rec).reason(&format!(
                "{reason}; recorded by a later `dormant adopt` (the one that took it over was killed \
                 before it could)"
            ));
            if let Err(e) = events.append(&event, ctx).await {
                ctx.log.warn(format!(
                    "the adopted event of environment {id} is still not recorded ({e:#}): the next \
                     `dormant adopt` tries again"
                ));
                continue;
            }
            ctx.log.info(format!(
                "recorded the adopted event of environment {id} that an earlier `dormant adopt` was \
                 killed before writing"
            ));
        }
        let _ = store::remove_file(&marker);
    }
}

/// Whether the log holds environment `id`'s `adopted` event with `reason`
/// (a later note may follow it).
fn already_recorded(events: &EventLog, id: uuid::Uuid, reason: &str) -> Result<bool> {
    let mut found = false;
    crate::events::read::read_from(events.dir(), None, &mut |line| {
        if let crate::events::read::Line::Event(e, _) = line {
            if e.env == Some(id)
                && e.event == Kind::Adopted.as_str()
                && e.reason.as_deref().is_some_and(|r| r.starts_with(reason))
            {
                found = true;
            }
        }
    })?;
    Ok(found)
}
