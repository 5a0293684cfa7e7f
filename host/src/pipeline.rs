//! The batch pipeline: planned events → messages handed to sinks → broker
//! acknowledgements → what becomes of each event (mark, hold, retry, fail).
//!
//! A batch here is a list of *deliveries*: an event and one route that
//! selected it. Routes are subscriptions: an event three routes select is
//! three deliveries, each with its own plugin answer, messages, retries and
//! failure, and `relay/mod.rs` marks the event once every delivery went
//! through (`Claim::route`, `Plan::Done`).
//!
//! This is where the ordering promise of `../shared/DESIGN.md` is kept. For
//! one aggregate on one route, under `relay.ordering` (another route's
//! deliveries of the aggregate are never held back by this one's):
//!
//! | what happens to an earlier event X1        | `aggregate`                        | `strict`                  | `none`        |
//! |--------------------------------------------|------------------------------------|---------------------------|---------------|
//! | refused before sending (plugin, allow-list)| later events held                  | later events held         | others go     |
//! | refused when handed to the client (send)   | later events of the batch not sent | not sent                  | others go     |
//! | fails at ack time after X2 was sent        | X2 not marked (re-sent after X1); counted as an order risk | cannot happen: X2 is sent only after X1's ack | others go |
//! | sink reconnected since X1 was sent         | X1's ack awaited before X2 is sent | (already so)              | others go     |
//! | (NATS) X1 unacknowledged when X2 is due     | X1's ack awaited before X2 is sent | (already so)              | others go     |
//!
//! The NATS row is there because a NATS client may write X1 to a connection
//! that dies and X2, still buffered, to the next one: the fault proxy test
//! (`tests/tests/network_faults.rs`) saw exactly that. Kafka's idempotent
//! producer re-sends in sequence, so on Kafka many events of one aggregate
//! are in flight at once.
//!
//! "Held" events stay pending with no attempt counted and come back in the
//! next batch. Whatever inversion could not be prevented is counted
//! (`outroute_order_risk_total{sink}`) and logged with both event ids, never
//! silent. The pipeline never touches the store: `relay.rs` claims before it
//! and marks/records after it, so it is unit-tested below with a scripted
//! sink that fails chosen messages at send or at ack time.

// Per-batch maps: foldhash (see host/Cargo.toml), not SipHash.
use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::Instrument;

use crate::config::{DefaultKey, OnFailure, Ordering};
use crate::event::{Rejection, envelope};
use crate::failpoint;
use crate::metrics as m;
use crate::routing::Routes;
use crate::sink::{Ack, Outgoing, PublishError, Sinks};
use crate::store::{Claim, FailureKind};

mod lease;
pub use lease::{LeaseGuard, LeaseView};

/// What happens to one event of a batch, decided before publishing.
#[derive(Debug)]
pub enum Plan {
    /// Publish these messages, then mark.
    Publish {
        route: usize,
        messages: Vec<crate::event::Message>,
    },
    /// An earlier event of the same aggregate did not go through: leave this
    /// one pending (it is claimed again once the earlier one is resolved).
    Held,
    /// An earlier attempt already delivered the event on this route (its
    /// other routes did not all go through then): nothing to send.
    Done,
    /// Record a failed attempt (retry or failed state).
    Fail {
        route: Option<usize>,
        rejection: Rejection,
    },
    /// The event waits `delay` (recorded as a retry with no attempt
    /// counted), holding its aggregate: its route is quarantined or its
    /// plugin not loaded, or (`route: None`) the route that would take it
    /// belongs to a team whose file is refused.
    Defer {
        route: Option<usize>,
        reason: String,
        delay: Duration,
    },
}

/// What became of one event once its messages were sent and acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Every message acknowledged: mark it published.
    Publish,
    /// Not sent, or sent but an earlier event of its aggregate failed: stays
    /// pending, no attempt counted.
    Held,
    /// A failed attempt: retry with backoff or the failed state.
    Fail {
        route: Option<usize>,
        rejection: Rejection,
        /// The broker was unreachable: wait for it, never use up attempts.
        broker_retry: bool,
        /// Fan-out legs acknowledged so far (this attempt and earlier ones):
        /// the retry sends only the others.
        done_legs: Vec<String>,
    },
    /// Not sent (see [`Plan::Defer`]): waits `delay`, no attempt counted.
    Defer {
        route: Option<usize>,
        reason: String,
        delay: Duration,
    },
}

/// How one batch went through the sinks.
#[derive(Debug, Default)]
pub struct Delivery {
    /// Same index as the batch.
    pub fates: Vec<Fate>,
    /// Every publish failed with "unavailable": the broker is likely down.
    pub outage: Option<String>,
    /// Events acknowledged after an earlier event of their aggregate failed
    /// at ack time (their first delivery is out of order).
    pub order_risks: usize,
}

/// Retry or fail, decided in one place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    pub kind: FailureKind,
    /// Attempts including this one.
    pub attempts: u32,
}

impl Verdict {
    /// Does this failure hold back later events of its aggregate?
    pub fn holds_aggregate(&self) -> bool {
        matches!(
            self.kind,
            FailureKind::Retry { .. } | FailureKind::Failed { hold: true }
        )
    }
}

/// The sinks and rules a batch is delivered with.
pub struct Pipeline {
    pub routes: Arc<Routes>,
    pub sinks: Sinks,
    pub ordering: Ordering,
    /// How long a broker may take to acknowledge.
    pub publish_timeout: Duration,
    /// CloudEvents `source` attribute.
    pub source: String,
}

/// What order is kept within: one aggregate on one route. Routes are
/// subscriptions, so a failure on one route never holds the aggregate's
/// events back on another.
type Aggregate<'a> = (Option<usize>, &'a str, &'a str);

fn aggregate_of(c: &Claim) -> Aggregate<'_> {
    match &c.row {
        Ok(e) => (c.route, &e.aggregate_type, &e.aggregate_id),
        Err(b) => (c.route, &b.aggregate_type, &b.aggregate_id),
    }
}

pub(crate) fn attempts_so_far(c: &Claim) -> u32 {
    c.row.as_ref().map(|e| e.attempts).unwrap_or(0)
}

impl Pipeline {
    fn ordered(&self) -> bool {
        self.ordering != Ordering::None
    }

    /// Retry (with its backoff) or fail (holding the aggregate or not) for
    /// a failed attempt of an event with `prior` failed attempts. A broker
    /// that is unreachable is an infrastructure problem, not the event's: it
    /// waits with backoff for as long as it takes and never uses attempts.
    pub fn verdict(
        &self,
        route: Option<usize>,
        rejection: &Rejection,
        prior: u32,
        broker_retry: bool,
    ) -> Verdict {
        let r = route.map(|i| &self.routes.0[i].config);
        let attempts = if broker_retry { prior } else { prior + 1 };
        let max_attempts = r.map(|r| r.max_attempts).unwrap_or(1);
        let kind = match rejection {
            Rejection::Retryable(_) if broker_retry || attempts < max_attempts => {
                let (min, max) = r
                    .map(|r| (r.backoff_min, r.backoff_max))
                    .unwrap_or_default();
                let exponent = if broker_retry {
                    3
                } else {
                    attempts.saturating_sub(1).min(20)
                };
                FailureKind::Retry {
                    delay: crate::backoff::jitter(min.saturating_mul(1 << exponent).min(max)),
                }
            }
            _ => FailureKind::Failed {
                hold: self.ordered()
                    && r.map(|r| r.on_failure).unwrap_or(OnFailure::Block) == OnFailure::Block,
            },
        };
        Verdict { kind, attempts }
    }

    /// Deliver a planned batch: hold what an earlier failure blocks, send,
    /// await acks, and decide each event's fate.
    pub async fn deliver(
        &self,
        events: &mut [(Claim, Plan)],
        lease: Option<&mut LeaseGuard>,
    ) -> Delivery {
        // Refused before sending: later events of that aggregate wait.
        if self.ordered() {
            let mut held: HashSet<Aggregate<'_>> = HashSet::new();
            for (claim, plan) in events.iter_mut() {
                let claim: &Claim = claim;
                let key = aggregate_of(claim);
                if matches!(plan, Plan::Done) {
                    // Delivered by an earlier attempt: nothing to hold.
                } else if held.contains(&key) {
                    *plan = Plan::Held;
                } else if matches!(plan, Plan::Held | Plan::Defer { .. }) {
                    // Left for later (quarantine, batch split): so are the
                    // aggregate's later events.
                    held.insert(key);
                } else if let Plan::Fail { route, rejection } = plan
                    && self
                        .verdict(*route, rejection, attempts_so_far(claim), false)
                        .holds_aggregate()
                {
                    held.insert(key);
                }
            }
        }
        let sent = self.send_all(events, None, lease).await;
        // An outage: nothing at all got through (had a fan-out leg been
        // acknowledged, its event's failure must be recorded with it).
        let outage = (!sent.acks.is_empty()
            && sent.acked_legs.is_empty()
            && sent
                .acks
                .values()
                .all(|r| matches!(r, Err(PublishError::Unavailable(_)))))
        .then(|| {
            sent.acks
                .values()
                .find_map(|r| r.as_ref().err().map(|e| e.to_string()))
                .unwrap_or_default()
        });
        let fates = self.decide(events, &sent);
        Delivery {
            fates,
            outage,
            order_risks: sent.order_risks,
        }
    }

    /// Acks → fates. An event is marked only when every message of it was
    /// acknowledged and no earlier event of its aggregate failed.
    fn decide(&self, events: &[(Claim, Plan)], sent: &Sent) -> Vec<Fate> {
        let acks = &sent.acks;
        let ordered = self.ordered();
        let mut held: HashSet<Aggregate<'_>> = HashSet::new();
        let mut fates = Vec::with_capacity(events.len());
        for (i, (claim, plan)) in events.iter().enumerate() {
            let agg = aggregate_of(claim);
            if ordered && held.contains(&agg) && !matches!(plan, Plan::Done) {
                fates.push(Fate::Held);
                continue;
            }
            let fate = match plan {
                Plan::Held => Fate::Held,
                Plan::Done => Fate::Publish,
                Plan::Publish { route, .. } => match acks.get(&i) {
                    // Never sent (held back, or publishing stopped early).
                    None => Fate::Held,
                    Some(Ok(())) => Fate::Publish,
                    Some(Err(e)) => {
                        let rejection = match e {
                            PublishError::Unavailable(r) | PublishError::Retryable(r) => {
                                Rejection::Retryable(r.clone())
                            }
                            PublishError::Permanent(r) => Rejection::Invalid(r.clone()),
                        };
                        let mut done_legs = claim.done_legs.clone();
                        if let Some(legs) = sent.acked_legs.get(&i) {
                            done_legs.extend(legs.iter().cloned());
                        }
                        Fate::Fail {
                            route: Some(*route),
                            rejection,
                            broker_retry: matches!(e, PublishError::Unavailable(_)),
                            done_legs,
                        }
                    }
                },
                Plan::Fail { route, rejection } => Fate::Fail {
                    route: *route,
                    rejection: rejection.clone(),
                    broker_retry: false,
                    done_legs: claim.done_legs.clone(),
                },
                Plan::Defer {
                    route,
                    reason,
                    delay,
                } => Fate::Defer {
                    route: *route,
                    reason: reason.clone(),
                    delay: *delay,
                },
            };
            let holds = match &fate {
                Fate::Publish => false,
                Fate::Held | Fate::Defer { .. } => true,
                Fate::Fail {
                    route,
                    rejection,
                    broker_retry,
                    ..
                } => self
                    .verdict(*route, rejection, attempts_so_far(claim), *broker_retry)
                    .holds_aggregate(),
            };
            if ordered && holds {
                held.insert(agg);
            }
            fates.push(fate);
        }
        fates
    }

    /// Hand every message of every `Plan::Publish` to its sink, in batch
    /// order, then await the acknowledgements; result per event index (no
    /// entry: not sent). `replay` tags broker-side dedup ids (JetStream
    /// `Nats-Msg-Id`) so a deliberate re-publish is not dropped as a
    /// duplicate; consumers still see the same `ce_id`.
    pub async fn send_all(
        &self,
        events: &[(Claim, Plan)],
        replay: Option<&str>,
        mut lease: Option<&mut LeaseGuard>,
    ) -> Sent {
        let mut s = Sending::default();
        let ordered = self.ordered() && replay.is_none();
        let strict = ordered && self.ordering == Ordering::Strict;
        'events: for (i, (claim, plan)) in events.iter().enumerate() {
            let (Plan::Publish { messages, route }, Ok(ev)) = (plan, &claim.row) else {
                continue;
            };
            let agg = aggregate_of(claim);
            if ordered && s.stopped.contains(&agg) {
                continue;
            }
            if let Some(l) = lease.as_deref_mut()
                && !l.still_valid()
            {
                tracing::warn!(
                    unsent = events.len() - i,
                    "lane lease lapsed while publishing; the rest of the batch is left to the next owner"
                );
                break;
            }
            if ordered && s.unsettled.contains(&agg) {
                // Strict: the aggregate's previous event must be acknowledged
                // first. Aggregate: only on a sink that may reorder messages
                // in flight (NATS), or one that reconnected since the
                // aggregate last sent on it.
                let must_wait = || {
                    messages.iter().any(|msg| {
                        let Some(sink) = self.sinks.get(&msg.sink) else {
                            return false;
                        };
                        let sent_on = s.session_of.get(&(agg, msg.sink.as_str()));
                        sent_on.is_some()
                            && (!sink.keeps_order_in_flight()
                                || sent_on.is_some_and(|then| *then != sink.session()))
                    })
                };
                if strict || must_wait() {
                    self.settle(&mut s, lease.as_deref()).await;
                    if s.stopped.contains(&agg) {
                        continue;
                    }
                }
            }
            s.acks.insert(i, Ok(()));
            s.sent_by_aggregate.entry(agg).or_default().push(i);
            // One span per event: event id, aggregate, route and the trace id
            // from its `traceparent`, on everything logged while publishing it.
            let span = tracing::debug_span!(
                "event",
                event_id = %ev.id,
                aggregate = %format_args!("{}/{}", ev.aggregate_type, ev.aggregate_id),
                route = self.routes.0[*route].name(),
                trace_id = ev.traceparent().and_then(|t| t.split('-').nth(1)).unwrap_or(""),
            );
            let route_name = self.routes.0[*route].name();
            let default_key = self.routes.0[*route].config.default_key;
            let mut seen: HashMap<(&str, &str), usize> = HashMap::new();
            for msg in messages {
                let Some(sink) = self.sinks.get(&msg.sink) else {
                    s.record(
                        i,
                        &msg.sink,
                        PublishError::Permanent(format!("no sink `{}`", msg.sink)),
                    );
                    if ordered {
                        s.stopped.insert(agg);
                    }
                    continue 'events;
                };
                let headers = envelope(ev, &self.source, &msg.headers);
                // Broker-side dedup id (JetStream `Nats-Msg-Id`): source,
                // event id, route and subject (plus a count for repeats), so
                // the same message re-sent after a crash is dropped, while a
                // plugin that changes its fan-out between attempts can never
                // reuse an id — nor can another source's event with the same
                // id (a table's ids are unique only in that table), nor
                // another route's copy of the event on the same subject.
                let n = seen
                    .entry((msg.sink.as_str(), msg.topic.as_str()))
                    .or_insert(0);
                // `concat`, not `format!`: two ids per message through the
                // formatting machinery were ~2.5 % of the relay's instructions.
                let repeat = (*n > 0).then(|| n.to_string());
                let (id, topic) = (ev.id.as_str(), msg.topic.as_str());
                let source = self.source.as_str();
                let mut dedup = match &repeat {
                    None => [source, ":", id, ":", route_name, ":", topic].concat(),
                    Some(r) => [source, ":", id, ":", route_name, ":", topic, ":", r].concat(),
                };
                let nth = repeat.as_deref().unwrap_or("0");
                let leg = crate::store::leg(route_name, &msg.sink, topic, nth);
                *n += 1;
                // Acknowledged by an earlier attempt (its sibling leg's
                // broker was down): not sent again.
                if replay.is_none() && claim.done_legs.contains(&leg) {
                    continue;
                }
                if let Some(tag) = replay {
                    dedup = format!("{dedup}:replay-{tag}");
                }
                // Kafka: a message without key or partition is keyed by its
                // aggregate so the aggregate stays on one partition.
                let key = match (&msg.key, msg.partition, default_key) {
                    (Some(k), _, _) => Some(k.as_slice()),
                    (None, None, DefaultKey::AggregateId) => Some(ev.aggregate_id.as_bytes()),
                    (None, _, _) => None,
                };
                let out = Outgoing {
                    topic: &msg.topic,
                    key,
                    partition: msg.partition,
                    headers: &headers,
                    payload: &msg.payload,
                    dedup_id: &dedup,
                };
                // An in-flight slot; if none is free, our own unacknowledged
                // messages may be holding them: settle those first.
                let permit = match sink.try_reserve() {
                    Some(p) => p,
                    None => {
                        self.settle(&mut s, lease.as_deref()).await;
                        let reserved = sink.reserve().await;
                        // That may have taken a while: stop if the lanes
                        // moved to another relay meanwhile, or if an earlier
                        // event of this aggregate failed.
                        if lease.as_deref_mut().is_some_and(|l| !l.still_valid()) {
                            s.acks.remove(&i);
                            break 'events;
                        }
                        if ordered && s.failed_earlier(agg, i) {
                            s.acks.remove(&i);
                            continue 'events;
                        }
                        match reserved {
                            Ok(p) => p,
                            Err(e) => {
                                s.record(i, &msg.sink, e);
                                continue 'events;
                            }
                        }
                    }
                };
                let session = sink.session();
                match sink.send(out, permit).instrument(span.clone()).await {
                    Ok(ack) => {
                        s.pending.push((i, msg.sink.as_str(), leg, ack));
                        s.session_of.insert((agg, msg.sink.as_str()), session);
                        s.unsettled.insert(agg);
                    }
                    // Refused at send time: the event's other messages and
                    // the aggregate's later events are not sent.
                    Err(e) => {
                        s.record(i, &msg.sink, e);
                        if ordered {
                            s.stopped.insert(agg);
                        }
                        continue 'events;
                    }
                }
            }
            if replay.is_none() && s.acks.len() == 1 {
                failpoint::hit("mid-publish");
            }
        }
        failpoint::hit("before-ack");
        self.settle(&mut s, lease.as_deref()).await;
        let order_risks = if ordered {
            self.count_order_risks(events, &s)
        } else {
            0
        };
        Sent {
            acks: s.acks,
            acked_legs: s.acked_legs,
            order_risks,
        }
    }

    /// Wait for every pending acknowledgement (bounded by `publish_timeout`
    /// and by the lease's validity) and note every failure against its
    /// event; aggregates with a failed event stop sending.
    async fn settle<'e>(&self, s: &mut Sending<'e>, lease: Option<&LeaseGuard>) {
        let pending = std::mem::take(&mut s.pending);
        if pending.is_empty() {
            return;
        }
        // The wait ends at `publish_timeout` (and a margin) or when the
        // lease ends, whichever comes first. The lease's end moves on with
        // every lease round that renews the batch's lanes: under load a
        // batch's acks may take longer than the lease had left when they
        // began, and cutting them there would send the whole batch again,
        // and again. Lanes released or taken over meanwhile keep the end
        // they had.
        let publish_deadline = Instant::now() + self.publish_timeout + Duration::from_secs(5);
        let first_end = lease.map(|l| l.valid_until());
        let deadline_now = || match lease {
            None => publish_deadline,
            Some(l) => {
                publish_deadline.min(l.renewed_until().or(first_end).unwrap_or(publish_deadline))
            }
        };
        let mut deadline = deadline_now();
        let mut sinks: Vec<&str> = pending.iter().map(|(_, sink, _, _)| *sink).collect();
        sinks.sort_unstable();
        sinks.dedup();
        // The lanes may belong to another relay by now: take back what has
        // not left yet, before waiting and again after a wait the lease cut.
        let lapsed = || lease.is_some_and(|l| Instant::now() >= l.valid_until());
        if lapsed() {
            self.abandon(&sinks).await;
        }
        // Every message is already on its way: awaiting the acks one after
        // the other takes as long as the slowest, with one timer for the
        // batch (a timer and a task slot per ack cost 1–3k instructions per
        // event). An ack that is ready is taken even past the deadline.
        let expired = tokio::time::sleep_until(deadline.into());
        tokio::pin!(expired);
        for (i, sink, leg, ack) in pending {
            let wait = ack.wait();
            tokio::pin!(wait);
            let r = loop {
                tokio::select! {
                    biased;
                    r = &mut wait => break r,
                    () = &mut expired => {
                        // Renewed meanwhile: wait on, to the new end.
                        let later = deadline_now();
                        if later > deadline && Instant::now() < later {
                            deadline = later;
                            expired.as_mut().reset(deadline.into());
                            continue;
                        }
                        break Err(PublishError::Unavailable(
                            "no acknowledgement before the publish deadline (publish_timeout, or the lane lease's end)"
                                .into(),
                        ));
                    }
                }
            };
            match r {
                Ok(()) => s.acked_legs.entry(i).or_default().push(leg),
                Err(e) => s.record(i, sink, e),
            }
        }
        if lapsed() {
            self.abandon(&sinks).await;
        }
        for agg in std::mem::take(&mut s.unsettled) {
            if s.sent_by_aggregate
                .get(&agg)
                .is_some_and(|evs| evs.iter().any(|i| matches!(s.acks.get(i), Some(Err(_)))))
            {
                s.stopped.insert(agg);
            }
        }
    }

    async fn abandon(&self, sinks: &[&str]) {
        for name in sinks {
            if let Some(sink) = self.sinks.get(*name) {
                sink.abandon().await;
            }
        }
    }

    /// An event acknowledged after an earlier event of its aggregate failed
    /// was delivered out of order the first time: count it per sink.
    fn count_order_risks(&self, events: &[(Claim, Plan)], s: &Sending<'_>) -> usize {
        let mut risks = 0;
        for evs in s.sent_by_aggregate.values() {
            let Some(first_failed) = evs
                .iter()
                .position(|i| matches!(s.acks.get(i), Some(Err(_))))
            else {
                continue;
            };
            for later in &evs[first_failed + 1..] {
                if !matches!(s.acks.get(later), Some(Ok(()))) {
                    continue;
                }
                risks += 1;
                let earlier = events[evs[first_failed]].0.id();
                let (claim, plan) = &events[*later];
                if let Plan::Publish { messages, .. } = plan {
                    for sink in messages.iter().map(|m| m.sink.as_str()) {
                        metrics::counter!(m::ORDER_RISK, "sink" => sink.to_string()).increment(1);
                    }
                }
                tracing::warn!(
                    event_id = %claim.id(),
                    earlier_event_id = %earlier,
                    "order risk: acknowledged after an earlier event of its aggregate failed; it stays pending and is re-sent after it"
                );
            }
        }
        risks
    }
}

/// The outcome of [`Pipeline::send_all`].
pub struct Sent {
    /// Per event index: every message acknowledged, or the (worst) error.
    pub acks: HashMap<usize, Result<(), PublishError>>,
    /// Per event index: the legs (`route:sink/topic#n`) acknowledged.
    pub acked_legs: HashMap<usize, Vec<String>>,
    pub order_risks: usize,
}

/// Book-keeping while a batch is being sent.
#[derive(Default)]
struct Sending<'e> {
    acks: HashMap<usize, Result<(), PublishError>>,
    /// (event index, sink, leg, acknowledgement)
    pending: Vec<(usize, &'e str, String, Ack)>,
    acked_legs: HashMap<usize, Vec<String>>,
    /// Aggregates that send nothing more in this batch.
    stopped: HashSet<Aggregate<'e>>,
    /// Aggregates with messages sent since the last settle.
    unsettled: HashSet<Aggregate<'e>>,
    /// Events sent per aggregate, in order.
    sent_by_aggregate: HashMap<Aggregate<'e>, Vec<usize>>,
    /// The sink session an aggregate's last message on a sink went out on.
    session_of: HashMap<(Aggregate<'e>, &'e str), u64>,
}

impl<'e> Sending<'e> {
    /// Note a failed message of event `i` (permanent beats retryable).
    fn record(&mut self, i: usize, sink: &str, e: PublishError) {
        let kind = match e {
            PublishError::Permanent(_) => "permanent",
            PublishError::Retryable(_) => "retryable",
            PublishError::Unavailable(_) => "unavailable",
        };
        metrics::counter!(m::PUBLISH_ERRORS, "sink" => sink.to_string(), "kind" => kind)
            .increment(1);
        tracing::debug!(sink, "publish failed: {e}");
        let slot = self.acks.entry(i).or_insert(Ok(()));
        if !matches!(slot, Err(PublishError::Permanent(_))) {
            *slot = Err(e);
        }
    }

    /// Did an event of `agg` sent before event `i` fail?
    fn failed_earlier(&self, agg: Aggregate<'e>, i: usize) -> bool {
        self.sent_by_aggregate.get(&agg).is_some_and(|evs| {
            evs.iter()
                .take_while(|j| **j < i)
                .any(|j| matches!(self.acks.get(j), Some(Err(_))))
        })
    }
}

#[cfg(test)]
mod tests;
