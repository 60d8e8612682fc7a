//! Which AMI an environment is launched from: the job's `image:` if the
//! operator's `ec2.allowed_images` lets it, else `ec2.image`. A name pattern
//! resolves through DescribeImages to the newest match of `ec2.image_owners`.
//! The resolution (also of plain ids: dormant needs the root device name and
//! checks the AMI is EBS-backed) is cached in the state dir under a per-image
//! lock, so N concurrent prepares of one image make one DescribeImages call.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use aws_sdk_ec2::Client;
use serde::{Deserialize, Serialize};

use super::call::call;
use super::instance::filter;
use crate::context::Ctx;
use crate::provider::Refusal;
use crate::settings::ec2::{is_ami_id, Ec2Settings};
use crate::state::store::{read_json, write_json, FORMAT_VERSION};
use crate::state::{now_unix, FileLock, StateStore};

/// Picks the image request (id or pattern) for a job, enforcing the allow-list.
/// Returns the request and, when the job's image was ignored, why.
pub fn choose(
    settings: &Ec2Settings,
    job_image: Option<&str>,
) -> Result<(String, Option<String>), Refusal> {
    let default = settings.image.clone().unwrap_or_default();
    let Some(asked) = job_image.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok((default, None));
    };
    // The job's `image:` is untrusted: shown as a short excerpt.
    let (asked_q, default_q) = (crate::text::quoted(asked), crate::text::quoted(&default));
    if settings.allowed_images.is_empty() {
        // Pipelines often carry a docker `image:` meant for other runners: with no
        // allow-list, the job gets the operator's image and is told so.
        return Ok((
            default.clone(),
            Some(format!(
                "the job's image {asked_q} is ignored: ec2.allowed_images is empty, so jobs run on ec2.image {default_q}"
            )),
        ));
    }
    if settings.allowed_images.iter().any(|a| a == asked) {
        return Ok((asked.to_string(), None));
    }
    Err(Refusal(format!(
        "the job's image {asked_q} is not in this runner's allow-list ec2.allowed_images ({}); \
         use one of those or ask the runner's operator to add it",
        settings.allowed_images.join(", ")
    )))
}

/// A resolved AMI.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    pub image_id: String,
    pub name: Option<String>,
    pub root_device_name: Option<String>,
    pub creation_date: Option<String>,
    /// The size of the image's root EBS volume (its snapshot's), GiB: what
    /// an instance launched without `root_volume_size_gb` keeps while
    /// stopped. Absent from caches written before it was read.
    #[serde(default)]
    pub root_volume_gib: Option<u32>,
}

#[derive(Debug, Serialize, Deserialize)]
struct CacheEntry {
    version: u32,
    request: String,
    region: String,
    owners: Vec<String>,
    resolved_at: u64,
    image: ImageInfo,
}

pub struct ImageResolver<'a> {
    pub store: &'a StateStore,
    pub settings: &'a Ec2Settings,
    pub region: &'a str,
}

impl ImageResolver<'_> {
    fn cache_paths(&self, request: &str) -> (PathBuf, PathBuf) {
        let key = uuid::Uuid::new_v5(
            &uuid::Uuid::NAMESPACE_OID,
            format!(
                "{}\n{request}\n{}",
                self.region,
                self.settings.image_owners.join(",")
            )
            .as_bytes(),
        )
        .simple()
        .to_string();
        let dir = self.store.root().join("ec2").join("images");
        (
            dir.join(format!("{key}.json")),
            dir.join(format!("{key}.lock")),
        )
    }

    /// Resolves a request, from the cache when it is fresh.
    pub async fn resolve(&self, client: &Client, request: &str, ctx: &Ctx) -> Result<ImageInfo> {
        let request_q = crate::text::quoted(request);
        let (file, lock_path) = self.cache_paths(request);
        crate::state::store::ensure_private_dir(file.parent().expect("cache dir"))?;
        let _lock = FileLock::acquire(
            &lock_path,
            ctx,
            &format!("waiting for the lookup of image {request_q}"),
        )
        .await?
        .with_context(|| format!("{} vanished", lock_path.display()))?;
        let ttl = self.settings.image_cache_ttl.as_secs();
        if let Some(entry) = read_json::<CacheEntry>(&file).ok().flatten() {
            if entry.request == request && now_unix().saturating_sub(entry.resolved_at) < ttl {
                tracing::debug!(request, image = %entry.image.image_id, "image resolution from cache");
                return Ok(entry.image);
            }
        }
        let image = self.lookup(client, request, ctx).await?;
        let entry = CacheEntry {
            version: FORMAT_VERSION,
            request: request.to_string(),
            region: self.region.to_string(),
            owners: self.settings.image_owners.clone(),
            resolved_at: now_unix(),
            image: image.clone(),
        };
        if let Err(e) = write_json(&file, &entry) {
            tracing::warn!("caching the image resolution: {e:#}");
        }
        Ok(image)
    }

    async fn lookup(&self, client: &Client, request: &str, ctx: &Ctx) -> Result<ImageInfo> {
        let request_q = crate::text::quoted(request);
        let by_id = is_ami_id(request);
        let owners = self.settings.image_owners.clone();
        let out = call("DescribeImages", ctx, || {
            let mut req = client.describe_images();
            if by_id {
                req = req.image_ids(request);
            } else {
                req = req
                    .set_owners(Some(owners.clone()))
                    .filters(filter("name", &[request]))
                    .filters(filter("state", &["available"]));
            }
            req.send()
        })
        .await
        .with_context(|| format!("looking up image {request_q} in {}", self.region))?;
        // Newest first; equal dates: the highest name (versioned names sort).
        let best = out.images().iter().max_by(|a, b| {
            (a.creation_date(), a.name(), a.image_id()).cmp(&(
                b.creation_date(),
                b.name(),
                b.image_id(),
            ))
        });
        let Some(img) = best else {
            if by_id {
                bail!(
                    "image {request} does not exist in {} or is not visible to this account: check ec2.image \
                     (or the job's image: and ec2.allowed_images)",
                    self.region
                );
            }
            bail!(
                "no available image matches the name pattern {request_q} among the images of {} in {}: \
                 check ec2.image (or the job's image:) and ec2.image_owners",
                owners.join(", "),
                self.region
            );
        };
        let root_type = img.root_device_type().map(|t| t.as_str().to_string());
        if root_type.as_deref().is_some_and(|t| t != "ebs") {
            bail!(
                "image {} ({}) has a {} root device: dormant suspends by stopping the instance, which needs an \
                 EBS-backed image; pick another ec2.image",
                img.image_id().unwrap_or("?"),
                img.name().unwrap_or("?"),
                root_type.unwrap_or_default()
            );
        }
        let info = ImageInfo {
            image_id: img.image_id().unwrap_or_default().to_string(),
            name: img.name().map(str::to_string),
            root_device_name: img.root_device_name().map(str::to_string),
            creation_date: img.creation_date().map(str::to_string),
            root_volume_gib: img
                .block_device_mappings()
                .iter()
                .find(|m| m.device_name().is_some() && m.device_name() == img.root_device_name())
                .and_then(|m| m.ebs()?.volume_size())
                .and_then(|g| u32::try_from(g).ok()),
        };
        if !by_id {
            ctx.log.info(format!(
                "image {request_q} resolved to {} ({})",
                info.image_id,
                info.name.as_deref().unwrap_or("?")
            ));
        }
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(allowed: &[&str]) -> Ec2Settings {
        Ec2Settings {
            image: Some("ami-0default".into()),
            allowed_images: allowed.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn job_image_goes_through_the_allow_list() {
        let s = settings(&["ami-0a", "debian-12-*"]);
        assert_eq!(choose(&s, None).unwrap().0, "ami-0default");
        assert_eq!(choose(&s, Some("debian-12-*")).unwrap().0, "debian-12-*");
        let refusal = choose(&s, Some("ami-0evil")).unwrap_err();
        assert!(refusal.0.contains("ec2.allowed_images"), "{refusal}");
        let (chosen, note) = choose(&settings(&[]), Some("ruby:3.3")).unwrap();
        assert_eq!(chosen, "ami-0default");
        assert!(note.unwrap().contains("ec2.allowed_images is empty"));
    }
}
