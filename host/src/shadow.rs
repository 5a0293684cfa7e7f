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
//! [`differences`] is also what `outroute plugin try` prints; [`promote`]
//! is what `plugin promote` and the console's promote do.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{Context, Result, anyhow, bail};
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
    /// What the active plugin and the candidate answered (payloads cut
    /// at [`KEPT_PAYLOAD`] bytes): the console shows them side by side.
    #[serde(skip)]
    pub sides: Option<(Outcome, Outcome)>,
}

/// Payload bytes kept per message of a sample.
pub const KEPT_PAYLOAD: usize = 4096;

/// `o` with every payload cut at [`KEPT_PAYLOAD`] bytes.
pub fn trimmed(o: &Outcome) -> Outcome {
    o.clone().map(|messages| {
        messages
            .into_iter()
            .map(|mut m| {
                m.payload.truncate(KEPT_PAYLOAD);
                m
            })
            .collect()
    })
}

/// One compared event: its id, what differed (empty: nothing) and, when
/// something did, both answers.
pub type Compared = (String, Vec<String>, Option<(Outcome, Outcome)>);

static SHADOWS: Mutex<BTreeMap<(String, String), RouteShadow>> = Mutex::new(BTreeMap::new());

/// Record one compared batch of route `route` of source `source`: the event
/// ids with what differed for each (empty: the same answer).
pub fn record(source: &str, route: &str, candidate: &str, compared: Vec<Compared>) {
    let differing = compared.iter().filter(|(_, d, _)| !d.is_empty()).count() as u64;
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
    for (event_id, differences, sides) in compared {
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
            sides,
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

/// In the file of `files` that declares `[plugins.<plugin>]`, make its
/// `shadow` the `path` and drop `shadow`; with a `shadow_config`, it becomes
/// the `config` of every route using the plugin. Returns the plugin's file.
/// Each file is replaced whole (written aside, then renamed), so a relay
/// watching it never reads half of it.
pub fn promote(
    files: &[PathBuf],
    plugin: &str,
    shadow_config: Option<&serde_json::Value>,
) -> Result<PathBuf> {
    let config = shadow_config
        .map(|c| toml_value(c).with_context(|| format!("plugins.{plugin}.shadow_config")))
        .transpose()?;
    let mut declared = None;
    for file in files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let mut doc: toml_edit::DocumentMut = text
            .parse()
            .with_context(|| format!("{} is not valid TOML", file.display()))?;
        let mut changed = false;
        if let Some(table) = doc
            .get_mut("plugins")
            .and_then(|p| p.get_mut(plugin))
            .and_then(|t| t.as_table_like_mut())
        {
            let shadow = table
                .remove("shadow")
                .ok_or_else(|| anyhow!("{}: plugins.{plugin} has no `shadow`", file.display()))?;
            table.insert("path", shadow);
            table.remove("shadow_config");
            declared = Some(file.clone());
            changed = true;
        }
        if let Some(config) = &config
            && let Some(routes) = doc
                .get_mut("routes")
                .and_then(|r| r.as_array_of_tables_mut())
        {
            for route in routes.iter_mut() {
                if route.get("plugin").and_then(|p| p.as_str()) == Some(plugin) {
                    route.insert("config", toml_edit::value(config.clone()));
                    changed = true;
                }
            }
        }
        if changed {
            let tmp = file.with_extension("toml.promote");
            std::fs::write(&tmp, doc.to_string())
                .with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, file).with_context(|| format!("replacing {}", file.display()))?;
        }
    }
    declared.ok_or_else(|| anyhow!("no config file declares [plugins.{plugin}]"))
}

/// A JSON value as a TOML value (objects as inline tables); `null` has none.
fn toml_value(v: &serde_json::Value) -> Result<toml_edit::Value> {
    use serde_json::Value as J;
    Ok(match v {
        J::Null => bail!("null has no TOML form"),
        J::Bool(b) => (*b).into(),
        J::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => i.into(),
            (None, Some(f)) => f.into(),
            _ => bail!("number {n} has no TOML form"),
        },
        J::String(s) => s.as_str().into(),
        J::Array(items) => {
            let mut a = toml_edit::Array::new();
            for i in items {
                a.push(toml_value(i)?);
            }
            a.into()
        }
        J::Object(fields) => {
            let mut t = toml_edit::InlineTable::new();
            for (k, v) in fields {
                t.insert(k, toml_value(v)?);
            }
            t.into()
        }
    })
}
