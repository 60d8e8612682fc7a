//! The EC2 emulator for tests: moto's server mode on 127.0.0.1 (started per
//! test, killed on drop), and a small HTTP proxy in front of it that records
//! every EC2 action (to count API calls) and injects what moto cannot produce:
//! error responses (capacity, throttling, NotFound right after a launch,
//! UnauthorizedOperation), capacity shortages by market, instance type and
//! zone (`no_capacity`: RunInstances and StartInstances matching them get
//! `InsufficientInstanceCapacity`, as EC2 answers a launch it has no room
//! for; until `capacity_back`, or for a counted number of calls,
//! `Shortage::times`), EC2's refusal to attach a volume to an instance in
//! another zone (moto attaches it anyway), and slow state transitions (a `running`
//! instance shown as `pending` for a while; `hold_transitions` holds every
//! start and stop for a fixed time from its call, for the resume benchmark
//! and the tests that count polls during a transition; `hold_launches`
//! holds every new instance `pending` after RunInstances and
//! `hold_attaches` every volume `attaching` after AttachVolume, as EC2
//! takes seconds for each: for the EC2 benchmark, `scripts/bench-ec2.sh`).
//! Every hold is off until a test turns it on; `shown_held` counts the
//! describes that showed one, so a test can tell a hold was really seen.
//!
//! Network rule: only loopback. moto hands out 10.x / 54.x addresses for its
//! instances; nothing here connects to them.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness::free_port;
pub use crate::moto_refusals::Shortage;
use crate::moto_refusals::{late_refusal, refusal, show_stranded, Refusals};

/// How long moto may take to answer after it was started (measured ≈ 0.4 s).
const MOTO_START_TIMEOUT: Duration = Duration::from_secs(30);

pub const REGION: &str = "us-east-1";
pub const ACCESS_KEY: &str = "testing";
pub const SECRET_KEY: &str = "testing";

fn moto_binary() -> PathBuf {
    if let Ok(p) = std::env::var("DORMANT_TEST_MOTO_SERVER") {
        if !p.is_empty() {
            return PathBuf::from(p);
        }
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/moto_server");
    assert!(
        p.exists(),
        "moto (the EC2 emulator) is not installed at {}: run scripts/install-test-deps.sh \
         (or point DORMANT_TEST_MOTO_SERVER at a moto_server)",
        p.display()
    );
    p
}

/// A moto server on 127.0.0.1, killed on drop.
pub struct Moto {
    child: Child,
    pub port: u16,
}

impl Moto {
    pub fn start() -> Moto {
        let bin = moto_binary();
        for _ in 0..3 {
            let port = free_port();
            let mut child = Command::new(&bin)
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
            let started = Instant::now();
            while started.elapsed() < MOTO_START_TIMEOUT {
                if let Ok(Some(_)) = child.try_wait() {
                    break; // port taken in between: try another
                }
                if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Moto { child, port };
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("moto did not start on 127.0.0.1 ({})", bin.display());
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One EC2 request the proxy saw.
#[derive(Debug, Clone)]
pub struct Call {
    pub at: Instant,
    pub action: String,
    pub body: String,
    /// The held state its answer showed (`pending`, `attaching`, ...), if
    /// a hold rewrote it.
    pub held: Option<&'static str>,
    /// Numbers the calls in arrival order (never reused).
    seq: u64,
}

/// An injected error: the next `times` calls of `action`, after `skip` of them pass.
#[derive(Debug, Clone)]
struct Fault {
    action: String,
    skip: usize,
    times: usize,
    status: u16,
    code: String,
}

/// While `until` has not passed, DescribeInstances shows instances in state
/// `real` as `shown` (a slow transition).
#[derive(Debug, Clone)]
struct Slow {
    real: (u8, &'static str),
    shown: (u8, &'static str),
    until: Option<Instant>,
}

/// An instance's transition as the proxy shows it: after StartInstances
/// (StopInstances, RunInstances) DescribeInstances says `pending`
/// (`stopping`, `pending`) until `until`.
#[derive(Debug, Clone)]
struct Transition {
    id: String,
    real: (u8, &'static str),
    shown: (u8, &'static str),
    until: Instant,
}

#[derive(Default)]
struct State {
    calls: Vec<Call>,
    faults: Vec<Fault>,
    slow: Vec<Slow>,
    /// `hold_transitions`: how long every start and stop is held.
    hold: Option<(Duration, Duration)>,
    /// `hold_launches`: how long every new instance is held `pending`.
    launch_hold: Option<Duration>,
    /// `hold_attaches`: how long every attachment is held `attaching`.
    attach_hold: Option<Duration>,
    transitions: Vec<Transition>,
    /// (volume id, until): DescribeVolumes shows its attachment `attaching`.
    attaching: Vec<(String, Instant)>,
    /// Describes that showed a held state, by that state (`pending`, `attaching`, ...).
    shown_held: std::collections::BTreeMap<&'static str, usize>,
    /// The `seq` of the next call.
    next_seq: u64,
    /// `public_ip`: the address DescribeInstances reports as every instance's public IP.
    public_ip: Option<String>,
    /// `public_ip_once_running`: no public IP while a start is held `pending`.
    ip_once_running: bool,
    /// `launched_long_ago`: DescribeInstances shows every instance launched
    /// at [`LONG_AGO`] (moto's are all launched now).
    long_ago: bool,
}

impl State {
    /// Call `seq`'s answer showed something in the held state `state`.
    fn shown(&mut self, seq: u64, state: &'static str) {
        *self.shown_held.entry(state).or_default() += 1;
        if let Some(c) = self.calls.iter_mut().rev().find(|c| c.seq == seq) {
            c.held = Some(state);
        }
    }
}

/// The launch time `launched_long_ago` shows.
pub const LONG_AGO: &str = "2020-01-01T00:00:00.000Z";

/// The recording, fault-injecting proxy. Stops on drop.
pub struct Proxy {
    pub port: u16,
    state: Arc<Mutex<State>>,
    refusals: Arc<Mutex<Refusals>>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    pub fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(State::default()));
        let refusals = Arc::new(Mutex::new(Refusals::default()));
        let stop = Arc::new(AtomicBool::new(false));
        {
            let state = state.clone();
            let refusals = refusals.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    let (state, refusals) = (state.clone(), refusals.clone());
                    std::thread::spawn(move || {
                        let _ = serve(conn, upstream, &state, &refusals);
                    });
                }
            });
        }
        Proxy {
            port,
            state,
            refusals,
            stop,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The next `times` calls of `action` (after `skip` pass) fail with `code`.
    pub fn fail(&self, action: &str, skip: usize, times: usize, status: u16, code: &str) {
        self.state.lock().unwrap().faults.push(Fault {
            action: action.into(),
            skip,
            times,
            status,
            code: code.into(),
        });
    }

    /// From now on, launches and starts matching `s` find no capacity.
    pub fn no_capacity(&self, s: Shortage) {
        self.refusals.lock().unwrap().shortages.push(s);
    }

    /// From now on, starts matching `s` are accepted and then given up for
    /// lack of capacity: the instance shows `pending`, then `stopped` with
    /// the state reason `Server.InsufficientInstanceCapacity` (as EC2 does
    /// when it accepts a StartInstances it cannot place).
    pub fn no_capacity_after_start(&self, s: Shortage) {
        self.refusals.lock().unwrap().late.push(s);
    }

    /// Capacity is back everywhere.
    pub fn capacity_back(&self) {
        let mut r = self.refusals.lock().unwrap();
        r.shortages.clear();
        r.late.clear();
    }

    /// Shows running instances as pending for `d` (`None`: forever).
    pub fn slow_launch(&self, d: Option<Duration>) -> Option<Instant> {
        self.slow((16, "running"), (0, "pending"), d)
    }

    /// Shows stopped instances as stopping for `d`.
    pub fn slow_stop(&self, d: Option<Duration>) -> Option<Instant> {
        self.slow((80, "stopped"), (64, "stopping"), d)
    }

    fn slow(
        &self,
        real: (u8, &'static str),
        shown: (u8, &'static str),
        d: Option<Duration>,
    ) -> Option<Instant> {
        let until = d.map(|d| Instant::now() + d);
        self.state
            .lock()
            .unwrap()
            .slow
            .push(Slow { real, shown, until });
        until
    }

    /// From now on, every StartInstances (StopInstances) is followed by
    /// `start` (`stop`) during which DescribeInstances shows that instance
    /// `pending` (`stopping`), as a real instance is for seconds to minutes.
    pub fn hold_transitions(&self, start: Duration, stop: Duration) {
        self.state.lock().unwrap().hold = Some((start, stop));
    }

    /// From now on, every instance RunInstances makes is shown `pending`
    /// for `d` from the call (EC2: ≈ 20 s to `running` for a small Linux
    /// instance), whatever moto says.
    pub fn hold_launches(&self, d: Duration) {
        self.state.lock().unwrap().launch_hold = Some(d);
    }

    /// From now on, every volume AttachVolume attaches is shown with its
    /// attachment `attaching` for `d` from the call (EC2: seconds).
    pub fn hold_attaches(&self, d: Duration) {
        self.state.lock().unwrap().attach_hold = Some(d);
    }

    /// How many describe answers showed something in the held state `state`
    /// (`pending`, `stopping`: an instance; `attaching`: a volume): that a
    /// hold was not only set but seen by whoever asked.
    pub fn shown_held(&self, state: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .shown_held
            .get(state)
            .copied()
            .unwrap_or(0)
    }

    /// DescribeInstances reports `ip` as every instance's public IP (e.g.
    /// 127.0.0.1, so `ec2.address = "public"` reaches a loopback sshd).
    pub fn public_ip(&self, ip: &str) {
        self.state.lock().unwrap().public_ip = Some(ip.to_string());
    }

    /// While a start is held `pending`, DescribeInstances shows no public IP
    /// (EC2 usually shows the new one during `pending`; this is the case
    /// where it does not, so a resume must wait for `running` to learn it).
    pub fn public_ip_once_running(&self, on: bool) {
        self.state.lock().unwrap().ip_once_running = on;
    }

    /// DescribeInstances shows every instance launched at [`LONG_AGO`]
    /// (older than any grace a sweep gives a young machine).
    pub fn launched_long_ago(&self, on: bool) {
        self.state.lock().unwrap().long_ago = on;
    }

    /// When the proxy received the first `action` after `since`, waiting for it up to `timeout`.
    pub fn await_call(&self, action: &str, since: Instant, timeout: Duration) -> Option<Instant> {
        let end = Instant::now() + timeout;
        loop {
            let seen = self
                .calls()
                .into_iter()
                .find(|c| c.action == action && c.at >= since)
                .map(|c| c.at);
            if seen.is_some() || Instant::now() >= end {
                return seen;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// When DescribeInstances was asked about instance `id` by id.
    pub fn describes_of(&self, id: &str) -> Vec<Instant> {
        let needle = format!("InstanceId.1={id}");
        self.calls()
            .into_iter()
            .filter(|c| c.action == "DescribeInstances" && c.body.contains(&needle))
            .map(|c| c.at)
            .collect()
    }

    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().unwrap().calls.clone()
    }

    pub fn actions(&self) -> Vec<String> {
        self.calls().into_iter().map(|c| c.action).collect()
    }

    pub fn count(&self, action: &str) -> usize {
        self.calls().iter().filter(|c| c.action == action).count()
    }

    pub fn clear_calls(&self) {
        self.state.lock().unwrap().calls.clear();
    }

    /// Forgets every error [`Self::fail`] injected (the calls pass again).
    pub fn clear_faults(&self) {
        self.state.lock().unwrap().faults.clear();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Reads one HTTP/1.1 message head and its Content-Length body.
pub fn read_message(
    conn: &mut impl Read,
    eof_without_length: bool,
) -> std::io::Result<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i;
        }
        let n = conn.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(if eof_without_length { usize::MAX } else { 0 });
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = conn.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Ok((head, body))
}

pub fn form_value(body: &str, key: &str) -> Option<String> {
    body.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then(|| v.to_string())
    })
}

fn respond(conn: &mut TcpStream, status: u16, body: &[u8]) -> std::io::Result<()> {
    write!(
        conn,
        "HTTP/1.1 {status} X\r\nContent-Type: text/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    conn.write_all(body)?;
    conn.flush()
}

fn respond_error(
    conn: &mut TcpStream,
    status: u16,
    code: &str,
    message: &str,
) -> std::io::Result<()> {
    let xml = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>{code}</Code>\
         <Message>{message}</Message></Error></Errors><RequestID>fault</RequestID></Response>"
    );
    respond(conn, status, xml.as_bytes())
}

fn serve(
    mut conn: TcpStream,
    upstream: u16,
    state: &Mutex<State>,
    refusals: &Mutex<Refusals>,
) -> std::io::Result<()> {
    let (head, body) = read_message(&mut conn, false)?;
    let text = String::from_utf8_lossy(&body).to_string();
    let action = form_value(&text, "Action").unwrap_or_else(|| "?".into());
    let called = Instant::now();
    let seq;
    let fault = {
        let mut st = state.lock().unwrap();
        let now = called;
        seq = st.next_seq;
        st.next_seq += 1;
        st.calls.push(Call {
            at: now,
            action: action.clone(),
            body: text.clone(),
            held: None,
            seq,
        });
        let kind = match (action.as_str(), st.hold) {
            ("StartInstances", Some((h, _))) => Some(((16, "running"), (0, "pending"), h)),
            ("StopInstances", Some((_, h))) => Some(((80, "stopped"), (64, "stopping"), h)),
            _ => None,
        };
        if let Some((real, shown, hold)) = kind {
            if let Some(id) = form_value(&text, "InstanceId.1") {
                st.transitions.push(Transition {
                    id,
                    real,
                    shown,
                    until: now + hold,
                });
            }
        }
        let mut hit = None;
        for f in st.faults.iter_mut().filter(|f| f.action == action) {
            if f.skip > 0 {
                f.skip -= 1;
                continue;
            }
            if f.times > 0 {
                f.times -= 1;
                hit = Some(f.clone());
                break;
            }
        }
        hit
    };
    if let Some(f) = fault {
        return respond_error(&mut conn, f.status, &f.code, "injected by the test proxy");
    }
    if let Some((status, code, message)) = refusal(&action, &text, upstream, refusals)? {
        return respond_error(&mut conn, status, code, &message);
    }
    if let Some(accepted) = late_refusal(&action, &text, upstream, refusals)? {
        return respond(&mut conn, 200, accepted.as_bytes());
    }
    // Forward with Connection: close, then read moto's answer to the end.
    let mut up = TcpStream::connect(("127.0.0.1", upstream))?;
    let mut new_head = String::new();
    for line in head.lines() {
        let lower = line.to_ascii_lowercase();
        if lower.starts_with("connection:") || lower.starts_with("keep-alive:") {
            continue;
        }
        new_head.push_str(line);
        new_head.push_str("\r\n");
    }
    new_head.push_str("Connection: close\r\n\r\n");
    up.write_all(new_head.as_bytes())?;
    up.write_all(&body)?;
    let (resp_head, mut resp_body) = read_message(&mut up, true)?;
    if resp_head.starts_with("HTTP/1.1 200") {
        hold_after(&action, &text, &resp_body, called, state);
    }
    if action == "DescribeVolumes" {
        let xml = String::from_utf8_lossy(&resp_body).to_string();
        let mut st = state.lock().unwrap();
        let now = Instant::now();
        let mut shown = xml.clone();
        for (id, _) in st.attaching.iter().filter(|(_, u)| now < *u) {
            shown = show_attaching(&shown, id);
        }
        if shown != xml {
            st.shown(seq, "attaching");
            resp_body = shown.into_bytes();
        }
    }
    if action == "DescribeInstances" {
        let mut xml = String::from_utf8_lossy(&resp_body).to_string();
        let now = Instant::now();
        for s in state.lock().unwrap().slow.iter() {
            if s.until.is_none_or(|u| now < u) {
                xml = xml.replace(
                    &format!(
                        "<instanceState><code>{}</code><name>{}</name></instanceState>",
                        s.real.0, s.real.1
                    ),
                    &format!(
                        "<instanceState><code>{}</code><name>{}</name></instanceState>",
                        s.shown.0, s.shown.1
                    ),
                );
            }
        }
        xml = show_stranded(&xml, refusals);
        let mut st = state.lock().unwrap();
        let mut held = Vec::new();
        for t in st.transitions.iter().filter(|t| now < t.until) {
            let before = xml.clone();
            xml = show_state(&xml, &t.id, t.real, t.shown);
            if xml != before && !held.contains(&t.shown.1) {
                held.push(t.shown.1);
            }
        }
        for h in held {
            st.shown(seq, h);
        }
        if let Some(ip) = &st.public_ip {
            let starting = st
                .transitions
                .iter()
                .any(|t| now < t.until && t.shown.1 == "pending");
            let shown = (!st.ip_once_running || !starting).then_some(ip.as_str());
            xml = replace_elements(&xml, "ipAddress", shown);
        }
        if st.long_ago {
            xml = replace_elements(&xml, "launchTime", Some(LONG_AGO));
        }
        resp_body = xml.into_bytes();
    }
    let mut out = String::new();
    for line in resp_head.lines() {
        if line.to_ascii_lowercase().starts_with("content-length:") {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str(&format!("Content-Length: {}\r\n\r\n", resp_body.len()));
    conn.write_all(out.as_bytes())?;
    conn.write_all(&resp_body)?;
    conn.flush()?;
    let _ = conn.shutdown(Shutdown::Both);
    Ok(())
}

/// The holds a successful call starts: each instance RunInstances made is
/// held `pending` (`hold_launches`), the volume AttachVolume attached is
/// held `attaching` (`hold_attaches`), from `called` on.
fn hold_after(action: &str, request: &str, response: &[u8], called: Instant, state: &Mutex<State>) {
    let mut st = state.lock().unwrap();
    match (action, st.launch_hold, st.attach_hold) {
        ("RunInstances", Some(hold), _) => {
            let xml = String::from_utf8_lossy(response);
            let ids: Vec<String> = xml
                .split("<instanceId>")
                .skip(1)
                .filter_map(|rest| {
                    rest.split_once("</instanceId>")
                        .map(|(id, _)| id.to_string())
                })
                .collect();
            for id in ids {
                st.transitions.push(Transition {
                    id,
                    real: (16, "running"),
                    shown: (0, "pending"),
                    until: called + hold,
                });
            }
        }
        ("AttachVolume", _, Some(hold)) => {
            if let Some(id) = form_value(request, "VolumeId") {
                st.attaching.push((id, called + hold));
            }
        }
        _ => {}
    }
}

/// Shows every attachment of volume `id` that moto says is `attached` as
/// `attaching` (the volume stays `in-use`, as on EC2 during an attach).
pub fn show_attaching(xml: &str, id: &str) -> String {
    let mut out = String::new();
    let mut rest = xml;
    while let Some(i) = rest.find("<attachmentSet>") {
        let Some(j) = rest[i..].find("</attachmentSet>") else {
            break;
        };
        let set = &rest[i..i + j];
        let shown: Vec<String> = set
            .split_inclusive("</item>")
            .map(|item| {
                if item.contains(&format!("<volumeId>{id}</volumeId>")) {
                    item.replace("<status>attached</status>", "<status>attaching</status>")
                } else {
                    item.to_string()
                }
            })
            .collect();
        out.push_str(&rest[..i]);
        out.push_str(&shown.concat());
        rest = &rest[i + j..];
    }
    out.push_str(rest);
    out
}

/// Shows instance `id` in state `shown` where moto says `real`: the
/// `instanceState` after its `<instanceId>` (moto writes it right after).
pub fn show_state(xml: &str, id: &str, real: (u8, &str), shown: (u8, &str)) -> String {
    let from = format!(
        "<instanceState><code>{}</code><name>{}</name></instanceState>",
        real.0, real.1
    );
    let to = format!(
        "<instanceState><code>{}</code><name>{}</name></instanceState>",
        shown.0, shown.1
    );
    in_item(xml, id, |item| item.replacen(&from, &to, 1))
}

/// Rewrites instance `id`'s `<item>` (the innermost one around its
/// `<instanceId>`, wherever moto puts that among the item's fields) with `f`.
pub fn in_item(xml: &str, id: &str, f: impl Fn(&str) -> String) -> String {
    let Some(at) = xml.find(&format!("<instanceId>{id}</instanceId>")) else {
        return xml.to_string();
    };
    // The item open at `at`: scan the tags before it.
    let mut open: Vec<usize> = Vec::new();
    let mut i = 0;
    while let Some(j) = xml[i..at].find("item>") {
        let p = i + j;
        match xml[..p].chars().last() {
            Some('<') => open.push(p - 1),
            Some('/') => {
                open.pop();
            }
            _ => {}
        }
        i = p + "item>".len();
    }
    let Some(start) = open.pop() else {
        return xml.to_string();
    };
    // Its end: the `</item>` that closes it.
    let mut depth = 0usize;
    let mut i = start;
    let end = loop {
        let (o, c) = (xml[i..].find("<item>"), xml[i..].find("</item>"));
        match (o, c) {
            (Some(o), Some(c)) if o < c => {
                depth += 1;
                i += o + "<item>".len();
            }
            (_, Some(c)) => {
                depth -= 1;
                i += c + "</item>".len();
                if depth == 0 {
                    break i;
                }
            }
            _ => return xml.to_string(),
        }
    };
    format!("{}{}{}", &xml[..start], f(&xml[start..end]), &xml[end..])
}

/// Replaces the text of every `<tag>...</tag>` with `value`; `None` removes
/// the elements.
fn replace_elements(xml: &str, tag: &str, value: Option<&str>) -> String {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut out = String::new();
    let mut rest = xml;
    while let Some(i) = rest.find(&open) {
        let Some(j) = rest[i..].find(&close) else {
            break;
        };
        match value {
            Some(value) => {
                out.push_str(&rest[..i + open.len()]);
                out.push_str(value);
                out.push_str(&close);
            }
            None => out.push_str(&rest[..i]),
        }
        rest = &rest[i + j + close.len()..];
    }
    out.push_str(rest);
    out
}

/// Plays cloud-init for a loopback test sshd, one instance at a time, as a
/// real instance's boot goes: at an instance's first boot cloud-init
/// installs the `ssh_authorized_keys` of its user-data; at every later boot
/// of an instance whose user-data carries dormant's boot hook
/// (`provider/ec2/handover.rs`), the hook makes the key in its
/// `dormant:authorized-key` tag (as the tag is at that boot) its one
/// authorized key, dropping the ones before. The sshd's `authorized_keys` is
/// every instance's keys together (one sshd stands in for every instance;
/// each environment has a key of its own), so a key a boot hook replaced no
/// longer logs in. A boot is the stand-in seeing an instance running that it
/// last saw not running (it polls every 200 ms; a stop and a start are
/// seconds apart in every test). Stops on drop.
pub struct CloudInit {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

/// What the stand-in knows of one instance.
struct Booted {
    /// Its authorized keys now.
    keys: Vec<String>,
    /// Running when last seen.
    running: bool,
    /// Its user-data carries dormant's boot hook.
    hooked: bool,
}

/// The function name of dormant's boot hook, as its user-data carries it.
const BOOT_HOOK: &str = "dormant_authorized_key";

impl CloudInit {
    pub fn start(moto_url: String, authorized_keys: PathBuf) -> CloudInit {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let client = direct_client(&moto_url);
                let mut seen: std::collections::BTreeMap<String, Booted> = Default::default();
                while !flag.load(Ordering::SeqCst) {
                    if let Ok(out) = client.describe_instances().send().await {
                        for i in out.reservations().iter().flat_map(|r| r.instances()) {
                            let Some(id) = i.instance_id() else { continue };
                            let running = i.state().and_then(|s| s.name())
                                == Some(&aws_sdk_ec2::types::InstanceStateName::Running);
                            if let Some(b) = seen.get_mut(id) {
                                let tagged = i
                                    .tags()
                                    .iter()
                                    .find(|t| t.key() == Some("dormant:authorized-key"))
                                    .and_then(|t| t.value())
                                    .map(str::trim)
                                    .filter(|k| k.starts_with("ssh-ed25519 ") && !k.contains('\n'));
                                if running && !b.running && b.hooked {
                                    // A later boot: the hook replaces the keys (no tag: unchanged).
                                    if let Some(k) = tagged {
                                        b.keys = vec![k.to_string()];
                                    }
                                }
                                b.running = running;
                                continue;
                            }
                            // The first boot: the keys of its user-data.
                            let Ok(attr) = client
                                .describe_instance_attribute()
                                .instance_id(id)
                                .attribute(aws_sdk_ec2::types::InstanceAttributeName::UserData)
                                .send()
                                .await
                            else {
                                continue;
                            };
                            let data = attr
                                .user_data()
                                .and_then(|u| u.value())
                                .and_then(|v| aws_smithy_types::base64::decode(v).ok())
                                .map(|b| String::from_utf8_lossy(&b).to_string())
                                .unwrap_or_default();
                            seen.insert(
                                id.to_string(),
                                Booted {
                                    keys: authorized_keys_of(&data),
                                    running,
                                    hooked: data.contains(BOOT_HOOK),
                                },
                            );
                        }
                        let keys: std::collections::BTreeSet<&String> =
                            seen.values().flat_map(|b| &b.keys).collect();
                        let text: String = keys.iter().map(|k| format!("{k}\n")).collect();
                        let tmp = authorized_keys.with_extension("tmp");
                        if std::fs::write(&tmp, text).is_ok() {
                            let _ = std::fs::rename(&tmp, &authorized_keys);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            });
        });
        CloudInit {
            stop,
            handle: Some(handle),
        }
    }
}

impl Drop for CloudInit {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The `ssh_authorized_keys` entries of a `#cloud-config` document.
pub fn authorized_keys_of(user_data: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in user_data.lines() {
        if line.starts_with("ssh_authorized_keys:") {
            inside = true;
        } else if inside {
            match line.strip_prefix("  - ") {
                Some(k) => out.push(k.trim().to_string()),
                None => inside = false,
            }
        }
    }
    out
}

/// A client straight to moto (not through a proxy), with the test credentials.
pub fn direct_client(url: &str) -> aws_sdk_ec2::Client {
    use aws_sdk_ec2::config::{BehaviorVersion, Credentials, Region};
    let conf = aws_sdk_ec2::config::Builder::new()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(REGION))
        .endpoint_url(url)
        .credentials_provider(Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "test"))
        .build();
    aws_sdk_ec2::Client::from_conf(conf)
}

/// moto's default subnets, `(id, zone)`, sorted by zone (one per zone).
pub async fn default_subnets_by_zone(client: &aws_sdk_ec2::Client) -> Vec<(String, String)> {
    let out = client.describe_subnets().send().await.unwrap();
    let mut v: Vec<(String, String)> = out
        .subnets()
        .iter()
        .filter(|s| s.default_for_az() == Some(true))
        .map(|s| {
            (
                s.subnet_id().unwrap().to_string(),
                s.availability_zone().unwrap().to_string(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.1.cmp(&b.1));
    v
}

/// The lowest-numbered default subnet of moto's default VPC.
pub async fn default_subnet(client: &aws_sdk_ec2::Client) -> String {
    let subnets = client.describe_subnets().send().await.unwrap();
    subnets
        .subnets()
        .iter()
        .filter(|s| s.default_for_az() == Some(true))
        .filter_map(|s| s.subnet_id())
        .min()
        .unwrap()
        .to_string()
}

/// Canonical's account in moto's image catalogue.
pub const CANONICAL: &str = "099720109477";
/// Two of moto's catalogue images match it; the xenial one is the newest by name.
pub const UBUNTU_PATTERN: &str = "ubuntu/images/hvm-ssd/ubuntu-*";

/// An image of moto's catalogue matching `UBUNTU_PATTERN` whose name contains `name_part`.
pub async fn catalogue_image(client: &aws_sdk_ec2::Client, name_part: &str) -> String {
    let images = client
        .describe_images()
        .owners(CANONICAL)
        .filters(
            aws_sdk_ec2::types::Filter::builder()
                .name("name")
                .values(UBUNTU_PATTERN)
                .build(),
        )
        .send()
        .await
        .unwrap();
    images
        .images()
        .iter()
        .filter(|i| i.name().unwrap_or("").contains(name_part))
        .find_map(|i| i.image_id())
        .unwrap_or_else(|| panic!("moto's catalogue has an ubuntu image named *{name_part}*"))
        .to_string()
}
