//! Trying a candidate plugin on a route's recent real events, publishing
//! nothing: the newest published events the route selects are read from
//! the store, run through the route's active plugin and the candidate, and
//! each outcome is checked as the relay would (a message the route may not
//! send is the event's rejection). `outroute plugin try` prints the result;
//! the console shows it side by side.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::event::{Event, Outcome};
use crate::plugin::{Limits, PluginHandle, Runtime};
use crate::routing::Route;
use crate::store::{Cursor, Filter, Store};

/// The events tried and what each plugin made of them (same order).
pub struct Trial {
    pub events: Vec<Event>,
    pub was: Vec<Outcome>,
    pub would: Vec<Outcome>,
}

impl Trial {
    /// Per event that differs: its index and the differences in words.
    pub fn differing(&self) -> Vec<(usize, Vec<String>)> {
        self.was
            .iter()
            .zip(&self.would)
            .enumerate()
            .filter_map(|(i, (a, b))| {
                let d = crate::shadow::differences(a, b);
                (!d.is_empty()).then_some((i, d))
            })
            .collect()
    }
}

/// Up to `last` of the newest published events of `store` that `route`
/// selects, oldest first (at most 100 × `last` rows are read for them).
pub async fn recent_events(store: &Store, route: &Route, last: usize) -> Result<Vec<Event>> {
    let mut mine = Vec::new();
    let mut before: Option<Cursor> = None;
    let mut scanned = 0usize;
    while mine.len() < last && scanned < last.saturating_mul(100).max(1000) {
        let page = store
            .published_newest(&Filter::default(), before.as_ref(), 500)
            .await?;
        let Some(l) = page.last() else { break };
        before = Some(Cursor::after(l));
        scanned += page.len();
        for c in page {
            if let Ok(e) = c.row
                && route.selects(&e.aggregate_type, &e.event_type)
                && mine.len() < last
            {
                mine.push(e);
            }
        }
    }
    mine.reverse();
    Ok(mine)
}

/// Run `events` through the route's active plugin (`active`, with the
/// route's config) and the candidate (`candidate`, with
/// `candidate_config`), each under the route's limits.
pub async fn run(
    rt: Runtime,
    route: &Route,
    active: PathBuf,
    candidate: PathBuf,
    candidate_config: serde_json::Value,
    events: Vec<Event>,
) -> Result<Trial> {
    let limits = Limits::of(&route.config);
    let active_config = route.config.config.clone();
    let (events, was, would) = tokio::task::spawn_blocking(move || -> Result<_> {
        let go = |path: &Path, config: serde_json::Value, what: &str| -> Result<Vec<Outcome>> {
            let handle = PluginHandle::load(&rt, path, config, limits)
                .with_context(|| format!("{what} plugin {}", path.display()))?;
            let p = handle.current().context("plugin unavailable")?;
            Ok(p.route_batch(&events)
                .into_iter()
                .map(|a| a.into_outcome())
                .collect())
        };
        let was = go(&active, active_config, "active")?;
        let would = go(&candidate, candidate_config, "candidate")?;
        Ok((events, was, would))
    })
    .await??;
    let checked = |outcomes: Vec<Outcome>| -> Vec<Outcome> {
        outcomes
            .into_iter()
            .map(|o| crate::relay::checked(route, o))
            .collect()
    };
    Ok(Trial {
        events,
        was: checked(was),
        would: checked(would),
    })
}
