//! Metrics: every series is named here, once, and the Prometheus recorder
//! is installed here. Modules report to it (`metrics::counter!` with these
//! names); it knows none of them. `http.rs` serves it.
//!
//! What to alert on (README "Operating it"):
//! `outroute_oldest_pending_age_seconds` rising, `outroute_events_failed_total`
//! increasing, `/readyz` failing.

use anyhow::{Context, Result};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

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
