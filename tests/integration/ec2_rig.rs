//! One EC2 setup for the tests that drive whole jobs through the binary on
//! the `ec2` provider: moto behind the recording proxy, the loopback sshd
//! standing in for every instance (the environment's key reaches it through
//! user-data, via the `CloudInit` stand-in), and a runner whose settings point
//! at them. Network rule: the addresses moto hands out are never contacted.

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
