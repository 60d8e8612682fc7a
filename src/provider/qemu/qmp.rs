//! A minimal QMP client (QEMU Machine Protocol: one JSON object per line over
//! the VM's Unix socket). dormant sends a handful of commands (`stop`, `cont`,
//! `quit`, `system_powerdown`, `migrate`, `query-migrate`, `query-status`), so
//! a few dozen lines over serde_json beat a dependency: the QMP crates on
//! crates.io bring their own async runtime glue or generated schemas for
//! hundreds of commands we never call.
//!
//! Blocking, with short socket timeouts: every exchange is local and answers
//! in milliseconds; long operations (a migration) are polled by the caller.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

/// One QMP exchange may take this long (QEMU answers at once unless it hangs).
const IO_TIMEOUT: Duration = Duration::from_secs(10);

pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    socket: String,
}

impl Qmp {
    /// Connects, reads the greeting and leaves capabilities negotiation mode.
    pub fn connect(socket: &Path) -> Result<Qmp> {
        let stream = UnixStream::connect(socket)
            .with_context(|| format!("connecting to QMP socket {}", socket.display()))?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        let mut qmp = Qmp {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
            socket: socket.display().to_string(),
        };
        let greeting = qmp.read_message()?;
        if greeting.get("QMP").is_none() {
            bail!("{} did not greet as QMP: {greeting}", qmp.socket);
        }
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    fn read_message(&mut self) -> Result<Value> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .with_context(|| format!("reading from QMP socket {}", self.socket))?;
        if n == 0 {
            bail!("QEMU closed its QMP socket {}", self.socket);
        }
        serde_json::from_str(&line)
            .with_context(|| format!("QMP sent something that is not JSON: {line:?}"))
    }

    /// Runs one command and returns its `return` value; events are skipped.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value> {
        let mut msg = json!({ "execute": command });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut text = msg.to_string();
        text.push('\n');
        self.writer
            .write_all(text.as_bytes())
            .with_context(|| format!("sending {command} to QMP socket {}", self.socket))?;
        loop {
            let reply = self.read_message()?;
            if reply.get("event").is_some() {
                continue;
            }
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                return Err(anyhow!(
                    "QEMU refused {command}: {}",
                    err.get("desc")
                        .and_then(Value::as_str)
                        .unwrap_or("(no description)")
                ));
            }
            bail!("unexpected QMP reply to {command}: {reply}");
        }
    }

    /// `quit` closes the socket as it exits, sometimes before answering (or
    /// before reading it: a broken pipe). Either means it is on its way out.
    pub fn quit(mut self) -> Result<()> {
        match self.execute("quit", None) {
            Ok(_) => Ok(()),
            Err(e) => {
                let text = format!("{e:#}");
                if ["closed its QMP socket", "Broken pipe", "Connection reset"]
                    .iter()
                    .any(|s| text.contains(s))
                {
                    Ok(())
                } else {
                    Err(e)
                }
            }
        }
    }

    /// The memory save's state (`none`, `active`, `cancelling`, `completed`, ...).
    pub fn migration_status(&mut self) -> Result<String> {
        let r = self.execute("query-migrate", None)?;
        Ok(r.get("status")
            .and_then(Value::as_str)
            .unwrap_or("none")
            .to_string())
    }

    /// The run state (`running`, `paused`, `inmigrate`, `postmigrate`, ...).
    pub fn status(&mut self) -> Result<String> {
        let r = self.execute("query-status", None)?;
        Ok(r.get("status")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    /// A fake QEMU answering from a script: greeting, then one reply per command.
    fn fake(
        replies: Vec<&'static str>,
    ) -> (
        tempfile::TempDir,
        std::path::PathBuf,
        std::thread::JoinHandle<Vec<String>>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let handle = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut w = stream;
            w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .unwrap();
            let mut seen = Vec::new();
            for reply in replies {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap() == 0 {
                    break;
                }
                seen.push(line.trim().to_string());
                w.write_all(reply.as_bytes()).unwrap();
                w.write_all(b"\n").unwrap();
            }
            seen
        });
        (dir, path, handle)
    }

    #[test]
    fn negotiates_skips_events_and_reports_errors() {
        let (_dir, path, handle) = fake(vec![
            "{\"return\": {}}",
            "{\"event\": \"STOP\"}\n{\"return\": {\"status\": \"paused\", \"running\": false}}",
            "{\"error\": {\"class\": \"GenericError\", \"desc\": \"no such thing\"}}",
        ]);
        let mut q = Qmp::connect(&path).unwrap();
        assert_eq!(q.status().unwrap(), "paused");
        let err = q
            .execute("migrate", Some(json!({"uri": "file:/x"})))
            .unwrap_err();
        assert_eq!(format!("{err:#}"), "QEMU refused migrate: no such thing");
        drop(q);
        let seen = handle.join().unwrap();
        assert_eq!(seen[0], "{\"execute\":\"qmp_capabilities\"}");
        assert_eq!(seen[1], "{\"execute\":\"query-status\"}");
        assert_eq!(
            seen[2],
            "{\"arguments\":{\"uri\":\"file:/x\"},\"execute\":\"migrate\"}"
        );
    }

    #[test]
    fn quit_tolerates_the_socket_closing_first() {
        let (_dir, path, handle) = fake(vec!["{\"return\": {}}"]);
        let q = Qmp::connect(&path).unwrap();
        // The fake stops after the capabilities reply and closes: like QEMU exiting on quit.
        q.quit().unwrap();
        handle.join().unwrap();
    }
}
