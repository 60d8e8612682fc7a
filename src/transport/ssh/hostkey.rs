//! Host keys as ssh reports them: recognising a refused (changed) host key in
//! ssh's error text, and listing the fingerprints pinned in a known_hosts file.

use std::path::Path;

/// If ssh refused a changed host key, the fingerprint the host offered
/// (`SHA256:...`, or "a different key" when ssh did not print it).
pub fn host_key_mismatch(ssh_error: &str) -> Option<String> {
    if !ssh_error.contains("REMOTE HOST IDENTIFICATION HAS CHANGED")
        && !ssh_error.contains("Host key verification failed")
    {
        return None;
    }
    let after = ssh_error
        .split_once("sent by the remote host is")
        .map(|(_, rest)| rest)
        .unwrap_or(ssh_error);
    Some(
        after
            .split(|c: char| c.is_whitespace())
            .find(|w| w.starts_with("SHA256:"))
            .map(|w| w.trim_end_matches('.').to_string())
            .unwrap_or_else(|| "a different key".to_string()),
    )
}

/// The fingerprints pinned in a known_hosts file (`SHA256:... (ED25519)`).
pub fn fingerprints(known_hosts: &Path) -> Vec<String> {
    let Ok(out) = std::process::Command::new("ssh-keygen")
        .arg("-l")
        .arg("-f")
        .arg(known_hosts)
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            // "256 SHA256:abc dormant-<id> (ED25519)"
            let mut parts = l.split_whitespace();
            let _bits = parts.next()?;
            let fp = parts.next()?;
            let kind = l.rsplit_once(' ').map(|(_, k)| k).unwrap_or("");
            Some(format!("{fp} {kind}").trim().to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_host_key_is_recognised_with_the_offered_fingerprint() {
        let err = "failed to connect to the remote host: @@@@@@@@@@@\n\
            @    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n\
            The fingerprint for the ED25519 key sent by the remote host is\n\
            SHA256:AbCdEf0123456789.\n\
            Please contact your system administrator.\n\
            Host key verification failed.";
        assert_eq!(
            host_key_mismatch(err).as_deref(),
            Some("SHA256:AbCdEf0123456789")
        );
        assert_eq!(
            host_key_mismatch("Host key verification failed.").as_deref(),
            Some("a different key")
        );
        assert_eq!(
            host_key_mismatch("root@h: Permission denied (publickey)."),
            None
        );
    }
}
