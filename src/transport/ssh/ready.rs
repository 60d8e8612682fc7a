//! Whether a host is ready to take an SSH login: sshd's identification line
//! (`SSH-2.0-...`, RFC 4253 §4.2) on the port. A TCP connect alone proves
//! nothing: a port forward, an SSM tunnel or a load balancer accepts TCP long
//! before (or without) an sshd behind it. Used by the master's readiness wait
//! and by providers that probe a machine while it starts.

use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::context::Ctx;
use crate::wait::{Poll, Schedule, Wait};

/// Readiness is probed this often: a banner probe costs one short TCP
/// connection, and the interval bounds how late an sshd that came up is
/// noticed (half of it on average).
pub const READY_POLL: Duration = Duration::from_millis(200);
/// A probe waits this long for the banner once TCP is accepted (sshd sends
/// it at once; a tunnel with nothing behind it sends nothing).
pub const BANNER_WAIT: Duration = Duration::from_secs(1);
/// sshd may send other lines first; it must send its identification within this.
const MAX_BANNER_BYTES: usize = 8192;

/// Connects to `host:port` and reads until sshd identifies itself. `Ok`: the
/// identification line; `Err`: why the host does not take a login yet.
pub async fn banner(host: &str, port: u16, limit: Duration) -> Result<String, String> {
    let probe = async {
        let mut stream = TcpStream::connect((host, port))
            .await
            .map_err(|e| format!("port {port} not open yet: {e}"))?;
        let mut seen = Vec::new();
        let mut buf = [0u8; 512];
        loop {
            let n = stream
                .read(&mut buf)
                .await
                .map_err(|e| format!("port {port} accepted, then: {e}"))?;
            if n == 0 {
                return Err(format!(
                    "port {port} accepted and closed without an SSH banner (sshd starting, or a tunnel with nothing behind it)"
                ));
            }
            seen.extend_from_slice(&buf[..n]);
            // Whole lines only: the identification ends with CR LF.
            let complete = match seen.iter().rposition(|b| *b == b'\n') {
                Some(end) => &seen[..end],
                None => &[][..],
            };
            if let Some(line) = complete
                .split(|b| *b == b'\n')
                .find(|l| l.starts_with(b"SSH-"))
            {
                return Ok(String::from_utf8_lossy(line).trim_end().to_string());
            }
            if seen.len() > MAX_BANNER_BYTES {
                return Err(format!("port {port} answers, but not as an SSH server"));
            }
        }
    };
    match tokio::time::timeout(limit, probe).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "port {port} gives no SSH banner within {:.1} s (a tunnel or forward with no sshd behind it yet?)",
            limit.as_secs_f64()
        )),
    }
}

/// Waits until sshd answers on `host:port`, probing every [`READY_POLL`]
/// inside `ctx`, with progress in the job log.
pub async fn wait_for_banner(ctx: &Ctx, what: &str, host: &str, port: u16) -> anyhow::Result<()> {
    let mut wait = Wait::new(ctx, format!("SSH on {what}"), Schedule::fixed(READY_POLL));
    wait.until(|| async {
        Ok(
            match banner(host, port, BANNER_WAIT.min(ctx.remaining())).await {
                Ok(_) => Poll::Ready(()),
                Err(why) => Poll::Pending(why),
            },
        )
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    async fn server(reply: &'static [u8]) -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let _ = s.write_all(reply).await;
                // Keep it open, as a silent tunnel would.
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    drop(s);
                });
            }
        });
        port
    }

    #[tokio::test]
    async fn only_an_ssh_identification_line_counts_as_ready() {
        let sshd = server(b"SSH-2.0-OpenSSH_9.9\r\n").await;
        assert_eq!(
            banner("127.0.0.1", sshd, BANNER_WAIT).await.unwrap(),
            "SSH-2.0-OpenSSH_9.9"
        );
        let chatty = server(b"hello\r\nSSH-2.0-x\r\n").await;
        assert_eq!(
            banner("127.0.0.1", chatty, BANNER_WAIT).await.unwrap(),
            "SSH-2.0-x"
        );
        // A forward that accepts TCP but has no sshd behind it yet is not ready.
        let silent = server(b"").await;
        let e = banner("127.0.0.1", silent, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(e.contains("no SSH banner"), "{e}");
        let http = server(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        assert!(banner("127.0.0.1", http, Duration::from_millis(300))
            .await
            .is_err());
        // Nothing listening.
        let closed = free_port();
        let e = banner("127.0.0.1", closed, BANNER_WAIT).await.unwrap_err();
        assert!(e.contains("not open yet"), "{e}");
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }
}
