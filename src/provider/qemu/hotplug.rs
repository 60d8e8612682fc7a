//! Hot-plugging a volume-mode environment's data disk into a running VM over
//! QMP: `blockdev-add` opens the qcow2 file as a block node ([`NODE`]), then
//! `device_add` puts a virtio disk on it, with the serial the guest finds it
//! by (`vm::DATA_SERIAL`: `/dev/disk/by-id/virtio-dormant-data`), into the
//! empty PCIe root port every VM is started with (`vm::DATA_PORT`).
//!
//! Both are looked for before they are made, so a `plug` killed at any line
//! is finished by the next one: the device there (`query-block` names it) is
//! success; the node without the device (killed between the two commands) gets
//! its device; neither gets both. A node or device of these names holding
//! another file is an error, never taken for the environment's disk.

use std::path::Path;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::qmp::Qmp;
use super::vm;

/// The block node of the data disk (one per VM: a VM holds one environment's).
pub const NODE: &str = "dormant-data";
/// The id of the data disk's virtio device.
pub const DEVICE: &str = "dormant-data-disk";

/// What [`plug`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plugged {
    /// The disk was in the VM already.
    Already,
    /// Its block node was there (an earlier attempt was killed after adding
    /// it): the device was added.
    Finished,
    /// Node and device were added.
    New,
}

/// The `blockdev-add` arguments: the qcow2 image over its file, cached by the
/// host as a `-drive` is by default.
pub fn blockdev_args(disk: &Path) -> Value {
    json!({
        "driver": "qcow2",
        "node-name": NODE,
        "file": { "driver": "file", "filename": disk.display().to_string() },
    })
}

/// The `device_add` arguments: a virtio disk on the data disk's root port.
pub fn device_args() -> Value {
    json!({
        "driver": "virtio-blk-pci",
        "id": DEVICE,
        "drive": NODE,
        "serial": vm::DATA_SERIAL,
        "bus": vm::DATA_PORT,
    })
}

/// Makes the VM behind `qmp` have `disk` as its data disk.
pub fn plug(qmp: &mut Qmp, disk: &Path) -> Result<Plugged> {
    let want = disk.display().to_string();
    if let Some(file) = device_file(qmp)? {
        if file != want {
            bail!("the VM's data disk device {DEVICE} holds {file}, not {want}: delete this VM");
        }
        return Ok(Plugged::Already);
    }
    let node = node_file(qmp)?;
    match &node {
        Some(file) if *file != want => {
            bail!("the VM's block node {NODE} holds {file}, not {want}: delete this VM")
        }
        Some(_) => {}
        None => {
            qmp.execute("blockdev-add", Some(blockdev_args(disk)))?;
        }
    }
    qmp.execute("device_add", Some(device_args()))?;
    Ok(if node.is_some() {
        Plugged::Finished
    } else {
        Plugged::New
    })
}

/// The file of the data disk's device, if the VM has the device.
fn device_file(qmp: &mut Qmp) -> Result<Option<String>> {
    let prefix = format!("/machine/peripheral/{DEVICE}/");
    let blocks = qmp.execute("query-block", None)?;
    Ok(list(&blocks)
        .iter()
        .find(|b| {
            b.get("qdev")
                .and_then(Value::as_str)
                .is_some_and(|q| q == DEVICE || q.starts_with(&prefix))
        })
        .map(|b| text(&b["inserted"]["file"])))
}

/// The file of the data disk's block node, if the VM has the node.
fn node_file(qmp: &mut Qmp) -> Result<Option<String>> {
    let nodes = qmp.execute("query-named-block-nodes", Some(json!({ "flat": true })))?;
    Ok(list(&nodes)
        .iter()
        .find(|n| n.get("node-name").and_then(Value::as_str) == Some(NODE))
        .map(|n| text(&n["file"])))
}

fn list(v: &Value) -> &[Value] {
    v.as_array().map(Vec::as_slice).unwrap_or_default()
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or("(none)").to_string()
}

#[cfg(test)]
pub(crate) mod fake {
    //! A fake QEMU's QMP socket that keeps the state `plug` looks at: which
    //! block nodes and devices exist, and which file each holds.

    use std::io::{BufRead, BufReader, Write};
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex};

    use serde_json::{json, Value};

    /// What the fake VM has, and the commands it got.
    #[derive(Debug, Default)]
    pub struct State {
        /// The file of the block node `NODE`, if added.
        pub node: Option<String>,
        /// The file of the device `DEVICE`, if added.
        pub device: Option<String>,
        /// Every command but `qmp_capabilities`, in order.
        pub commands: Vec<String>,
    }

    /// Serves QMP on `socket` (any number of connections, one after
    /// another) until the test ends.
    pub fn serve(socket: &Path, state: State) -> Arc<Mutex<State>> {
        let state = Arc::new(Mutex::new(state));
        let shared = state.clone();
        let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let _ = conn.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n");
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap_or(0) > 0 {
                    let msg: Value = serde_json::from_str(&line).unwrap();
                    let reply = answer(&mut shared.lock().unwrap(), &msg);
                    let _ = conn.write_all(format!("{reply}\n").as_bytes());
                    line.clear();
                }
            }
        });
        state
    }

    fn answer(s: &mut State, msg: &Value) -> Value {
        let cmd = msg["execute"].as_str().unwrap().to_string();
        let args = &msg["arguments"];
        if cmd != "qmp_capabilities" {
            s.commands.push(cmd.clone());
        }
        let error = |desc: String| json!({"error": {"class": "GenericError", "desc": desc}});
        match cmd.as_str() {
            "query-block" => {
                // The root disk, as QEMU lists it, then the data disk if any.
                let mut list = vec![
                    json!({"device": "virtio0", "qdev": "/machine/peripheral-anon/device[1]/virtio-backend",
                    "inserted": {"node-name": "#block123", "file": "/x/overlay.qcow2"}}),
                ];
                if let Some(file) = &s.device {
                    list.push(json!({"device": "", "qdev": format!("/machine/peripheral/{}/virtio-backend", super::DEVICE),
                        "inserted": {"node-name": super::NODE, "file": file}}));
                }
                json!({ "return": list })
            }
            "query-named-block-nodes" => {
                assert_eq!(args["flat"], true);
                let mut list = vec![json!({"node-name": "#block123", "file": "/x/overlay.qcow2"})];
                if let Some(file) = &s.node {
                    list.push(json!({"node-name": super::NODE, "file": file, "drv": "qcow2"}));
                }
                json!({ "return": list })
            }
            "blockdev-add" => {
                if s.node.is_some() {
                    return error(format!("Duplicate nodes with node-name='{}'", super::NODE));
                }
                assert_eq!(args["node-name"], super::NODE);
                assert_eq!(args["driver"], "qcow2");
                s.node = Some(args["file"]["filename"].as_str().unwrap().to_string());
                json!({"return": {}})
            }
            "device_add" => {
                if s.device.is_some() {
                    return error(format!("Duplicate device ID '{}'", super::DEVICE));
                }
                assert_eq!(args["drive"], super::NODE);
                let Some(file) = s.node.clone() else {
                    return error(format!(
                        "Cannot find device='' nor node-name='{}'",
                        super::NODE
                    ));
                };
                assert_eq!(args["bus"], super::vm::DATA_PORT);
                assert_eq!(args["serial"], super::vm::DATA_SERIAL);
                s.device = Some(file);
                json!({"return": {}})
            }
            "qmp_capabilities" => json!({"return": {}}),
            other => error(format!("The command {other} has not been found")),
        }
    }

    /// A path to use as a data disk in the fake's state.
    pub fn disk(dir: &Path) -> PathBuf {
        dir.join("data.qcow2")
    }
}

#[cfg(test)]
mod tests {
    use super::fake::{self, State};
    use super::*;

    fn connect(dir: &Path, state: State) -> (Qmp, std::sync::Arc<std::sync::Mutex<State>>) {
        let socket = dir.join("qmp.sock");
        let shared = fake::serve(&socket, state);
        (Qmp::connect(&socket).unwrap(), shared)
    }

    #[test]
    fn a_vm_without_the_disk_gets_node_then_device_and_a_second_plug_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let disk = fake::disk(dir.path());
        let (mut q, state) = connect(dir.path(), State::default());
        assert_eq!(plug(&mut q, &disk).unwrap(), Plugged::New);
        {
            let s = state.lock().unwrap();
            assert_eq!(
                s.commands,
                [
                    "query-block",
                    "query-named-block-nodes",
                    "blockdev-add",
                    "device_add"
                ]
            );
            assert_eq!(s.device.as_deref(), Some(disk.to_str().unwrap()));
        }
        assert_eq!(plug(&mut q, &disk).unwrap(), Plugged::Already);
        assert_eq!(
            state.lock().unwrap().commands[4..],
            ["query-block"],
            "the disk is there: nothing added"
        );
    }

    #[test]
    fn a_plug_killed_between_node_and_device_is_finished() {
        let dir = tempfile::tempdir().unwrap();
        let disk = fake::disk(dir.path());
        let half = State {
            node: Some(disk.display().to_string()),
            ..State::default()
        };
        let (mut q, state) = connect(dir.path(), half);
        assert_eq!(plug(&mut q, &disk).unwrap(), Plugged::Finished);
        let s = state.lock().unwrap();
        assert_eq!(
            s.commands,
            ["query-block", "query-named-block-nodes", "device_add"]
        );
        assert_eq!(s.device.as_deref(), Some(disk.to_str().unwrap()));
    }

    #[test]
    fn a_node_or_device_holding_another_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let disk = fake::disk(dir.path());
        let (mut q, state) = connect(
            dir.path(),
            State {
                node: Some("/elsewhere/data.qcow2".into()),
                ..State::default()
            },
        );
        let e = format!("{:#}", plug(&mut q, &disk).unwrap_err());
        assert!(
            e.contains("block node dormant-data holds /elsewhere/data.qcow2"),
            "{e}"
        );
        assert!(state.lock().unwrap().device.is_none(), "nothing added");
        drop(q);

        let dir = tempfile::tempdir().unwrap();
        let other = State {
            node: Some("/elsewhere/data.qcow2".into()),
            device: Some("/elsewhere/data.qcow2".into()),
            ..State::default()
        };
        let (mut q, _state) = connect(dir.path(), other);
        let e = format!("{:#}", plug(&mut q, &disk).unwrap_err());
        assert!(e.contains("device dormant-data-disk holds"), "{e}");
    }
}
