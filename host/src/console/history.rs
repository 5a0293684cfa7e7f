//! The last hour of each source, for the console's charts: every
//! [`EVERY`] a sample of what the relay already counts in memory (its
//! health: backlog, oldest pending event, events published, commit → ack
//! time) goes into a ring of [`KEPT`] samples per source. Sampling costs
//! no statement and runs only while the console is on.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::health::Readiness;

/// How often a sample is taken.
pub const EVERY: Duration = Duration::from_secs(5);
/// Samples kept per source: one hour.
const KEPT: usize = 720;

/// One source at one moment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub at: DateTime<Utc>,
    pub backlog: i64,
    /// Age of the oldest pending event, seconds (`None`: nothing pending).
    pub oldest: Option<f64>,
    /// Events published per second since the previous sample.
    pub rate: f64,
    /// Mean commit → ack time of those events, milliseconds.
    pub latency_ms: Option<f64>,
}

/// Per source: its samples, oldest first, and the totals the last one
/// was computed from.
#[derive(Default)]
pub struct History(Mutex<BTreeMap<String, Ring>>);

#[derive(Default)]
struct Ring {
    samples: VecDeque<Sample>,
    last: Option<(DateTime<Utc>, (u64, u64, u64))>,
    /// Per route: its published total at each of the last minute's samples.
    routes: BTreeMap<String, VecDeque<(DateTime<Utc>, u64)>>,
}

/// Samples a route's rate is taken over: one minute.
const ROUTE_WINDOW: usize = 13;

impl History {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Ring>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Take one sample of every source `ready` lists; forget sources it
    /// no longer lists.
    pub fn sample(&self, ready: &Readiness) {
        let view = ready.get();
        let now = Utc::now();
        let mut all = self.lock();
        all.retain(|name, _| view.sources.iter().any(|(n, _)| n == name));
        for (name, health) in &view.sources {
            let ring = all.entry(name.clone()).or_default();
            let totals = health.published_totals();
            let (backlog, oldest) = health.backlog();
            let (rate, latency_ms) = match ring.last {
                Some((then, (n0, sum0, k0))) => {
                    let secs = (now - then).num_milliseconds().max(1) as f64 / 1000.0;
                    let n = totals.0.saturating_sub(n0);
                    let k = totals.2.saturating_sub(k0);
                    let sum = totals.1.saturating_sub(sum0);
                    (
                        n as f64 / secs,
                        (k > 0).then(|| sum as f64 / k as f64 / 1000.0),
                    )
                }
                None => (0.0, None),
            };
            ring.last = Some((now, totals));
            for (route, total) in health.route_totals() {
                let r = ring.routes.entry(route).or_default();
                r.push_back((now, total));
                while r.len() > ROUTE_WINDOW {
                    r.pop_front();
                }
            }
            ring.samples.push_back(Sample {
                at: now,
                backlog,
                oldest,
                rate,
                latency_ms,
            });
            while ring.samples.len() > KEPT {
                ring.samples.pop_front();
            }
        }
    }

    /// Source `name`'s samples, oldest first.
    pub fn of(&self, name: &str) -> Vec<Sample> {
        self.lock()
            .get(name)
            .map(|r| r.samples.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Route `route`'s events/s over the last minute on source `source`
    /// (`None`: not sampled twice yet).
    pub fn route_rate(&self, source: &str, route: &str) -> Option<f64> {
        let all = self.lock();
        let r = all.get(source)?.routes.get(route)?;
        let ((t0, n0), (t1, n1)) = (r.front()?, r.back()?);
        let secs = (*t1 - *t0).num_milliseconds() as f64 / 1000.0;
        (secs > 0.0).then(|| n1.saturating_sub(*n0) as f64 / secs)
    }

    /// Sample every [`EVERY`] until `stop`.
    pub async fn keep(
        self: Arc<Self>,
        ready: Readiness,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => self.sample(&ready),
            }
        }
    }
}
