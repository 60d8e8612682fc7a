//! Where and how an instance is launched when there is a choice: the ordered
//! list of (instance type, subnet, market) a launch tries, and one round of
//! trying them. EC2's capacity is per instance type, zone and market, so a
//! choice without capacity (`InsufficientInstanceCapacity`, ...) moves on to
//! the next; a round in which none had capacity is one "no capacity" for the
//! capacity wait (`capacity.rs`), which backs off and tries the round again.
//!
//! The order (docs/ec2.md, "Placement"): the configured market first (spot,
//! then on-demand only with `ec2.on_demand_fallback`), within a market the
//! instance types in order, within a type the subnets in order. Price goes
//! first: any spot choice is cheaper than any on-demand one; then the
//! operator's (or the job's) preference of type over zone, because a type
//! decides what the job gets while a zone only decides where it runs.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::Result;

use super::errors::capacity_reason;
use crate::context::Ctx;
use crate::settings::ec2::Market;

/// A subnet and, when dormant looked it up, its zone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subnet {
    pub id: String,
    pub zone: Option<String>,
}

/// One way to launch: an instance type in a subnet, in a market.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub instance_type: String,
    pub subnet: Subnet,
    pub market: Market,
}

impl std::fmt::Display for Subnet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.id)?;
        if let Some(zone) = &self.zone {
            write!(f, " ({zone})")?;
        }
        Ok(())
    }
}

impl std::fmt::Display for Choice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} in {}",
            self.instance_type,
            self.market.as_str(),
            self.subnet
        )
    }
}

/// Every choice in the order they are tried (see the module comment).
pub fn choices(
    types: &[String],
    subnets: &[Subnet],
    market: Market,
    on_demand_fallback: bool,
) -> Vec<Choice> {
    let mut markets = vec![market];
    if market == Market::Spot && on_demand_fallback {
        markets.push(Market::OnDemand);
    }
    let mut out = Vec::new();
    for market in markets {
        for t in types {
            for s in subnets {
                out.push(Choice {
                    instance_type: t.clone(),
                    subnet: s.clone(),
                    market,
                });
            }
        }
    }
    out
}

/// What a round launched: the instance and the choice it was launched with.
#[derive(Debug, Clone)]
pub struct Launched {
    pub id: String,
    pub choice: Choice,
}

/// Rounds of [`try_round`] that share one log: the steps from one choice to
/// the next are told in the job log in the first round only (later rounds
/// are the capacity wait's, which reports its progress itself).
#[derive(Default)]
pub struct Rounds {
    done: AtomicU32,
}

impl Rounds {
    /// Tries `choices` in order with `launch(index)` until one
    /// launches. `Ok(Err(reason))`: none had capacity; any other error ends
    /// the round at once (a bad image, a missing permission).
    pub async fn try_round<F, Fut>(
        &self,
        choices: &[Choice],
        ctx: &Ctx,
        launch: F,
    ) -> Result<Result<Launched, String>>
    where
        F: Fn(usize) -> Fut,
        Fut: Future<Output = Result<String>>,
    {
        let first_round = self.done.fetch_add(1, Ordering::Relaxed) == 0;
        let mut refused: Vec<(usize, String)> = Vec::new();
        for (k, choice) in choices.iter().enumerate() {
            let reason = match launch(k).await {
                Ok(id) => {
                    return Ok(Ok(Launched {
                        id,
                        choice: choice.clone(),
                    }))
                }
                Err(e) => capacity_reason(e)?,
            };
            if first_round {
                if let Some(next) = choices.get(k + 1) {
                    let why = if next.market != choice.market {
                        " (ec2.on_demand_fallback)"
                    } else {
                        ""
                    };
                    ctx.log.info(format!(
                        "no capacity for {choice}: {reason}; trying {next}{why}"
                    ));
                }
            }
            refused.push((k, reason));
        }
        Ok(Err(summary(choices, &refused)))
    }
}

/// The capacity wait's reason after a round without capacity. One choice:
/// EC2's own words (as before there were choices); several: what was tried
/// and the distinct errors, and whether on-demand could have been tried.
fn summary(choices: &[Choice], refused: &[(usize, String)]) -> String {
    if let [(_, reason)] = refused {
        return with_fallback_hint(choices, reason.clone());
    }
    let mut types: Vec<&str> = Vec::new();
    let mut places: Vec<String> = Vec::new();
    let mut markets: Vec<&str> = Vec::new();
    for c in choices {
        if !types.contains(&c.instance_type.as_str()) {
            types.push(&c.instance_type);
        }
        let place = c.subnet.zone.clone().unwrap_or_else(|| c.subnet.id.clone());
        if !places.contains(&place) {
            places.push(place);
        }
        if !markets.contains(&c.market.as_str()) {
            markets.push(c.market.as_str());
        }
    }
    let mut codes: Vec<&str> = Vec::new();
    for (_, r) in refused {
        let code = r.split(':').next().unwrap_or(r);
        if !codes.contains(&code) {
            codes.push(code);
        }
    }
    with_fallback_hint(
        choices,
        format!(
            "no capacity for any of the {} choices ({} in {}, {}): {}",
            choices.len(),
            types.join(", "),
            places.join(", "),
            markets.join(" then "),
            codes.join("; ")
        ),
    )
}

/// Spot-only choices: say that on-demand was not tried, and which setting would.
fn with_fallback_hint(choices: &[Choice], reason: String) -> String {
    if choices.iter().all(|c| c.market == Market::Spot) {
        format!(
            "{reason} (spot only: ec2.on_demand_fallback = true would launch on-demand instead)"
        )
    } else {
        reason
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subnet(id: &str, zone: &str) -> Subnet {
        Subnet {
            id: id.into(),
            zone: Some(zone.into()),
        }
    }

    #[test]
    fn spot_first_then_types_then_subnets() {
        let types = vec!["t3.medium".to_string(), "t3a.medium".to_string()];
        let subnets = vec![subnet("subnet-a", "z-a"), subnet("subnet-b", "z-b")];
        let order: Vec<String> = choices(&types, &subnets, Market::Spot, true)
            .iter()
            .map(|c| c.to_string())
            .collect();
        assert_eq!(
            order,
            [
                "t3.medium spot in subnet-a (z-a)",
                "t3.medium spot in subnet-b (z-b)",
                "t3a.medium spot in subnet-a (z-a)",
                "t3a.medium spot in subnet-b (z-b)",
                "t3.medium on-demand in subnet-a (z-a)",
                "t3.medium on-demand in subnet-b (z-b)",
                "t3a.medium on-demand in subnet-a (z-a)",
                "t3a.medium on-demand in subnet-b (z-b)",
            ]
        );
        // No fallback: spot only; on-demand: the fallback flag changes nothing.
        assert_eq!(choices(&types, &subnets, Market::Spot, false).len(), 4);
        assert!(choices(&types, &subnets, Market::OnDemand, true)
            .iter()
            .all(|c| c.market == Market::OnDemand));
    }

    #[test]
    fn the_summary_keeps_ec2s_words_for_one_choice_and_names_the_fallback() {
        let one = choices(
            &["t3.medium".into()],
            &[subnet("s", "z")],
            Market::OnDemand,
            false,
        );
        let reason = "EC2 InsufficientInstanceCapacity: none left".to_string();
        assert_eq!(summary(&one, &[(0, reason.clone())]), reason);
        let spot = choices(
            &["t3.medium".into(), "m5.large".into()],
            &[subnet("s", "z")],
            Market::Spot,
            false,
        );
        let text = summary(&spot, &[(0, reason.clone()), (1, reason)]);
        assert_eq!(
            text,
            "no capacity for any of the 2 choices (t3.medium, m5.large in z, spot): \
             EC2 InsufficientInstanceCapacity (spot only: ec2.on_demand_fallback = true would launch \
             on-demand instead)"
        );
    }
}
