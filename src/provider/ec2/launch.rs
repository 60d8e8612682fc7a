//! RunInstances for one environment: a deterministic name and ClientToken,
//! `Name` and `dormant:*` tags on the instance and its volumes (set atomically
//! at launch, so a retried prepare finds the instance by tag even when the
//! first attempt died before saving state), IMDSv2 required, EBS root, and the
//! environment's SSH public key in cloud-init user-data. A machine-mode
//! instance also gets the way back in for a replacement runner-manager host
//! (`handover.rs`): the boot hook in its user-data, its key in the
//! `dormant:authorized-key` tag, and instance tags readable through the
//! instance metadata service.

use anyhow::{bail, Result};
use aws_sdk_ec2::types::{
    BlockDeviceMapping, EbsBlockDevice, HibernationOptionsRequest, HttpTokensState,
    IamInstanceProfileSpecification, InstanceInterruptionBehavior, InstanceMarketOptionsRequest,
    InstanceMetadataEndpointState, InstanceMetadataOptionsRequest, InstanceMetadataTagsState,
    InstanceType, MarketType, ResourceType, SpotInstanceType, SpotMarketOptions, Tag,
    TagSpecification, VolumeType,
};
use aws_sdk_ec2::Client;

use super::call::call;
use super::handover;
use super::image::ImageInfo;
use super::instance::tag;
use super::placement::Choice;
use crate::context::Ctx;
use crate::provider::MachineSpec;
use crate::settings::ec2::{Ec2Settings, Market};

/// The tags of an environment's instance and volumes.
pub fn tags(spec: &MachineSpec, settings: &Ec2Settings) -> Vec<(String, String)> {
    let mut t: Vec<(String, String)> = vec![
        ("Name".into(), spec.name.clone()),
        (tag::MANAGED_BY.into(), tag::MANAGED_BY_VALUE.into()),
        (tag::ENV.into(), spec.env_id.to_string()),
        (tag::RUNNER.into(), spec.runner_id.clone()),
        (tag::SYSTEM.into(), spec.system_id.clone()),
        (tag::PROJECT.into(), spec.project_id.to_string()),
        (tag::JOB.into(), spec.job_id.to_string()),
        (
            handover::tag::EPOCH.into(),
            handover::FIRST_EPOCH.to_string(),
        ),
    ];
    t.extend(settings.tags.iter().map(|(k, v)| (k.clone(), v.clone())));
    t
}

/// The instance's own tags beyond [`tags`] in machine mode: the way back in
/// for a replacement host (`handover.rs`), i.e. the hook's version and the
/// key it installs.
pub fn entry_tags(spec: &MachineSpec) -> Result<Vec<(String, String)>> {
    let key = spec.ssh_public_key.as_deref().unwrap_or_default();
    let Some(key) = handover::authorized_key_tag(key) else {
        bail!(
            "the SSH public key of environment {} is not one ed25519 key line short enough for the \
             {} tag",
            spec.env_id,
            handover::tag::AUTHORIZED_KEY
        );
    };
    Ok(vec![
        (
            handover::tag::ENTRY.into(),
            handover::tag::ENTRY_IMDS_KEY.into(),
        ),
        (handover::tag::AUTHORIZED_KEY.into(), key),
    ])
}

/// With instance tags in the metadata service, EC2 accepts only tag keys of
/// letters, digits and `+ - = . , _ : @` (no spaces, no `/`): an operator's
/// tag outside that would fail every machine-mode launch, so it is refused
/// here, before anything is made, naming the setting.
pub fn check_tags_for_metadata(settings: &Ec2Settings) -> Result<()> {
    for k in settings.tags.keys() {
        let fits = !k.is_empty()
            && k != "."
            && k != ".."
            && k != "_index"
            && k.chars().all(|c| {
                c.is_ascii_alphanumeric()
                    || matches!(c, '+' | '-' | '=' | '.' | ',' | '_' | ':' | '@')
            });
        if !fits {
            bail!(
                "ec2.tags: the tag key {} cannot be used on machine-mode instances: they expose their tags \
                 to the instance metadata service (how a replacement runner-manager host gets back in), \
                 where EC2 allows only letters, digits and + - = . , _ : @ in tag keys; rename the tag",
                crate::text::quoted(k)
            );
        }
    }
    Ok(())
}

/// A ClientToken (≤ 64 ASCII characters) that makes RunInstances idempotent on
/// real EC2: a retried call returns the instance the first one made. The
/// generation counts instances of this environment already gone, because EC2
/// answers a reused token with the (terminated) instance it first made.
pub fn client_token(spec: &MachineSpec, generation: usize) -> String {
    format!("dormant-{}-{generation}", spec.env_id.simple())
}

/// cloud-init user-data (the one every provider uses, `provider::cloud_init`),
/// base64-encoded as RunInstances wants it.
pub fn user_data(spec: &MachineSpec, settings: &Ec2Settings) -> Result<String> {
    let text = crate::provider::cloud_init::user_data(
        spec.env_id,
        spec.ssh_public_key.as_deref(),
        &settings.ssh_user,
    )?;
    Ok(aws_smithy_types::base64::encode(text))
}

/// A machine-mode instance's user-data: [`user_data`]'s document plus the
/// boot hook that installs the key of the `dormant:authorized-key` tag on
/// every boot (`handover::boot_hook`).
pub fn machine_user_data(spec: &MachineSpec, settings: &Ec2Settings) -> Result<String> {
    let mut text = crate::provider::cloud_init::user_data(
        spec.env_id,
        spec.ssh_public_key.as_deref(),
        &settings.ssh_user,
    )?;
    text.push_str(&handover::boot_hook_yaml(&settings.ssh_user));
    Ok(aws_smithy_types::base64::encode(text))
}

/// What every choice of a launch shares.
pub struct LaunchRequest<'a> {
    pub spec: &'a MachineSpec,
    /// The instance's and its volumes' tags ([`tags`] for an environment's
    /// instance; a warm instance's own, `warm.rs`).
    pub tags: Vec<(String, String)>,
    pub settings: &'a Ec2Settings,
    pub image: &'a ImageInfo,
    /// The ClientToken of the first choice; later choices append their index
    /// (a token reused with other parameters is refused by EC2).
    pub client_token: String,
    pub user_data: String,
    /// Launch with hibernation configured (machine mode, `suspend_mode =
    /// "hibernate"`; on-demand only).
    pub hibernate: bool,
    /// Machine mode: the instance's [`entry_tags`], and its tags readable
    /// through the instance metadata service (the boot hook reads one).
    /// Empty: neither.
    pub entry_tags: Vec<(String, String)>,
}

/// A ClientToken used for one launch only (volume mode, where every resume
/// launches anew).
pub fn fresh_token() -> String {
    format!("dormant-{}", uuid::Uuid::new_v4().simple())
}

/// The ClientToken of the `index`-th placement choice.
pub fn choice_token(base: &str, index: usize) -> String {
    if index == 0 {
        base.to_string()
    } else {
        format!("{base}-{index}")
    }
}

/// One RunInstances call for one placement choice (throttling retried
/// inside); returns the instance id. Capacity errors come back to the
/// placement round (`placement.rs`) and the capacity loop.
pub async fn run_instance(
    client: &Client,
    req: &LaunchRequest<'_>,
    choice: &Choice,
    index: usize,
    ctx: &Ctx,
) -> Result<String> {
    let s = req.settings;
    let token = choice_token(&req.client_token, index);
    // One-time spot, terminated on interruption: a spot instance is never
    // stopped (its environment's state is on a volume, or not kept at all).
    let market = (choice.market == Market::Spot).then(|| {
        InstanceMarketOptionsRequest::builder()
            .market_type(MarketType::Spot)
            .spot_options(
                SpotMarketOptions::builder()
                    .spot_instance_type(SpotInstanceType::OneTime)
                    .instance_interruption_behavior(InstanceInterruptionBehavior::Terminate)
                    .build(),
            )
            .build()
    });
    let sdk_tag = |(k, v): (String, String)| Tag::builder().key(k).value(v).build();
    let sdk_tags: Vec<Tag> = req.tags.iter().cloned().map(sdk_tag).collect();
    let spec_for = |rt: ResourceType, extra: &[(String, String)]| {
        let mut all = sdk_tags.clone();
        all.extend(extra.iter().cloned().map(sdk_tag));
        TagSpecification::builder()
            .resource_type(rt)
            .set_tags(Some(all))
            .build()
    };
    let metadata_tags = if req.entry_tags.is_empty() {
        InstanceMetadataTagsState::Disabled
    } else {
        InstanceMetadataTagsState::Enabled
    };
    let wants_root = s.root_volume_size_gb.is_some()
        || s.root_volume_type.is_some()
        || s.root_volume_encrypted.is_some()
        || s.root_volume_kms_key_id.is_some();
    let root = if wants_root {
        let Some(device) = req.image.root_device_name.clone() else {
            bail!(
                "image {} reports no root device name, so ec2.root_volume_* cannot be applied",
                req.image.image_id
            );
        };
        Some(
            BlockDeviceMapping::builder()
                .device_name(device)
                .ebs(
                    EbsBlockDevice::builder()
                        .set_volume_size(s.root_volume_size_gb.map(|g| g as i32))
                        .set_volume_type(s.root_volume_type.as_deref().map(VolumeType::from))
                        .set_encrypted(s.root_volume_encrypted)
                        .set_kms_key_id(s.root_volume_kms_key_id.clone())
                        .delete_on_termination(true)
                        .build(),
                )
                .build(),
        )
    } else {
        None
    };
    let profile = s.iam_instance_profile.as_ref().map(|p| {
        let b = IamInstanceProfileSpecification::builder();
        if p.starts_with("arn:") {
            b.arn(p)
        } else {
            b.name(p)
        }
        .build()
    });
    let out = call("RunInstances", ctx, || {
        client
            .run_instances()
            .image_id(&req.image.image_id)
            .instance_type(InstanceType::from(choice.instance_type.as_str()))
            .min_count(1)
            .max_count(1)
            .subnet_id(&choice.subnet.id)
            .set_security_group_ids(
                (!s.security_group_ids.is_empty()).then(|| s.security_group_ids.clone()),
            )
            .client_token(&token)
            .set_instance_market_options(market.clone())
            .user_data(&req.user_data)
            .metadata_options(
                InstanceMetadataOptionsRequest::builder()
                    .http_tokens(HttpTokensState::Required)
                    .http_endpoint(InstanceMetadataEndpointState::Enabled)
                    .instance_metadata_tags(metadata_tags.clone())
                    .build(),
            )
            .tag_specifications(spec_for(ResourceType::Instance, &req.entry_tags))
            .tag_specifications(spec_for(ResourceType::Volume, &[]))
            .set_block_device_mappings(root.clone().map(|r| vec![r]))
            .set_iam_instance_profile(profile.clone())
            .set_hibernation_options((req.hibernate && choice.market == Market::OnDemand).then(
                || {
                    HibernationOptionsRequest::builder()
                        .configured(true)
                        .build()
                },
            ))
            .send()
    })
    .await?;
    match out.instances().first().and_then(|i| i.instance_id()) {
        Some(id) => Ok(id.to_string()),
        None => bail!("EC2 RunInstances answered without an instance"),
    }
}
