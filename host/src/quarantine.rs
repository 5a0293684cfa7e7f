//! Route quarantine: one team's broken plugin must not cost other routes.
//!
//! Every event a route's plugin handles either keeps within the route's
//! limits or breaks one (CPU budget, memory, log lines, messages or bytes
//! per event). After `routes[].quarantine_after` breaches in a row the route
//! is **quarantined**: its plugin is no longer called, its events are
//! deferred (recorded as waiting, no attempt counted, their aggregates held)
//! and the other routes flow as before. Every
//! `routes[].quarantine_probe_interval` one event is let through as a
//! probe; if it keeps within the limits the route resumes. An operator can
//! resume it at once with `outroute route resume NAME`.
//!
//! The decision is shared by every relay of the outbox through the store
//! (`outroute_route_counts.quarantined_since`): the relay that quarantines a
//! route records it, every relay follows the record, `outroute status`
//! shows it, and a resume (probe or operator) clears it for all.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use crate::routing::Routes;

/// What a batch may do with a route's events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Route them all.
    All,
    /// Quarantined, probe due: route the first one; defer the rest.
    Probe { reason: String, delay: Duration },
    /// Quarantined: defer them all for `delay`.
    Defer { reason: String, delay: Duration },
}

/// What a batch's answers changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    None,
    /// The route just broke its limits `quarantine_after` times in a row.
    Quarantined {
        reason: String,
    },
    /// A probe kept within the limits.
    Resumed,
}

#[derive(Debug, Default)]
struct RouteState {
    strikes: u32,
    quarantined: Option<Quarantined>,
}

#[derive(Debug, Clone)]
struct Quarantined {
    reason: String,
    since: DateTime<Utc>,
    next_probe: Instant,
    /// The store has the record (a resume elsewhere clears it from there).
    recorded: bool,
}

/// The quarantine state of every route of a relay (same index as `Routes`).
pub struct Quarantine {
    names: Vec<String>,
    after: Vec<u32>,
    probe_every: Vec<Duration>,
    state: Vec<Mutex<RouteState>>,
}

impl Quarantine {
    pub fn new(routes: &Routes) -> Self {
        Quarantine {
            names: routes.0.iter().map(|r| r.name().to_string()).collect(),
            after: routes.0.iter().map(|r| r.config.quarantine_after).collect(),
            probe_every: routes
                .0
                .iter()
                .map(|r| r.config.quarantine_probe_interval)
                .collect(),
            state: routes
                .0
                .iter()
                .map(|_| Mutex::new(RouteState::default()))
                .collect(),
        }
    }

    /// What this batch may do with route `route`'s events.
    pub fn admit(&self, route: usize) -> Admission {
        let Some(Ok(mut st)) = self.state.get(route).map(|m| m.lock()) else {
            return Admission::All;
        };
        let every = self.probe_every[route];
        let Some(q) = st.quarantined.as_mut() else {
            return Admission::All;
        };
        let now = Instant::now();
        let reason = format!(
            "route `{}` is quarantined since {}: {}",
            self.names[route],
            q.since.format("%Y-%m-%d %H:%M:%S UTC"),
            q.reason
        );
        if now >= q.next_probe {
            q.next_probe = now + every;
            Admission::Probe {
                reason,
                delay: every,
            }
        } else {
            Admission::Defer {
                reason,
                delay: (q.next_probe - now).max(Duration::from_secs(1)),
            }
        }
    }

    /// Count a batch's answers for `route`, in order: `Some(reason)` for an
    /// event that broke a limit, `None` for one that kept within them.
    pub fn record(&self, route: usize, answers: &[Option<String>]) -> Change {
        let Some(Ok(mut st)) = self.state.get(route).map(|m| m.lock()) else {
            return Change::None;
        };
        let after = self.after[route];
        let mut change = Change::None;
        for a in answers {
            match a {
                None => {
                    st.strikes = 0;
                    if st.quarantined.take().is_some() {
                        change = Change::Resumed;
                    }
                }
                Some(reason) => {
                    st.strikes = st.strikes.saturating_add(1);
                    if after > 0 && st.strikes >= after && st.quarantined.is_none() {
                        let reason = format!(
                            "{} events in a row broke a limit; last: {reason}",
                            st.strikes
                        );
                        st.quarantined = Some(Quarantined {
                            reason: reason.clone(),
                            since: Utc::now(),
                            next_probe: Instant::now() + self.probe_every[route],
                            recorded: false,
                        });
                        change = Change::Quarantined { reason };
                    }
                }
            }
        }
        change
    }

    /// The store now has this relay's record of `route`'s quarantine.
    pub fn recorded(&self, route: usize) {
        if let Some(Ok(mut st)) = self.state.get(route).map(|m| m.lock())
            && let Some(q) = st.quarantined.as_mut()
        {
            q.recorded = true;
        }
    }

    /// Follow the store's records (route name → reason, since): adopt
    /// quarantines decided by other relays, drop those resumed elsewhere.
    /// Returns the routes that changed, with their new state.
    pub fn follow(
        &self,
        records: &BTreeMap<String, (String, DateTime<Utc>)>,
    ) -> Vec<(String, bool)> {
        let mut changed = Vec::new();
        for (i, name) in self.names.iter().enumerate() {
            let Ok(mut st) = self.state[i].lock() else {
                continue;
            };
            match (records.get(name), st.quarantined.as_mut()) {
                (Some((reason, since)), None) => {
                    st.quarantined = Some(Quarantined {
                        reason: reason.clone(),
                        since: *since,
                        next_probe: Instant::now() + self.probe_every[i],
                        recorded: true,
                    });
                    changed.push((name.clone(), true));
                }
                (Some(_), Some(q)) => q.recorded = true,
                (None, Some(q)) if q.recorded => {
                    st.quarantined = None;
                    st.strikes = 0;
                    changed.push((name.clone(), false));
                }
                _ => {}
            }
        }
        changed
    }

    /// Is route `route` quarantined (as this relay knows it)?
    pub fn is_quarantined(&self, route: usize) -> bool {
        self.state
            .get(route)
            .and_then(|s| s.lock().ok().map(|st| st.quarantined.is_some()))
            .unwrap_or(false)
    }

    /// Quarantined routes and why (for `/readyz` and logs).
    pub fn quarantined(&self) -> Vec<(String, String)> {
        self.names
            .iter()
            .zip(&self.state)
            .filter_map(|(n, s)| {
                let st = s.lock().ok()?;
                st.quarantined
                    .as_ref()
                    .map(|q| (n.clone(), q.reason.clone()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn quarantine(after: u32) -> Quarantine {
        let text = format!(
            r#"
            [store]
            url = "postgres://x/y"
            [sinks.file]
            kind = "kafka"
            brokers = "b:9092"
            [plugins.p]
            path = "p.wasm"
            [[routes]]
            name = "bad"
            plugin = "p"
            quarantine_after = {after}
            quarantine_probe_interval = "50ms"
            allow = {{ file = ["*"] }}
            [[routes]]
            name = "good"
            plugin = "p"
            allow = {{ file = ["*"] }}
            "#
        );
        let config: Config = toml::from_str(&text).unwrap();
        Quarantine::new(&Routes::compile(&config).unwrap())
    }

    #[test]
    fn breaches_in_a_row_quarantine_and_a_good_probe_resumes() {
        let q = quarantine(3);
        let bad = Some("exceeded its CPU budget".to_string());
        // Two breaches, then a good event: the count starts again.
        assert_eq!(q.record(0, &[bad.clone(), bad.clone(), None]), Change::None);
        assert_eq!(q.record(0, &[bad.clone(), bad.clone()]), Change::None);
        assert!(matches!(
            q.record(0, std::slice::from_ref(&bad)),
            Change::Quarantined { reason } if reason.contains("3 events in a row") && reason.contains("CPU budget")
        ));
        // Other routes are not affected.
        assert_eq!(q.admit(1), Admission::All);
        assert!(
            matches!(q.admit(0), Admission::Defer { reason, .. } if reason.contains("route `bad` is quarantined"))
        );
        std::thread::sleep(Duration::from_millis(60));
        assert!(matches!(q.admit(0), Admission::Probe { .. }));
        // Only one probe per interval.
        assert!(matches!(q.admit(0), Admission::Defer { .. }));
        // A failed probe keeps it quarantined; a good one resumes.
        assert_eq!(q.record(0, std::slice::from_ref(&bad)), Change::None);
        assert_eq!(q.quarantined().len(), 1);
        assert_eq!(q.record(0, &[None]), Change::Resumed);
        assert_eq!(q.admit(0), Admission::All);
    }

    #[test]
    fn zero_never_quarantines() {
        let q = quarantine(0);
        let bad = Some("x".to_string());
        assert_eq!(q.record(0, &vec![bad; 100]), Change::None);
        assert_eq!(q.admit(0), Admission::All);
    }

    #[test]
    fn relays_follow_the_store_record() {
        let q = quarantine(2);
        let mut records = BTreeMap::new();
        records.insert("bad".to_string(), ("set elsewhere".to_string(), Utc::now()));
        assert_eq!(q.follow(&records), vec![("bad".to_string(), true)]);
        assert!(matches!(q.admit(0), Admission::Defer { .. }));
        // An unrecorded local quarantine survives a read that predates it...
        let q2 = quarantine(1);
        assert!(matches!(
            q2.record(0, &[Some("x".into())]),
            Change::Quarantined { .. }
        ));
        assert!(q2.follow(&BTreeMap::new()).is_empty());
        // ...a recorded one that vanished was resumed elsewhere.
        q2.recorded(0);
        assert_eq!(
            q2.follow(&BTreeMap::new()),
            vec![("bad".to_string(), false)]
        );
        assert_eq!(q2.admit(0), Admission::All);
    }
}
