//! The zones of `ec2.subnet_ids`: a launch with several subnets says which
//! zone it tries, and a volume lives in one zone, so its resume needs the
//! subnet of that zone. A subnet's zone never changes (and AWS never reuses
//! a subnet id), so a lookup is kept for good in the state dir
//! (`ec2/subnets-<region>.json`): DescribeSubnets is called for subnets
//! this runner has not seen yet, not on every launch. One subnet per zone is
//! checked here (the settings parser cannot: it makes no call).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use aws_sdk_ec2::Client;
use serde::{Deserialize, Serialize};

use super::call::call;
use super::placement::Subnet;
use crate::context::Ctx;
use crate::state::store::{ensure_private_dir, read_json, write_json, FORMAT_VERSION};
use crate::state::{FileLock, StateStore};

#[derive(Debug, Default, Serialize, Deserialize)]
struct Known {
    version: u32,
    /// subnet id → zone name
    zones: BTreeMap<String, String>,
}

fn paths(store: &StateStore, region: &str) -> (PathBuf, PathBuf) {
    let safe: String = region
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let dir = store.root().join("ec2");
    (
        dir.join(format!("subnets-{safe}.json")),
        dir.join(format!("subnets-{safe}.lock")),
    )
}

/// The subnets `ids` with their zones, in the order given; an error when two
/// are in one zone, naming the setting.
pub async fn with_zones(
    client: &Client,
    store: &StateStore,
    region: &str,
    ids: &[String],
    ctx: &Ctx,
) -> Result<Vec<Subnet>> {
    let (file, lock_path) = paths(store, region);
    let mut known = read_json::<Known>(&file).ok().flatten().unwrap_or_default();
    let missing: Vec<String> = ids
        .iter()
        .filter(|id| !known.zones.contains_key(*id))
        .cloned()
        .collect();
    if !missing.is_empty() {
        let out = call("DescribeSubnets", ctx, || {
            client
                .describe_subnets()
                .set_subnet_ids(Some(missing.clone()))
                .send()
        })
        .await
        .with_context(|| format!("looking up the zones of subnets {}", missing.join(", ")))?;
        let found: BTreeMap<String, String> = out
            .subnets()
            .iter()
            .filter_map(|s| {
                Some((
                    s.subnet_id()?.to_string(),
                    s.availability_zone()?.to_string(),
                ))
            })
            .collect();
        if let Some(absent) = missing.iter().find(|id| !found.contains_key(*id)) {
            bail!(
                "subnet {absent} does not exist in {region}: check ec2.subnet_id / ec2.subnet_ids"
            );
        }
        // Merged under the lock: two prepares may have looked up different subnets.
        ensure_private_dir(file.parent().expect("ec2 dir"))?;
        let _lock = FileLock::acquire(&lock_path, ctx, "waiting for the subnet cache lock")
            .await?
            .with_context(|| format!("{} vanished", lock_path.display()))?;
        known = read_json::<Known>(&file).ok().flatten().unwrap_or_default();
        known.version = FORMAT_VERSION;
        known.zones.extend(found);
        if let Err(e) = write_json(&file, &known) {
            tracing::warn!("caching the zones of subnets: {e:#}");
        }
    }
    let subnets: Vec<Subnet> = ids
        .iter()
        .map(|id| Subnet {
            id: id.clone(),
            zone: known.zones.get(id).cloned(),
        })
        .collect();
    for (i, a) in subnets.iter().enumerate() {
        if let Some(b) = subnets[..i].iter().find(|b| b.zone == a.zone) {
            bail!(
                "ec2.subnet_ids: {} and {} are both in zone {}: list one subnet per zone (a volume-mode \
                 environment resumes in the subnet of its volume's zone)",
                b.id,
                a.id,
                a.zone.as_deref().unwrap_or("?")
            );
        }
    }
    Ok(subnets)
}

/// The subnet of `zone` among `subnets`.
pub fn in_zone<'a>(subnets: &'a [Subnet], zone: &str) -> Option<&'a Subnet> {
    subnets.iter().find(|s| s.zone.as_deref() == Some(zone))
}
