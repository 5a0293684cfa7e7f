//! Dead letters: an event that enters the failed state on a route with
//! `dead_letter = { sink, topic }` is told about there, as a message of its
//! own, before it is recorded failed.
//!
//! The dead letter carries the event as consumers would have seen it (the
//! payload, the producer's headers, the CloudEvents envelope) and why it
//! failed: `outroute-failure-reason`, `-attempts`, `-route`, `-plugin`,
//! `-plugin-version`, `-owner`, `-owner-contact`, `-first-error-at` and
//! `-source`. It is keyed by the aggregate id, so one aggregate's dead
//! letters stay in order on one partition.
//!
//! A dead letter is never lost either: it is acknowledged like any
//! message, and until it is, the event is not recorded failed but retried
//! with the route's backoff (holding its aggregate, as any retry does).
//! The retry runs the route again: the event fails again — and its dead
//! letter is sent again — or goes through (under `on_failure = "skip"`
//! possibly after later events of its aggregate, as after `failed retry`).
//! An event failed on several routes sends each route's dead letter once:
//! those acknowledged are marked in its done legs while another is
//! retried. A dead letter the sink refuses for good (too large, topic
//! unknown) has nothing to wait for: the event is recorded failed, its
//! reason saying so. A relay that dies between the acknowledgement and the
//! record sends it again on the next attempt; JetStream drops that copy
//! within its duplicate window (the dead letter's `Nats-Msg-Id` is the
//! source, event and route), a Kafka consumer sees it twice, with the same
//! `ce_id`.

use std::borrow::Cow;

use chrono::SecondsFormat;
use futures::future::join_all;

use super::*;
use crate::event::{Header, envelope};
use crate::sink::{Outgoing, PublishError};

/// A dead letter to send: the event (its claim) failed for good on `route`
/// with `reason`; its failure record is `failures[record]`.
pub(super) struct Letter<'a> {
    pub record: usize,
    pub route: usize,
    pub claim: &'a Claim,
    pub reason: String,
}

/// The header names a dead letter adds to the event's own.
pub mod header {
    pub const REASON: &str = "outroute-failure-reason";
    pub const ATTEMPTS: &str = "outroute-failure-attempts";
    pub const ROUTE: &str = "outroute-failure-route";
    pub const PLUGIN: &str = "outroute-failure-plugin";
    pub const PLUGIN_VERSION: &str = "outroute-failure-plugin-version";
    pub const OWNER: &str = "outroute-failure-owner";
    pub const OWNER_CONTACT: &str = "outroute-failure-owner-contact";
    pub const FIRST_ERROR_AT: &str = "outroute-failure-first-error-at";
    pub const SOURCE: &str = "outroute-failure-source";
}

/// The done leg that says a route's dead letter of the event went out
/// (kept while the event is retried for another route's dead letter).
const DEAD_LETTER_LEG: &str = ":dead-letter";

fn dead_letter_leg(route: &str) -> String {
    format!("{route}{DEAD_LETTER_LEG}")
}

/// The longest failure reason a dead letter carries (as the failure
/// record keeps it).
const MAX_REASON_CHARS: usize = 2000;

/// A producer header a dead letter may carry: one a plugin's message could
/// (not the envelope's, no `Nats-*` a JetStream would act on, a name and
/// value every broker takes), and none of the dead letter's own.
fn forwarded(name: &str, value: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !lower.starts_with("outroute-failure-")
        && lower != RESOLUTION_HEADER
        && crate::routing::check_headers(&[(name.to_string(), value.to_string())]).is_ok()
}

/// A header value as every broker takes it: one line (reasons come from
/// plugins and brokers, and a NATS header cannot hold a line break).
fn one_line(v: &str) -> Cow<'_, str> {
    if v.chars().any(char::is_control) {
        Cow::Owned(
            v.chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect(),
        )
    } else {
        Cow::Borrowed(v)
    }
}

impl Relay {
    /// The dead letters of an event this batch leaves failed for good: one
    /// per route it failed on that has a `dead_letter` (`record`: where its
    /// failure record is). None unless the record says failed: an event
    /// still retried or waiting on some route is not failed yet.
    pub(super) fn letters_of<'a>(
        &self,
        record: usize,
        failure: &Failure,
        event: &'a [(Claim, Plan)],
        fates: &[Fate],
    ) -> Vec<Letter<'a>> {
        if !matches!(failure.kind, FailureKind::Failed { .. }) {
            return Vec::new();
        }
        event
            .iter()
            .zip(fates)
            .filter_map(|((claim, _), fate)| match fate {
                Fate::Fail {
                    route: Some(route),
                    rejection,
                    ..
                } if self.routes.0[*route].config.dead_letter.is_some()
                    && !claim
                        .done_legs
                        .contains(&dead_letter_leg(self.routes.0[*route].name())) =>
                {
                    Some(Letter {
                        record,
                        route: *route,
                        claim,
                        reason: failed_reason(rejection, failure.attempts),
                    })
                }
                _ => None,
            })
            .collect()
    }

    /// Send `letters` and wait for their acknowledgements, then settle
    /// each event's record:
    ///
    /// * every dead letter acknowledged: recorded failed (the markers of
    ///   dead letters sent on earlier attempts are dropped, so an event
    ///   an operator retries is told about again if it fails again);
    /// * one not acknowledged because the sink is down or refused it for
    ///   now: retried with the route's backoff instead, the reason saying
    ///   why; the dead letters that did go out are marked
    ///   (`route:dead-letter` in its done legs) and not sent again;
    /// * one the sink refuses for good (too large, unknown topic): there is
    ///   nothing to wait for, so the event is recorded failed all the same,
    ///   its reason saying the dead letter could not be sent.
    pub(super) async fn send_dead_letters(
        &self,
        letters: &[Letter<'_>],
        failures: &mut [Failure],
        report: &mut BatchReport,
    ) {
        if letters.is_empty() {
            return;
        }
        // When each event first failed: its failure record's, or now (the
        // event failed at its first attempt).
        let ids: Vec<String> = letters.iter().map(|l| l.claim.id().to_string()).collect();
        let first: HashMap<String, chrono::DateTime<Utc>> =
            match self.store.first_errors(&ids).await {
                Ok(found) => found.into_iter().collect(),
                Err(e) => {
                    tracing::warn!("could not read when failed events first failed: {e:#}");
                    HashMap::new()
                }
            };
        let now = Utc::now();
        let results = join_all(letters.iter().map(|l| {
            let at = first.get(l.claim.id()).copied().unwrap_or(now);
            self.send_dead_letter(l, &failures[l.record], at)
        }))
        .await;
        // Per record: the routes whose dead letters went out, and why one
        // must be tried again (the first such reason).
        let mut sent: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut again: HashMap<usize, (usize, String)> = HashMap::new();
        for (letter, result) in letters.iter().zip(results) {
            let route = &self.routes.0[letter.route];
            let (sink, topic) = route
                .config
                .dead_letter
                .as_ref()
                .map_or(("-", "-"), |d| (d.sink.as_str(), d.topic.as_str()));
            let outcome = if result.is_ok() { "sent" } else { "unsent" };
            metrics::counter!(m::DEAD_LETTERS, "route" => route.name().to_string(), "result" => outcome)
                .increment(1);
            let f = &mut failures[letter.record];
            match result {
                Ok(()) => sent.entry(letter.record).or_default().push(letter.route),
                Err(PublishError::Permanent(e)) => {
                    tracing::error!(event_id = %f.id, route = %route.name(), sink, topic, "the dead letter was refused for good; the event is recorded failed without it: {e}");
                    f.reason = format!(
                        "{} (its dead letter to `{sink}`/`{topic}` was refused for good: {e})",
                        f.reason
                    );
                }
                Err(e) => {
                    tracing::warn!(event_id = %f.id, route = %route.name(), sink, topic, "dead letter not acknowledged; the event is retried: {e}");
                    again.entry(letter.record).or_insert((
                        letter.route,
                        format!("dead letter to `{sink}`/`{topic}` not acknowledged ({e})"),
                    ));
                }
            }
        }
        let records: std::collections::BTreeSet<usize> = letters.iter().map(|l| l.record).collect();
        for record in records {
            let f = &mut failures[record];
            match again.remove(&record) {
                None => f.done_legs.retain(|l| !l.ends_with(DEAD_LETTER_LEG)),
                Some((route, why)) => {
                    let r = &self.routes.0[route].config;
                    let exponent = f.attempts.saturating_sub(1).min(20);
                    let delay = r
                        .backoff_min
                        .saturating_mul(1 << exponent)
                        .min(r.backoff_max);
                    f.reason = format!("{why}; the event failed: {}", f.reason);
                    f.kind = FailureKind::Retry {
                        delay: jitter(delay),
                    };
                    for route in sent.remove(&record).into_iter().flatten() {
                        f.done_legs
                            .push(dead_letter_leg(self.routes.0[route].name()));
                    }
                    f.done_legs.sort_unstable();
                    f.done_legs.dedup();
                    report.failed = report.failed.saturating_sub(1);
                    report.retried += 1;
                }
            }
        }
    }

    /// One dead letter, sent and acknowledged.
    async fn send_dead_letter(
        &self,
        letter: &Letter<'_>,
        failure: &Failure,
        first_error_at: chrono::DateTime<Utc>,
    ) -> Result<(), PublishError> {
        let route = &self.routes.0[letter.route];
        let Some(dl) = &route.config.dead_letter else {
            return Ok(());
        };
        let Some(sink) = self.sinks.get(&dl.sink) else {
            return Err(PublishError::Permanent(format!("no sink `{}`", dl.sink)));
        };
        let plugin = self.plugins[letter.route].current().map(|p| p.info.clone());
        let attempts = failure.attempts.to_string();
        let first = first_error_at.to_rfc3339_opts(SecondsFormat::Micros, true);
        let (payload, key, mut headers): (&[u8], &str, Vec<Header<'_>>) = match &letter.claim.row {
            Ok(ev) => {
                let mut h = envelope(ev, &self.pipeline.source, &[]);
                for (k, v) in &ev.headers {
                    if forwarded(k, v) && !h.iter().any(|(hk, _)| *hk == k.as_str()) {
                        h.push((k.as_str(), one_line(v)));
                    }
                }
                (ev.payload.as_slice(), ev.aggregate_id.as_str(), h)
            }
            // A row that is not an event: what could be read of it.
            Err(bad) => {
                let payload = bad
                    .raw
                    .as_ref()
                    .and_then(|r| r.payload.as_deref())
                    .unwrap_or("")
                    .as_bytes();
                let h: Vec<Header<'_>> = vec![
                    (crate::event::ce::ID, one_line(&bad.id)),
                    (crate::event::ce::TYPE, one_line(&bad.event_type)),
                    (
                        crate::event::ce::SOURCE,
                        Cow::Borrowed(self.pipeline.source.as_str()),
                    ),
                    (
                        crate::event::ce::AGGREGATE_TYPE,
                        one_line(&bad.aggregate_type),
                    ),
                    (crate::event::ce::AGGREGATE_ID, one_line(&bad.aggregate_id)),
                ];
                (payload, bad.aggregate_id.as_str(), h)
            }
        };
        headers.extend([
            (
                header::REASON,
                Cow::Owned(
                    one_line(&letter.reason)
                        .chars()
                        .take(MAX_REASON_CHARS)
                        .collect(),
                ),
            ),
            (header::ATTEMPTS, Cow::Borrowed(attempts.as_str())),
            (header::ROUTE, Cow::Borrowed(route.name())),
            (
                header::PLUGIN,
                Cow::Owned(plugin.as_ref().map_or(String::new(), |p| p.name.clone())),
            ),
            (
                header::PLUGIN_VERSION,
                Cow::Owned(plugin.as_ref().map_or(String::new(), |p| p.version.clone())),
            ),
            (header::OWNER, Cow::Borrowed(route.config.owner())),
            (header::FIRST_ERROR_AT, Cow::Borrowed(first.as_str())),
            (header::SOURCE, Cow::Borrowed(self.source.as_str())),
        ]);
        if let Some(contact) = &route.config.owner_contact {
            headers.push((header::OWNER_CONTACT, one_line(contact)));
        }
        let dedup_id = format!(
            "{}:{}:{}:dead-letter",
            self.pipeline.source,
            letter.claim.id(),
            route.name()
        );
        let publish = sink.publish(Outgoing {
            topic: &dl.topic,
            key: Some(key.as_bytes()),
            partition: None,
            headers: &headers,
            payload,
            dedup_id: &dedup_id,
        });
        match tokio::time::timeout(self.pipeline.publish_timeout, publish).await {
            Ok(result) => result,
            Err(_) => Err(PublishError::Unavailable(format!(
                "no acknowledgement within {:?}",
                self.pipeline.publish_timeout
            ))),
        }
    }
}

/// Why an event failed for good on a route, as its failure record says it.
pub(super) fn failed_reason(rejection: &Rejection, attempts: u32) -> String {
    match rejection {
        Rejection::Retryable(r) => format!("gave up after {attempts} attempts: {r}"),
        Rejection::Invalid(r) => r.clone(),
    }
}

/// What an operator did about a failed event: `outroute failed retry`
/// (`Retried`) or `failed discard` (`Discarded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    Retried,
    Discarded,
}

impl Resolution {
    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::Retried => "retried",
            Resolution::Discarded => "discarded",
        }
    }
}

/// The header naming a resolution record's resolution.
pub const RESOLUTION_HEADER: &str = "outroute-resolution";

/// Where a resolution record goes and what it says beside the event.
pub struct ResolutionRecord<'a> {
    pub event: &'a crate::store::FailedEvent,
    pub resolution: Resolution,
    pub route: &'a crate::config::RouteConfig,
    /// The source's name and its CloudEvents `source`.
    pub source: &'a str,
    pub ce_source: &'a str,
}

/// Tell a route's dead-letter topic what became of a failed event it was
/// told about: one record (payload: the event id, the resolution, when,
/// and the failure it resolves; headers: `ce_id` the event id,
/// `outroute-resolution`, the route, owner and source), keyed by the
/// aggregate id so it follows the event's dead letter on its partition.
/// Acknowledged, or the error.
pub async fn send_resolution(
    sinks: &crate::sink::Sinks,
    r: ResolutionRecord<'_>,
    timeout: Duration,
) -> Result<(), PublishError> {
    let Some(dl) = &r.route.dead_letter else {
        return Ok(());
    };
    let Some(sink) = sinks.get(&dl.sink) else {
        return Err(PublishError::Permanent(format!("no sink `{}`", dl.sink)));
    };
    let e = r.event;
    let now = Utc::now();
    let payload = serde_json::json!({
        "event_id": e.id,
        "resolution": r.resolution.as_str(),
        "resolved_at": now.to_rfc3339_opts(SecondsFormat::Micros, true),
        "route": r.route.name,
        "owner": r.route.owner(),
        "reason": e.reason,
        "attempts": e.attempts,
        "first_error_at": e.first_error_at.to_rfc3339_opts(SecondsFormat::Micros, true),
    })
    .to_string();
    let reason = e.reason.as_deref().unwrap_or("");
    let headers: Vec<Header<'_>> = vec![
        (crate::event::ce::ID, Cow::Borrowed(e.id.as_str())),
        (crate::event::ce::TYPE, Cow::Borrowed(e.event_type.as_str())),
        (crate::event::ce::SOURCE, Cow::Borrowed(r.ce_source)),
        (
            crate::event::ce::AGGREGATE_TYPE,
            Cow::Borrowed(e.aggregate_type.as_str()),
        ),
        (
            crate::event::ce::AGGREGATE_ID,
            Cow::Borrowed(e.aggregate_id.as_str()),
        ),
        (RESOLUTION_HEADER, Cow::Borrowed(r.resolution.as_str())),
        (header::REASON, one_line(reason)),
        (header::ROUTE, Cow::Borrowed(r.route.name.as_str())),
        (header::OWNER, Cow::Borrowed(r.route.owner())),
        (header::SOURCE, Cow::Borrowed(r.source)),
    ];
    // Each resolution is news: a retried event that fails again and is
    // discarded later has two.
    let dedup_id = format!(
        "{}:{}:{}:{}:{}",
        r.ce_source,
        e.id,
        r.route.name,
        r.resolution.as_str(),
        now.timestamp_micros()
    );
    let publish = sink.publish(Outgoing {
        topic: &dl.topic,
        key: Some(e.aggregate_id.as_bytes()),
        partition: None,
        headers: &headers,
        payload: payload.as_bytes(),
        dedup_id: &dedup_id,
    });
    match tokio::time::timeout(timeout, publish).await {
        Ok(result) => result,
        Err(_) => Err(PublishError::Unavailable(format!(
            "no acknowledgement within {timeout:?}"
        ))),
    }
}
