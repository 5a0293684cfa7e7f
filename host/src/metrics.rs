//! Metrics and health, served over HTTP by `outroute run`.
//!
//! Every series is named here, once. What to alert on (README "Operating it"):
//! `outroute_oldest_pending_age_seconds` rising, `outroute_events_failed_total`
//! increasing, `/readyz` failing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::sink::Sinks;
use crate::store::Store;

pub const BACKLOG: &str = "outroute_backlog_events";
pub const OLDEST_PENDING_AGE: &str = "outroute_oldest_pending_age_seconds";
pub const EVENTS_PUBLISHED: &str = "outroute_events_published_total";
pub const MESSAGES_PUBLISHED: &str = "outroute_messages_published_total";
/// Commit to the last acknowledgement of an event (see [`PICKUP`] for what
/// "commit" is in each capture mode).
pub const COMMIT_TO_ACK: &str = "outroute_commit_to_ack_seconds";
pub const PLUGIN_CALL: &str = "outroute_plugin_call_seconds";
/// Events a route's shadow (candidate) plugin answered beside the active one.
pub const SHADOW_EVENTS: &str = "outroute_shadow_events_total";
/// Of those, events the candidate would have handled differently.
pub const SHADOW_DIFFERENCES: &str = "outroute_shadow_differences_total";
pub const REJECTIONS: &str = "outroute_rejections_total";
pub const RETRIES: &str = "outroute_retries_total";
pub const EVENTS_FAILED: &str = "outroute_events_failed_total";
pub const PUBLISH_ERRORS: &str = "outroute_publish_errors_total";
pub const LEASE_HANDOVERS: &str = "outroute_lease_handovers_total";
pub const LANES_OWNED: &str = "outroute_lanes_owned";
pub const MARK_FENCED: &str = "outroute_mark_fenced_total";
pub const BATCH_SECONDS: &str = "outroute_batch_seconds";
pub const PLUGIN_RELOADS: &str = "outroute_plugin_reloads_total";
pub const PURGED: &str = "outroute_purged_events_total";
/// One claim statement (rows or none): what a poll costs the database.
pub const CLAIM_SECONDS: &str = "outroute_claim_seconds";
/// Statements the relay gave up on after `store.statement_timeout` (the
/// database did not answer; the connection was replaced).
pub const STATEMENTS_ABANDONED: &str = "outroute_statements_abandoned_total";
/// Pending rows a sweep found below a lane's claim floor (a producer
/// transaction that committed long after it took its sequence number):
/// each lowered the floor, nothing was lost, but the row went out late.
pub const FLOOR_LOWERED: &str = "outroute_claim_floor_lowered_total";
/// Commit to claim: how fast new events are noticed. Logical capture knows
/// the commit time (the WAL's commit record); lease mode only the row's
/// `created_at`, the producer's transaction start, so its figure includes
/// the producer's own time in the transaction.
pub const PICKUP: &str = "outroute_pickup_seconds";
/// Events acknowledged after an earlier event of their aggregate failed at
/// ack time: their first delivery was out of order (re-sent after it).
pub const ORDER_RISK: &str = "outroute_order_risk_total";
/// Events a plugin answered with no messages (marked published, nothing sent).
pub const EVENTS_WITHOUT_MESSAGES: &str = "outroute_events_without_messages_total";

/// Plugin calls stopped by a route limit (`limit`: cpu_budget, wall_clock,
/// memory, log, messages_per_event, bytes_per_event).
pub const LIMIT_BREACHES: &str = "outroute_plugin_limit_breaches_total";
/// What a plugin counted itself (`host.count`, contract 0.1.1), by route,
/// plugin and counter name; only calls that succeeded count.
pub const PLUGIN_COUNT: &str = "outroute_plugin_count_total";
/// 1 while a route is quarantined (its plugin kept breaking its limits).
pub const ROUTE_QUARANTINED: &str = "outroute_route_quarantined";
/// Events of a quarantined route recorded as waiting (no attempt counted).
pub const EVENTS_DEFERRED: &str = "outroute_events_deferred_total";

/// Config reloads (SIGHUP or a changed file) by `result`: `applied`,
/// `unchanged`, `rejected` (the running config kept).
pub const CONFIG_RELOADS: &str = "outroute_config_reloads_total";

/// `capture = "logical"`: WAL the slot keeps past its confirmed position
/// (bytes), and how far behind the producers' commits the relay is
/// (seconds, the last handled transaction's commit time).
pub const SLOT_LAG_BYTES: &str = "outroute_slot_lag_bytes";
pub const SLOT_LAG_SECONDS: &str = "outroute_slot_lag_seconds";

/// Install the Prometheus recorder (once per process).
pub fn install() -> Result<PrometheusHandle> {
    // Fine around 1–10 ms, where pickup and batch times sit at steady load.
    let latency = [
        0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
        0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
    ];
    let fast = [
        0.000_002, 0.000_005, 0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_5, 0.001, 0.005, 0.01,
        0.05, 0.1,
    ];
    let db = [
        0.000_2, 0.000_5, 0.001, 0.001_5, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0,
    ];
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(COMMIT_TO_ACK.into()), &latency)?
        .set_buckets_for_metric(Matcher::Full(BATCH_SECONDS.into()), &latency)?
        .set_buckets_for_metric(Matcher::Full(PICKUP.into()), &latency)?
        .set_buckets_for_metric(Matcher::Full(CLAIM_SECONDS.into()), &db)?
        .set_buckets_for_metric(Matcher::Full(PLUGIN_CALL.into()), &fast)?
        .install_recorder()
        .context("installing the metrics recorder")
}

/// What `/readyz` looks at, updated by the relay as it works.
pub struct Health {
    started: Instant,
    last_progress_ms: AtomicI64,
    backlog: AtomicI64,
    store_ok: AtomicBool,
    /// Quarantined routes and why: shown by `/readyz`, which stays ready
    /// (the other routes flow).
    quarantined: std::sync::Mutex<Vec<(String, String)>>,
    pub stall_after: Duration,
}

impl Health {
    pub fn new(stall_after: Duration) -> Arc<Self> {
        Arc::new(Health {
            started: Instant::now(),
            last_progress_ms: AtomicI64::new(0),
            backlog: AtomicI64::new(0),
            store_ok: AtomicBool::new(true),
            quarantined: std::sync::Mutex::new(Vec::new()),
            stall_after,
        })
    }

    fn now_ms(&self) -> i64 {
        self.started.elapsed().as_millis() as i64
    }

    /// Events were published (or there was nothing to do).
    pub fn progressed(&self) {
        self.last_progress_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }

    pub fn set_backlog(&self, n: i64) {
        self.backlog.store(n, Ordering::Relaxed);
        if n == 0 {
            self.progressed();
        }
    }

    pub fn set_store_ok(&self, ok: bool) {
        self.store_ok.store(ok, Ordering::Relaxed);
    }

    pub fn set_quarantined(&self, routes: Vec<(String, String)>) {
        if let Ok(mut q) = self.quarantined.lock() {
            *q = routes;
        }
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

/// What `/readyz` checks: each source's store and progress, and the sinks.
/// Replaced as a whole when a config reload changes them.
#[derive(Clone, Default)]
pub struct Readiness(Arc<std::sync::RwLock<ReadyView>>);

#[derive(Clone, Default)]
pub struct ReadyView {
    /// `(source name, its health, its store)`.
    pub sources: Vec<(String, Arc<Health>, Arc<Store>)>,
    pub sinks: Sinks,
}

impl Readiness {
    pub fn set(&self, view: ReadyView) {
        match self.0.write() {
            Ok(mut v) => *v = view,
            Err(poisoned) => *poisoned.into_inner() = view,
        }
    }

    fn get(&self) -> ReadyView {
        match self.0.read() {
            Ok(v) => v.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }
}

#[derive(Clone)]
struct AppState {
    prom: PrometheusHandle,
    ready: Readiness,
}

async fn metrics(State(s): State<AppState>) -> String {
    s.prom.render()
}

async fn readyz(State(s): State<AppState>) -> (StatusCode, String) {
    let view = s.ready.get();
    let mut problems = Vec::new();
    let mut note = String::new();
    let named = view.sources.len() > 1;
    for (source, health, store) in &view.sources {
        let prefix = if named {
            format!("source `{source}`: ")
        } else {
            String::new()
        };
        if !store.ping().await {
            problems.push(format!("{prefix}database unreachable"));
        }
        if let Some(why) = health.stalled() {
            problems.push(format!("{prefix}{why}"));
        }
        note.push_str(&health.quarantine_note());
    }
    for (name, sink) in view.sinks.iter() {
        if !sink.connected().await {
            problems.push(format!("sink `{name}` not connected"));
        }
    }
    if problems.is_empty() {
        (StatusCode::OK, format!("ready\n{note}"))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n{note}", problems.join("; ")),
        )
    }
}

/// Serve `/metrics`, `/healthz`, `/readyz` until `shutdown`.
pub async fn serve(
    listen: &str,
    prom: PrometheusHandle,
    ready: Readiness,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<tokio::task::JoinHandle<()>> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route(
            "/shadow",
            get(|| async { axum::Json(crate::shadow::report()) }),
        )
        .with_state(AppState { prom, ready });
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => anyhow::bail!(
            "http.listen: cannot bind {listen}: the address is in use (another relay on this host?). \
             Give each relay its own address, e.g. OUTROUTE_HTTP__LISTEN=127.0.0.1:9465, or port 0 for \
             any free port (logged at start), or \"\" for no HTTP endpoint"
        ),
        Err(e) => return Err(e).with_context(|| format!("http.listen: cannot bind {listen}")),
    };
    let bound = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| listen.to_string());
    tracing::info!(listen = %bound, "serving /metrics, /healthz, /readyz");
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
    }))
}
