//! The EBS calls of volume mode (`provider::ec2::volume`) against moto
//! through the test proxy: create with its zone, size, type, encryption, KMS
//! key and tags; attach and detach with their waits; describe; delete;
//! finding volumes by tag; and the attach across zones EC2 refuses (the
//! proxy refuses it: moto would attach it).

use std::collections::BTreeMap;

use dormant::provider::ec2::volume::{self, NewVolume, Until};
use dormant::provider::{MachineSpec, Provider};

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
