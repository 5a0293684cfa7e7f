//! Metrics and health, served over HTTP by `outroute run`.
//!
//! Every series is named here, once. What to alert on (README "Operating it"):
//! `outroute_oldest_pending_age_seconds` rising, `outroute_events_failed_total`
//! increasing, `/readyz` failing.

use anyhow::{Context, Result};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::health::Readiness;

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
/// JetStream answered "duplicate" (a message with that `Nats-Msg-Id` is
/// already stored): a re-send after a crash or timeout, or — if it grows
/// without those — two events sharing a dedup id.
pub const DUPLICATE_ACKS: &str = "outroute_duplicate_acks_total";
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

/// 1 while a source's database answers (its store open, its last
/// statement through), 0 while the relay waits for it.
pub const SOURCE_UP: &str = "outroute_source_up";
/// 1 while a sink's broker is connected, 0 while publishing to it waits.
pub const SINK_UP: &str = "outroute_sink_up";
/// 1 while a route's events wait for a part that is not up (`reason`:
/// `plugin`, its plugin not loaded; `sink`, a sink it may publish to down).
pub const ROUTE_WAITING: &str = "outroute_route_waiting";

/// Team files refused at the last (re)load: each costs only its team
/// (which runs its last known good copy, or waits).
pub const TEAM_FILES_REFUSED: &str = "outroute_team_files_refused";

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

#[derive(Clone)]
struct AppState {
    prom: PrometheusHandle,
    ready: Readiness,
    /// `http.token`: what the endpoints showing event content require.
    token: Option<crate::config::Secret>,
}

/// The request carries `Authorization: Bearer <http.token>` (compared in
/// constant time); always false without a configured token.
fn authorised(token: Option<&crate::config::Secret>, headers: &axum::http::HeaderMap) -> bool {
    let Some(token) = token else {
        return false;
    };
    let Some(given) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    let (a, b) = (given.as_bytes(), token.expose().as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// `/shadow`: the shadow plugins' differences, which show payload bytes,
/// keys and headers of live events — only with the bearer token.
async fn shadow(
    State(s): State<AppState>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if !authorised(s.token.as_ref(), &headers) {
        let why = if s.token.is_none() {
            "/shadow shows event content: set http.token (or OUTROUTE_HTTP__TOKEN, http.token_file) to serve it\n"
        } else {
            "/shadow needs `Authorization: Bearer <http.token>`\n"
        };
        return (
            StatusCode::UNAUTHORIZED,
            [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
            why,
        )
            .into_response();
    }
    axum::Json(crate::shadow::report()).into_response()
}

async fn metrics(State(s): State<AppState>) -> String {
    s.prom.render()
}

/// `/readyz`: ready while some source is live; `/readyz?strict`: only
/// while every source, sink and route is up. Either lists what is not.
async fn readyz(State(s): State<AppState>, uri: axum::http::Uri) -> (StatusCode, String) {
    let strict = uri.query().is_some_and(|q| {
        q.split('&')
            .any(|p| p == "strict" || p.starts_with("strict="))
    });
    let a = s.ready.assess(true).await;
    let code = if a.ready(strict) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, a.render(strict))
}

/// Serve `/metrics`, `/healthz`, `/readyz` (open) and `/shadow` (with
/// `token` only) until `shutdown`.
pub async fn serve(
    listen: &str,
    prom: PrometheusHandle,
    ready: Readiness,
    token: Option<crate::config::Secret>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<tokio::task::JoinHandle<()>> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/shadow", get(shadow))
        .with_state(AppState {
            prom,
            ready: ready.clone(),
            token,
        });
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
    tokio::spawn(ready.watch(shutdown.clone()));
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
    }))
}
