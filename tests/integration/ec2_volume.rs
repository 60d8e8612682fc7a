//! The EBS calls of volume mode (`provider::ec2::volume`) against moto
//! through the test proxy: create with its zone, size, type, encryption, KMS
//! key and tags; attach and detach with their waits; describe; delete;
//! finding volumes by tag; and the attach across zones EC2 refuses (the
//! proxy refuses it: moto would attach it). Then the provider's `Volumes`
//! side as the lifecycle calls it: the first instance launched with the
//! volume, a retried create finding both, a detach without the guest's
//! unmount, a deleted volume and a foreign one.

use std::collections::BTreeMap;

use dormant::provider::ec2::volume::{self, NewVolume, Until};
use dormant::provider::{MachineSpec, Provider, VolumeGone, VolumeSpec};

use crate::ec2::{err_text, rig, Ec2};
use crate::moto::direct_client;

/// moto's default subnets' zones, sorted.
async fn zones(rig: &Ec2) -> Vec<(String, String)> {
    let out = rig.direct.describe_subnets().send().await.unwrap();
    let mut v: Vec<(String, String)> = out
        .subnets()
        .iter()
        .filter(|s| s.default_for_az() == Some(true))
        .map(|s| {
            (
                s.availability_zone().unwrap().to_string(),
                s.subnet_id().unwrap().to_string(),
            )
        })
        .collect();
    v.sort();
    v
}

fn new_volume(zone: &str, spec: &MachineSpec, system: &str) -> NewVolume {
    NewVolume {
        zone: zone.into(),
        size_gb: 12,
        volume_type: "gp3".into(),
        encrypted: true,
        kms_key_id: Some("alias/dormant-test".into()),
        tags: vec![
            ("Name".into(), spec.name.clone()),
            ("dormant:managed-by".into(), "dormant".into()),
            ("dormant:env".into(), spec.env_id.to_string()),
            ("dormant:system".into(), system.into()),
            ("dormant:volume".into(), "data".into()),
        ],
        client_token: format!("dormant-vol-{}", spec.env_id.simple()),
    }
}

#[tokio::test]
async fn create_attach_detach_delete_a_data_volume() {
    let rig = rig(&[]).await;
    let client = direct_client(&rig.proxy.url());
    let spec = rig.spec();
    let m = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(120))
        .await
        .unwrap();
    let zone = rig
        .instance(&m.id)
        .await
        .placement()
        .unwrap()
        .availability_zone()
        .unwrap()
        .to_string();
    let ctx = rig.ctx(60);

    rig.proxy.clear_calls();
    let vol = volume::create(&client, &new_volume(&zone, &spec, &rig.system_id), &ctx)
        .await
        .unwrap();
    assert_eq!(rig.proxy.count("CreateVolume"), 1);
    let body = &rig
        .proxy
        .calls()
        .into_iter()
        .find(|c| c.action == "CreateVolume")
        .unwrap()
        .body;
    assert!(body.contains("ClientToken=dormant-vol-"), "{body}");
    let v = rig
        .direct
        .describe_volumes()
        .volume_ids(&vol)
        .send()
        .await
        .unwrap()
        .volumes()[0]
        .clone();
    assert_eq!(v.availability_zone(), Some(zone.as_str()));
    assert_eq!(v.size(), Some(12));
    assert_eq!(v.volume_type().map(|t| t.as_str()), Some("gp3"));
    assert_eq!(v.encrypted(), Some(true));
    assert_eq!(v.kms_key_id(), Some("alias/dormant-test"));
    let tags: BTreeMap<_, _> = v
        .tags()
        .iter()
        .map(|t| (t.key().unwrap(), t.value().unwrap()))
        .collect();
    assert_eq!(
        tags.get("dormant:env"),
        Some(&spec.env_id.to_string().as_str())
    );
    assert_eq!(tags.get("dormant:volume"), Some(&"data"));
    assert_eq!(tags.get("Name"), Some(&spec.name.as_str()));

    // Attach: waits until EC2 says attached; a second attach makes no call.
    volume::attach(&client, &vol, &m.id, &ctx).await.unwrap();
    let seen = volume::describe(&client, &vol, &ctx)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(seen.state, "in-use");
    assert_eq!(seen.attachment_to(&m.id), Some("attached"));
    rig.proxy.clear_calls();
    volume::attach(&client, &vol, &m.id, &ctx).await.unwrap();
    assert_eq!(
        rig.proxy.count("AttachVolume"),
        0,
        "{:?}",
        rig.proxy.actions()
    );

    // Detach: available again; detaching a detached volume makes no call.
    volume::detach(&client, &vol, &m.id, &ctx).await.unwrap();
    let seen = volume::describe(&client, &vol, &ctx)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (seen.state.as_str(), seen.attachments.len()),
        ("available", 0)
    );
    rig.proxy.clear_calls();
    volume::detach(&client, &vol, &m.id, &ctx).await.unwrap();
    assert_eq!(rig.proxy.count("DetachVolume"), 0);

    // Terminating the instance leaves an attached data volume `available`.
    volume::attach(&client, &vol, &m.id, &ctx).await.unwrap();
    rig.provider.delete(&m, &ctx).await.unwrap();
    volume::wait_until(&client, &vol, Until::Available, &ctx)
        .await
        .unwrap();

    // Delete, twice: the second is a no-op; describe says it is gone.
    volume::delete(&client, &vol, &ctx).await.unwrap();
    volume::delete(&client, &vol, &ctx).await.unwrap();
    assert_eq!(volume::describe(&client, &vol, &ctx).await.unwrap(), None);
}

#[tokio::test]
async fn an_attach_across_zones_is_refused_as_ec2_refuses_it() {
    let rig = rig(&[]).await;
    let client = direct_client(&rig.proxy.url());
    let spec = rig.spec();
    let m = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(120))
        .await
        .unwrap();
    let own = rig
        .instance(&m.id)
        .await
        .placement()
        .unwrap()
        .availability_zone()
        .unwrap()
        .to_string();
    let other = zones(&rig)
        .await
        .into_iter()
        .map(|(z, _)| z)
        .find(|z| *z != own)
        .unwrap();
    let ctx = rig.ctx(60);
    let vol = volume::create(&client, &new_volume(&other, &spec, &rig.system_id), &ctx)
        .await
        .unwrap();
    let e = volume::attach(&client, &vol, &m.id, &ctx)
        .await
        .unwrap_err();
    let text = err_text(&e);
    assert!(
        text.contains("InvalidVolume.ZoneMismatch")
            && text.contains("can only be attached to an instance in its own zone"),
        "{text}"
    );
    // moto itself would have attached it: the refusal is the proxy's, as on EC2.
    rig.direct
        .attach_volume()
        .volume_id(&vol)
        .instance_id(&m.id)
        .device("/dev/sdg")
        .send()
        .await
        .expect("moto attaches across zones");
}

#[tokio::test]
async fn volumes_are_found_by_their_tags() {
    let rig = rig(&[]).await;
    let client = direct_client(&rig.proxy.url());
    let zone = zones(&rig).await[0].0.clone();
    let ctx = rig.ctx(60);
    let ours = rig.spec();
    let theirs = rig.spec();
    let a = volume::create(&client, &new_volume(&zone, &ours, &rig.system_id), &ctx)
        .await
        .unwrap();
    let b = volume::create(&client, &new_volume(&zone, &theirs, "s_someoneelse"), &ctx)
        .await
        .unwrap();
    let filter = |k: &str, v: &str| {
        aws_sdk_ec2::types::Filter::builder()
            .name(format!("tag:{k}"))
            .values(v)
            .build()
    };
    let found = volume::find(
        &client,
        vec![
            filter("dormant:system", &rig.system_id),
            filter("dormant:volume", "data"),
        ],
        &ctx,
    )
    .await
    .unwrap();
    let ids: Vec<&str> = found.iter().map(|v| v.id.as_str()).collect();
    assert_eq!(ids, [a.as_str()], "not {b}");
    assert_eq!(
        found[0].tag("dormant:env"),
        Some(ours.env_id.to_string().as_str())
    );
    assert_eq!(found[0].zone, zone);
}

fn volume_spec(rig: &Ec2, machine: Option<MachineSpec>) -> VolumeSpec {
    let m = machine.clone().unwrap_or_else(|| rig.spec());
    VolumeSpec {
        env_id: m.env_id,
        name: m.name.clone(),
        runner_id: m.runner_id.clone(),
        system_id: m.system_id.clone(),
        project_id: m.project_id,
        job_id: m.job_id,
        paths: m.paths.clone(),
        machine,
        beside: None,
    }
}

/// A new environment's volume is made beside its first instance; a second
/// `create_volume` (a retried prepare whose first attempt made both) finds
/// the volume and the instance by their tags instead of making new ones, and
/// the machine's launch adopts the instance.
#[tokio::test]
async fn create_volume_launches_the_first_instance_and_a_retry_finds_both() {
    let rig = rig(&[]).await;
    let first = rig.spec();
    let spec = volume_spec(&rig, Some(first.clone()));
    let vols = rig.provider.volumes().unwrap();
    let v = vols.create_volume(&spec, &rig.ctx(120)).await.unwrap();
    let live = rig.live_of(first.env_id).await;
    assert_eq!(live.len(), 1, "the first instance");
    let zone = live[0].placement().unwrap().availability_zone().unwrap();
    assert_eq!(v.field("zone"), Some(zone), "the volume is beside it");

    rig.proxy.clear_calls();
    let again = vols.create_volume(&spec, &rig.ctx(120)).await.unwrap();
    assert_eq!(again.id, v.id);
    assert_eq!(
        rig.proxy.count("CreateVolume"),
        0,
        "{:?}",
        rig.proxy.actions()
    );
    assert_eq!(
        rig.proxy.count("RunInstances"),
        0,
        "{:?}",
        rig.proxy.actions()
    );
    let mut with_volume = first.clone();
    with_volume.volume = Some(v.clone());
    let m = rig
        .provider
        .create_or_reclaim(&with_volume, &rig.ctx(120))
        .await
        .unwrap();
    assert_eq!(Some(m.id.as_str()), live[0].instance_id(), "adopted");
    assert_eq!(rig.proxy.count("RunInstances"), 0);
}

/// When the guest could not be asked to unmount (a lost machine, a crashed
/// process), detach never pulls the volume from under a mounted filesystem:
/// it terminates the instance (whose shutdown unmounts it) and waits for the
/// volume to be available.
#[tokio::test]
async fn a_detach_without_the_guests_unmount_terminates_the_instance_first() {
    let rig = rig(&[]).await;
    let spec = volume_spec(&rig, Some(rig.spec()));
    let vols = rig.provider.volumes().unwrap();
    let v = vols.create_volume(&spec, &rig.ctx(120)).await.unwrap();
    let mut ms = spec.machine.clone().unwrap();
    ms.volume = Some(v.clone());
    let m = rig
        .provider
        .create_or_reclaim(&ms, &rig.ctx(120))
        .await
        .unwrap();
    vols.attach(&v, &m, &rig.ctx(60)).await.unwrap();
    rig.proxy.clear_calls();
    vols.detach(&v, &m, false, &rig.ctx(60)).await.unwrap();
    assert_eq!(
        rig.proxy.count("DetachVolume"),
        0,
        "{:?}",
        rig.proxy.actions()
    );
    assert_eq!(rig.proxy.count("TerminateInstances"), 1);
    let i = rig.instance(&m.id).await;
    assert!(matches!(
        i.state().unwrap().name(),
        Some(aws_sdk_ec2::types::InstanceStateName::Terminated)
            | Some(aws_sdk_ec2::types::InstanceStateName::ShuttingDown)
    ));
    let client = direct_client(&rig.proxy.url());
    let seen = volume::describe(&client, &v.id, &rig.ctx(10))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(seen.state, "available");

    // With the guest's unmount: a DetachVolume; the instance is left to the
    // machine's delete.
    let m2 = rig
        .provider
        .create_or_reclaim(&ms, &rig.ctx(120))
        .await
        .unwrap();
    vols.attach(&v, &m2, &rig.ctx(60)).await.unwrap();
    rig.proxy.clear_calls();
    vols.detach(&v, &m2, true, &rig.ctx(60)).await.unwrap();
    assert_eq!(rig.proxy.count("DetachVolume"), 1);
    assert_eq!(rig.proxy.count("TerminateInstances"), 0);
}

/// A volume deleted outside dormant is `VolumeGone` at the attach (the resume
/// refuses instead of retrying); a volume without this runner manager's tags
/// is neither attached nor deleted.
#[tokio::test]
async fn a_deleted_volume_is_gone_and_a_foreign_one_is_refused() {
    let rig = rig(&[]).await;
    let spec = volume_spec(&rig, Some(rig.spec()));
    let vols = rig.provider.volumes().unwrap();
    let v = vols.create_volume(&spec, &rig.ctx(120)).await.unwrap();
    let m = rig
        .provider
        .find(spec.env_id, &rig.ctx(30))
        .await
        .unwrap()
        .expect("the first instance");
    rig.direct
        .delete_volume()
        .volume_id(&v.id)
        .send()
        .await
        .unwrap();
    let e = vols.attach(&v, &m, &rig.ctx(30)).await.unwrap_err();
    assert!(e.downcast_ref::<VolumeGone>().is_some(), "{e:#}");
    assert!(err_text(&e).contains("no longer exists"), "{e:#}");

    let zone = v.field("zone").unwrap().to_string();
    let foreign = rig
        .direct
        .create_volume()
        .availability_zone(&zone)
        .size(1)
        .send()
        .await
        .unwrap()
        .volume_id()
        .unwrap()
        .to_string();
    let fv = dormant::model::Volume::new(&foreign).with("zone", &zone);
    let e = vols.delete_volume(&fv, &rig.ctx(30)).await.unwrap_err();
    assert!(err_text(&e).contains("refusing to delete volume"), "{e:#}");
    let e = vols.attach(&fv, &m, &rig.ctx(30)).await.unwrap_err();
    assert!(err_text(&e).contains("refusing to attach volume"), "{e:#}");
    assert!(
        volume::describe(&direct_client(&rig.proxy.url()), &foreign, &rig.ctx(10))
            .await
            .unwrap()
            .is_some()
    );
}

/// A new environment that took a warm instance makes its volume beside it
/// (`VolumeSpec::beside`): in that instance's zone (here not the zone of
/// the settings' subnet, where a volume without a machine would go), with
/// no launch, even though the spec also names the machine to launch.
#[tokio::test]
async fn create_volume_beside_a_taken_instance_goes_to_its_zone_without_a_launch() {
    let rig = rig(&[]).await;
    let all = zones(&rig).await;
    let mut spec = volume_spec(&rig, Some(rig.spec()));
    let subnet_zone = all
        .iter()
        .find(|(_, s)| *s == rig.subnet)
        .map(|(z, _)| z.clone())
        .unwrap();
    let other = all
        .iter()
        .map(|(z, _)| z.clone())
        .find(|z| *z != subnet_zone)
        .unwrap();
    spec.beside = Some(dormant::model::Machine::new("i-taken").with("zone", other.as_str()));
    rig.proxy.clear_calls();
    let vols = rig.provider.volumes().unwrap();
    let v = vols.create_volume(&spec, &rig.ctx(120)).await.unwrap();
    assert_eq!(v.field("zone"), Some(other.as_str()));
    let info = volume::describe(&direct_client(&rig.proxy.url()), &v.id, &rig.ctx(30))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.zone, other, "made in the instance's zone");
    assert_eq!(
        rig.proxy.count("RunInstances"),
        0,
        "{:?}",
        rig.proxy.actions()
    );
    assert_eq!(rig.proxy.count("CreateVolume"), 1);
    assert!(
        rig.live_of(spec.env_id).await.is_empty(),
        "no instance launched"
    );
}
