//! Health: which parts of a running relay are up — each source, sink and
//! route — since when, and why not. `/readyz`, the `outroute_*_up` gauges
//! and `outroute status` show what is kept here.
//!
//! A shared relay is never all-or-nothing. A source whose database is down,
//! a sink whose broker cannot be reached and a route whose plugin cannot be
//! loaded each wait on their own, retried in the background
//! (`topology.rs`), while every other part runs. So `/readyz` answers
//! ready while at least one source is *live* (its store is open, its
//! database answers and it is not stalled) and lists every part that is
//! not; `/readyz?strict` answers ready only when every part is.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, SecondsFormat, Utc};

use crate::metrics as m;
use crate::sink::Sinks;
use crate::store::Store;

/// Up or down, why, and since when. Every change of state sets its gauge.
pub struct Part {
    up: AtomicBool,
    state: Mutex<(String, DateTime<Utc>)>,
    gauge: Gauge,
}

/// What a [`Part`]'s gauge says: 1 while it is up (`outroute_source_up`),
/// or 1 while it is down and something waits for it
/// (`outroute_route_waiting`).
pub enum Gauge {
    Up(metrics::Gauge),
    Waiting(metrics::Gauge),
}

impl Gauge {
    fn show(&self, up: bool) {
        match self {
            Gauge::Up(g) => g.set(f64::from(u8::from(up))),
            Gauge::Waiting(g) => g.set(f64::from(u8::from(!up))),
        }
    }
}

impl Part {
    /// A part that starts down (not yet brought up), for `reason`.
    pub fn down(reason: impl Into<String>, gauge: Gauge) -> Self {
        gauge.show(false);
        Part {
            up: AtomicBool::new(false),
            state: Mutex::new((reason.into(), Utc::now())),
            gauge,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (String, DateTime<Utc>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Mark it up; `true` if it was down.
    pub fn set_up(&self) -> bool {
        if self.up.load(Ordering::Relaxed) {
            return false;
        }
        let mut s = self.lock();
        if self.up.swap(true, Ordering::Relaxed) {
            return false;
        }
        *s = (String::new(), Utc::now());
        self.gauge.show(true);
        true
    }

    /// Mark it down for `reason` (the latest reason is kept, the time it
    /// went down too); `true` if it was up.
    pub fn set_down(&self, reason: impl Into<String>) -> bool {
        let mut s = self.lock();
        let was_up = self.up.swap(false, Ordering::Relaxed);
        if was_up {
            s.1 = Utc::now();
        }
        s.0 = reason.into();
        self.gauge.show(false);
        was_up
    }

    /// Why it is down and since when; `None` while up.
    pub fn why_down(&self) -> Option<(String, DateTime<Utc>)> {
        if self.is_up() {
            return None;
        }
        let s = self.lock();
        Some(s.clone())
    }
}

impl std::fmt::Debug for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.why_down() {
            None => f.write_str("up"),
            Some((why, since)) => write!(f, "down since {since}: {why}"),
        }
    }
}

/// A time as `/readyz` and `status` print it.
pub fn since(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// One source's health, updated by its relay as it works.
pub struct Health {
    started: Instant,
    last_progress_ms: AtomicI64,
    backlog: AtomicI64,
    /// The oldest pending event's age in ms as last counted (-1: none).
    oldest_ms: AtomicI64,
    /// Events published since the start, and the sum (µs) and number of
    /// their commit → ack times: what the console's charts sample.
    published: AtomicU64,
    latency_sum_us: AtomicU64,
    latency_n: AtomicU64,
    /// Events published since the start, per route.
    route_published: Mutex<BTreeMap<String, u64>>,
    /// The source's database: down until its store is open, then as the
    /// last statement found it.
    pub database: Part,
    /// The store, once it opened (`topology.rs` keeps retrying until then).
    store: OnceLock<Arc<Store>>,
    /// Quarantined routes and why (the other routes flow).
    quarantined: Mutex<Vec<(String, String)>>,
    /// Routes whose plugin is not loaded (missing or unusable file): their
    /// events wait. Route name → its part.
    plugins: Mutex<BTreeMap<String, Arc<Part>>>,
    pub stall_after: Duration,
}

impl Health {
    pub fn new(source: &str, stall_after: Duration) -> Arc<Self> {
        Arc::new(Health {
            started: Instant::now(),
            last_progress_ms: AtomicI64::new(0),
            backlog: AtomicI64::new(0),
            oldest_ms: AtomicI64::new(-1),
            published: AtomicU64::new(0),
            latency_sum_us: AtomicU64::new(0),
            latency_n: AtomicU64::new(0),
            route_published: Mutex::new(BTreeMap::new()),
            database: Part::down(
                "connecting",
                Gauge::Up(metrics::gauge!(m::SOURCE_UP, "source" => source.to_string())),
            ),
            store: OnceLock::new(),
            quarantined: Mutex::new(Vec::new()),
            plugins: Mutex::new(BTreeMap::new()),
            stall_after,
        })
    }

    /// The store opened: the source is up.
    pub fn opened(&self, store: Arc<Store>) {
        let _ = self.store.set(store);
        self.database.set_up();
    }

    pub fn store(&self) -> Option<&Arc<Store>> {
        self.store.get()
    }

    fn now_ms(&self) -> i64 {
        self.started.elapsed().as_millis() as i64
    }

    /// Events were published (or there was nothing to do).
    pub fn progressed(&self) {
        self.last_progress_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }

    /// A batch published `n` events whose commit → ack times add up to
    /// `latency_sum_us` over `latency_n` of them (rows without a commit
    /// time are not timed).
    pub fn count_published(&self, n: u64, latency_sum_us: u64, latency_n: u64) {
        self.published.fetch_add(n, Ordering::Relaxed);
        self.latency_sum_us
            .fetch_add(latency_sum_us, Ordering::Relaxed);
        self.latency_n.fetch_add(latency_n, Ordering::Relaxed);
    }

    /// A batch published `n` events of route `route`.
    pub fn count_route(&self, route: &str, n: u64) {
        let mut m = self
            .route_published
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match m.get_mut(route) {
            Some(k) => *k += n,
            None => {
                m.insert(route.to_string(), n);
            }
        }
    }

    /// Events published per route since the start.
    pub fn route_totals(&self) -> BTreeMap<String, u64> {
        self.route_published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// (events published, commit → ack µs summed, events timed) since the
    /// start.
    pub fn published_totals(&self) -> (u64, u64, u64) {
        (
            self.published.load(Ordering::Relaxed),
            self.latency_sum_us.load(Ordering::Relaxed),
            self.latency_n.load(Ordering::Relaxed),
        )
    }

    /// The backlog and its oldest event's age (s) as the relay last
    /// counted them.
    pub fn backlog(&self) -> (i64, Option<f64>) {
        let oldest = self.oldest_ms.load(Ordering::Relaxed);
        (
            self.backlog.load(Ordering::Relaxed),
            (oldest >= 0).then(|| oldest as f64 / 1000.0),
        )
    }

    pub fn set_backlog(&self, n: i64, oldest_seconds: Option<f64>) {
        self.oldest_ms.store(
            oldest_seconds.map_or(-1, |s| (s * 1000.0) as i64),
            Ordering::Relaxed,
        );
        self.backlog.store(n, Ordering::Relaxed);
        if n == 0 {
            self.progressed();
        }
    }

    /// A statement went through.
    pub fn set_store_ok(&self) {
        if self.database.set_up() {
            tracing::info!("database reachable again");
        }
    }

    /// A statement failed with `e`.
    pub fn store_failed(&self, e: &anyhow::Error) {
        if self.database.set_down(format!("{e:#}")) {
            tracing::warn!("database unreachable: {e:#}");
        }
    }

    pub fn set_quarantined(&self, routes: Vec<(String, String)>) {
        if let Ok(mut q) = self.quarantined.lock() {
            *q = routes;
        }
    }

    /// Route `route`'s plugin: its part (down until loaded).
    pub fn plugin_part(&self, route: &str) -> Arc<Part> {
        let mut p = self.plugins.lock().unwrap_or_else(|e| e.into_inner());
        p.entry(route.to_string())
            .or_insert_with(|| {
                Arc::new(Part::down(
                    "loading",
                    Gauge::Waiting(metrics::gauge!(m::ROUTE_WAITING, "route" => route.to_string(), "reason" => "plugin")),
                ))
            })
            .clone()
    }

    /// One line per quarantined route.
    pub fn quarantine_note(&self) -> String {
        self.quarantined
            .lock()
            .map(|q| {
                q.iter()
                    .map(|(r, why)| format!("route `{r}` quarantined: {why}\n"))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `None` when ready, else why not.
    pub fn stalled(&self) -> Option<String> {
        let idle = Duration::from_millis(
            (self.now_ms() - self.last_progress_ms.load(Ordering::Relaxed)).max(0) as u64,
        );
        let backlog = self.backlog.load(Ordering::Relaxed);
        (backlog > 0 && idle > self.stall_after).then(|| {
            format!(
                "{backlog} events pending and nothing published for {}s",
                idle.as_secs()
            )
        })
    }
}

/// How often the sinks are checked between `/readyz` requests.
const SINK_CHECK: Duration = Duration::from_secs(10);

/// The parts `/readyz` looks at, replaced as a whole when a config reload
/// changes them; and since when each sink has been connected or not (as
/// the checks saw it: every [`SINK_CHECK`], and at every `/readyz`).
#[derive(Clone, Default)]
pub struct Readiness(Arc<std::sync::RwLock<ReadyView>>, Arc<Mutex<SinkStates>>);

/// Per sink: connected when last checked, and since when.
type SinkStates = BTreeMap<String, (bool, DateTime<Utc>)>;

#[derive(Clone, Default)]
pub struct ReadyView {
    /// Every source the relay serves, up or not, with its health.
    pub sources: Vec<(String, Arc<Health>)>,
    pub sinks: Sinks,
    /// Each route with the sinks it may publish to (a route waits while
    /// one of them is down).
    pub routes: Vec<(String, Vec<String>)>,
    /// Team files refused at the last (re)load, one line each.
    pub teams_refused: Vec<String>,
    /// The config running (the console shows it and scopes by it).
    pub loaded: Option<Arc<crate::config::Loaded>>,
}

/// What `/readyz` found.
#[derive(Debug)]
pub struct Assessment {
    /// Sources whose database answers and that are not stalled.
    pub live: usize,
    pub sources: usize,
    /// Every part that is not up, one line each.
    pub problems: Vec<String>,
    /// Lines that are not problems (quarantined routes).
    pub notes: String,
}

impl Assessment {
    /// Ready: some source is live (or the relay serves none); `strict`:
    /// every part is up.
    pub fn ready(&self, strict: bool) -> bool {
        if strict {
            self.problems.is_empty()
        } else {
            self.live > 0 || self.sources == 0
        }
    }

    /// The `/readyz` body.
    pub fn render(&self, strict: bool) -> String {
        let head = match (self.ready(strict), self.problems.is_empty()) {
            (true, true) => "ready".to_string(),
            (true, false) => format!(
                "ready (degraded: {} of {} sources live)",
                self.live, self.sources
            ),
            (false, _) => format!(
                "not ready: {} down, {} of {} sources live",
                match self.problems.len() {
                    1 => "1 part".to_string(),
                    n => format!("{n} parts"),
                },
                self.live,
                self.sources
            ),
        };
        let mut out = format!("{head}\n");
        for p in &self.problems {
            out.push_str(&format!("- {p}\n"));
        }
        out.push_str(&self.notes);
        out
    }
}

impl Readiness {
    pub fn set(&self, view: ReadyView) {
        match self.0.write() {
            Ok(mut v) => *v = view,
            Err(poisoned) => *poisoned.into_inner() = view,
        }
    }

    /// The parts as the topology last published them.
    pub fn get(&self) -> ReadyView {
        match self.0.read() {
            Ok(v) => v.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Look at every part; `ping`: ask each open store's database too
    /// (`/readyz`), rather than trust the last statement (the gauges).
    pub async fn assess(&self, ping: bool) -> Assessment {
        let view = self.get();
        let mut problems = Vec::new();
        let mut notes = String::new();
        let mut live = 0;
        for (source, health) in &view.sources {
            let mut ok = true;
            match health.store() {
                None => {
                    ok = false;
                    let (why, t) = health
                        .database
                        .why_down()
                        .unwrap_or_else(|| ("connecting".into(), Utc::now()));
                    problems.push(format!(
                        "source `{source}`: database unreachable since {}: {why}",
                        since(t)
                    ));
                }
                Some(store) => {
                    let reachable = if ping {
                        let ok = store.ping().await;
                        if ok {
                            health.set_store_ok();
                        } else if health.database.is_up() {
                            health.store_failed(&anyhow::anyhow!("no answer to a ping"));
                        }
                        ok
                    } else {
                        health.database.is_up()
                    };
                    if !reachable {
                        ok = false;
                        let (why, t) = health
                            .database
                            .why_down()
                            .unwrap_or_else(|| ("no answer".into(), Utc::now()));
                        problems.push(format!(
                            "source `{source}`: database unreachable since {}: {why}",
                            since(t)
                        ));
                    }
                }
            }
            if let Some(why) = health.stalled() {
                ok = false;
                problems.push(format!("source `{source}`: {why}"));
            }
            let plugins = health.plugins.lock().map(|p| p.clone()).unwrap_or_default();
            for (route, part) in plugins {
                if let Some((why, t)) = part.why_down() {
                    problems.push(format!(
                        "route `{route}` waiting since {}: plugin not loaded: {why}",
                        since(t)
                    ));
                }
            }
            notes.push_str(&health.quarantine_note());
            if ok {
                live += 1;
            }
        }
        let mut down_sinks = Vec::new();
        for (name, sink) in view.sinks.iter() {
            let connected = sink.connected().await;
            metrics::gauge!(m::SINK_UP, "sink" => name.clone()).set(f64::from(connected));
            // When this sink was last seen changing state.
            let changed = {
                let mut seen = self.1.lock().unwrap_or_else(|e| e.into_inner());
                let entry = seen.entry(name.clone()).or_insert((connected, Utc::now()));
                if entry.0 != connected {
                    *entry = (connected, Utc::now());
                }
                entry.1
            };
            if !connected {
                down_sinks.push(name.as_str());
                problems.push(match sink.down_reason() {
                    Some((why, t)) => {
                        format!("sink `{name}` not connected since {}: {why}", since(t))
                    }
                    None => format!("sink `{name}` not connected since {}", since(changed)),
                });
            }
        }
        for (route, sinks) in &view.routes {
            let waits = sinks.iter().find(|s| down_sinks.contains(&s.as_str()));
            metrics::gauge!(m::ROUTE_WAITING, "route" => route.clone(), "reason" => "sink")
                .set(f64::from(u8::from(waits.is_some())));
        }
        problems.extend(view.teams_refused.iter().cloned());
        Assessment {
            live,
            sources: view.sources.len(),
            problems,
            notes,
        }
    }

    /// Keep the gauges of the sinks and of routes waiting for one current
    /// (sources and plugins set theirs as they change), every
    /// [`SINK_CHECK`]: asking a Kafka sink whether it is connected fetches
    /// the cluster's metadata, not something to do every second.
    pub async fn watch(self, shutdown: tokio_util::sync::CancellationToken) {
        while !shutdown.is_cancelled() {
            self.assess(false).await;
            tokio::select! {
                _ = shutdown.cancelled() => {},
                _ = tokio::time::sleep(SINK_CHECK) => {},
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_keeps_the_time_it_went_down_and_the_latest_reason() {
        let p = Part::down("connecting", Gauge::Up(metrics::gauge!("test_part")));
        let (why, first) = p.why_down().unwrap_or_default();
        assert_eq!(why, "connecting");
        assert!(!p.set_down("refused"), "was already down");
        let (why, t) = p.why_down().unwrap_or_default();
        assert_eq!((why.as_str(), t), ("refused", first));
        assert!(p.set_up());
        assert!(!p.set_up());
        assert!(p.why_down().is_none());
        assert!(p.set_down("gone"));
        assert!(p.why_down().is_some_and(|(w, t)| w == "gone" && t >= first));
    }

    #[test]
    fn ready_while_one_source_is_live_strict_only_when_all_are() {
        let a = |live, sources, problems: &[&str]| Assessment {
            live,
            sources,
            problems: problems.iter().map(|s| s.to_string()).collect(),
            notes: String::new(),
        };
        let degraded = a(1, 3, &["source `x`: down"]);
        assert!(degraded.ready(false));
        assert!(!degraded.ready(true));
        assert!(
            degraded
                .render(false)
                .starts_with("ready (degraded: 1 of 3")
        );
        assert!(
            degraded
                .render(true)
                .starts_with("not ready: 1 part down, 1 of 3 sources live\n- source `x`: down")
        );
        assert!(!a(0, 2, &["a", "b"]).ready(false));
        assert!(a(0, 0, &[]).ready(true));
        assert!(a(2, 2, &[]).ready(true));
    }
}
