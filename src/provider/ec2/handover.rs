//! What a replacement runner-manager host needs from the cloud to take over
//! an environment whose record was lost with the old host, and how dormant
//! keeps it there: tags on the instance (and on a data volume).
//!
//! - `dormant:epoch`: the ownership epoch, `1` at creation. A take-over
//!   raises it and writes it with the taking host's owner id
//!   (`<number>/<owner>`, [`epoch_value`]); the record keeps the whole value
//!   it was made or adopted with, so two hosts that both wrote epoch N+1 do
//!   not both match it.
//! - `dormant:suspended-at`: unix seconds of the environment's last
//!   suspension, written before the instance is stopped (machine mode) and
//!   after the data volume is detached (volume mode), so the TTL still counts
//!   from the original suspension after a take-over.
//! - Machine mode only, at launch: `dormant:entry` (the version of the way
//!   back in), `dormant:authorized-key` (the SSH public key the boot hook in
//!   the user-data installs on every boot; [`boot_hook`]), and, once the
//!   first connection has pinned it, `dormant:host-key` (the machine's SSH
//!   host key as `type base64`). A new host sets its own key in
//!   `dormant:authorized-key` before it starts the instance, and checks the
//!   machine against `dormant:host-key`.
//!
//! An instance without `dormant:entry` (made before this), or without a
//! pinned host key, cannot be entered by a new host: [`entry`] says why.
//! Volume mode needs none of it: every resume launches a new instance with
//! the resuming host's key and pins its host key anew.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use aws_sdk_ec2::types::Tag;
use aws_sdk_ec2::Client;

use super::call::call;
use crate::context::Ctx;
use crate::text::shell_quote;

pub mod tag {
    pub const EPOCH: &str = "dormant:epoch";
    pub const SUSPENDED_AT: &str = "dormant:suspended-at";
    pub const ENTRY: &str = "dormant:entry";
    pub const AUTHORIZED_KEY: &str = "dormant:authorized-key";
    pub const HOST_KEY: &str = "dormant:host-key";
    /// The only way back in so far: [`super::boot_hook`], reading
    /// `dormant:authorized-key` through the instance metadata service.
    pub const ENTRY_IMDS_KEY: &str = "imds-authorized-key-1";
}

/// The epoch of a new environment.
pub const FIRST_EPOCH: u64 = 1;

/// EC2 tag values are at most 256 characters.
const TAG_VALUE_MAX: usize = 256;

/// The instance metadata service, as every instance sees it.
pub const IMDS: &str = "http://169.254.169.254";

/// CreateTags on one instance or volume (an existing tag is overwritten).
pub async fn set_tags(
    client: &Client,
    resource: &str,
    tags: &[(&str, String)],
    ctx: &Ctx,
) -> Result<()> {
    let sdk: Vec<Tag> = tags
        .iter()
        .map(|(k, v)| Tag::builder().key(*k).value(v.clone()).build())
        .collect();
    call("CreateTags", ctx, || {
        client
            .create_tags()
            .resources(resource)
            .set_tags(Some(sdk.clone()))
            .send()
    })
    .await
    .with_context(|| {
        format!(
            "tagging {resource} with {}",
            tags.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
        )
    })?;
    Ok(())
}

/// The host key pinned in an environment's known_hosts, as the tag keeps it
/// (`ssh-ed25519 AAAA...`): the key of its one line. `None` if there is no
/// pin, more than one, or the key does not fit a tag (RSA; such a machine
/// is reported as not enterable by a new host, never trusted blindly).
pub fn pinned_host_key(known_hosts: &str) -> Option<String> {
    let mut lines = known_hosts
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'));
    let line = lines.next()?;
    if lines.next().is_some() {
        return None;
    }
    let mut f = line.split_whitespace();
    let (_host, kind, key) = (f.next()?, f.next()?, f.next()?);
    let value = format!("{kind} {key}");
    plain_key(&value).then_some(value)
}

/// One OpenSSH public key (`type base64`, an optional comment), short enough
/// for a tag, with nothing a shell or a YAML document would read specially.
fn plain_key(value: &str) -> bool {
    let mut f = value.split(' ');
    let (Some(kind), Some(b64)) = (f.next(), f.next()) else {
        return false;
    };
    value.len() <= TAG_VALUE_MAX
        && (kind.starts_with("ssh-") || kind.starts_with("ecdsa-"))
        && kind
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '@'))
        && !b64.is_empty()
        && b64
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '='))
        && value.chars().all(|c| c.is_ascii_graphic() || c == ' ')
}

/// The authorized key dormant puts in `dormant:authorized-key`: its
/// environment key (`ssh-ed25519 AAAA... comment`), checked like a pinned
/// key. `None`: it cannot go into a tag.
pub fn authorized_key_tag(public_key: &str) -> Option<String> {
    let k = public_key.trim();
    (k.starts_with("ssh-ed25519 ") && plain_key(k)).then(|| k.to_string())
}

/// How a new host gets into a machine-mode instance, from its tags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// `type base64`, to be written to the environment's known_hosts.
    pub host_key: String,
}

/// Whether a new host can enter this machine-mode instance, and if not, why
/// (one sentence, naming what is missing and what the operator can do).
pub fn entry(tags: &BTreeMap<String, String>) -> Result<Entry, String> {
    match tags.get(tag::ENTRY).map(String::as_str) {
        Some(tag::ENTRY_IMDS_KEY) => {}
        Some(other) => {
            return Err(format!(
                "its way back in ({} = {}) is not one this dormant knows: adopt it with the dormant \
                 version that made it",
                tag::ENTRY,
                crate::text::quoted(other)
            ))
        }
        None => {
            return Err(format!(
                "it was made before dormant could hand environments over (no {} tag): its SSH key was \
                 lost with the old host, so no new host can log in; release it (terminate the instance) \
                 or copy the old host's state dir",
                tag::ENTRY
            ))
        }
    }
    match tags.get(tag::HOST_KEY) {
        Some(k) if plain_key(k) => Ok(Entry {
            host_key: k.clone(),
        }),
        Some(k) => Err(format!(
            "its {} tag {} is not one SSH public key: its host key cannot be checked, so it is not started",
            tag::HOST_KEY,
            crate::text::quoted(k)
        )),
        None => Err(format!(
            "it has no {} tag (its first connection never recorded the pinned host key): its host key \
             cannot be checked, so it is not started; release it or copy the old host's state dir",
            tag::HOST_KEY
        )),
    }
}

/// A number tag (`dormant:epoch`, `dormant:suspended-at`): `Ok(None)` when
/// absent, an error naming it when it does not parse.
pub fn number(tags: &BTreeMap<String, String>, name: &str) -> Result<Option<u64>, String> {
    match tags.get(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| format!("its tag {name} is {}, not a number", crate::text::quoted(v))),
    }
}

/// The number of an epoch tag value (`3`, or `3/<owner>` after a take-over);
/// `None` when it is not one.
pub fn epoch_number(value: &str) -> Option<u64> {
    let v = value.trim();
    v.split_once('/').map_or(v, |(n, _)| n).parse().ok()
}

/// The owner id in an epoch tag value written by a take-over, if any.
pub fn epoch_owner(value: &str) -> Option<&str> {
    value.trim().split_once('/').map(|(_, o)| o)
}

/// The epoch tag value a take-over by `owner` writes for epoch `n`.
pub fn epoch_value(n: u64, owner: &str) -> String {
    format!("{n}/{owner}")
}

/// A new owner id for one `dormant adopt` run: random, so two hosts (or two
/// runs) never write the same epoch value.
pub fn new_owner_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Whether a record may act on an instance or data volume: the ownership
/// epoch it recorded (`recorded`) must be the one the tags carry now
/// (`tagged`; absent: 0) — the number and, after a take-over, the owner id
/// (two hosts adopting at once may both write epoch N+1: only the one whose
/// value the tag kept may act). A record without one (made before epochs,
/// or a data volume's record from its creation) may act only while nobody
/// has taken the environment over: a take-over always writes an epoch above
/// [`FIRST_EPOCH`].
pub fn epoch_matches(recorded: Option<&str>, tagged: Option<&str>) -> bool {
    let parse = |v: &str| (epoch_number(v), epoch_owner(v).map(str::to_string));
    let tagged_number = tagged.and_then(epoch_number).unwrap_or(0);
    match recorded.map(parse) {
        Some((Some(n), owner)) => {
            n == tagged_number && owner == tagged.and_then(epoch_owner).map(str::to_string)
        }
        _ => tagged_number <= FIRST_EPOCH,
    }
}

/// The epoch a take-over of an environment whose tags carry `epoch` writes.
pub fn next_epoch(epoch: u64) -> u64 {
    epoch.max(FIRST_EPOCH) + 1
}

/// The refusal of a record whose epoch is not the tags' (a host that comes
/// back after another one took its environment over).
pub fn stale_record(
    doing: &str,
    resource: &str,
    recorded: Option<&str>,
    tagged: Option<&str>,
) -> String {
    format!(
        "refusing to {doing} {resource}: another runner-manager host has taken this environment over \
         (ownership epoch {} on it, {} in this host's record), so this host's record of it is stale and \
         must not touch it; the environment is the other host's now: remove it from this host's state \
         dir (its directory under environments/) without releasing it",
        tagged.unwrap_or("none"),
        recorded.unwrap_or("none")
    )
}

/// The boot hook dormant puts in a machine-mode instance's user-data (a
/// `bootcmd` entry, which cloud-init runs early on every boot): it asks the
/// instance metadata service (IMDSv2, `imds`) for the instance tag
/// `dormant:authorized-key` and makes it the one key in `user`'s
/// `authorized_keys`. On the first boot `user` does not exist yet and the
/// hook does nothing (cloud-init's own module installs the key of the
/// user-data, which is the tag's too). Anything missing — no metadata
/// service, no tag, a value that is not one ed25519 key — leaves the file
/// as it is. A function called once, so nothing in it ends the boot script.
pub fn boot_hook(user: &str, imds: &str) -> String {
    let user = shell_quote(user);
    let tag = tag::AUTHORIZED_KEY;
    format!(
        r#"# dormant: on every boot, the SSH key in the instance tag {tag}
# (through the instance metadata service) becomes the one authorized key of {user}:
# a runner-manager host that takes this environment over sets its own key there
# before it starts the instance.
dormant_authorized_key() {{
  home=$(getent passwd {user} | cut -d: -f6)
  [ -n "$home" ] && [ -d "$home" ] || return 0
  token=$(curl -sf -m 5 -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 60' '{imds}/latest/api/token') || return 0
  key=$(curl -sf -m 5 -H "X-aws-ec2-metadata-token: $token" '{imds}/latest/meta-data/tags/instance/{tag}') || return 0
  [ "$(printf '%s\n' "$key" | wc -l)" = 1 ] || return 0
  case "$key" in ssh-ed25519\ *) ;; *) return 0 ;; esac
  (umask 077 && mkdir -p "$home/.ssh" && printf '%s\n' "$key" > "$home/.ssh/authorized_keys.dormant") || return 0
  chown {user}: "$home/.ssh" "$home/.ssh/authorized_keys.dormant" || return 0
  mv -f "$home/.ssh/authorized_keys.dormant" "$home/.ssh/authorized_keys"
}}
dormant_authorized_key
"#
    )
}

/// The hook as a `bootcmd` block to append to a `#cloud-config` document.
pub fn boot_hook_yaml(user: &str) -> String {
    let mut out = String::from("bootcmd:\n  - |\n");
    for line in boot_hook(user, IMDS).lines() {
        out.push_str("    ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
#[path = "handover_tests.rs"]
mod tests;
