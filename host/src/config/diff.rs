//! What a new config changes compared with the running one. `outroute
//! config diff OLD NEW` prints it; a reload (SIGHUP) applies exactly it:
//! sources, sinks, plugins and routes that were added, removed or changed,
//! and which sources that touches. `[relay]`, `[http]` and `[log]` are the
//! process's own settings: changing them needs a restart, and a reload that
//! changes them is refused as a whole.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;

use super::{Config, RouteConfig};

/// Added, removed and changed names of one kind.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
}

impl Changes {
    fn between<T: PartialEq>(old: &BTreeMap<String, T>, new: &BTreeMap<String, T>) -> Self {
        let mut c = Changes::default();
        for (k, v) in new {
            match old.get(k) {
                None => c.added.push(k.clone()),
                Some(o) if o != v => c.changed.push(k.clone()),
                Some(_) => {}
            }
        }
        c.removed = old
            .keys()
            .filter(|k| !new.contains_key(*k))
            .cloned()
            .collect();
        c
    }

    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }

    /// Was `name` added, removed or changed?
    pub fn touches(&self, name: &str) -> bool {
        [&self.added, &self.removed, &self.changed]
            .iter()
            .any(|l| l.iter().any(|n| n == name))
    }
}

/// Everything a new config changes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Diff {
    pub sources: Changes,
    pub sinks: Changes,
    pub plugins: Changes,
    pub routes: Changes,
    /// Keys of `[relay]`, `[http]` and `[log]` that changed: a restart
    /// applies them, a reload refuses them.
    pub restart: Vec<String>,
    /// Sources whose relay is rebuilt: their store, or a route reading them
    /// (or its plugin or sinks), changed; or they were added. Removed
    /// sources are in `sources.removed`.
    pub affected_sources: Vec<String>,
}

fn routes_by_name(c: &Config) -> BTreeMap<String, RouteConfig> {
    c.routes
        .iter()
        .map(|r| (r.name.clone(), r.clone()))
        .collect()
}

/// Top-level keys of a settings table that differ (`table.key`).
fn changed_keys<T: Serialize + PartialEq>(table: &str, old: &T, new: &T, out: &mut Vec<String>) {
    if old == new {
        return;
    }
    let (Ok(serde_json::Value::Object(o)), Ok(serde_json::Value::Object(n))) =
        (serde_json::to_value(old), serde_json::to_value(new))
    else {
        out.push(table.to_string());
        return;
    };
    let keys: BTreeSet<&String> = o.keys().chain(n.keys()).collect();
    let before = out.len();
    for k in keys {
        if o.get(k) != n.get(k) {
            out.push(format!("{table}.{k}"));
        }
    }
    if out.len() == before {
        out.push(table.to_string());
    }
}

pub fn diff(old: &Config, new: &Config) -> Diff {
    let mut d = Diff {
        sources: Changes::between(&old.sources, &new.sources),
        sinks: Changes::between(&old.sinks, &new.sinks),
        plugins: Changes::between(&old.plugins, &new.plugins),
        routes: Changes::between(&routes_by_name(old), &routes_by_name(new)),
        ..Diff::default()
    };
    changed_keys("relay", &old.relay, &new.relay, &mut d.restart);
    changed_keys("http", &old.http, &new.http, &mut d.restart);
    changed_keys("log", &old.log, &new.log, &mut d.restart);
    // A source's routes, in order (the first that selects an event wins).
    let reading = |c: &Config, source: &str| {
        c.routes
            .iter()
            .filter(|r| Config::route_reads(r, source))
            .map(|r| r.name.clone())
            .collect::<Vec<_>>()
    };
    for source in new.sources.keys() {
        let touched = d.sources.touches(source)
            || reading(old, source) != reading(new, source)
            || new
                .routes
                .iter()
                .filter(|r| Config::route_reads(r, source))
                .any(|r| {
                    d.routes.touches(&r.name)
                        || d.plugins.touches(&r.plugin)
                        || r.allow.keys().any(|s| d.sinks.touches(s))
                });
        if touched {
            d.affected_sources.push(source.clone());
        }
    }
    d
}

impl Diff {
    /// Nothing to apply.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
            && self.sinks.is_empty()
            && self.plugins.is_empty()
            && self.routes.is_empty()
            && self.restart.is_empty()
    }
}

impl fmt::Display for Diff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return writeln!(f, "no changes");
        }
        for (kind, c) in [
            ("source", &self.sources),
            ("sink", &self.sinks),
            ("plugin", &self.plugins),
            ("route", &self.routes),
        ] {
            for n in &c.added {
                writeln!(f, "+ {kind} {n}")?;
            }
            for n in &c.removed {
                writeln!(f, "- {kind} {n}")?;
            }
            for n in &c.changed {
                writeln!(f, "~ {kind} {n}")?;
            }
        }
        if !self.affected_sources.is_empty() {
            writeln!(
                f,
                "sources whose relay is rebuilt (in-flight batches finish first, lanes are kept): {}",
                self.affected_sources.join(", ")
            )?;
        }
        if !self.restart.is_empty() {
            writeln!(
                f,
                "needs a restart (a reload refuses it): {}",
                self.restart.join(", ")
            )?;
        }
        Ok(())
    }
}
