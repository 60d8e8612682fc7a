//! One EC2 setup for the tests that drive whole jobs through the binary on
//! the `ec2` provider: moto behind the recording proxy, the loopback sshd
//! standing in for every instance (the environment's key reaches it through
//! user-data, via the `CloudInit` stand-in), and a runner whose settings point
//! at them. In volume mode the provider's guest seam stands in for the
//! instance's EBS device (`provider/ec2/guest_seam.rs`). Network rule: the
//! addresses moto hands out are never contacted.

use aws_sdk_ec2::types::{Filter, Instance, InstanceStateName, Volume};

use crate::harness::Rig;
use crate::moto::{
    catalogue_image, default_subnet, direct_client, CloudInit, Moto, Proxy, ACCESS_KEY, REGION,
    SECRET_KEY,
};
use crate::sshd::Sshd;

pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// Fields drop in this order: the cloud-init stand-in before the servers it polls.
pub struct Ec2Env {
    _cloud_init: CloudInit,
    pub sshd: Sshd,
    pub proxy: Proxy,
    pub moto: Moto,
    /// Every "instance" is this host's sshd: this environment's builds dir on it.
    pub host_dir: tempfile::TempDir,
    pub subnet: String,
    pub image: String,
}

impl Ec2Env {
    pub fn start() -> Ec2Env {
        let moto = Moto::start();
        let proxy = Proxy::start(moto.port);
        let sshd = Sshd::start();
        let cloud_init = CloudInit::start(moto.url(), sshd.dir.path().join("authorized_keys"));
        let (subnet, image) = block_on(async {
            let c = direct_client(&moto.url());
            (
                default_subnet(&c).await,
                catalogue_image(&c, "ubuntu").await,
            )
        });
        Ec2Env {
            _cloud_init: cloud_init,
            sshd,
            proxy,
            moto,
            host_dir: tempfile::tempdir().unwrap(),
            subnet,
            image,
        }
    }

    /// SSH reaches every instance at the loopback sshd.
    pub fn connect_address(&self) -> String {
        format!("connect_address = \"127.0.0.1:{}\"\n", self.sshd.port)
    }

    /// `provider = "ec2"` settings through the proxy; `reach`: the `[ec2]`
    /// lines saying how SSH reaches an instance; `extra`: more sections.
    pub fn settings(&self, reach: &str, extra: &str) -> String {
        format!(
            "provider = \"ec2\"\n[ssh]\nready_timeout = \"60s\"\n[ec2]\nregion = \"{REGION}\"\nendpoint_url = \"{}\"\n\
             subnet_id = \"{}\"\nimage = \"{}\"\nssh_user = \"root\"\n\
             {reach}builds_dir = \"{dir}/builds\"\ncache_dir = \"{dir}/cache\"\n{extra}",
            self.proxy.url(),
            self.subnet,
            self.image,
            dir = self.host_dir.path().display(),
        )
    }

    /// Volume mode (`storage = "volume"`): `[ec2]` lines (`ec2_lines` added;
    /// the default subnet unless they name `subnet_ids`) with the data volume
    /// mounted at `<host dir>/mnt` and the builds and cache dirs on it;
    /// `tail`: more sections.
    pub fn volume_settings(&self, ec2_lines: &str, tail: &str) -> String {
        let subnet = if ec2_lines.contains("subnet_ids") {
            String::new()
        } else {
            format!("subnet_id = \"{}\"\n", self.subnet)
        };
        format!(
            "provider = \"ec2\"\n[ssh]\nready_timeout = \"60s\"\n[ec2]\nregion = \"{REGION}\"\nendpoint_url = \"{}\"\n\
             image = \"{}\"\nssh_user = \"root\"\n{}{subnet}storage = \"volume\"\nvolume_mount = \"{}\"\n{ec2_lines}{tail}",
            self.proxy.url(),
            self.image,
            self.connect_address(),
            self.mountpoint().display(),
        )
    }

    /// Where the loopback host shows the attached data volume (volume mode).
    pub fn mountpoint(&self) -> std::path::PathBuf {
        self.host_dir.path().join("mnt")
    }

    /// The files of data volume `id` on the loopback host (the guest seam).
    pub fn volume_files(&self, id: &str) -> std::path::PathBuf {
        self.host_dir.path().join("volumes").join(id)
    }

    /// A runner in volume mode: the guest seam on (`DORMANT_TEST_EC2_VOLUMES`:
    /// the provider links `mountpoint()` to the attached volume's files,
    /// since the loopback host has no EBS device to mount).
    pub fn volume_rig(&self, runner_id: &str, system_id: &str, settings: &str) -> Rig {
        let mut rig = self.rig(runner_id, system_id, settings);
        rig.runner.env.insert(
            "DORMANT_TEST_EC2_VOLUMES".into(),
            self.host_dir.path().join("volumes").display().to_string(),
        );
        rig
    }

    /// A runner with these settings and the emulator's credentials.
    pub fn rig(&self, runner_id: &str, system_id: &str, settings: &str) -> Rig {
        let mut rig = Rig::new(runner_id, system_id, settings);
        for (k, v) in [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            // Keeps the credential chain off the instance-metadata address: loopback only.
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ] {
            rig.runner.env.insert(k.into(), v.into());
        }
        rig
    }
}

// What the tests look at in the emulator (straight to moto, not counted).

/// A field of an environment key (`volume`, `zone`, ...).
pub fn key_field(key: &str, name: &str) -> Option<String> {
    key.split(['&', '?', '/'])
        .find_map(|f| f.strip_prefix(&format!("{name}=")))
        .map(str::to_string)
}

/// The data volume as moto has it (`None`: deleted).
pub fn volume(env: &Ec2Env, id: &str) -> Option<Volume> {
    block_on(async {
        let c = direct_client(&env.moto.url());
        c.describe_volumes()
            .volume_ids(id)
            .send()
            .await
            .ok()
            .and_then(|o| o.volumes().first().cloned())
    })
}

/// An instance's tags, straight from the emulator.
pub fn instance_tags(env: &Ec2Env, id: &str) -> std::collections::BTreeMap<String, String> {
    let i = instances(env)
        .into_iter()
        .find(|i| i.instance_id() == Some(id))
        .unwrap_or_else(|| panic!("moto knows instance {id}"));
    i.tags()
        .iter()
        .map(|t| (t.key().unwrap().to_string(), t.value().unwrap().to_string()))
        .collect()
}

/// An instance's state, straight from the emulator (by its URL: the rig's
/// sshd may have been moved out of the `Ec2Env` by then).
pub fn instance_state(moto_url: &str, id: &str) -> InstanceStateName {
    block_on(async {
        let c = direct_client(moto_url);
        let out = c
            .describe_instances()
            .instance_ids(id)
            .send()
            .await
            .unwrap();
        out.reservations()[0].instances()[0]
            .state()
            .unwrap()
            .name()
            .unwrap()
            .clone()
    })
}

/// Every instance moto has (terminated ones too), by launch order.
pub fn instances(env: &Ec2Env) -> Vec<Instance> {
    block_on(async {
        let c = direct_client(&env.moto.url());
        let out = c.describe_instances().send().await.unwrap();
        let mut v: Vec<Instance> = out
            .reservations()
            .iter()
            .flat_map(|r| r.instances())
            .cloned()
            .collect();
        v.sort_by_key(|i| i.launch_time().map(|t| t.as_nanos()));
        v
    })
}

pub fn is_live(i: &Instance) -> bool {
    !matches!(
        i.state().and_then(|s| s.name()),
        Some(InstanceStateName::Terminated | InstanceStateName::ShuttingDown)
    )
}

/// Data volumes moto has that carry `dormant:volume = data`.
pub fn data_volumes(env: &Ec2Env) -> Vec<Volume> {
    block_on(async {
        let c = direct_client(&env.moto.url());
        let out = c
            .describe_volumes()
            .filters(
                Filter::builder()
                    .name("tag:dormant:volume")
                    .values("data")
                    .build(),
            )
            .send()
            .await
            .unwrap();
        out.volumes().to_vec()
    })
}
