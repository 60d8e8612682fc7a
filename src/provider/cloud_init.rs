//! The cloud-init user-data every provider that boots a cloud image sends (EC2
//! as instance user-data, QEMU on a NoCloud seed ISO): one function, so what a
//! test proves valid for one is what the other boots with.

use anyhow::{bail, Result};
use uuid::Uuid;

/// `#cloud-config` installing the environment's public key for the image's
/// default user (`ssh_user`, which must be that user: cloud-init puts
/// `ssh_authorized_keys` on the default user). The key pair is made by
/// `transport::keys::ensure_keypair`. Plain text; EC2 base64-encodes it.
///
/// The same in both storage modes: a data volume is not there at boot (EC2
/// attaches it after the launch, QEMU hot-plugs it), so it is formatted and
/// mounted by the guest's mount command after dormant connects
/// (`lifecycle::guest`), never by cloud-init.
pub fn user_data(env_id: Uuid, ssh_public_key: Option<&str>, ssh_user: &str) -> Result<String> {
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
}
