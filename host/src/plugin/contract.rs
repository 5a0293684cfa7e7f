//! The contract as the host sees it: the version it speaks ([`CONTRACT`])
//! and which plugin versions it runs, the bindings generated from
//! `wit/router.wit`, and the conversions between the host's events and
//! outcomes and the contract's records.

use super::*;

/// The contract this relay speaks: the `package` line of `wit/router.wit`
/// (a unit test keeps them equal).
pub const CONTRACT: &str = "outroute:router@0.1.1";

/// The contract version a component was built against, read from its
/// `outroute:router/…@x.y.z` imports (`None` if it imports none).
pub fn contract_of(imports: &[String]) -> Option<String> {
    imports.iter().find_map(|i| {
        let (iface, version) = i.strip_prefix("outroute:router/")?.split_once('@')?;
        (!iface.is_empty()).then(|| format!("outroute:router@{version}"))
    })
}

/// Whether a plugin built against `theirs` (`outroute:router@x.y.z`) runs
/// on this relay: same semver-compatible series (for 0.x, the same minor),
/// and not newer than [`CONTRACT`].
pub fn contract_supported(theirs: &str) -> bool {
    let parse = |c: &str| {
        c.strip_prefix("outroute:router@")
            .and_then(|v| semver::Version::parse(v).ok())
    };
    match (parse(theirs), parse(CONTRACT)) {
        (Some(t), Some(h)) => {
            let series = |v: &semver::Version| {
                if v.major == 0 {
                    (0, v.minor)
                } else {
                    (v.major, 0)
                }
            };
            t.pre.is_empty() && series(&t) == series(&h) && t <= h
        }
        _ => false,
    }
}

pub(super) mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "router",
        imports: {
            "outroute:router/host.log": trappable,
            "outroute:router/host.count": trappable,
        },
    });
}

/// A batch of events as a plugin receives them (WIT `event` records).
#[derive(Clone)]
pub struct PluginInputs(pub(super) Vec<wit::Event>);

impl PluginInputs {
    pub fn from_events<'e>(events: impl Iterator<Item = &'e Event>) -> Self {
        PluginInputs(events.map(to_wit).collect())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The event ids, in order.
    pub fn ids(&self) -> Vec<String> {
        self.0.iter().map(|e| e.id.clone()).collect()
    }
}

pub(super) fn to_wit(e: &Event) -> wit::Event {
    wit::Event {
        id: e.id.clone(),
        sequence: e.sequence,
        aggregate_type: e.aggregate_type.clone(),
        aggregate_id: e.aggregate_id.clone(),
        event_type: e.event_type.clone(),
        event_version: e.event_version,
        payload: e.payload.clone(),
        headers: e.headers.clone(),
        created_at_ms: e.created_at.timestamp_millis(),
        attempt: e.attempts.saturating_add(1),
    }
}

pub(super) fn from_wit(o: wit::Outcome) -> Outcome {
    match o {
        Ok(msgs) => Ok(msgs
            .into_iter()
            .map(|m| Message {
                sink: m.sink,
                topic: m.topic,
                key: m.key,
                partition: m.partition,
                headers: m.headers,
                payload: m.payload,
            })
            .collect()),
        Err(wit::Rejection::Retryable(r)) => Err(Rejection::Retryable(r)),
        Err(wit::Rejection::Invalid(r)) => Err(Rejection::Invalid(r)),
    }
}
