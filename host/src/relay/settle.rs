//! What is left of a batch after sending: for each event some route did not
//! deliver, one record — the routes that went through kept as done, the
//! rest retried with backoff, deferred (no attempt counted) or failed for
//! good with the reason — written by the store in one statement per batch.

use super::*;

impl Relay {
    /// What to record for an event some route did not deliver: `None` when
    /// nothing changed (every delivery not done was held back, so the event
    /// simply stays pending). Otherwise one record for the event: the
    /// routes that went through are kept (`route:done` in its done legs,
    /// with every acknowledged leg), and the event comes back for the rest
    /// — failed for good only once no route is left to retry or wait for.
    pub(super) fn left_over(
        &self,
        units: &[(Claim, Plan)],
        fates: &[Fate],
        report: &mut BatchReport,
    ) -> Option<Failure> {
        let claim = &units[0].0;
        let mut done_legs = claim.done_legs.clone();
        let mut parts: Vec<Failure> = Vec::new();
        let (mut delivered, mut held, mut deferred) = (Vec::new(), Vec::new(), false);
        let mut wait: Option<Duration> = None;
        // The routes still to deliver (`None`: every route — a delivery
        // with no route stands for them all).
        // A row that is not an event holds every route: which ones would
        // select it is not known.
        let mut waiting: Option<Vec<String>> = claim.row.is_ok().then(Vec::new);
        for ((unit, plan), fate) in units.iter().zip(fates) {
            if !matches!(fate, Fate::Publish) {
                match (unit.route, waiting.as_mut()) {
                    (Some(r), Some(w)) => w.push(self.routes.0[r].name().to_string()),
                    _ => waiting = None,
                }
            }
            match fate {
                Fate::Publish => {
                    if let Plan::Publish { route, .. } = plan {
                        let name = self.routes.0[*route].name();
                        delivered.push(name);
                        done_legs.push(crate::store::route_done(name));
                    }
                }
                Fate::Held => held.push(unit.route),
                Fate::Fail {
                    route,
                    rejection,
                    broker_retry,
                    done_legs: legs,
                } => {
                    done_legs.extend(legs.iter().cloned());
                    let f = self.failure(claim, *route, rejection, report, *broker_retry);
                    if let FailureKind::Retry { delay } = f.kind {
                        wait = Some(wait.map_or(delay, |w| w.min(delay)));
                    }
                    parts.push(f);
                }
                Fate::Defer {
                    route,
                    reason,
                    delay,
                } => {
                    deferred = true;
                    if let Some(r) = route {
                        report.deferred_routes.insert(*r);
                    }
                    let name = route.map_or("-", |r| self.routes.0[r].name()).to_string();
                    metrics::counter!(m::EVENTS_DEFERRED, "route" => name, "source" => self.source.clone())
                        .increment(1);
                    wait = Some(wait.map_or(*delay, |w| w.min(*delay)));
                    parts.push(self.deferral(claim, *route, reason, *delay));
                }
            }
        }
        done_legs.sort_unstable();
        done_legs.dedup();
        if deferred {
            report.deferred += 1;
        }
        let held_names = || {
            held.iter()
                .map(|r| r.map_or("-", |r| self.routes.0[r].name()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut record = match parts.len() {
            0 if delivered.is_empty() => {
                // Nothing went out and nothing failed: it stays pending. A
                // streamed event cannot (the slot moves on): it waits in the
                // parked queue (once). Nor can one claimed although earlier
                // events hold routes of it, for the routes that do not take
                // it: it is recorded as waiting for its own routes (once),
                // so claims step over it until they are free.
                report.held += 1;
                let streamed = claim.captured.is_some_and(|c| !c.parked);
                if streamed || (!claim.held.is_empty() && !claim.has_state) {
                    let mut f = self.waiting(claim);
                    f.done_legs = done_legs;
                    f.waiting_routes = waiting;
                    return Some(f);
                }
                return None;
            }
            0 => {
                report.held += 1;
                let first = held.first().copied().flatten();
                self.record(
                    claim,
                    first,
                    attempts_so_far(claim),
                    format!(
                        "delivered on route(s) {}; route(s) {} wait behind an earlier event of its aggregate",
                        delivered.join(", "),
                        held_names()
                    ),
                    FailureKind::Retry {
                        delay: Duration::ZERO,
                    },
                )
            }
            1 => parts.remove(0),
            _ => {
                let reason = parts
                    .iter()
                    .map(|p| {
                        format!(
                            "route `{}`: {}",
                            p.route.as_deref().unwrap_or("-"),
                            p.reason
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ");
                let attempts = parts.iter().map(|p| p.attempts).max().unwrap_or(0);
                let hold = parts
                    .iter()
                    .any(|p| matches!(p.kind, FailureKind::Failed { hold: true }));
                let mut first = parts.remove(0);
                first.reason = reason;
                first.attempts = attempts;
                first.kind = FailureKind::Failed { hold };
                first
            }
        };
        // Failed for good only when no route is left to retry or wait for:
        // a route that may still deliver comes back (a route that failed
        // for good is run again then, and fails again or goes through).
        if let Some(delay) = wait {
            record.kind = FailureKind::Retry { delay };
        } else if !held.is_empty() && matches!(record.kind, FailureKind::Failed { .. }) {
            record.kind = FailureKind::Retry {
                delay: Duration::ZERO,
            };
            record.reason = format!(
                "{} (route(s) {} wait behind an earlier event of its aggregate)",
                record.reason,
                held_names()
            );
        }
        record.done_legs = done_legs;
        record.waiting_routes = waiting;
        Some(record)
    }

    /// The record of a deferred event (its route cannot run now:
    /// quarantined, its plugin not loaded, its team's file refused): it
    /// waits `delay` with its attempts unchanged, holding its aggregate.
    pub(super) fn deferral(
        &self,
        claim: &Claim,
        route: Option<usize>,
        reason: &str,
        delay: Duration,
    ) -> Failure {
        let attempts = attempts_so_far(claim);
        self.record(
            claim,
            route,
            attempts,
            reason.to_string(),
            FailureKind::Retry { delay },
        )
    }

    /// The failure record for an event: retry with backoff, or failed.
    pub(super) fn failure(
        &self,
        claim: &Claim,
        route: Option<usize>,
        rejection: &Rejection,
        report: &mut BatchReport,
        broker_retry: bool,
    ) -> Failure {
        let route_name = route
            .map(|i| self.routes.0[i].name().to_string())
            .unwrap_or_else(|| "-".into());
        let verdict = self
            .pipeline
            .verdict(route, rejection, attempts_so_far(claim), broker_retry);
        let (kind, attempts) = (verdict.kind, verdict.attempts);
        match kind {
            FailureKind::Retry { .. } => {
                report.retried += 1;
                metrics::counter!(m::RETRIES, "route" => route_name.clone(), "source" => self.source.clone()).increment(1);
            }
            FailureKind::Failed { .. } => {
                report.failed += 1;
                metrics::counter!(m::EVENTS_FAILED, "route" => route_name.clone(), "source" => self.source.clone()).increment(1);
                tracing::warn!(event_id = %claim.id(), route = %route_name, attempts, reason = %rejection.reason(), "event failed");
            }
        }
        let reason = match kind {
            FailureKind::Failed { .. } => super::dead_letter::failed_reason(rejection, attempts),
            FailureKind::Retry { .. } => rejection.reason().to_string(),
        };
        self.record(claim, route, attempts, reason, kind)
    }

    /// What the store keeps about an event that did not go out.
    pub(crate) fn record(
        &self,
        claim: &Claim,
        route: Option<usize>,
        attempts: u32,
        reason: String,
        kind: FailureKind,
    ) -> Failure {
        let r: Option<&Route> = route.map(|i| &self.routes.0[i]);
        let (aggregate_type, aggregate_id, event_type, sequence) = match &claim.row {
            Ok(e) => (
                e.aggregate_type.clone(),
                e.aggregate_id.clone(),
                e.event_type.clone(),
                e.sequence,
            ),
            Err(b) => (
                b.aggregate_type.clone(),
                b.aggregate_id.clone(),
                b.event_type.clone(),
                b.sequence,
            ),
        };
        let plugin = route
            .and_then(|i| self.plugins[i].current())
            .map(|p| p.info.clone());
        // Bounded: reasons come from plugins and brokers.
        let reason: String = if reason.chars().count() > 2000 {
            format!("{}…", reason.chars().take(2000).collect::<String>())
        } else {
            reason
        };
        Failure {
            id: claim.id().to_string(),
            lane: claim.lane,
            epoch: claim.epoch,
            aggregate_type,
            aggregate_id,
            event_type,
            sequence,
            attempts,
            reason,
            route: r.map(|r| r.name().to_string()),
            waiting_routes: r.map(|r| vec![r.name().to_string()]),
            plugin: plugin.as_ref().map(|p| p.name.clone()),
            plugin_version: plugin.map(|p| p.version),
            kind,
            done_legs: Vec::new(),
            // A streamed event is written whole to the parked queue (the
            // slot moves past it); one read back from the queue is there.
            parked: claim
                .captured
                .filter(|c| !c.parked)
                .map(|c| (c.commit_lsn, crate::store::ParkedEvent::of(&claim.row))),
        }
    }
}
