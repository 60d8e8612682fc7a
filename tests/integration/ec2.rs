//! The EC2 provider against moto on loopback (`moto.rs`), called through the
//! library API with a `Ctx` like the stages call it, plus `dormant sweep` and
//! a refused prepare through the binary. The recording proxy counts API calls
//! and injects what moto cannot produce (capacity, throttling, NotFound right
//! after a launch, slow transitions, UnauthorizedOperation).
//!
//! Network rule: only loopback. Every provider here has `connect_address` set
//! to a loopback port; the 10.x / 54.x addresses moto hands out are asserted
//! on, never contacted.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_ec2::types::{Filter, Instance, InstanceStateName};
use dormant::context::{Ctx, JobLog};
use dormant::provider::ec2::Ec2Provider;
use dormant::provider::{MachineSpec, MachineState, Provider, Refusal, Target};
use dormant::settings::Settings;
use dormant::state::StateStore;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::harness::{self, JobResult};
use crate::moto::{
    catalogue_image, default_subnet, direct_client, CloudInit, Moto, Proxy, ACCESS_KEY, CANONICAL,
    REGION, SECRET_KEY, UBUNTU_PATTERN,
};

pub const TEST_KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDormantTestKeyDormantTestKeyDormantTest dormant-test";

pub struct Ec2 {
    pub moto: Moto,
    pub proxy: Proxy,
    pub dir: tempfile::TempDir,
    pub store: StateStore,
    pub settings: Settings,
    pub provider: Arc<Ec2Provider>,
    /// Straight to moto, not through the proxy: set-up and assertions are not counted.
    pub direct: aws_sdk_ec2::Client,
    pub subnet: String,
    pub image: String,
    pub system_id: String,
    pub log: Arc<Mutex<Vec<u8>>>,
    pub job_log: JobLog,
}

/// The `[ec2]` section: defaults for these tests, overridden by `extra` (key, TOML value).
pub fn ec2_section(proxy: &Proxy, subnet: &str, image: &str, extra: &[(&str, &str)]) -> String {
    let mut keys: BTreeMap<String, String> = [
        ("region", format!("{REGION:?}")),
        ("endpoint_url", format!("{:?}", proxy.url())),
        ("subnet_id", format!("{subnet:?}")),
        ("image", format!("{image:?}")),
        ("image_owners", format!("[{CANONICAL:?}]")),
        // Never the emulator's addresses: a loopback port (nothing listens; nothing here connects).
        ("connect_address", "\"127.0.0.1:1\"".into()),
        ("ssh_user", "\"root\"".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for (k, v) in extra {
        keys.insert(k.to_string(), v.to_string());
    }
    let mut text = String::from("[ec2]\n");
    for (k, v) in keys {
        text.push_str(&format!("{k} = {v}\n"));
    }
    text
}

pub async fn rig(extra: &[(&str, &str)]) -> Ec2 {
    let moto = Moto::start();
    let proxy = Proxy::start(moto.port);
    let direct = direct_client(&moto.url());
    let subnet = default_subnet(&direct).await;
    let image = catalogue_image(&direct, "xenial").await;
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    let system_id = format!("s_{}", &Uuid::new_v4().simple().to_string()[..12]);
    let text = format!(
        "provider = \"ec2\"\nsystem_id = \"{system_id}\"\nrunner_system_id_file = \"/nonexistent\"\n{}",
        ec2_section(&proxy, &subnet, &image, extra)
    );
    let settings = Settings::parse_str(&text).unwrap_or_else(|e| panic!("{e:#}\n{text}"));
    let provider =
        Arc::new(Ec2Provider::with_credentials(&settings, &store, ACCESS_KEY, SECRET_KEY).unwrap());
    let (job_log, log) = JobLog::capture();
    Ec2 {
        moto,
        proxy,
        dir,
        store,
        settings,
        provider,
        direct,
        subnet,
        image,
        system_id,
        log,
        job_log,
    }
}

impl Ec2 {
    pub fn spec(&self) -> MachineSpec {
        let env_id = Uuid::new_v4();
        MachineSpec {
            env_id,
            name: MachineSpec::machine_name(env_id),
            runner_id: "7".into(),
            system_id: self.system_id.clone(),
            project_id: 42,
            job_id: harness::job_id(),
            image: None,
            variables: BTreeMap::new(),
            ssh_public_key: Some(TEST_KEY.into()),
            paths: self.store.env_paths(env_id),
            volume: None,
        }
    }

    pub fn ctx(&self, secs: u64) -> Ctx {
        Ctx::new(
            self.job_log.clone(),
            CancellationToken::new(),
            Duration::from_secs(secs),
        )
    }

    pub fn log(&self) -> String {
        String::from_utf8_lossy(&self.log.lock().unwrap()).to_string()
    }

    pub async fn instance(&self, id: &str) -> Instance {
        let out = self
            .direct
            .describe_instances()
            .instance_ids(id)
            .send()
            .await
            .unwrap();
        out.reservations()[0].instances()[0].clone()
    }

    pub async fn state(&self, id: &str) -> InstanceStateName {
        self.instance(id)
            .await
            .state()
            .unwrap()
            .name()
            .unwrap()
            .clone()
    }

    /// Live (not terminated) instances tagged with this environment.
    pub async fn live_of(&self, env: Uuid) -> Vec<Instance> {
        let out = self
            .direct
            .describe_instances()
            .filters(
                Filter::builder()
                    .name("tag:dormant:env")
                    .values(env.to_string())
                    .build(),
            )
            .send()
            .await
            .unwrap();
        out.reservations()
            .iter()
            .flat_map(|r| r.instances())
            .filter(|i| {
                !matches!(
                    i.state().and_then(|s| s.name()),
                    Some(InstanceStateName::Terminated | InstanceStateName::ShuttingDown)
                )
            })
            .cloned()
            .collect()
    }
}

pub fn tags_of(i: &Instance) -> BTreeMap<String, String> {
    i.tags()
        .iter()
        .map(|t| (t.key().unwrap().to_string(), t.value().unwrap().to_string()))
        .collect()
}

pub fn err_text(e: &anyhow::Error) -> String {
    format!("{e:#}")
}

#[tokio::test]
async fn launch_sets_tags_imdsv2_and_the_key_in_user_data() {
    let rig = rig(&[("tags", "{ team = \"ci\" }")]).await;
    let spec = rig.spec();
    let m = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(120))
        .await
        .unwrap();
    let calls = rig.proxy.actions();
    eprintln!("MEASURE fresh create: {} EC2 calls: {calls:?}", calls.len());
    assert_eq!(rig.proxy.count("RunInstances"), 1, "{calls:?}");
    assert_eq!(rig.proxy.count("DescribeImages"), 1, "{calls:?}");

    assert!(m.id.starts_with("i-"));
    assert_eq!(m.field("region"), Some(REGION));
    let i = rig.instance(&m.id).await;
    assert_eq!(i.state().unwrap().name(), Some(&InstanceStateName::Running));
    assert_eq!(i.image_id(), Some(rig.image.as_str()));
    assert_eq!(i.subnet_id(), Some(rig.subnet.as_str()));
    assert_eq!(
        m.field("address"),
        i.private_ip_address(),
        "address = private by default"
    );
    let tags = tags_of(&i);
    for (k, v) in [
        ("Name", spec.name.as_str()),
        ("dormant:managed-by", "dormant"),
        ("dormant:env", &spec.env_id.to_string()),
        ("dormant:runner", "7"),
        ("dormant:system", &rig.system_id),
        ("dormant:project", "42"),
        ("team", "ci"),
        // What a replacement runner-manager host enters the machine with
        // (provider/ec2/handover.rs): the ownership epoch, the boot hook's
        // version and the key it installs.
        ("dormant:epoch", "1"),
        ("dormant:entry", "imds-authorized-key-1"),
        ("dormant:authorized-key", TEST_KEY),
    ] {
        assert_eq!(
            tags.get(k).map(String::as_str),
            Some(v),
            "instance tag {k}: {tags:?}"
        );
    }
    // The volumes carry the same tags (cost allocation, orphan hunting).
    let vol_id = i.block_device_mappings()[0]
        .ebs()
        .unwrap()
        .volume_id()
        .unwrap();
    let vols = rig
        .direct
        .describe_volumes()
        .volume_ids(vol_id)
        .send()
        .await
        .unwrap();
    let vtags: BTreeMap<_, _> = vols.volumes()[0]
        .tags()
        .iter()
        .map(|t| (t.key().unwrap().to_string(), t.value().unwrap().to_string()))
        .collect();
    assert_eq!(
        vtags.get("dormant:env"),
        Some(&spec.env_id.to_string()),
        "{vtags:?}"
    );
    assert_eq!(vtags.get("Name"), Some(&spec.name));
    // IMDSv2 only.
    assert_eq!(
        i.metadata_options()
            .unwrap()
            .http_tokens()
            .map(|t| t.as_str()),
        Some("required")
    );
    // The boot hook reads dormant:authorized-key through the metadata service.
    assert_eq!(
        i.metadata_options()
            .unwrap()
            .instance_metadata_tags()
            .map(|t| t.as_str()),
        Some("enabled")
    );
    // The environment's public key reaches cloud-init.
    let ud = rig
        .direct
        .describe_instance_attribute()
        .instance_id(&m.id)
        .attribute(aws_sdk_ec2::types::InstanceAttributeName::UserData)
        .send()
        .await
        .unwrap();
    let text = String::from_utf8(
        aws_smithy_types::base64::decode(ud.user_data().unwrap().value().unwrap()).unwrap(),
    )
    .unwrap();
    assert!(text.starts_with("#cloud-config\n"), "{text}");
    assert!(
        text.contains(&format!("ssh_authorized_keys:\n  - {TEST_KEY}\n")),
        "{text}"
    );
    assert!(
        text.ends_with(&dormant::provider::ec2::handover::boot_hook_yaml("root")),
        "the boot hook ends the user-data: {text}"
    );
    // A deterministic ClientToken went with the launch (idempotent on real EC2).
    let run = rig
        .proxy
        .calls()
        .into_iter()
        .find(|c| c.action == "RunInstances")
        .unwrap();
    assert!(
        run.body
            .contains(&format!("ClientToken=dormant-{}-0", spec.env_id.simple())),
        "{}",
        run.body
    );
    // Key fields and the target: the loopback connect_address, never the emulator's IPs.
    assert_eq!(
        rig.provider.key_fields(&m),
        vec![
            ("instance".to_string(), m.id.clone()),
            ("region".to_string(), REGION.to_string())
        ]
    );
    let Target::Ssh(t) = rig.provider.target(&m).unwrap() else {
        panic!("an ssh target")
    };
    assert_eq!(
        (t.host.as_str(), t.port, t.user.as_str()),
        ("127.0.0.1", 1, "root")
    );
    assert!(
        rig.log()
            .contains(&format!("instance {} running after", m.id)),
        "{}",
        rig.log()
    );
}

#[tokio::test]
async fn a_retried_prepare_adopts_the_instance_it_already_made() {
    let rig = rig(&[]).await;
    let spec = rig.spec();
    let first = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(120))
        .await
        .unwrap();
    rig.proxy.clear_calls();
    // A new process after a crash between RunInstances and saving state: a fresh provider.
    let again =
        Ec2Provider::with_credentials(&rig.settings, &rig.store, ACCESS_KEY, SECRET_KEY).unwrap();
    let second = again.create_or_reclaim(&spec, &rig.ctx(120)).await.unwrap();
    assert_eq!(first.id, second.id);
    assert_eq!(
        rig.proxy.count("RunInstances"),
        0,
        "{:?}",
        rig.proxy.actions()
    );
    assert_eq!(rig.live_of(spec.env_id).await.len(), 1);
    assert!(
        rig.log()
            .contains(&format!("adopting instance {} (running)", first.id)),
        "{}",
        rig.log()
    );
}

#[tokio::test]
async fn reclaim_after_lost_state_starts_a_stopped_instance_and_replaces_a_terminated_one() {
    let rig = rig(&[]).await;
    let spec = rig.spec();
    let first = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(120))
        .await
        .unwrap();
    // Adopted while it is still stopping: waited for, then started.
    rig.direct
        .stop_instances()
        .instance_ids(&first.id)
        .send()
        .await
        .unwrap();
    // (Slow enough that the adoption sees it stopping on a loaded machine.)
    rig.proxy.slow_stop(Some(Duration::from_secs(8)));
    let m = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(120))
        .await
        .unwrap();
    assert_eq!(m.id, first.id);
    assert_eq!(rig.state(&m.id).await, InstanceStateName::Running);
    assert!(
        rig.log()
            .contains(&format!("adopting instance {} (stopping)", m.id)),
        "{}",
        rig.log()
    );
    assert!(
        rig.log()
            .contains(&format!("instance {} stopped after", m.id)),
        "{}",
        rig.log()
    );

    // The state dir is gone and the instance was stopped meanwhile.
    rig.direct
        .stop_instances()
        .instance_ids(&first.id)
        .send()
        .await
        .unwrap();
    let dir2 = tempfile::tempdir().unwrap();
    let store2 = StateStore::open(dir2.path()).unwrap();
    let fresh =
        Ec2Provider::with_credentials(&rig.settings, &store2, ACCESS_KEY, SECRET_KEY).unwrap();
    let m = fresh.create_or_reclaim(&spec, &rig.ctx(120)).await.unwrap();
    assert_eq!(m.id, first.id, "the stopped instance is adopted");
    assert_eq!(
        rig.state(&m.id).await,
        InstanceStateName::Running,
        "and started"
    );

    // A terminated instance is not adopted: a new one is made, with a new ClientToken.
    rig.direct
        .terminate_instances()
        .instance_ids(&m.id)
        .send()
        .await
        .unwrap();
    rig.proxy.clear_calls();
    let m2 = fresh.create_or_reclaim(&spec, &rig.ctx(120)).await.unwrap();
    assert_ne!(m2.id, m.id);
    assert_eq!(rig.state(&m2.id).await, InstanceStateName::Running);
    let run = rig
        .proxy
        .calls()
        .into_iter()
        .find(|c| c.action == "RunInstances")
        .unwrap();
    assert!(
        run.body
            .contains(&format!("ClientToken=dormant-{}-1", spec.env_id.simple())),
        "a reused token would make real EC2 answer with the terminated instance: {}",
        run.body
    );
}

#[tokio::test]
async fn suspend_resume_release_state_machine_rereads_the_address() {
    let rig = rig(&[("address", "\"public\"")]).await;
    let p = &rig.provider;
    let spec = rig.spec();
    let m = p.create_or_reclaim(&spec, &rig.ctx(120)).await.unwrap();
    assert_eq!(
        p.describe(&m, &rig.ctx(30)).await.unwrap(),
        MachineState::Running
    );
    let before = m.field("address").unwrap().to_string();
    assert_eq!(
        Some(before.as_str()),
        rig.instance(&m.id).await.public_ip_address()
    );

    rig.proxy.clear_calls();
    p.stop(&m, &rig.ctx(120)).await.unwrap();
    let suspend_calls = rig.proxy.actions();
    eprintln!(
        "MEASURE suspend: {} EC2 calls: {suspend_calls:?}",
        suspend_calls.len()
    );
    assert_eq!(rig.state(&m.id).await, InstanceStateName::Stopped);
    assert_eq!(
        p.describe(&m, &rig.ctx(30)).await.unwrap(),
        MachineState::Stopped
    );
    // Suspending a suspended environment is a no-op.
    p.stop(&m, &rig.ctx(30)).await.unwrap();

    rig.proxy.clear_calls();
    let resumed = p.start(&m, &rig.ctx(120)).await.unwrap();
    let resume_calls = rig.proxy.actions();
    eprintln!(
        "MEASURE resume: {} EC2 calls: {resume_calls:?}",
        resume_calls.len()
    );
    assert_eq!(rig.state(&m.id).await, InstanceStateName::Running);
    assert_eq!(resumed.id, m.id);
    let after = resumed.field("address").unwrap();
    assert_eq!(Some(after), rig.instance(&m.id).await.public_ip_address());
    assert_ne!(
        after, before,
        "the public IP changed across stop/start and was re-read"
    );
    assert_eq!(resumed.field("env"), m.field("env"));

    p.delete(&resumed, &rig.ctx(60)).await.unwrap();
    assert!(matches!(
        rig.state(&m.id).await,
        InstanceStateName::Terminated | InstanceStateName::ShuttingDown
    ));
    assert_eq!(
        p.describe(&m, &rig.ctx(30)).await.unwrap(),
        MachineState::Gone
    );
    // Already gone is success.
    p.delete(&resumed, &rig.ctx(60)).await.unwrap();
    // And resuming a terminated environment says its disk is gone.
    let e = p.start(&m, &rig.ctx(30)).await.unwrap_err();
    assert!(err_text(&e).contains("disk is gone"), "{e:#}");
    assert!(
        e.downcast_ref::<dormant::provider::MachineGone>().is_some(),
        "typed, so prepare refuses it once instead of retrying: {e:#}"
    );
}

#[tokio::test]
async fn resume_and_release_refuse_an_instance_whose_tags_do_not_match() {
    let rig = rig(&[]).await;
    let p = &rig.provider;
    let a = p
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    let b = p
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    p.stop(&b, &rig.ctx(120)).await.unwrap();
    // A record whose instance id points at another environment's instance.
    let mut forged = a.clone();
    forged.id = b.id.clone();
    rig.proxy.clear_calls();
    let e = p.start(&forged, &rig.ctx(60)).await.unwrap_err();
    assert!(err_text(&e).contains("refusing to start instance"), "{e:#}");
    assert!(err_text(&e).contains("dormant:env"), "{e:#}");
    assert_eq!(rig.proxy.count("StartInstances"), 0);
    assert_eq!(
        rig.state(&b.id).await,
        InstanceStateName::Stopped,
        "never started"
    );
    let e = p.delete(&forged, &rig.ctx(60)).await.unwrap_err();
    assert!(err_text(&e).contains("refusing to terminate"), "{e:#}");
    assert_eq!(rig.proxy.count("TerminateInstances"), 0);
    assert_eq!(
        rig.state(&b.id).await,
        InstanceStateName::Stopped,
        "never terminated"
    );
    // An instance nobody tagged (not dormant's) is refused too.
    let foreign = rig
        .direct
        .run_instances()
        .image_id(&rig.image)
        .min_count(1)
        .max_count(1)
        .send()
        .await
        .unwrap();
    let mut forged = a.clone();
    forged.id = foreign.instances()[0].instance_id().unwrap().to_string();
    let e = p.stop(&forged, &rig.ctx(60)).await.unwrap_err();
    assert!(err_text(&e).contains("dormant:managed-by"), "{e:#}");
}

#[tokio::test]
async fn max_environments_waits_for_a_slot_then_proceeds() {
    let rig = rig(&[("max_environments", "1")]).await;
    let p = rig.provider.clone();
    let first = p
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    let calls = rig.proxy.actions();
    eprintln!(
        "MEASURE fresh create with max_environments: {} EC2 calls: {calls:?}",
        calls.len()
    );
    // A suspended environment still takes its slot.
    p.stop(&first, &rig.ctx(60)).await.unwrap();

    // Time is up while the slot is taken: a clear failure, no instance made.
    let spec = rig.spec();
    let e = p.create_or_reclaim(&spec, &rig.ctx(3)).await.unwrap_err();
    let text = err_text(&e);
    assert!(
        text.contains("no capacity after") && text.contains("1 of 1 environments in use"),
        "{text}"
    );
    assert!(text.contains("ec2.max_environments"), "{text}");
    assert!(rig.live_of(spec.env_id).await.is_empty());

    // SIGTERM during the wait ends it promptly.
    let ctx = rig.ctx(60);
    let cancel = ctx.cancel.clone();
    let waiting = {
        let p = p.clone();
        let spec = rig.spec();
        tokio::spawn(async move { p.create_or_reclaim(&spec, &ctx).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cancelled = Instant::now();
    cancel.cancel();
    let e = waiting.await.unwrap().unwrap_err();
    // (Far below the wait's 60 s; room for an emulator call in flight.)
    assert!(
        cancelled.elapsed() < Duration::from_secs(10),
        "{:?}",
        cancelled.elapsed()
    );
    assert!(
        err_text(&e).contains("cancelled (termination signal)"),
        "{e:#}"
    );

    // A slot frees while the prepare waits: it proceeds.
    let spec = rig.spec();
    let waiting = {
        let p = p.clone();
        let ctx = rig.ctx(60);
        let spec = spec.clone();
        tokio::spawn(async move {
            let m = p.create_or_reclaim(&spec, &ctx).await;
            (m, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !waiting.is_finished(),
        "the second environment waits for the slot"
    );
    let freed = Instant::now();
    p.delete(&first, &rig.ctx(60)).await.unwrap();
    let (m, done) = waiting.await.unwrap();
    let m = m.unwrap();
    eprintln!(
        "MEASURE capacity slot detection lag: {:.1} s",
        done.duration_since(freed).as_secs_f64()
    );
    assert_eq!(rig.state(&m.id).await, InstanceStateName::Running);
    let log = rig.log();
    assert!(
        log.contains("waiting for capacity: 1 of 1 environments in use ("),
        "{log}"
    );
    // Woken by the release (a local marker), not by its next backoff look at EC2.
    assert!(
        log.contains("an instance of this runner manager was terminated: looking again"),
        "{log}"
    );
}

#[tokio::test]
async fn allow_lists_refuse_naming_the_list_before_any_cloud_call() {
    let rig = rig(&[
        ("allowed_instance_types", "[\"t3.large\"]"),
        ("allowed_images", &format!("[{UBUNTU_PATTERN:?}]")),
    ])
    .await;
    let mut spec = rig.spec();
    spec.variables
        .insert("DORMANT_EC2_INSTANCE_TYPE".into(), "p5.48xlarge".into());
    let e = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(60))
        .await
        .unwrap_err();
    assert!(
        e.downcast_ref::<Refusal>().is_some(),
        "a refusal, not a system failure: {e:#}"
    );
    assert!(
        err_text(&e).contains("ec2.allowed_instance_types (t3.large)"),
        "{e:#}"
    );

    let mut spec = rig.spec();
    spec.image = Some("ami-0123456789abcdef0".into());
    let e = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(60))
        .await
        .unwrap_err();
    assert!(e.downcast_ref::<Refusal>().is_some(), "{e:#}");
    assert!(err_text(&e).contains("ec2.allowed_images"), "{e:#}");
    assert!(rig.proxy.actions().is_empty(), "{:?}", rig.proxy.actions());

    // Allowed picks go through: the pattern resolves to the newest match.
    let mut spec = rig.spec();
    spec.variables
        .insert("DORMANT_EC2_INSTANCE_TYPE".into(), "t3.large".into());
    spec.image = Some(UBUNTU_PATTERN.into());
    let m = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(120))
        .await
        .unwrap();
    let i = rig.instance(&m.id).await;
    assert_eq!(i.instance_type().map(|t| t.as_str()), Some("t3.large"));
    assert_eq!(
        i.image_id(),
        Some(rig.image.as_str()),
        "xenial is the newest match"
    );
}

#[tokio::test]
async fn a_refused_image_fails_prepare_once_as_a_build_failure() {
    // Through the binary: the runner must not retry a refusal.
    let moto = Moto::start();
    let proxy = Proxy::start(moto.port);
    let section = ec2_section(
        &proxy,
        "subnet-0123",
        "ami-0123456789abcdef0",
        &[("allowed_images", "[\"ami-0aaaaaaaaaaaaaaaa\"]")],
    );
    let mut rig = harness::Rig::new(
        "7",
        "s_0123456789ab",
        &format!("provider = \"ec2\"\n{section}"),
    );
    for (k, v) in [
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
        ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
    ] {
        rig.runner.env.insert(k.into(), v.into());
    }
    let mut job = harness::job(5);
    job.image = Some("ami-0bbbbbbbbbbbbbbbb".into());
    let r = rig.run(&job);
    assert_eq!(r.result, JobResult::BuildFailure(None), "{}", r.log());
    assert!(r.ran("prepare#1") && !r.ran("prepare#2"), "not retried");
    assert!(r.log().contains("ec2.allowed_images"), "{}", r.log());
    // prepare refused before any cloud call; cleanup only looked for a machine
    // the record might not know of (so that nothing leaks), and found none.
    let actions = proxy.actions();
    assert!(
        actions.iter().all(|a| a == "DescribeInstances"),
        "nothing but a lookup: {actions:?}"
    );
}

#[tokio::test]
async fn a_name_pattern_is_resolved_once_under_concurrency() {
    let rig = rig(&[("image", &format!("{UBUNTU_PATTERN:?}"))]).await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let p = rig.provider.clone();
        let spec = rig.spec();
        let ctx = rig.ctx(120);
        tasks.push(tokio::spawn(async move {
            p.create_or_reclaim(&spec, &ctx).await
        }));
    }
    // A second process (own provider, same state dir) too.
    let other =
        Ec2Provider::with_credentials(&rig.settings, &rig.store, ACCESS_KEY, SECRET_KEY).unwrap();
    let m = other
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    let mut ids = vec![m.id];
    for t in tasks {
        ids.push(t.await.unwrap().unwrap().id);
    }
    assert_eq!(
        rig.proxy.count("DescribeImages"),
        1,
        "{:?}",
        rig.proxy.actions()
    );
    assert_eq!(rig.proxy.count("RunInstances"), 5);
    for id in ids {
        assert_eq!(rig.instance(&id).await.image_id(), Some(rig.image.as_str()));
    }
    assert_eq!(
        rig.log().matches("resolved to").count(),
        1,
        "one lookup: {}",
        rig.log()
    );
}

#[tokio::test]
async fn capacity_and_throttling_errors_are_waited_out_visibly() {
    let rig = rig(&[]).await;
    rig.proxy
        .fail("RunInstances", 0, 2, 500, "InsufficientInstanceCapacity");
    // The first DescribeInstances (the reclaim lookup) is throttled twice.
    rig.proxy
        .fail("DescribeInstances", 0, 2, 503, "RequestLimitExceeded");
    // A 5xx is retried a few times too.
    rig.proxy.fail("DescribeImages", 0, 1, 500, "InternalError");
    let m = rig
        .provider
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    assert_eq!(rig.state(&m.id).await, InstanceStateName::Running);
    assert_eq!(
        rig.proxy.count("RunInstances"),
        3,
        "{:?}",
        rig.proxy.actions()
    );
    let log = rig.log();
    assert_eq!(
        // One progress line: the same reason twice within 10 s is said once.
        log.matches("waiting for capacity: EC2 InsufficientInstanceCapacity")
            .count(),
        1,
        "{log}"
    );
    assert_eq!(
        log.matches("waiting for EC2 DescribeInstances to be accepted: RequestLimitExceeded")
            .count(),
        1,
        "{log}"
    );
    assert_eq!(
        rig.proxy.count("DescribeImages"),
        2,
        "{:?}",
        rig.proxy.actions()
    );
    assert!(
        log.contains(
            "waiting for EC2 DescribeImages to be accepted: InternalError (a transient fault)"
        ),
        "{log}"
    );

    // Resume hits capacity too (StartInstances), and waits it out.
    rig.provider.stop(&m, &rig.ctx(60)).await.unwrap();
    rig.proxy
        .fail("StartInstances", 0, 1, 500, "InsufficientInstanceCapacity");
    rig.provider.start(&m, &rig.ctx(60)).await.unwrap();
    assert_eq!(rig.proxy.count("StartInstances"), 2);

    // Out of time: a clear failure, and nothing left running.
    rig.proxy
        .fail("RunInstances", 0, 1000, 500, "InsufficientInstanceCapacity");
    let spec = rig.spec();
    let e = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(4))
        .await
        .unwrap_err();
    let text = err_text(&e);
    assert!(
        text.contains("no capacity after") && text.contains("InsufficientInstanceCapacity"),
        "{text}"
    );
    assert!(rig.live_of(spec.env_id).await.is_empty());
}

#[tokio::test]
async fn not_found_right_after_launch_means_not_visible_yet() {
    let rig = rig(&[]).await;
    // Skip the reclaim lookup; the first two polls after RunInstances get NotFound.
    rig.proxy
        .fail("DescribeInstances", 1, 2, 400, "InvalidInstanceID.NotFound");
    let m = rig
        .provider
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    assert_eq!(rig.state(&m.id).await, InstanceStateName::Running);
    assert_eq!(
        rig.proxy.count("DescribeInstances"),
        4,
        "{:?}",
        rig.proxy.actions()
    );
}

/// During a transition the instance is described once a second (the first
/// right away), by the proxy's count of DescribeInstances by instance id.
#[tokio::test]
async fn slow_transitions_are_polled_once_a_second() {
    let rig = rig(&[]).await;
    rig.proxy.slow_launch(Some(Duration::from_secs(4)));
    let m = rig
        .provider
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    let polls = rig.proxy.describes_of(&m.id).len();
    assert!(
        (2..=6).contains(&polls),
        "{polls} polls in a 4 s launch: {:?}",
        rig.proxy.actions()
    );

    rig.proxy.clear_calls();
    rig.proxy
        .hold_transitions(Duration::ZERO, Duration::from_secs(4));
    rig.provider.stop(&m, &rig.ctx(120)).await.unwrap();
    // The tag check before StopInstances, then the polls of a 4 s stop.
    let describes = rig.proxy.describes_of(&m.id).len();
    assert!(
        (3..=7).contains(&describes),
        "{describes} describes for a 4 s stop: {:?}",
        rig.proxy.actions()
    );
    assert_eq!(rig.state(&m.id).await, InstanceStateName::Stopped);
}

#[tokio::test]
async fn a_create_that_times_out_terminates_what_it_launched() {
    let rig = rig(&[]).await;
    rig.proxy.slow_launch(None); // stuck in pending
    let spec = rig.spec();
    // (Room for the launch and at least one look at it on a loaded machine.)
    let e = rig
        .provider
        .create_or_reclaim(&spec, &rig.ctx(10))
        .await
        .unwrap_err();
    let text = err_text(&e);
    assert!(
        text.contains("waiting for instance")
            && text.contains("to be running after")
            && text.contains("(last: pending)"),
        "{text}"
    );
    assert!(text.contains("timed out"), "{text}");
    assert!(
        rig.live_of(spec.env_id).await.is_empty(),
        "no instance leaked"
    );
    assert!(
        rig.log().contains("launched by this failed prepare"),
        "{}",
        rig.log()
    );
}

/// Settings to change, a fault to inject (action, code), what the error must say.
type ErrorCase = (
    Vec<(&'static str, String)>,
    Option<(&'static str, &'static str)>,
    &'static str,
);

#[tokio::test]
async fn errors_name_the_setting_or_the_permission() {
    let rig = rig(&[]).await;
    let instance_store = rig
        .direct
        .describe_images()
        .owners("amazon")
        .filters(
            Filter::builder()
                .name("root-device-type")
                .values("instance-store")
                .build(),
        )
        .send()
        .await
        .unwrap()
        .images()
        .iter()
        .find_map(|i| i.image_id().map(str::to_string))
        .expect("moto's catalogue has an instance-store image");
    let cases: Vec<ErrorCase> = vec![
        (
            vec![("image", "\"ami-0deadbeef\"".into())],
            None,
            "ec2.image",
        ),
        (
            vec![("image", format!("{instance_store:?}"))],
            None,
            "needs an EBS-backed image",
        ),
        (
            vec![("subnet_id", "\"subnet-0deadbeef\"".into())],
            None,
            "ec2.subnet_id",
        ),
        (
            vec![("security_group_ids", "[\"sg-0deadbeef\"]".into())],
            None,
            "ec2.security_group_ids",
        ),
        (
            vec![("endpoint_url", "\"http://127.0.0.1:1\"".into())],
            None,
            "cannot reach the EC2 endpoint",
        ),
        (
            vec![],
            Some(("RunInstances", "UnauthorizedOperation")),
            "lacks the IAM permission ec2:RunInstances",
        ),
        (
            vec![],
            Some(("DescribeInstances", "AuthFailure")),
            "standard AWS credential chain",
        ),
    ];
    for (extra, fault, needle) in cases {
        let extra: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let text = format!(
            "provider = \"ec2\"\nsystem_id = \"{}\"\nrunner_system_id_file = \"/nonexistent\"\n{}",
            rig.system_id,
            ec2_section(&rig.proxy, &rig.subnet, &rig.image, &extra)
        );
        let settings = Settings::parse_str(&text).unwrap();
        let p =
            Ec2Provider::with_credentials(&settings, &rig.store, ACCESS_KEY, SECRET_KEY).unwrap();
        if let Some((action, code)) = fault {
            rig.proxy.fail(action, 0, 1, 400, code);
        }
        let e = p
            .create_or_reclaim(&rig.spec(), &rig.ctx(60))
            .await
            .unwrap_err();
        assert!(err_text(&e).contains(needle), "want {needle:?} in: {e:#}");
    }
}

#[tokio::test]
async fn hibernate_mode_launches_with_hibernation_and_stops_with_hibernate() {
    let rig = rig(&[
        ("suspend_mode", "\"hibernate\""),
        ("root_volume_encrypted", "true"),
        ("root_volume_size_gb", "40"),
        ("root_volume_type", "\"gp3\""),
    ])
    .await;
    let m = rig
        .provider
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    let run = rig
        .proxy
        .calls()
        .into_iter()
        .find(|c| c.action == "RunInstances")
        .unwrap();
    assert!(
        run.body.contains("HibernationOptions.Configured=true"),
        "{}",
        run.body
    );
    assert!(
        run.body.contains("BlockDeviceMapping.1.Ebs.Encrypted=true"),
        "{}",
        run.body
    );
    assert!(
        run.body.contains("BlockDeviceMapping.1.Ebs.VolumeSize=40"),
        "{}",
        run.body
    );
    assert!(
        run.body
            .contains("BlockDeviceMapping.1.DeviceName=%2Fdev%2Fsda1"),
        "{}",
        run.body
    );
    assert_eq!(
        rig.instance(&m.id)
            .await
            .hibernation_options()
            .and_then(|h| h.configured()),
        Some(true)
    );
    rig.provider.stop(&m, &rig.ctx(60)).await.unwrap();
    let stop = rig
        .proxy
        .calls()
        .into_iter()
        .find(|c| c.action == "StopInstances")
        .unwrap();
    assert!(stop.body.contains("Hibernate=true"), "{}", stop.body);
    assert_eq!(rig.state(&m.id).await, InstanceStateName::Stopped);

    // EC2 refuses to hibernate (agent not ready, unsupported image): a plain
    // stop keeps the disk, which is what a suspended job needs.
    rig.provider.start(&m, &rig.ctx(60)).await.unwrap();
    rig.proxy.clear_calls();
    rig.proxy.fail(
        "StopInstances",
        0,
        1,
        400,
        "UnsupportedHibernationConfiguration",
    );
    rig.provider.stop(&m, &rig.ctx(60)).await.unwrap();
    let stops: Vec<_> = rig
        .proxy
        .calls()
        .into_iter()
        .filter(|c| c.action == "StopInstances")
        .collect();
    assert_eq!(stops.len(), 2);
    assert!(stops[0].body.contains("Hibernate=true") && stops[1].body.contains("Hibernate=false"));
    assert_eq!(rig.state(&m.id).await, InstanceStateName::Stopped);
    assert!(rig.log().contains("cannot hibernate"), "{}", rig.log());
}

#[tokio::test]
async fn list_and_sweep_find_orphans_of_this_runner_manager_only() {
    let rig = rig(&[]).await;
    let p = &rig.provider;
    // Known: has a record in the state dir.
    let known_spec = rig.spec();
    let known = p
        .create_or_reclaim(&known_spec, &rig.ctx(120))
        .await
        .unwrap();
    dormant::state::testing::place(
        &rig.store,
        known_spec.env_id,
        dormant::state::EnvStatus::Active,
        None,
        0,
        Some(known.clone()),
    )
    .unwrap();
    // Orphan: launched, then the state was lost (no record).
    let orphan_spec = rig.spec();
    let orphan = p
        .create_or_reclaim(&orphan_spec, &rig.ctx(120))
        .await
        .unwrap();
    p.stop(&orphan, &rig.ctx(60)).await.unwrap();
    // Another runner manager's instance in the same account.
    let mut foreign_spec = rig.spec();
    foreign_spec.system_id = "s_othersystem".into();
    let foreign = p
        .create_or_reclaim(&foreign_spec, &rig.ctx(120))
        .await
        .unwrap();

    let listed = p.list(&rig.ctx(60)).await.unwrap();
    let ids: Vec<&str> = listed.iter().map(|m| m.machine.id.as_str()).collect();
    assert!(
        ids.contains(&known.id.as_str()) && ids.contains(&orphan.id.as_str()),
        "{ids:?}"
    );
    assert!(!ids.contains(&foreign.id.as_str()), "{ids:?}");
    let o = listed.iter().find(|m| m.machine.id == orphan.id).unwrap();
    assert_eq!(o.env_id, Some(orphan_spec.env_id));
    assert_eq!(o.state, MachineState::Stopped);
    assert!(o.launched_at.is_some());

    // `dormant sweep` through the binary, with credentials from the environment.
    let settings_text = format!(
        "provider = \"ec2\"\nrunner_system_id_file = \"/nonexistent\"\nsystem_id = \"{}\"\nstate_dir = \"{}\"\n{}",
        rig.system_id,
        rig.store.root().display(),
        ec2_section(&rig.proxy, &rig.subnet, &rig.image, &[])
    );
    let cfg = rig.store.root().parent().unwrap().join("dormant.toml");
    std::fs::write(&cfg, settings_text).unwrap();
    let sweep = |args: &[&str]| {
        std::process::Command::new(harness::BIN)
            .args(args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", rig.store.root())
            .env("DORMANT_CONFIG", &cfg)
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .output()
            .unwrap()
    };
    // No credentials anywhere (IMDS disabled: only loopback traffic here).
    let empty_home = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(harness::BIN)
        .arg("sweep")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", empty_home.path())
        .env("DORMANT_CONFIG", &cfg)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("standard AWS credential chain"), "{err}");

    let out = sweep(&["sweep"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!("machine {} ", orphan.id))
            && err.contains("belongs to no environment"),
        "{err}"
    );
    assert!(
        !err.contains(&known.id) && !err.contains(&foreign.id),
        "{err}"
    );
    assert_eq!(
        rig.state(&orphan.id).await,
        InstanceStateName::Stopped,
        "only reported"
    );

    let out = sweep(&["sweep", "--delete-orphans"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(matches!(
        rig.state(&orphan.id).await,
        InstanceStateName::Terminated | InstanceStateName::ShuttingDown
    ));
    assert_eq!(rig.state(&known.id).await, InstanceStateName::Running);
    assert_eq!(rig.state(&foreign.id).await, InstanceStateName::Running);
}

#[tokio::test]
async fn the_cloud_init_stand_in_installs_the_environment_key_for_a_test_sshd() {
    // What the end-to-end test (EC2 from moto, SSH to a loopback sshd through
    // ec2.connect_address) relies on: the key from user-data lands in authorized_keys.
    let rig = rig(&[]).await;
    let keys = rig.dir.path().join("authorized_keys");
    let _cloud_init = CloudInit::start(rig.moto.url(), keys.clone());
    rig.provider
        .create_or_reclaim(&rig.spec(), &rig.ctx(120))
        .await
        .unwrap();
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(&keys).unwrap_or_default();
        if text.contains(TEST_KEY) {
            assert_eq!(text, format!("{TEST_KEY}\n"));
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the key never arrived: {text:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_ttl_sweep_terminates_expired_suspended_instances_only() {
    use dormant::state::EnvStatus;
    let rig = rig(&[]).await;
    let p = &rig.provider;
    let mut records = Vec::new();
    for age_days in [8u64, 1] {
        let spec = rig.spec();
        let m = p.create_or_reclaim(&spec, &rig.ctx(120)).await.unwrap();
        p.stop(&m, &rig.ctx(60)).await.unwrap();
        dormant::state::testing::place(
            &rig.store,
            spec.env_id,
            EnvStatus::Suspended,
            None,
            age_days * 86400,
            Some(m.clone()),
        )
        .unwrap();
        records.push((spec, m));
    }
    let events = dormant::events::EventLog::new(rig.store.root(), &rig.settings.events);
    let world = dormant::lifecycle::World {
        store: &rig.store,
        provider: p.as_ref(),
        events: &events,
    };
    let full = dormant::lifecycle::sweep::Scope::Full;
    let report =
        dormant::lifecycle::sweep::sweep(world, &rig.settings.suspend, full, &rig.ctx(120))
            .await
            .unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let (old, old_m) = &records[0];
    let (young, young_m) = &records[1];
    assert_eq!(report.released, vec![old.env_id]);
    assert!(matches!(
        rig.state(&old_m.id).await,
        InstanceStateName::Terminated | InstanceStateName::ShuttingDown
    ));
    assert!(!old.paths.exists());
    assert_eq!(
        rig.state(&young_m.id).await,
        InstanceStateName::Stopped,
        "kept: within the TTL"
    );
    assert!(young.paths.exists());
}
