//! The cloud-init user-data every provider that boots a cloud image sends (EC2
//! as instance user-data, QEMU on a NoCloud seed ISO): one function, so what a
//! test proves valid for one is what the other boots with.

use anyhow::{bail, Result};
use uuid::Uuid;

use crate::model::GuestMount;

/// `#cloud-config` installing the environment's public key for the image's
/// default user (`ssh_user`, which must be that user: cloud-init puts
/// `ssh_authorized_keys` on the default user). The key pair is made by
/// `transport::keys::ensure_keypair`. Plain text; EC2 base64-encodes it.
/// A machine-mode environment's: [`user_data_with`] without a volume.
pub fn user_data(env_id: Uuid, ssh_public_key: Option<&str>, ssh_user: &str) -> Result<String> {
    user_data_with(env_id, ssh_public_key, ssh_user, None)
}

/// The user-data of every machine: the SSH key as [`user_data`] says, and in
/// volume mode the data volume (`volume`, a device the machine has at boot):
/// `fs_setup` formats it ext4 only if it holds no filesystem at all
/// (`partition: auto` with the label finds an existing one and leaves it;
/// a device holding another filesystem is left alone too), and `mounts`
/// mounts it on the mount point (`nofail`: a missing disk must not stop the
/// boot; dormant's own mount check then says what is wrong). Both run in
/// cloud-init's first stage, before sshd starts. dormant checks the mount
/// after it connects (`lifecycle::guest`), so an image whose cloud-init
/// lacks these modules still works.
pub fn user_data_with(
    env_id: Uuid,
    ssh_public_key: Option<&str>,
    ssh_user: &str,
    volume: Option<&GuestMount>,
) -> Result<String> {
    let Some(key) = ssh_public_key.map(str::trim) else {
        bail!("environment {env_id} has no SSH public key to put in user-data");
    };
    if key.contains('\n') || !key.starts_with("ssh-") {
        bail!("the SSH public key of environment {env_id} is not one OpenSSH key line");
    }
    let mut text = format!(
        "#cloud-config\n# dormant environment {env_id}: its own SSH key, for the image's default user ({ssh_user}).\n\
         ssh_authorized_keys:\n  - {key}\n"
    );
    if ssh_user == "root" {
        text.push_str("disable_root: false\n");
    }
    if let Some(v) = volume {
        // fstab and fs_setup take one name: a provider whose guests name the
        // device in more than one way mounts it with the core's mount command.
        let [device] = v.devices.as_slice() else {
            bail!(
                "environment {env_id}: cloud-init mounts a data volume only by one device name, not {:?}",
                v.devices
            );
        };
        let plain = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '-' | '_' | '.'))
        };
        if !plain(device) || !plain(&v.mountpoint) {
            bail!(
                "environment {env_id}: the data volume's device {device:?} or mount point {:?} has \
                 characters that cannot go into fstab",
                v.mountpoint
            );
        }
        text.push_str(&format!(
            "# Its data volume (volume mode): formatted only if it holds no filesystem, mounted where\n\
             # the builds and cache dirs are.\n\
             fs_setup:\n  - label: {label}\n    filesystem: ext4\n    device: {device}\n    partition: auto\n\
             mounts:\n  - [ {device}, {mount}, ext4, \"defaults,nofail\", \"0\", \"2\" ]\n",
            label = super::volume::FS_LABEL,
            mount = v.mountpoint,
        ));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carries_one_key_and_refuses_anything_else() {
        let id = Uuid::nil();
        let text = user_data(id, Some("ssh-ed25519 AAAA c\n"), "debian").unwrap();
        assert!(text.starts_with("#cloud-config\n"), "{text}");
        assert!(
            text.contains("ssh_authorized_keys:\n  - ssh-ed25519 AAAA c\n"),
            "{text}"
        );
        assert!(!text.contains("disable_root"), "{text}");
        assert!(user_data(id, Some("ssh-ed25519 AAAA\n"), "root")
            .unwrap()
            .contains("disable_root: false"));
        assert!(user_data(id, None, "debian").is_err());
        assert!(user_data(id, Some("ssh-ed25519 A\nssh-rsa B"), "debian").is_err());
        assert!(user_data(id, Some("runcmd: [reboot]"), "debian").is_err());
    }

    #[test]
    fn a_data_volume_is_formatted_only_when_blank_and_mounted() {
        let m = GuestMount {
            devices: vec!["/dev/disk/by-id/virtio-dormant-data".into()],
            mountpoint: "/dormant".into(),
            user_dirs: Vec::new(),
        };
        let text =
            user_data_with(Uuid::nil(), Some("ssh-ed25519 AAAA"), "debian", Some(&m)).unwrap();
        assert!(
            text.contains(
                "fs_setup:\n  - label: dormant-data\n    filesystem: ext4\n    \
                 device: /dev/disk/by-id/virtio-dormant-data\n    partition: auto\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "mounts:\n  - [ /dev/disk/by-id/virtio-dormant-data, /dormant, ext4, \"defaults,nofail\", \"0\", \"2\" ]\n"
            ),
            "{text}"
        );
        assert_eq!(
            user_data_with(Uuid::nil(), Some("ssh-ed25519 AAAA"), "debian", None).unwrap(),
            user_data(Uuid::nil(), Some("ssh-ed25519 AAAA"), "debian").unwrap()
        );
        let bad = GuestMount {
            mountpoint: "/a b".into(),
            ..m.clone()
        };
        assert!(user_data_with(Uuid::nil(), Some("ssh-ed25519 A"), "debian", Some(&bad)).is_err());
        let two = GuestMount {
            devices: vec!["/dev/xvdf".into(), "/dev/sdf".into()],
            ..m.clone()
        };
        assert!(user_data_with(Uuid::nil(), Some("ssh-ed25519 A"), "debian", Some(&two)).is_err());
        let none = GuestMount {
            devices: Vec::new(),
            ..m
        };
        assert!(user_data_with(Uuid::nil(), Some("ssh-ed25519 A"), "debian", Some(&none)).is_err());
    }
}
