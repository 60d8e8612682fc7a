//! What EC2 refuses that moto does not, played by the test proxy
//! (`moto.rs`): launches and starts without capacity for a market, instance
//! type or zone (`Shortage`: EC2's `InsufficientInstanceCapacity`), starts
//! EC2 accepts and then gives up for lack of capacity (`late`: the instance
//! goes `pending`, then `stopped` with the state reason
//! `Server.InsufficientInstanceCapacity`), and an
//! attach of a volume to an instance in another zone
//! (`InvalidVolume.ZoneMismatch`). The proxy asks moto itself what it needs
//! to know (an instance's type and zone, a subnet's zone, a volume's zone)
//! with queries of its own that are not recorded as calls.

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::moto::{form_value, read_message, ACCESS_KEY, REGION};

/// EC2 has no capacity for launches and starts matching every field given
/// (`None`: any): the market (`"spot"` or `"on-demand"`), the instance type,
/// the zone; for the next `times` of them (`None`: until `capacity_back`).
#[derive(Debug, Clone, Default)]
pub struct Shortage {
    pub market: Option<&'static str>,
    pub instance_type: Option<String>,
    pub zone: Option<String>,
    pub times: Option<usize>,
}

impl Shortage {
    pub fn spot() -> Shortage {
        Shortage {
            market: Some("spot"),
            ..Default::default()
        }
    }

    pub fn of_type(mut self, t: &str) -> Shortage {
        self.instance_type = Some(t.to_string());
        self
    }

    pub fn in_zone(mut self, z: &str) -> Shortage {
        self.zone = Some(z.to_string());
        self
    }

    /// Refuses only the next `n` matching calls, then capacity is back.
    /// The proxy counts them as it answers, so a test knows exactly which
    /// call is the first with room, however slow the machine: capacity
    /// restored by the test from outside (`Proxy::capacity_back` after
    /// watching the calls) lands wherever the code under test happens to be.
    pub fn times(mut self, n: usize) -> Shortage {
        assert!(n > 0, "a shortage of no calls: leave it out");
        self.times = Some(n);
        self
    }

    fn matches(&self, market: &str, instance_type: &str, zone: &str) -> bool {
        self.market.is_none_or(|m| m == market)
            && self
                .instance_type
                .as_deref()
                .is_none_or(|t| t == instance_type)
            && self.zone.as_deref().is_none_or(|z| z == zone)
    }
}

/// Whether a shortage in `list` refuses this call. The first that matches
/// (in the order they were set) refuses it; if it is limited by `times`,
/// the refusal is counted, and it is dropped once used up (under the
/// caller's lock: one decision per call, in the order calls arrive).
fn refuses(list: &mut Vec<Shortage>, market: &str, instance_type: &str, zone: &str) -> bool {
    let Some(k) = list
        .iter()
        .position(|s| s.matches(market, instance_type, zone))
    else {
        return false;
    };
    if let Some(n) = &mut list[k].times {
        *n -= 1;
        if *n == 0 {
            list.remove(k);
        }
    }
    true
}

/// How long an instance whose start EC2 accepted without capacity shows
/// `pending` before it shows `stopped` (on EC2: seconds).
const STRANDED_PENDING: Duration = Duration::from_millis(1500);

/// The state reason EC2 gives an instance it stopped for lack of capacity.
pub const LATE_CAPACITY_CODE: &str = "Server.InsufficientInstanceCapacity";

/// The shortages in force and what the proxy learnt about subnets.
#[derive(Default)]
pub struct Refusals {
    pub shortages: Vec<Shortage>,
    /// Starts matching these are accepted, and the instance stays stopped
    /// (moto is not asked) with EC2's capacity state reason.
    pub late: Vec<Shortage>,
    /// Instances whose start was accepted without capacity, and until when
    /// they show `pending`.
    stranded: HashMap<String, Instant>,
    /// Subnet id → zone, learnt from moto.
    subnet_zones: HashMap<String, String>,
}

/// The instance a StartInstances names, with its market, type and zone as
/// moto knows them.
fn start_target(
    body: &str,
    upstream: u16,
) -> std::io::Result<Option<(String, String, String, String)>> {
    let Some(id) = form_value(body, "InstanceId.1") else {
        return Ok(None);
    };
    let xml = side_query(
        upstream,
        &format!("Action=DescribeInstances&InstanceId.1={id}"),
    )?;
    let market = if first_element(&xml, "instanceLifecycle").as_deref() == Some("spot") {
        "spot"
    } else {
        "on-demand"
    };
    let t = first_element(&xml, "instanceType").unwrap_or_default();
    let zone = first_element(&xml, "availabilityZone").unwrap_or_default();
    Ok(Some((id, market.to_string(), t, zone)))
}

/// A StartInstances EC2 accepts but cannot place (a `late` shortage): the
/// answer EC2 gives (`pending`), without asking moto, so the instance stays
/// stopped; DescribeInstances then shows it as EC2 would
/// ([`show_stranded`]). Any other StartInstances clears what was shown of
/// its instance. `None`: pass it on.
pub fn late_refusal(
    action: &str,
    body: &str,
    upstream: u16,
    state: &Mutex<Refusals>,
) -> std::io::Result<Option<String>> {
    if action != "StartInstances" {
        return Ok(None);
    }
    let Some(id) = form_value(body, "InstanceId.1") else {
        return Ok(None);
    };
    state.lock().unwrap().stranded.remove(&id);
    if state.lock().unwrap().late.is_empty() {
        return Ok(None);
    }
    let Some((id, market, t, zone)) = start_target(body, upstream)? else {
        return Ok(None);
    };
    let mut st = state.lock().unwrap();
    if !refuses(&mut st.late, &market, &t, &zone) {
        return Ok(None);
    }
    st.stranded
        .insert(id.clone(), Instant::now() + STRANDED_PENDING);
    Ok(Some(format!(
        "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n<StartInstancesResponse \
         xmlns=\"http://ec2.amazonaws.com/doc/2016-11-15\"><instancesSet><item><instanceId>{id}\
         </instanceId><currentState><code>0</code><name>pending</name></currentState>\
         <previousState><code>80</code><name>stopped</name></previousState></item></instancesSet>\
         <requestId>test-proxy</requestId></StartInstancesResponse>"
    )))
}

/// DescribeInstances as EC2 shows an instance whose start it accepted
/// without capacity: `pending` for a moment, then `stopped` with the state
/// reason `Server.InsufficientInstanceCapacity`.
pub fn show_stranded(xml: &str, state: &Mutex<Refusals>) -> String {
    let st = state.lock().unwrap();
    let mut xml = xml.to_string();
    let now = Instant::now();
    for (id, until) in &st.stranded {
        xml = if now < *until {
            crate::moto::show_state(&xml, id, (80, "stopped"), (0, "pending"))
        } else {
            crate::moto::in_item(&xml, id, |item| {
                let Some(start) = item.find("<stateReason>") else {
                    return item.to_string();
                };
                let Some(len) = item[start..].find("</stateReason>") else {
                    return item.to_string();
                };
                format!(
                    "{}<stateReason><code>{LATE_CAPACITY_CODE}</code><message>{LATE_CAPACITY_CODE}: \
                     Insufficient capacity. (test proxy)</message></stateReason>{}",
                    &item[..start],
                    &item[start + len + "</stateReason>".len()..]
                )
            })
        };
    }
    xml
}

/// What EC2 would refuse that moto does not: a launch or start without
/// capacity (a `Shortage`), an attach across zones. `None`: pass it on.
pub fn refusal(
    action: &str,
    body: &str,
    upstream: u16,
    state: &Mutex<Refusals>,
) -> std::io::Result<Option<(u16, &'static str, String)>> {
    let no_room = |market: &str, t: &str, zone: &str| {
        let mut st = state.lock().unwrap();
        refuses(&mut st.shortages, market, t, zone).then(|| {
            (
                500,
                "InsufficientInstanceCapacity",
                format!(
                    "We currently do not have sufficient {t} capacity in the Availability Zone you requested \
                     ({zone}) for {market} instances (test proxy)"
                ),
            )
        })
    };
    match action {
        "RunInstances" if !state.lock().unwrap().shortages.is_empty() => {
            let market = match form_value(body, "InstanceMarketOptions.MarketType").as_deref() {
                Some("spot") => "spot",
                _ => "on-demand",
            };
            let t = form_value(body, "InstanceType").unwrap_or_default();
            let zone = match form_value(body, "SubnetId") {
                Some(subnet) => subnet_zone(&subnet, upstream, state)?,
                None => String::new(),
            };
            Ok(no_room(market, &t, &zone))
        }
        "StartInstances" if !state.lock().unwrap().shortages.is_empty() => {
            let Some((_, market, t, zone)) = start_target(body, upstream)? else {
                return Ok(None);
            };
            Ok(no_room(&market, &t, &zone))
        }
        "AttachVolume" => {
            let (Some(vol), Some(id)) =
                (form_value(body, "VolumeId"), form_value(body, "InstanceId"))
            else {
                return Ok(None);
            };
            let v = side_query(
                upstream,
                &format!("Action=DescribeVolumes&VolumeId.1={vol}"),
            )?;
            let i = side_query(
                upstream,
                &format!("Action=DescribeInstances&InstanceId.1={id}"),
            )?;
            let (vz, iz) = (
                first_element(&v, "availabilityZone"),
                first_element(&i, "availabilityZone"),
            );
            Ok((vz.is_some() && iz.is_some() && vz != iz).then(|| {
                (
                    400,
                    "InvalidVolume.ZoneMismatch",
                    format!(
                        "The volume '{vol}' is not in the same availability zone as instance '{id}' (test proxy: \
                         {} and {})",
                        vz.unwrap_or_default(),
                        iz.unwrap_or_default()
                    ),
                )
            }))
        }
        _ => Ok(None),
    }
}

fn subnet_zone(subnet: &str, upstream: u16, state: &Mutex<Refusals>) -> std::io::Result<String> {
    if let Some(z) = state.lock().unwrap().subnet_zones.get(subnet) {
        return Ok(z.clone());
    }
    let xml = side_query(
        upstream,
        &format!("Action=DescribeSubnets&SubnetId.1={subnet}"),
    )?;
    let zone = first_element(&xml, "availabilityZone").unwrap_or_default();
    state
        .lock()
        .unwrap()
        .subnet_zones
        .insert(subnet.to_string(), zone.clone());
    Ok(zone)
}

/// A query of the proxy's own, straight to moto (not recorded). moto reads
/// the service and region from the credential scope and checks no signature.
fn side_query(upstream: u16, query: &str) -> std::io::Result<String> {
    let body = format!("{query}&Version=2016-11-15");
    let mut up = TcpStream::connect(("127.0.0.1", upstream))?;
    write!(
        up,
        "POST / HTTP/1.1\r\nHost: 127.0.0.1:{upstream}\r\n\
         Content-Type: application/x-www-form-urlencoded; charset=utf-8\r\n\
         Authorization: AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/20260101/{REGION}/ec2/aws4_request, \
         SignedHeaders=host, Signature=0\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let (_, resp) = read_message(&mut up, true)?;
    Ok(String::from_utf8_lossy(&resp).to_string())
}

/// The text of the first `<tag>...</tag>` in `xml`.
pub fn first_element(xml: &str, tag: &str) -> Option<String> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let start = xml.find(&open)? + open.len();
    let len = xml[start..].find(&close)?;
    Some(xml[start..start + len].to_string())
}
