//! Shadow rollout: a candidate version of a route's plugin
//! (`[plugins.X] shadow = "v2.wasm"`) answers the same live events as the
//! active version. Its answers are compared with the active ones and never
//! published. Every compared event counts in
//! `outroute_shadow_events_total{route}`, every differing one in
//! `outroute_shadow_differences_total{route}`; the latest differing events
//! of each route are kept in memory and served at `/shadow` (JSON), which
//! `outroute plugin shadow-report` prints. `outroute plugin promote X` then
//! makes the candidate the active version (a config change the running
//! relay applies without a restart).
//!
//! [`differences`] is also what `outroute plugin try` prints.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::event::Outcome;

/// Differing events kept per route.
pub const SAMPLES: usize = 20;

/// What the shadow of one route has seen in this process.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RouteShadow {
    pub source: String,
    pub route: String,
    /// The candidate plugin file.
    pub candidate: String,
    pub compared: u64,
    pub differing: u64,
    /// The latest differing events, newest last.
    pub samples: VecDeque<Sample>,
}

/// One event the candidate would have handled differently.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub event_id: String,
    pub at: DateTime<Utc>,
    pub differences: Vec<String>,
}

static SHADOWS: Mutex<BTreeMap<(String, String), RouteShadow>> = Mutex::new(BTreeMap::new());

/// Record one compared batch of route `route` of source `source`: the event
/// ids with what differed for each (empty: the same answer).
pub fn record(source: &str, route: &str, candidate: &str, compared: Vec<(String, Vec<String>)>) {
    let differing = compared.iter().filter(|(_, d)| !d.is_empty()).count() as u64;
    metrics::counter!(crate::metrics::SHADOW_EVENTS, "route" => route.to_string())
        .increment(compared.len() as u64);
    metrics::counter!(crate::metrics::SHADOW_DIFFERENCES, "route" => route.to_string())
        .increment(differing);
    let mut all = match SHADOWS.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    };
    let entry = all
        .entry((source.to_string(), route.to_string()))
        .or_insert_with(|| RouteShadow {
            source: source.to_string(),
            route: route.to_string(),
            ..RouteShadow::default()
        });
    entry.candidate = candidate.to_string();
    entry.compared += compared.len() as u64;
    entry.differing += differing;
    let now = Utc::now();
    for (event_id, differences) in compared {
        if differences.is_empty() {
            continue;
        }
        tracing::debug!(route, %event_id, ?differences, "shadow plugin answered differently");
        if entry.samples.len() == SAMPLES {
            entry.samples.pop_front();
        }
        entry.samples.push_back(Sample {
            event_id,
            at: now,
            differences,
        });
    }
}

/// Every route's shadow so far (the `/shadow` endpoint).
pub fn report() -> Vec<RouteShadow> {
    match SHADOWS.lock() {
        Ok(g) => g.values().cloned().collect(),
        Err(poisoned) => poisoned.into_inner().values().cloned().collect(),
    }
}

/// What the candidate's outcome changes, in words (empty: the same).
pub fn differences(was: &Outcome, would: &Outcome) -> Vec<String> {
    let show = |b: &[u8]| {
        let t = String::from_utf8_lossy(b);
        if t.len() > 80 {
            format!("{}…", &t[..t.floor_char_boundary(80)])
        } else {
            t.into_owned()
        }
    };
    match (was, would) {
        (Err(a), Err(b)) if a == b => Vec::new(),
        (Err(a), Err(b)) => vec![format!(
            "refused differently: {} → {}",
            a.reason(),
            b.reason()
        )],
        (Ok(_), Err(b)) => vec![format!("now refused: {}", b.reason())],
        (Err(a), Ok(_)) => vec![format!("no longer refused (was: {})", a.reason())],
        (Ok(a), Ok(b)) if a.len() != b.len() => {
            vec![format!("{} messages → {}", a.len(), b.len())]
        }
        (Ok(a), Ok(b)) => {
            let mut out = Vec::new();
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                let at = if a.len() > 1 {
                    format!("message {i}: ")
                } else {
                    String::new()
                };
                if (&x.sink, &x.topic) != (&y.sink, &y.topic) {
                    out.push(format!(
                        "{at}{}/{} → {}/{}",
                        x.sink, x.topic, y.sink, y.topic
                    ));
                }
                if x.key != y.key {
                    let k =
                        |k: &Option<Vec<u8>>| k.as_deref().map(show).unwrap_or_else(|| "-".into());
                    out.push(format!("{at}key {} → {}", k(&x.key), k(&y.key)));
                }
                if x.partition != y.partition {
                    out.push(format!(
                        "{at}partition {:?} → {:?}",
                        x.partition, y.partition
                    ));
                }
                if x.headers != y.headers {
                    out.push(format!("{at}headers {:?} → {:?}", x.headers, y.headers));
                }
                if x.payload != y.payload {
                    out.push(format!(
                        "{at}payload {} → {}",
                        show(&x.payload),
                        show(&y.payload)
                    ));
                }
            }
            out
        }
    }
}
