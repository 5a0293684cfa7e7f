//! Metrics: every series is named here, once, with its kind, its labels and
//! what it means, and the Prometheus recorder is installed here. Modules
//! report to it (`metrics::counter!` with these names); it knows none of
//! them. `http.rs` serves it; `outroute reference metrics` prints the table
//! as the user guide's reference page (a test keeps the page, and the kinds
//! and labels the code uses, true to it).
//!
//! What to alert on, and what to do then: docs/src/operating/runbooks.md.

use std::fmt::Write as _;

use anyhow::{Context, Result};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// What kind of series a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One series: its name, kind, labels and meaning (its doc comment).
#[derive(Debug)]
pub struct Series {
    /// The constant's name in this module (`BACKLOG`).
    pub constant: &'static str,
    pub name: &'static str,
    pub kind: Kind,
    pub labels: &'static [&'static str],
    doc: &'static str,
}

impl Series {
    /// The doc comment as one line (Prometheus `# HELP`).
    pub fn help(&self) -> String {
        self.doc.split_whitespace().collect::<Vec<_>>().join(" ")
    }
}

/// Declares each series' constant and its row of [`ALL`] from one line.
macro_rules! series {
    ($( $(#[doc = $doc:literal])+ $constant:ident = $name:literal, $kind:ident [$($label:literal),*]; )*) => {
        $( $(#[doc = $doc])+ pub const $constant: &str = $name; )*
        /// Every series the relay exports.
        pub const ALL: &[Series] = &[$(Series {
            constant: stringify!($constant),
            name: $name,
            kind: Kind::$kind,
            labels: &[$($label),*],
            doc: concat!($($doc, "\n"),+),
        }),*];
    };
}

series! {
    /// Events pending (committed, not yet published or failed): exact up to
    /// 1,000, estimated from the span of pending sequence numbers above that.
    BACKLOG = "outroute_backlog_events", Gauge ["source"];
    /// How long the oldest pending event has waited (seconds).
    OLDEST_PENDING_AGE = "outroute_oldest_pending_age_seconds", Gauge ["source"];
    /// Events marked published, per route that delivered them.
    EVENTS_PUBLISHED = "outroute_events_published_total", Counter ["route", "source"];
    /// Messages acknowledged by a sink.
    MESSAGES_PUBLISHED = "outroute_messages_published_total", Counter ["route", "sink"];
    /// Commit to the last acknowledgement of an event (see
    /// `outroute_pickup_seconds` for what "commit" is in each capture mode).
    COMMIT_TO_ACK = "outroute_commit_to_ack_seconds", Histogram ["source"];
    /// One plugin call (a batch of a route's events).
    PLUGIN_CALL = "outroute_plugin_call_seconds", Histogram ["route"];
    /// Events a route's shadow (candidate) plugin answered beside the active one.
    SHADOW_EVENTS = "outroute_shadow_events_total", Counter ["route"];
    /// Of those, events the candidate would have handled differently.
    SHADOW_DIFFERENCES = "outroute_shadow_differences_total", Counter ["route"];
    /// Events a route's plugin (or its limits) refused (`kind`: `invalid`,
    /// failed for good; `retryable`, tried again).
    REJECTIONS = "outroute_rejections_total", Counter ["route", "kind"];
    /// Deliveries that failed for a reason that may pass and were scheduled
    /// for another attempt.
    RETRIES = "outroute_retries_total", Counter ["route", "source"];
    /// Deliveries that failed for good (kept with their reason:
    /// `outroute failed list`).
    EVENTS_FAILED = "outroute_events_failed_total", Counter ["route", "source"];
    /// Events in the failed state now (not discarded), per route and its
    /// owner (the team that answers for them): what someone must act on.
    /// Read from the database once a minute and after each failure.
    FAILED_EVENTS = "outroute_failed_events", Gauge ["source", "route", "owner"];
    /// Dead letters acknowledged by their sink (`result`: `sent`), or not
    /// (`result`: `unsent`; the event is retried until one is).
    DEAD_LETTERS = "outroute_dead_letters_total", Counter ["route", "result"];
    /// Scheduled reconciliation (`relay.reconcile_every`), last window
    /// checked: events the outbox marked published that a topic of the
    /// route does not hold (lost messages; the log names them).
    RECONCILE_MISSING = "outroute_reconcile_missing", Gauge ["source", "route"];
    /// Last window checked: events a topic of the route holds more often
    /// than the route sends them (re-sends; expected after crashes).
    RECONCILE_DUPLICATED = "outroute_reconcile_duplicated", Gauge ["source", "route"];
    /// Last window checked: events found after a later event of their
    /// aggregate in one partition.
    RECONCILE_OUT_OF_ORDER = "outroute_reconcile_out_of_order", Gauge ["source", "route"];
    /// Last window checked: messages of the route on topics that could not
    /// be read back (nothing proved for them).
    RECONCILE_UNCHECKED = "outroute_reconcile_unchecked", Gauge ["source", "route"];
    /// Last window checked: messages of this source in the window whose
    /// event the outbox does not list as published.
    RECONCILE_UNEXPECTED = "outroute_reconcile_unexpected", Gauge ["source"];
    /// Scheduled reconciliations by `result`: `clean`, `findings` (missing,
    /// out of order or unreadable), `error` (could not run; the window is
    /// checked next time).
    RECONCILE_RUNS = "outroute_reconcile_runs_total", Counter ["source", "result"];
    /// End of the last window reconciled (Unix seconds): stale when no
    /// relay checks the source any more.
    RECONCILE_CHECKED_UNTIL = "outroute_reconcile_checked_until_seconds", Gauge ["source"];
    /// Messages a sink failed to publish (`kind`: `permanent`, the event
    /// fails; `retryable`, tried again; `unavailable`, the broker is down and
    /// the event waits, no attempt counted).
    PUBLISH_ERRORS = "outroute_publish_errors_total", Counter ["sink", "kind"];
    /// Lane leases this relay took over (under log capture each start of
    /// streaming counts one).
    LEASE_HANDOVERS = "outroute_lease_handovers_total", Counter ["source"];
    /// Lanes this relay holds.
    LANES_OWNED = "outroute_lanes_owned", Gauge ["source"];
    /// Marks refused because the relay's lease lapsed mid-batch (another
    /// relay re-publishes those events, same ids).
    MARK_FENCED = "outroute_mark_fenced_total", Counter ["source"];
    /// One batch, claim to mark.
    BATCH_SECONDS = "outroute_batch_seconds", Histogram ["source"];
    /// Plugin (re)loads by `result`: `ok`, `error`.
    PLUGIN_RELOADS = "outroute_plugin_reloads_total", Counter ["route", "result"];
    /// Rows deleted by `relay.retention` and by log capture's
    /// `cleanup = "delete"`.
    PURGED = "outroute_purged_events_total", Counter ["source"];
    /// One claim statement (rows or none): what a poll costs the database.
    CLAIM_SECONDS = "outroute_claim_seconds", Histogram ["source"];
    /// Statements the relay gave up on after `store.statement_timeout` (the
    /// database did not answer; the connection was replaced).
    STATEMENTS_ABANDONED = "outroute_statements_abandoned_total", Counter ["source"];
    /// Pending rows a sweep found below a lane's claim floor (a producer
    /// transaction that committed long after it took its sequence number):
    /// each lowered the floor, nothing was lost, but the row went out late.
    FLOOR_LOWERED = "outroute_claim_floor_lowered_total", Counter ["source"];
    /// Commit to claim: how fast new events are noticed. Logical capture
    /// knows the commit time (the WAL's commit record); lease mode only the
    /// row's `created_at`, the producer's transaction start, so its figure
    /// includes the producer's own time in the transaction.
    PICKUP = "outroute_pickup_seconds", Histogram ["source"];
    /// Events acknowledged after an earlier event of their aggregate failed
    /// at ack time: their first delivery was out of order (re-sent after it).
    ORDER_RISK = "outroute_order_risk_total", Counter ["sink"];
    /// JetStream answered "duplicate" (a message with that `Nats-Msg-Id` is
    /// already stored): a re-send after a crash or timeout, or — if it grows
    /// without those — two events sharing a dedup id.
    DUPLICATE_ACKS = "outroute_duplicate_acks_total", Counter ["sink"];
    /// Events a plugin answered with no messages (marked published, nothing
    /// sent).
    EVENTS_WITHOUT_MESSAGES = "outroute_events_without_messages_total", Counter ["route"];
    /// Plugin calls stopped by a route limit (`limit`: `cpu_budget`,
    /// `wall_clock`, `memory`, `log`, `messages_per_event`, `bytes_per_event`).
    LIMIT_BREACHES = "outroute_plugin_limit_breaches_total", Counter ["route", "limit"];
    /// What a plugin counted itself (`host.count`, contract 0.1.1), by route,
    /// plugin and counter name; only calls that succeeded count.
    PLUGIN_COUNT = "outroute_plugin_count_total", Counter ["route", "plugin", "name"];
    /// 1 while a route is quarantined (its plugin kept breaking its limits).
    ROUTE_QUARANTINED = "outroute_route_quarantined", Gauge ["route"];
    /// Events of a route that cannot run now (quarantined, plugin not
    /// loaded, team file refused) recorded as waiting, no attempt counted.
    EVENTS_DEFERRED = "outroute_events_deferred_total", Counter ["route", "source"];
    /// 1 while a source's database answers (its store open, its last
    /// statement through), 0 while the relay waits for it.
    SOURCE_UP = "outroute_source_up", Gauge ["source"];
    /// 1 while a source sleeps: idle, its relay waits for the pending
    /// queue's insert trigger to notify it instead of polling, and costs its
    /// database next to nothing.
    SOURCE_ASLEEP = "outroute_source_asleep", Gauge ["source"];
    /// Connections this relay holds to a source's database: its pool's
    /// (opened on demand, closed after 5 s unused) and the LISTEN one (which
    /// carries a sleeping source's lease rounds). Set every second, every
    /// minute while the source sleeps.
    SOURCE_CONNECTIONS = "outroute_source_connections", Gauge ["source"];
    /// 1 while a sink's broker is connected, 0 while publishing to it waits.
    SINK_UP = "outroute_sink_up", Gauge ["sink"];
    /// 1 while a route's events wait for a part that is not up (`reason`:
    /// `plugin`, its plugin not loaded; `sink`, a sink it may publish to down).
    ROUTE_WAITING = "outroute_route_waiting", Gauge ["route", "reason"];
    /// Team files refused at the last (re)load: each costs only its team
    /// (which runs its last known good copy, or waits).
    TEAM_FILES_REFUSED = "outroute_team_files_refused", Gauge [];
    /// Config reloads (SIGHUP or a changed file) by `result`: `applied`,
    /// `unchanged`, `rejected` (the running config kept).
    CONFIG_RELOADS = "outroute_config_reloads_total", Counter ["result"];
    /// `capture = "logical"`: WAL the slot keeps past its confirmed position
    /// (bytes).
    SLOT_LAG_BYTES = "outroute_slot_lag_bytes", Gauge ["source"];
    /// `capture = "logical"` or `"binlog"`: how far behind the producers'
    /// commits the relay is (seconds, the last handled transaction's commit
    /// time; the binlog logs whole seconds).
    CAPTURE_LAG_SECONDS = "outroute_capture_lag_seconds", Gauge ["source"];
}

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
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(COMMIT_TO_ACK.into()), &latency)?
        .set_buckets_for_metric(Matcher::Full(BATCH_SECONDS.into()), &latency)?
        .set_buckets_for_metric(Matcher::Full(PICKUP.into()), &latency)?
        .set_buckets_for_metric(Matcher::Full(CLAIM_SECONDS.into()), &db)?
        .set_buckets_for_metric(Matcher::Full(PLUGIN_CALL.into()), &fast)?
        .install_recorder()
        .context("installing the metrics recorder")?;
    for s in ALL {
        match s.kind {
            Kind::Counter => metrics::describe_counter!(s.name, s.help()),
            Kind::Gauge => metrics::describe_gauge!(s.name, s.help()),
            Kind::Histogram => metrics::describe_histogram!(s.name, s.help()),
        }
    }
    Ok(handle)
}

/// `docs/src/reference/metrics.md`: every series with its kind, labels and
/// meaning (`outroute reference metrics`).
pub fn reference_markdown() -> String {
    let mut out = String::from(
        "# Metrics reference\n\n\
         <!-- Generated by `outroute reference metrics` from host/src/metrics.rs; do not edit. -->\n\n\
         Every series the relay serves on `/metrics` (Prometheus text, with a `# HELP` line each).\n\
         What to alert on and what to do then: [runbooks](../operating/runbooks.md).\n\n\
         | series | kind | labels | meaning |\n| --- | --- | --- | --- |\n",
    );
    let mut all: Vec<&Series> = ALL.iter().collect();
    all.sort_by_key(|s| s.name);
    for s in all {
        let labels = if s.labels.is_empty() {
            "—".to_string()
        } else {
            s.labels
                .iter()
                .map(|l| format!("`{l}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            out,
            "| `{}` | {} | {labels} | {} |",
            s.name,
            s.kind.as_str(),
            s.help().replace('|', "\\|")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `counter!`/`gauge!`/`histogram!` call in the crate's source:
    /// (macro, constant, labels), the constant being the last path segment
    /// of its first argument.
    fn uses() -> Vec<(String, String, Vec<String>)> {
        let mut out = Vec::new();
        let mut dirs = vec![std::path::PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/src"
        ))];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") || path.ends_with("metrics.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                for kind in ["counter", "gauge", "histogram"] {
                    let open = format!("{kind}!(");
                    for (at, _) in text.match_indices(&open) {
                        let rest = &text[at + open.len()..];
                        let mut depth = 1;
                        let end = rest
                            .char_indices()
                            .find(|&(_, c)| {
                                depth += match c {
                                    '(' => 1,
                                    ')' => -1,
                                    _ => 0,
                                };
                                depth == 0
                            })
                            .map_or(rest.len(), |(i, _)| i);
                        let args = &rest[..end];
                        let first = args.split(',').next().unwrap_or("").trim();
                        let constant = first.rsplit("::").next().unwrap_or("").to_string();
                        let pieces: Vec<&str> = args.split("=>").collect();
                        // Each label is the string just before a `=>`.
                        let labels = pieces[..pieces.len() - 1]
                            .iter()
                            .filter_map(|before| {
                                let before = before.trim_end();
                                let before = before.strip_suffix('"')?;
                                let start = before.rfind('"')?;
                                Some(before[start + 1..].to_string())
                            })
                            .collect();
                        out.push((kind.to_string(), constant, labels));
                    }
                }
            }
        }
        out
    }

    #[test]
    fn every_series_is_used_as_declared_and_every_use_is_declared() {
        let uses = uses();
        let mut problems = Vec::new();
        for (kind, constant, labels) in &uses {
            if constant.starts_with('"') {
                continue; // a literal name: only the health unit test's
            }
            match ALL.iter().find(|s| s.constant == constant) {
                None => problems.push(format!("{kind}!({constant}) is not in metrics::ALL")),
                Some(s) => {
                    if s.kind.as_str() != kind {
                        problems.push(format!(
                            "{constant} is a {}, used as a {kind}",
                            s.kind.as_str()
                        ));
                    }
                    if s.labels != labels.as_slice() {
                        problems.push(format!(
                            "{constant} declares labels {:?}, used with {labels:?}",
                            s.labels
                        ));
                    }
                }
            }
        }
        for s in ALL {
            if !uses.iter().any(|(_, c, _)| c == s.constant) {
                problems.push(format!("{} is declared but never reported", s.constant));
            }
            if s.help().is_empty() {
                problems.push(format!("{} has no meaning written", s.constant));
            }
        }
        assert!(uses.len() >= ALL.len(), "found only {} uses", uses.len());
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn the_reference_page_is_fresh() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/src/reference/metrics.md"
        );
        let page = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            page == reference_markdown(),
            "docs/src/reference/metrics.md is stale: run `outroute reference metrics > docs/src/reference/metrics.md`"
        );
    }
}
