//! Dispatch: a dispatcher hands each captured event to one of
//! `relay.concurrency` partition workers by its aggregate, and every
//! transaction end to all of them as a numbered mark; a worker keeps up to
//! two batches out; a mark may be confirmed once every worker handled what
//! came before it ([`Progress`]; the confirming is `clean.rs`'s).

use super::*;

/// The aggregate of a claim (also of a malformed row, as far as known).
pub(super) fn aggregate_of(c: &Claim) -> (String, String) {
    let (t, id) = aggregate_key(c);
    (t.to_string(), id.to_string())
}

/// [`aggregate_of`], borrowed.
pub(super) fn aggregate_key(c: &Claim) -> (&str, &str) {
    match &c.row {
        Ok(e) => (&e.aggregate_type, &e.aggregate_id),
        Err(m) => (&m.aggregate_type, &m.aggregate_id),
    }
}

/// A hash of the aggregate, fixed for the process: the dispatcher and every
/// worker agree on it. (A `(String, String)` hashes as its two `str`s.)
pub(super) fn aggregate_hash<A: std::hash::Hash>(aggregate: &A) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0).hash_one(aggregate)
}

/// What the dispatcher hands a partition worker, in stream order.
pub(super) enum Feed {
    Event(Box<Claim>, Option<Room>),
    /// Mark `n`: every event before it has been handed out. Reported back
    /// once this worker handled everything it got before it. With the
    /// commit time of the transaction it ends, if it ends one.
    Mark(u64, Option<DateTime<Utc>>),
}

/// Which aggregates a partition worker owns.
#[derive(Clone, Copy)]
pub(super) struct Partition {
    pub(super) index: usize,
    pub(super) of: usize,
}

impl Partition {
    /// The partition of an aggregate (a hash fixed for the process: every
    /// worker and the dispatcher agree).
    pub(super) fn of_aggregate<A: std::hash::Hash>(aggregate: &A, of: usize) -> usize {
        (aggregate_hash(aggregate) % of.max(1) as u64) as usize
    }

    pub(super) fn own(&self, all: HeldAggregates) -> HeldAggregates {
        all.into_iter()
            .filter(|(a, _)| Self::of_aggregate(a, self.of) == self.index)
            .collect()
    }
}

/// Where a capture's parked queues are. PostgreSQL writes a waiting event
/// whole to `outroute_event_state` (the slot moves past it and may take
/// the row with it); MySQL/MariaDB leaves its row pending in the table
/// with a state record, and reads the rows back from there.
#[derive(Clone, Copy)]
pub(crate) enum Queues<'a> {
    Pg(&'a PgStore),
    MySql(&'a crate::store::mysql::MySqlStore),
}

impl Queues<'_> {
    /// The aggregates with a parked queue, and the routes it holds.
    pub(super) async fn held(&self) -> Result<HeldAggregates> {
        match self {
            Queues::Pg(pg) => {
                pg.bounded("reading held aggregates", pg.held_aggregates())
                    .await
            }
            Queues::MySql(my) => {
                my.bounded("reading held aggregates", my.held_aggregates())
                    .await
            }
        }
    }

    /// The due heads of `held`'s queues and the due events behind them,
    /// in order, up to `limit`.
    pub(super) async fn heads(&self, held: &HeldAggregates, limit: u32) -> Result<Vec<Claim>> {
        match self {
            Queues::Pg(pg) => {
                pg.bounded("reading parked events", pg.parked_heads(held, limit))
                    .await
            }
            Queues::MySql(my) => {
                my.bounded("reading waiting events", my.held_events(held, limit))
                    .await
            }
        }
    }
}

impl Relay {
    /// This source's parked queues, if it streams.
    pub(crate) fn queues(&self) -> Option<Queues<'_>> {
        match self.store.logical() {
            Some(pg) => Some(Queues::Pg(pg)),
            None => self.store.binlog().map(Queues::MySql),
        }
    }
}

/// The partition workers of a stream: the feed of each, the tasks, how
/// far they got, and the token that stops them.
pub(super) struct Partitions {
    pub(super) k: usize,
    pub(super) feeds: Vec<mpsc::Sender<Feed>>,
    pub(super) workers: tokio::task::JoinSet<Result<()>>,
    pub(super) progress: Progress,
    pub(super) stop: CancellationToken,
}

/// How far each partition worker got (the marks they report), and so the
/// last mark every one of them handled: what the stream may confirm.
pub(super) struct Progress {
    reports: mpsc::UnboundedReceiver<(usize, u64)>,
    reached: Vec<Option<u64>>,
}

impl Progress {
    /// Wait for the next report. `Some(all)`: the mark every worker has
    /// handled by now (`None` while one has reported nothing yet); `None`:
    /// every worker is gone.
    pub(super) async fn next(&mut self) -> Option<Option<u64>> {
        let (w, mark) = self.reports.recv().await?;
        Some(self.note(w, mark))
    }

    fn note(&mut self, w: usize, mark: u64) -> Option<u64> {
        self.reached[w] = Some(self.reached[w].map_or(mark, |r| r.max(mark)));
        self.reached.iter().copied().min().flatten()
    }

    /// A graceful end: stop the workers, let them finish their in-flight
    /// batches, and take what they reported. The mark every one handled.
    pub(super) async fn finish(
        &mut self,
        stop: &CancellationToken,
        workers: &mut tokio::task::JoinSet<Result<()>>,
    ) -> Option<u64> {
        stop.cancel();
        while workers.join_next().await.is_some() {}
        while let Ok((w, mark)) = self.reports.try_recv() {
            self.note(w, mark);
        }
        self.reached.iter().copied().min().flatten()
    }
}

/// Why a stream ends once one of its partition workers ended.
pub(super) fn worker_ended(
    ended: Option<Result<Result<()>, tokio::task::JoinError>>,
) -> Result<()> {
    match ended {
        Some(Ok(Ok(()))) | None => Ok(()),
        Some(Ok(Err(e))) => Err(e),
        Some(Err(e)) => Err(anyhow!("a capture worker stopped: {e}")),
    }
}

impl Relay {
    /// Start `relay.concurrency` partition workers for a stream held under
    /// the capture lease of `view`.
    pub(super) fn start_partitions(
        self: Arc<Self>,
        view: &LeaseView,
        leases: &watch::Receiver<LeaseView>,
        shutdown: &CancellationToken,
    ) -> Partitions {
        let k = self.config.concurrency.max(1) as usize;
        let batch = self.config.batch_size as usize;
        let (reached_tx, reached_rx) = mpsc::unbounded_channel::<(usize, u64)>();
        let stop = shutdown.child_token();
        let mut feeds = Vec::with_capacity(k);
        let mut workers = tokio::task::JoinSet::new();
        for w in 0..k {
            let (feed_tx, feed_rx) = mpsc::channel::<Feed>(4 * batch);
            feeds.push(feed_tx);
            let worker = self.clone().partition(
                Partition { index: w, of: k },
                feed_rx,
                reached_tx.clone(),
                LeaseGuard::new(leases.clone(), view, vec![CAPTURE_LANE]),
                stop.clone(),
            );
            workers.spawn(worker.in_current_span());
        }
        Partitions {
            k,
            feeds,
            workers,
            progress: Progress {
                reports: reached_rx,
                reached: vec![None; k],
            },
            stop,
        }
    }
}

/// Batches a partition worker has out at once (see [`Relay::partition`]).
pub(super) const BATCHES_IN_FLIGHT: usize = 2;

/// A partition worker's state between batches.
pub(super) struct Worker {
    pub(super) part: Partition,
    /// Aggregates with a parked queue, and the routes it holds: their
    /// stream events wait behind it on those routes.
    pub(super) held: HeldAggregates,
    pub(super) outage_backoff: Duration,
    /// Batches handed on, oldest first.
    pub(super) out: std::collections::VecDeque<Out>,
    pub(super) reached: mpsc::UnboundedSender<(usize, u64)>,
}

/// What `hand_on` returns, and the backoff it left.
pub(super) type HandedOn = (
    Result<Option<(BatchReport, Vec<(String, String)>)>>,
    Duration,
);

/// Wait for the oldest batch out to end and take its outcome (`None`: it
/// carries only a mark). Cancel-safe: nothing is taken until the task ended.
pub(super) async fn oldest(out: &mut std::collections::VecDeque<Out>) -> Option<HandedOn> {
    let task = out.front_mut()?.task.as_mut()?;
    let ended = (&mut task.0).await;
    if let Some(o) = out.front_mut() {
        o.task = None;
    }
    Some(ended.unwrap_or_else(|e| {
        (
            Err(anyhow!("a capture batch stopped: {e}")),
            Duration::from_millis(100),
        )
    }))
}

/// A batch handed on (or only a mark, queued behind the batches out).
pub(super) struct Out {
    pub(super) task: Option<AbortOnDrop<HandedOn>>,
    /// It holds `relay.batch_size` events (a backlog is being drained).
    pub(super) full: bool,
    /// Hashes of its aggregates (see [`aggregate_hash`]).
    pub(super) aggregates: Vec<u64>,
    pub(super) mark: Option<u64>,
    pub(super) last_commit: Option<DateTime<Utc>>,
}

/// One partition's batch: events in stream order and the last mark seen.
#[derive(Default)]
pub(super) struct Batch {
    pub(super) claims: Vec<Claim>,
    /// The last mark received with (after) these events.
    pub(super) mark: Option<u64>,
    /// Commit time of the last transaction ended in the batch.
    pub(super) last_commit: Option<DateTime<Utc>>,
    /// Its events' share of the capture [`Budget`], given back when the
    /// batch ends.
    pub(super) room: Option<Room>,
}

impl Relay {
    /// Hand a batch of captured events on: those of an aggregate in `held`
    /// join its parked queue untouched; the rest go through `process`, again
    /// and again with backoff while every publish fails (the slot is not
    /// confirmed meanwhile). Returns the report and the aggregates whose
    /// events joined a queue; `None` when stopped, or the lease lost,
    /// during an outage.
    pub(super) async fn hand_on(
        &self,
        mut claims: Vec<Claim>,
        held: &HeldAggregates,
        lease: &mut LeaseGuard,
        stop: &CancellationToken,
        backoff: &mut Duration,
    ) -> Result<Option<(BatchReport, Vec<(String, String)>)>> {
        lease.stamp(&mut claims);
        // (The usual case, nothing parked, needs no per-event lookup.)
        // An aggregate held on every route joins its queue untouched; one
        // held on some routes goes on the others (`Claim::held`), and what
        // its held routes did not take is parked by `process`.
        let (queue, mut go): (Vec<Claim>, Vec<Claim>) = if held.is_empty() {
            (Vec::new(), claims)
        } else {
            let mut claims = claims;
            for c in claims.iter_mut() {
                if let Some(routes) = held.get(&aggregate_of(c)) {
                    c.held.clone_from(routes);
                }
            }
            claims
                .into_iter()
                .partition(|c| c.held.iter().any(|r| r == "*"))
        };
        let report = loop {
            let mut report = self.process(go, Some(&mut *lease)).await?;
            if !report.outage {
                break report;
            }
            go = std::mem::take(&mut report.unsent);
            tracing::warn!(backoff = ?*backoff, reason = report.outage_reason.as_deref().unwrap_or(""), "every publish failed; backing off (the slot is not confirmed)");
            sleep_or_cancel(crate::backoff::jitter(*backoff), stop).await;
            *backoff = (*backoff * 2).min(Duration::from_secs(10));
            if stop.is_cancelled() || !lease.still_valid() {
                return Ok(None);
            }
        };
        *backoff = Duration::from_millis(100);
        let waiting: Vec<Failure> = queue.iter().map(|c| self.waiting(c)).collect();
        if !waiting.is_empty() {
            let n = self.store.record_failures(&waiting).await?;
            if (n as usize) < waiting.len() {
                bail!("capture lease lost while parking events; not confirming");
            }
        }
        Ok(Some((report, queue.iter().map(aggregate_of).collect())))
    }

    /// One partition worker: its aggregates' parked queues and stream
    /// events, batch after batch, in order. Returns `Ok` when the lease or
    /// the stream ends, `Err` when the stream must restart.
    ///
    /// Up to [`BATCHES_IN_FLIGHT`] batches are out at once: while one that
    /// is not full waits for its acknowledgements the next is collected and
    /// handed on, so an event that arrives meanwhile is not held up by it. A batch never
    /// holds an aggregate that one still out holds (collecting stops at the
    /// first such event), so each aggregate's events still go one batch
    /// after the other, in stream order; batches finish, and report their
    /// marks, in the order they started.
    pub(super) async fn partition(
        self: Arc<Self>,
        part: Partition,
        mut feed: mpsc::Receiver<Feed>,
        reached: mpsc::UnboundedSender<(usize, u64)>,
        mut lease: LeaseGuard,
        stop: CancellationToken,
    ) -> Result<()> {
        let Some(pg) = self.queues() else {
            bail!("not a streaming source");
        };
        // This partition's parked queues as the database has them: every
        // relay that owned the stream before wrote its parked events there.
        let mut w = Worker {
            held: part.own(pg.held().await?),
            outage_backoff: Duration::from_millis(100),
            out: Default::default(),
            part,
            reached,
        };
        // The next item of the feed, when collecting stopped before it.
        let mut carry: Option<Feed> = None;
        let mut last_parked = Instant::now() - PARKED_EVERY;
        // The last round moved events: the next comes at once (a long queue
        // drains at batch speed), otherwise every PARKED_EVERY.
        let mut parked_moving = false;
        // The parked queues' time came while batches were out.
        let mut parked_due = false;
        while !stop.is_cancelled() {
            if !lease.still_valid() {
                tracing::warn!("capture lease lost: stopping the stream (a standby takes over)");
                return Ok(());
            }
            // Operators' `failed retry|discard` and earlier owners' records
            // reach this partition's view of the parked queues. With none
            // parked, only a `failed retry` of an event that held nothing
            // can add one: looked for less often.
            let every = if w.held.is_empty() {
                PARKED_NONE_EVERY
            } else {
                PARKED_EVERY
            };
            if last_parked.elapsed() >= every {
                w.held = part.own(pg.held().await?);
                last_parked = Instant::now();
                parked_due |= !w.held.is_empty();
            }
            // Parked events whose turn came, before the stream's later ones;
            // with no batch out, so a queue released here goes before its
            // aggregate's later events.
            if parked_due || parked_moving {
                if !w.out.is_empty() {
                    if !self.finish_oldest(pg, &mut w).await? {
                        return Ok(());
                    }
                    continue;
                }
                parked_due = false;
                let moved = if w.held.is_empty() {
                    0
                } else {
                    self.retry_parked(pg, &w.held, &mut lease).await?
                };
                parked_moving = moved > 0;
                if parked_moving {
                    w.held = part.own(pg.held().await?);
                }
            }
            let wait = if parked_moving {
                Duration::ZERO
            } else {
                PARKED_EVERY
            };
            // Collect the next batch unless enough are out, or the next
            // event is of an aggregate a batch still out holds.
            // A full batch out means a backlog: a second one would not
            // shorten anyone's wait (measured: it cost the drain ~10 %), so
            // the pipeline is for arrivals at a steady rate.
            let busy: HashSet<u64> = w
                .out
                .iter()
                .flat_map(|b| b.aggregates.iter().copied())
                .collect();
            let blocked = w.out.len() >= BATCHES_IN_FLIGHT
                || w.out.back().is_some_and(|b| b.full)
                || matches!(&carry, Some(Feed::Event(c, _))
                    if busy.contains(&aggregate_hash(&aggregate_key(c))));
            if blocked {
                if !self.finish_oldest(pg, &mut w).await? {
                    return Ok(());
                }
                continue;
            }
            // Both branches are cancel-safe: waiting for a task, or for the
            // feed's first item.
            let batch = tokio::select! {
                biased;
                done = oldest(&mut w.out), if !w.out.is_empty() => {
                    if !self.take_in(pg, &mut w, done).await? {
                        return Ok(());
                    }
                    continue;
                }
                batch = self.collect(&mut feed, &mut carry, &busy, wait, &stop) => batch?,
            };
            if batch.claims.is_empty() {
                if let Some(mark) = batch.mark {
                    // It comes after every event of the batches out: the
                    // youngest reports it when it ends (a slot of its own
                    // would keep the next batch from going out).
                    match w.out.back_mut() {
                        Some(last) => {
                            last.mark = Some(mark);
                            if batch.last_commit.is_some() {
                                last.last_commit = batch.last_commit;
                            }
                        }
                        None => {
                            w.out.push_back(Out {
                                task: None,
                                full: false,
                                aggregates: Vec::new(),
                                mark: Some(mark),
                                last_commit: batch.last_commit,
                            });
                            self.finish_oldest(pg, &mut w).await?;
                        }
                    }
                }
                continue;
            }
            failpoint::hit("after-claim");
            // The stream's pace: background work (the backlog gauge) slows
            // while events come slowly and speeds up when they come fast.
            self.paced(batch.claims.len());
            if !self.slow() {
                self.hurry.notify_waiters();
            }
            let now = Utc::now();
            let pickup = metrics::histogram!(m::PICKUP, "source" => self.source.clone());
            for at in batch.claims.iter().filter_map(Claim::committed_at) {
                pickup.record(crate::relay::seconds_since(at, now));
            }
            let aggregates = batch
                .claims
                .iter()
                .map(|c| aggregate_hash(&aggregate_key(c)))
                .collect();
            let (me, held, mut guard, stop) =
                (self.clone(), w.held.clone(), lease.clone(), stop.clone());
            let mut backoff = w.outage_backoff;
            let (claims, room) = (batch.claims, batch.room);
            let full = claims.len() >= self.config.batch_size as usize;
            let task = tokio::spawn(
                async move {
                    let r = me
                        .hand_on(claims, &held, &mut guard, &stop, &mut backoff)
                        .await;
                    drop(room);
                    (r, backoff)
                }
                .in_current_span(),
            );
            w.out.push_back(Out {
                task: Some(AbortOnDrop(task)),
                full,
                aggregates,
                mark: batch.mark,
                last_commit: batch.last_commit,
            });
        }
        // Graceful stop: the batches out finish and report their marks; once
        // one stopped short, the younger ones still finish sending (their
        // marks are not reported: the next reader starts before them).
        let mut reporting = true;
        while !w.out.is_empty() {
            if reporting {
                reporting = self.finish_oldest(pg, &mut w).await?;
            } else {
                let _ = oldest(&mut w.out).await;
                w.out.pop_front();
            }
        }
        Ok(())
    }

    /// Wait for the oldest batch out and take in what became of it. False:
    /// it stopped without finishing (shutdown or lease lost).
    pub(super) async fn finish_oldest(&self, pg: Queues<'_>, w: &mut Worker) -> Result<bool> {
        let done = oldest(&mut w.out).await;
        self.take_in(pg, w, done).await
    }

    /// Take in what became of the oldest batch out (`done`, from
    /// [`oldest`]): the parked queues it added to, then its mark.
    pub(super) async fn take_in(
        &self,
        pg: Queues<'_>,
        w: &mut Worker,
        done: Option<HandedOn>,
    ) -> Result<bool> {
        if let Some((r, backoff)) = done {
            w.outage_backoff = backoff;
            let Some((report, queued)) = r? else {
                return Ok(false);
            };
            if report.failed + report.retried + report.held + report.deferred > 0 {
                w.held = w.part.own(pg.held().await?);
            }
            for aggregate in queued {
                w.held.insert(aggregate, vec!["*".to_string()]);
            }
        }
        let Some(out) = w.out.pop_front() else {
            return Ok(true);
        };
        // Handled (published or parked): the marks before these events
        // may be confirmed (and their rows deleted) once every worker got
        // there.
        if let Some(mark) = out.mark {
            let _ = w.reached.send((w.part.index, mark));
        }
        if let Some(at) = out.last_commit {
            metrics::gauge!(m::CAPTURE_LAG_SECONDS, "source" => self.source.clone())
                .set(((Utc::now() - at).num_milliseconds().max(0) as f64) / 1e3);
        }
        self.health.set_store_ok();
        Ok(true)
    }

    /// Gather a batch from a partition's feed: wait up to `wait` for the
    /// first item, then take what is already there, up to
    /// `relay.batch_size` events or `relay.max_batch_bytes` of payload
    /// (the event that reaches it is the batch's last). Stops before an event whose aggregate is
    /// in `busy` (a batch still out holds it), leaving it in `carry`, where
    /// the next call starts.
    pub(super) async fn collect(
        &self,
        feed: &mut mpsc::Receiver<Feed>,
        carry: &mut Option<Feed>,
        busy: &HashSet<u64>,
        wait: Duration,
        stop: &CancellationToken,
    ) -> Result<Batch> {
        let mut batch = Batch::default();
        let mut bytes = 0u64;
        let mut next = match carry.take() {
            Some(item) => Some(item),
            None => tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(batch),
                item = feed.recv() => item,
                _ = tokio::time::sleep(wait) => return Ok(batch),
            },
        };
        loop {
            match next {
                None => bail!("the stream dispatcher stopped"),
                Some(Feed::Event(c, room)) => {
                    if !busy.is_empty() && busy.contains(&aggregate_hash(&aggregate_key(&c))) {
                        *carry = Some(Feed::Event(c, room));
                        break;
                    }
                    bytes += c.bytes();
                    batch.claims.push(*c);
                    match (&mut batch.room, room) {
                        (Some(all), Some(room)) => all.merge(room),
                        (all, room) => *all = all.take().or(room),
                    }
                }
                Some(Feed::Mark(n, at)) => {
                    batch.mark = Some(n);
                    if at.is_some() {
                        batch.last_commit = at;
                    }
                }
            }
            if batch.claims.len() >= self.config.batch_size as usize
                || bytes >= self.config.max_batch_bytes
            {
                break;
            }
            match feed.try_recv() {
                Ok(item) => next = Some(item),
                Err(_) => break,
            }
        }
        Ok(batch)
    }
}
