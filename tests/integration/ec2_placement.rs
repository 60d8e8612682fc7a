//! Placement and market on the EC2 provider, against moto behind the test
//! proxy (which plays EC2's capacity: `Proxy::no_capacity` refuses launches
//! and starts of a market / instance type / zone with
//! `InsufficientInstanceCapacity`): several subnets (one per zone), spot with
//! and without the on-demand fallback, the ordered instance types for
//! launches and for resumes, and the capacity waits the job log shows.
//!
//! Network rule: only loopback (`connect_address` is a loopback port nothing
//! here connects to).

use aws_sdk_ec2::types::{InstanceLifecycleType, InstanceStateName};
use dormant::provider::ec2::Ec2Provider;
use dormant::provider::{MachineSpec, Provider};
use dormant::settings::Settings;

use crate::ec2::{err_text, rig, Ec2};
use crate::moto::{Shortage, ACCESS_KEY, CANONICAL, REGION, SECRET_KEY};

/// A provider on the rig's emulator with these `[ec2]` lines (no subnet
/// given by default) and more sections after them.
fn provider(rig: &Ec2, ec2_lines: &str, tail: &str) -> Ec2Provider {
    let text = format!(
        "provider = \"ec2\"\nsystem_id = \"{}\"\nrunner_system_id_file = \"/nonexistent\"\n[ec2]\n\
         region = \"{REGION}\"\nendpoint_url = \"{}\"\nimage = \"{}\"\nimage_owners = [\"{CANONICAL}\"]\n\
         connect_address = \"127.0.0.1:1\"\nssh_user = \"root\"\n{ec2_lines}{tail}",
        rig.system_id,
        rig.proxy.url(),
        rig.image
    );
    let settings = Settings::parse_str(&text).unwrap_or_else(|e| panic!("{e:#}\n{text}"));
    Ec2Provider::with_credentials(&settings, &rig.store, ACCESS_KEY, SECRET_KEY).unwrap()
}

const NO_SUSPEND: &str = "[suspend]\nenabled = false\n";

/// moto's default subnets, (id, zone), by zone.
async fn subnets_by_zone(rig: &Ec2) -> Vec<(String, String)> {
    crate::moto::default_subnets_by_zone(&rig.direct).await
}

/// The RunInstances calls the proxy saw: (instance type, subnet, market).
fn launches(rig: &Ec2) -> Vec<(String, String, String)> {
    let field = |body: &str, k: &str| {
        body.split('&')
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")).map(str::to_string))
            .unwrap_or_default()
    };
    rig.proxy
        .calls()
        .into_iter()
        .filter(|c| c.action == "RunInstances")
        .map(|c| {
            let market = field(&c.body, "InstanceMarketOptions.MarketType");
            (
                field(&c.body, "InstanceType"),
                field(&c.body, "SubnetId"),
                if market.is_empty() {
                    "on-demand".into()
                } else {
                    market
                },
            )
        })
        .collect()
}

fn choice(t: &str, subnet: &str, market: &str) -> (String, String, String) {
    (t.into(), subnet.into(), market.into())
}

#[tokio::test]
async fn spot_launches_fall_back_to_on_demand_only_when_allowed() {
    let rig = rig(&[]).await;
    let subnet = format!("subnet_id = \"{}\"\n", rig.subnet);

    // Spot with capacity: a spot instance, recorded as such.
    let spot = provider(&rig, &format!("{subnet}market = \"spot\"\n"), NO_SUSPEND);
    let spec = rig.spec();
    let m = spot.create_or_reclaim(&spec, &rig.ctx(120)).await.unwrap();
    let i = rig.instance(&m.id).await;
    assert_eq!(i.instance_lifecycle(), Some(&InstanceLifecycleType::Spot));
    assert_eq!(m.field("market"), Some("spot"));
    assert_eq!(launches(&rig), [choice("t3.medium", &rig.subnet, "spot")]);

    // No spot capacity, no fallback: a capacity wait that says which setting
    // would launch on-demand, then a clear failure; nothing launched.
    rig.proxy.clear_calls();
    rig.proxy.no_capacity(Shortage::spot());
    let spec = rig.spec();
    // (Room for two attempts 2 s apart however slow the emulator answers.)
    let e = spot
        .create_or_reclaim(&spec, &rig.ctx(10))
        .await
        .unwrap_err();
    let text = err_text(&e);
    assert!(
        text.contains("no capacity after")
            && text.contains("InsufficientInstanceCapacity")
            && text.contains("ec2.on_demand_fallback = true would launch on-demand"),
        "{text}"
    );
    assert!(
        rig.log()
            .contains("waiting for capacity: EC2 InsufficientInstanceCapacity"),
        "{}",
        rig.log()
    );
    assert!(rig.live_of(spec.env_id).await.is_empty());
    assert!(
        launches(&rig).iter().all(|l| l.2 == "spot") && launches(&rig).len() >= 2,
        "only spot was tried, more than once: {:?}",
        launches(&rig)
    );

    // With the fallback: spot first, then on-demand at once (no wait).
    rig.proxy.clear_calls();
    let fallback = provider(
        &rig,
        &format!("{subnet}market = \"spot\"\non_demand_fallback = true\n"),
        NO_SUSPEND,
    );
    let m = fallback
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    assert_eq!(
        launches(&rig),
        [
            choice("t3.medium", &rig.subnet, "spot"),
            choice("t3.medium", &rig.subnet, "on-demand")
        ]
    );
    let i = rig.instance(&m.id).await;
    assert_eq!(i.instance_lifecycle(), None, "on-demand");
    assert_eq!(m.field("market"), Some("on-demand"));
    assert!(
        rig.log().contains(&format!(
            "no capacity for t3.medium spot in {}: EC2 InsufficientInstanceCapacity",
            rig.subnet
        )) && rig.log().contains(&format!(
            "trying t3.medium on-demand in {} (ec2.on_demand_fallback)",
            rig.subnet
        )),
        "{}",
        rig.log()
    );
}

#[tokio::test]
async fn a_launch_tries_the_next_zone_then_the_next_instance_type() {
    let rig = rig(&[]).await;
    let zones = subnets_by_zone(&rig).await;
    let ((sa, za), (sb, zb)) = (zones[0].clone(), zones[1].clone());
    let p = provider(
        &rig,
        &format!("subnet_ids = [\"{sa}\", \"{sb}\"]\nfallback_instance_types = [\"t3a.medium\"]\n"),
        "",
    );

    // All capacity: the first choice, in the first subnet.
    let m = p
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    assert_eq!(rig.instance(&m.id).await.subnet_id(), Some(sa.as_str()));
    assert_eq!(m.field("zone"), Some(za.as_str()));
    assert_eq!(m.field("instance_types"), Some("t3.medium,t3a.medium"));
    assert_eq!(rig.proxy.count("DescribeSubnets"), 1);

    // No t3.medium in the first zone: the same type in the next zone.
    rig.proxy.clear_calls();
    rig.proxy
        .no_capacity(Shortage::default().of_type("t3.medium").in_zone(&za));
    let m = p
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    let i = rig.instance(&m.id).await;
    assert_eq!(
        (i.subnet_id(), i.instance_type().map(|t| t.as_str())),
        (Some(sb.as_str()), Some("t3.medium"))
    );
    assert_eq!(
        launches(&rig),
        [
            choice("t3.medium", &sa, "on-demand"),
            choice("t3.medium", &sb, "on-demand")
        ]
    );
    assert_eq!(
        rig.proxy.count("DescribeSubnets"),
        0,
        "the zones of the subnets are cached in the state dir"
    );

    // No t3.medium anywhere: the next type, in the first zone.
    rig.proxy.clear_calls();
    rig.proxy
        .no_capacity(Shortage::default().of_type("t3.medium"));
    let m = p
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    let i = rig.instance(&m.id).await;
    assert_eq!(
        (i.subnet_id(), i.instance_type().map(|t| t.as_str())),
        (Some(sa.as_str()), Some("t3a.medium"))
    );
    assert_eq!(launches(&rig).len(), 3, "{:?}", launches(&rig));

    // No capacity at all for one whole round of the 4 choices: a visible
    // wait that names every choice, then the next round launches with the
    // first choice. The proxy counts the 4 refusals itself: capacity
    // restored from the test when it sees some call lands wherever the
    // round happens to be (on a loaded machine, between the 5th and 6th
    // call, and the 6th launched in the second zone).
    rig.proxy.clear_calls();
    rig.proxy.capacity_back();
    rig.proxy.no_capacity(Shortage::default().times(4));
    let m = p
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    let i = rig.instance(&m.id).await;
    assert_eq!(
        (i.subnet_id(), i.instance_type().map(|t| t.as_str())),
        (Some(sa.as_str()), Some("t3.medium"))
    );
    let log = rig.log();
    assert!(
        log.contains(&format!(
            "waiting for capacity: no capacity for any of the 4 choices (t3.medium, t3a.medium in {za}, {zb}, \
             on-demand): EC2 InsufficientInstanceCapacity"
        )),
        "{log}"
    );
    assert_eq!(
        launches(&rig),
        [
            choice("t3.medium", &sa, "on-demand"),
            choice("t3.medium", &sb, "on-demand"),
            choice("t3a.medium", &sa, "on-demand"),
            choice("t3a.medium", &sb, "on-demand"),
            choice("t3.medium", &sa, "on-demand"),
        ],
        "a whole round refused, then the first choice of the next"
    );
}

#[tokio::test]
async fn subnet_ids_must_be_one_per_zone() {
    let rig = rig(&[]).await;
    let zones = subnets_by_zone(&rig).await;
    let (sa, za) = zones[0].clone();
    // A second subnet in the first zone, in the default VPC.
    let vpc = rig
        .direct
        .describe_subnets()
        .subnet_ids(&sa)
        .send()
        .await
        .unwrap()
        .subnets()[0]
        .vpc_id()
        .unwrap()
        .to_string();
    let extra = rig
        .direct
        .create_subnet()
        .vpc_id(vpc)
        .cidr_block("172.31.200.0/24")
        .availability_zone(&za)
        .send()
        .await
        .unwrap()
        .subnet()
        .unwrap()
        .subnet_id()
        .unwrap()
        .to_string();
    let p = provider(&rig, &format!("subnet_ids = [\"{sa}\", \"{extra}\"]\n"), "");
    let spec = rig.spec();
    let e = p.create_or_reclaim(&spec, &rig.ctx(60)).await.unwrap_err();
    let text = err_text(&e);
    assert!(
        text.contains(&format!(
            "ec2.subnet_ids: {sa} and {extra} are both in zone {za}: list one subnet per zone"
        )),
        "{text}"
    );
    assert_eq!(rig.proxy.count("RunInstances"), 0);

    let p = provider(
        &rig,
        &format!("subnet_ids = [\"{sa}\", \"subnet-0deadbeef\"]\n"),
        "",
    );
    let text = err_text(&p.create_or_reclaim(&spec, &rig.ctx(60)).await.unwrap_err());
    assert!(text.contains("ec2.subnet_ids"), "{text}");
}

#[tokio::test]
async fn the_jobs_own_list_of_instance_types_replaces_the_operators() {
    let rig = rig(&[]).await;
    let p = provider(
        &rig,
        &format!(
            "subnet_id = \"{}\"\nfallback_instance_types = [\"t3a.medium\"]\n\
             allowed_instance_types = [\"m5.large\", \"m5a.large\"]\n",
            rig.subnet
        ),
        "",
    );
    let mut spec: MachineSpec = rig.spec();
    spec.variables.insert(
        "DORMANT_EC2_INSTANCE_TYPE".into(),
        "m5.large, m5a.large".into(),
    );
    rig.proxy
        .no_capacity(Shortage::default().of_type("m5.large"));
    let m = p.create_or_reclaim(&spec, &rig.ctx(120)).await.unwrap();
    assert_eq!(m.field("instance_type"), Some("m5a.large"));
    assert_eq!(m.field("instance_types"), Some("m5.large,m5a.large"));
    assert!(
        launches(&rig).iter().all(|l| l.0.starts_with("m5")),
        "never the operator's t3 types: {:?}",
        launches(&rig)
    );

    // One type outside the allow-list refuses the whole list, before any call.
    rig.proxy.clear_calls();
    let mut spec = rig.spec();
    spec.variables.insert(
        "DORMANT_EC2_INSTANCE_TYPE".into(),
        "m5.large,p5.48xlarge".into(),
    );
    let e = p.create_or_reclaim(&spec, &rig.ctx(60)).await.unwrap_err();
    assert!(
        e.downcast_ref::<dormant::provider::Refusal>().is_some(),
        "{e:#}"
    );
    assert!(err_text(&e).contains("p5.48xlarge"), "{e:#}");
    assert!(rig.proxy.actions().is_empty(), "{:?}", rig.proxy.actions());
}

#[tokio::test]
async fn a_resume_changes_the_instance_type_when_its_own_has_no_capacity() {
    let rig = rig(&[]).await;
    let p = provider(
        &rig,
        &format!(
            "subnet_id = \"{}\"\nfallback_instance_types = [\"t3a.medium\", \"m5.large\"]\n",
            rig.subnet
        ),
        "",
    );
    let m = p
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    p.stop(&m, &rig.ctx(60)).await.unwrap();
    rig.proxy.clear_calls();
    rig.proxy
        .no_capacity(Shortage::default().of_type("t3.medium"));
    rig.proxy
        .no_capacity(Shortage::default().of_type("t3a.medium"));
    let resumed = p.start(&m, &rig.ctx(120)).await.unwrap();
    assert_eq!(
        resumed.id, m.id,
        "the same instance: its disk is the environment"
    );
    let i = rig.instance(&m.id).await;
    assert_eq!(i.state().unwrap().name(), Some(&InstanceStateName::Running));
    assert_eq!(i.instance_type().map(|t| t.as_str()), Some("m5.large"));
    assert_eq!(resumed.field("instance_type"), Some("m5.large"));
    assert_eq!(
        rig.proxy.count("ModifyInstanceAttribute"),
        2,
        "{:?}",
        rig.proxy.actions()
    );
    assert_eq!(rig.proxy.count("StartInstances"), 3);
    let log = rig.log();
    assert!(
        log.contains(&format!(
            "no capacity for instance {} as t3.medium in {}",
            m.id,
            m.field("zone").unwrap()
        )) && log.contains("changing it to t3a.medium (the environment's next instance type)"),
        "{log}"
    );

    // The next resume starts it as the type it has now, first.
    p.stop(&resumed, &rig.ctx(60)).await.unwrap();
    rig.proxy.clear_calls();
    p.start(&resumed, &rig.ctx(60)).await.unwrap();
    assert_eq!(rig.proxy.count("ModifyInstanceAttribute"), 0);
    assert_eq!(rig.proxy.count("StartInstances"), 1);
}

/// EC2 accepts a StartInstances it then cannot place: the instance goes
/// `pending`, then back to `stopped` with the state reason
/// `Server.InsufficientInstanceCapacity` (played by the proxy; moto cannot).
/// The resume changes the stopped instance to the environment's next type
/// and starts it again, saying so in the log; with no type left it stops,
/// naming what it tried, after one start per type.
#[tokio::test]
async fn a_start_that_ends_stopped_for_lack_of_capacity_is_retried_as_the_next_type() {
    let rig = rig(&[]).await;
    let p = provider(
        &rig,
        &format!(
            "subnet_id = \"{}\"\nfallback_instance_types = [\"t3a.medium\", \"m5.large\"]\n",
            rig.subnet
        ),
        "",
    );
    let m = p
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    p.stop(&m, &rig.ctx(60)).await.unwrap();
    rig.proxy.clear_calls();
    rig.proxy
        .no_capacity_after_start(Shortage::default().of_type("t3.medium"));
    rig.proxy
        .no_capacity_after_start(Shortage::default().of_type("t3a.medium"));
    let resumed = p.start(&m, &rig.ctx(120)).await.unwrap();
    assert_eq!(resumed.id, m.id, "the same instance");
    let i = rig.instance(&m.id).await;
    assert_eq!(i.state().unwrap().name(), Some(&InstanceStateName::Running));
    assert_eq!(i.instance_type().map(|t| t.as_str()), Some("m5.large"));
    assert_eq!(resumed.field("instance_type"), Some("m5.large"));
    assert_eq!(
        (
            rig.proxy.count("StartInstances"),
            rig.proxy.count("ModifyInstanceAttribute")
        ),
        (3, 2),
        "{:?}",
        rig.proxy.actions()
    );
    let log = rig.log();
    for said in [
        format!(
            "instance {} stopped again after it was started, for lack of capacity for t3.medium",
            m.id
        ),
        format!(
            "instance {} stopped again after it was started, for lack of capacity for t3a.medium",
            m.id
        ),
        "Server.InsufficientInstanceCapacity".to_string(),
        "starting it as another of the environment's instance types".to_string(),
    ] {
        assert!(log.contains(&said), "no {said:?} in:\n{log}");
    }

    // No type with room: one start per type, then an error naming them.
    p.stop(&resumed, &rig.ctx(60)).await.unwrap();
    rig.proxy.clear_calls();
    rig.proxy
        .no_capacity_after_start(Shortage::default().of_type("m5.large"));
    let e = p.start(&resumed, &rig.ctx(120)).await.unwrap_err();
    assert!(
        err_text(&e).contains("stopped again for lack of capacity")
            && err_text(&e).contains("m5.large, then t3.medium, then t3a.medium"),
        "{e:#}"
    );
    assert_eq!(
        rig.proxy.count("StartInstances"),
        3,
        "{:?}",
        rig.proxy.actions()
    );
    let i = rig.instance(&m.id).await;
    assert_eq!(i.state().unwrap().name(), Some(&InstanceStateName::Stopped));
}
