//! Grants (`[grants.<team>]` in the main file): what one team's routes may
//! read (sources, aggregate and event types), publish to (`allow`), own
//! (`owns`, for exclusive routes) and spend (`ceilings`, within the relay's
//! `route_ceilings`), and the checks of a team's routes against them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Config, RouteConfig};

/// What one team's routes may do (`[grants.<team>]` in the main file).
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// Sources the team's routes may read.
    #[serde(default)]
    pub sources: Vec<String>,
    /// Per sink, the topic/subject patterns the team's routes may allow
    /// (a route's pattern must lie within one of them).
    #[serde(default)]
    pub allow: BTreeMap<String, Vec<String>>,
    /// The events the team's routes may read, by aggregate type (name
    /// patterns, `*` any run of characters). Unset: every event of the
    /// granted sources. A team route that leaves `aggregate_types` at its
    /// default (`["*"]`) selects exactly these; one that names its own must
    /// stay within them.
    #[serde(default)]
    pub aggregate_types: Option<Vec<String>>,
    /// The same, by event type.
    #[serde(default)]
    pub event_types: Option<Vec<String>>,
    /// The aggregate types the team owns (name patterns): its routes may be
    /// `exclusive` over them, so that no other team's route gets a copy.
    /// An aggregate type has one owner: two grants' patterns may not be
    /// the same or one within the other.
    #[serde(default)]
    pub owns: Vec<String>,
    /// Directories besides the team file's own that the team's plugin and
    /// shadow files may be in (relative to the main file), e.g. a shared
    /// directory of reviewed builds. A team plugin path that leads anywhere
    /// else, after `..` and symlinks are resolved, is refused.
    #[serde(default)]
    #[schemars(with = "Vec<String>")]
    pub plugin_dirs: Vec<PathBuf>,
    /// The most the team's routes may set for each limit (unset: the
    /// relay's `route_ceilings`; never above them).
    #[serde(default)]
    pub ceilings: Ceilings,
}

/// An aggregate/event type pattern in [`within`]'s terms: there `*` stops
/// at `.`, in a name pattern it does not.
pub(super) fn name_pattern(p: &str) -> String {
    p.replace("**", "*").replace('*', "**")
}

/// The most a team's route may set for each of its limits, so that no
/// team can hold a shared source's batches (a minute of CPU per event) or
/// escape quarantine (`quarantine_after = 4000000000`). Set platform-wide in
/// `[relay.route_ceilings]` (unset fields: the built-in maxima below) and per
/// team in `[grants.<team>.ceilings]` (unset fields: the relay's), never
/// above the relay's. A team route above its ceiling is refused; routes of
/// the main file are the platform's own and are not bounded.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Ceilings {
    /// Highest `cpu_budget` (built-in: 1s).
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "Option<String>")]
    pub cpu_budget: Option<std::time::Duration>,
    /// Highest `memory_mib` (built-in: 512).
    #[serde(default)]
    pub memory_mib: Option<u32>,
    /// Highest `max_idle_memory_mib` (built-in: 512).
    #[serde(default)]
    pub max_idle_memory_mib: Option<u32>,
    /// Highest `max_log_lines_per_event` (built-in: 1000).
    #[serde(default)]
    pub max_log_lines_per_event: Option<u32>,
    /// Highest `max_log_bytes_per_event` (built-in: 1 MiB).
    #[serde(default)]
    pub max_log_bytes_per_event: Option<u64>,
    /// Highest `quarantine_after`; a team route cannot set 0 (never
    /// quarantine) either (built-in: 100).
    #[serde(default)]
    pub quarantine_after: Option<u32>,
    /// Highest `max_messages_per_event` (built-in: 1000).
    #[serde(default)]
    pub max_messages_per_event: Option<u32>,
    /// Highest `max_bytes_per_event` (built-in: 64 MiB).
    #[serde(default)]
    pub max_bytes_per_event: Option<u64>,
}

impl Ceilings {
    /// Each limit: its name, the ceiling this sets (if any) and what a
    /// route sets, as comparable numbers (durations in nanoseconds; a
    /// route's `quarantine_after = 0`, never, as infinite).
    fn fields(&self) -> [(&'static str, Option<u128>); 8] {
        [
            ("cpu_budget", self.cpu_budget.map(|d| d.as_nanos())),
            ("memory_mib", self.memory_mib.map(u128::from)),
            (
                "max_idle_memory_mib",
                self.max_idle_memory_mib.map(u128::from),
            ),
            (
                "max_log_lines_per_event",
                self.max_log_lines_per_event.map(u128::from),
            ),
            (
                "max_log_bytes_per_event",
                self.max_log_bytes_per_event.map(u128::from),
            ),
            ("quarantine_after", self.quarantine_after.map(u128::from)),
            (
                "max_messages_per_event",
                self.max_messages_per_event.map(u128::from),
            ),
            (
                "max_bytes_per_event",
                self.max_bytes_per_event.map(u128::from),
            ),
        ]
    }

    /// The built-in maxima.
    fn builtin() -> [u128; 8] {
        [
            std::time::Duration::from_secs(1).as_nanos(),
            512,
            512,
            1000,
            1 << 20,
            100,
            1000,
            64 << 20,
        ]
    }
}

pub(super) fn route_limits(r: &RouteConfig) -> [u128; 8] {
    [
        r.cpu_budget.as_nanos(),
        u128::from(r.memory_mib),
        u128::from(r.max_idle_memory_mib),
        u128::from(r.max_log_lines_per_event),
        u128::from(r.max_log_bytes_per_event),
        match r.quarantine_after {
            0 => u128::MAX,
            n => u128::from(n),
        },
        u128::from(r.max_messages_per_event),
        u128::from(r.max_bytes_per_event),
    ]
}

/// A limit as the config writes it (durations in humantime).
pub(super) fn shown(name: &str, v: u128) -> String {
    match name {
        "cpu_budget" => format!(
            "\"{}\"",
            humantime::format_duration(std::time::Duration::from_nanos(
                u64::try_from(v).unwrap_or(u64::MAX)
            ))
        ),
        "quarantine_after" if v == u128::MAX => "0 (never)".into(),
        _ => v.to_string(),
    }
}

/// What the relay allows at most, per limit: `[relay.route_ceilings]`, then
/// the built-in maxima.
pub(super) fn relay_ceilings(config: &Config) -> [u128; 8] {
    let mut out = Ceilings::builtin();
    for (slot, (_, set)) in out.iter_mut().zip(config.relay.route_ceilings.fields()) {
        if let Some(v) = set {
            *slot = v;
        }
    }
    out
}

/// Grant problems: a ceiling above the relay's.
pub(super) fn grant_ceiling_problems(
    config: &Config,
    team: &str,
    grant: &Grant,
) -> Vec<(String, String)> {
    let relay = relay_ceilings(config);
    grant
        .ceilings
        .fields()
        .iter()
        .zip(relay)
        .filter_map(|((name, set), max)| {
            let v = (*set)?;
            (v > max).then(|| {
                (
                    format!("grants.{team}.ceilings.{name}"),
                    format!(
                        "{} is above the relay's ceiling {} (relay.route_ceilings.{name})",
                        shown(name, v),
                        shown(name, max)
                    ),
                )
            })
        })
        .collect()
}

/// Grants whose `owns` overlap another's (an aggregate type has one
/// owner) or reach outside what the team may read: (key, reason).
pub(super) fn ownership_problems(grants: &BTreeMap<String, Grant>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let overlap = |a: &str, b: &str| {
        within(&name_pattern(a), &name_pattern(b)) || within(&name_pattern(b), &name_pattern(a))
    };
    for (i, (team, grant)) in grants.iter().enumerate() {
        let key = format!("grants.{team}.owns");
        for p in &grant.owns {
            if let Some(readable) = &grant.aggregate_types
                && !readable
                    .iter()
                    .any(|r| within(&name_pattern(p), &name_pattern(r)))
            {
                out.push((
                    key.clone(),
                    format!(
                        "`{p}` is outside what team `{team}` may read (grants.{team}.aggregate_types: {})",
                        readable.join(", ")
                    ),
                ));
            }
            for (other, theirs) in grants.iter().take(i) {
                if let Some(q) = theirs.owns.iter().find(|q| overlap(p, q)) {
                    out.push((
                        key.clone(),
                        format!(
                            "`{p}` overlaps `{q}`, owned by team `{other}`: an aggregate type has one owner"
                        ),
                    ));
                }
            }
        }
    }
    out
}

/// A team route's limits above its grant's ceilings: (field, reason).
pub(super) fn route_ceiling_problems(
    config: &Config,
    team: &str,
    grant: &Grant,
    r: &RouteConfig,
) -> Vec<(String, String)> {
    let mut ceilings = relay_ceilings(config);
    for (slot, (_, set)) in ceilings.iter_mut().zip(grant.ceilings.fields()) {
        if let Some(v) = set {
            *slot = (*slot).min(v);
        }
    }
    let names = grant.ceilings.fields().map(|(n, _)| n);
    route_limits(r)
        .iter()
        .zip(ceilings)
        .zip(names)
        .filter(|((v, max), _)| **v > *max)
        .map(|((v, max), name)| {
            (
                name.to_string(),
                format!(
                    "{} is above team `{team}`'s ceiling {} (grants.{team}.ceilings.{name}, within relay.route_ceilings)",
                    shown(name, *v),
                    shown(name, max)
                ),
            )
        })
        .collect()
}

/// Does route pattern `inner` only ever match what grant pattern `outer`
/// matches? (`*`: a run of characters without `.`; `**`: anything.)
pub fn within(inner: &str, outer: &str) -> bool {
    #[derive(Clone, Copy, PartialEq)]
    enum T {
        Lit(char),
        Star,
        DoubleStar,
    }
    fn tokens(p: &str) -> Vec<T> {
        let mut out = Vec::new();
        let mut it = p.chars().peekable();
        while let Some(c) = it.next() {
            if c == '*' {
                if it.peek() == Some(&'*') {
                    it.next();
                    out.push(T::DoubleStar);
                } else {
                    out.push(T::Star);
                }
            } else {
                out.push(T::Lit(c));
            }
        }
        out
    }
    fn m(outer: &[T], inner: &[T]) -> bool {
        match outer.first() {
            None => inner.is_empty(),
            Some(T::Lit(c)) => inner.first() == Some(&T::Lit(*c)) && m(&outer[1..], &inner[1..]),
            Some(T::Star) => {
                // Consume a run of inner tokens that never cross a `.`.
                for k in 0..=inner.len() {
                    if m(&outer[1..], &inner[k..]) {
                        return true;
                    }
                    match inner.get(k) {
                        Some(T::Lit('.')) | Some(T::DoubleStar) | None => return false,
                        _ => {}
                    }
                }
                false
            }
            Some(T::DoubleStar) => (0..=inner.len()).any(|k| m(&outer[1..], &inner[k..])),
        }
    }
    m(&tokens(outer), &tokens(inner))
}
