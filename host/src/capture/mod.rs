//! Log-based capture (`capture = "logical"`): events come from PostgreSQL's
//! write-ahead log through a logical replication slot instead of a claim of
//! the table, and "marking" is advancing the slot.
//!
//! ```text
//!  producer tx commits ─► WAL ─► slot (pgoutput) ─► reader task: decode rows / messages
//!                                                          │ (commit order)
//!  confirm slot position ◄─ delete captured rows ◄─ park what cannot go ◄─ Relay::process
//! ```
//!
//! The one rule that makes it safe: **the slot's confirmed position only
//! moves past a transaction once every event of it was acknowledged by every
//! destination or written, whole, to the parked queue** (`outroute_event_state`
//! with the event itself; see `store/postgres/logical.rs`). A crash anywhere
//! makes the next reader start at the confirmed position and re-publish what
//! followed, with the same event ids: duplicates, never a loss.
//!
//! Order: events arrive in commit order (then insert order within a
//! transaction). An aggregate whose event cannot go now gets a parked queue;
//! every later event of it joins that queue, and the queue is drained in
//! (commit LSN, sequence) order by [`Relay::retry_parked`], in the same task
//! as the stream, so the aggregate is released only after its last parked
//! event went out. Other aggregates never wait.
//!
//! One relay streams at a time: the owner of the capture lease (lane -1).
//! Standbys wait for it; when the owner dies its lease lapses after
//! `relay.lease_ttl`, a standby takes it, ends the old session if PostgreSQL
//! still thinks it is alive, and starts at the confirmed position.
//!
//! Failover: before PostgreSQL 17 a slot does not survive the promotion of
//! a standby. Each stream start checks the slot (`PgStore::check_slot`): one
//! missing on a later timeline than recorded is named as such; for table
//! input whose published rows leave the table (or are marked) the slot is
//! created again and the pending rows re-read, otherwise the source stops
//! and names the LSN range that may have been missed.
//!
//! Memory: the captured events the relay holds at once (read from the
//! stream and not yet handled) are bounded in bytes by a [`Budget`] of
//! `(relay.concurrency × 2 + 1) × relay.max_batch_bytes`; the reader waits
//! for room before it passes an event on, and up to [`READ_AHEAD`] more
//! messages wait in the replication client. One event larger than the
//! budget still goes, alone.
//!
//! Inputs: inserts into the outbox table (`logical.input = "table"`, the
//! mapped columns in text form), or logical messages
//! (`pg_logical_emit_message(true, '<prefix>', <envelope>)`, no table; the
//! envelope is [`Envelope`]).
//!
//! Files: this one runs the capture (the lease, the stream loop, backfill
//! and the parked queue); `connect.rs` opens the slot, `decode.rs` reads the
//! stream into events, `dispatch.rs` hands them to partition workers and
//! follows how far they got, `clean.rs` deletes handled rows and confirms
//! the slot, `pgoutput.rs` decodes the wire format; `binlog.rs` is
//! MariaDB's binlog capture on the same workers.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use chrono::{DateTime, NaiveDateTime, Utc};
use pgwire_replication::{
    Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent, SslMode, TlsConfig,
};
use serde::Deserialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::{Logical, LogicalInput, StoreConfig, TableConfig};
use crate::event::{Event, Malformed, RawRow};
use crate::failpoint;
use crate::metrics as m;
use crate::pipeline::{LeaseGuard, LeaseView};
use crate::relay::{AbortOnDrop, BatchReport, Relay, sleep_or_cancel};
use crate::store::postgres::{
    CAPTURE_LANE, CLEANUP_CHUNK, CapturedRows, HeldAggregates, PgStore, SlotCheck,
};
use crate::store::{Captured, Claim, Failure, FailureKind};

mod binlog;
mod clean;
mod connect;
mod decode;
mod dispatch;
pub mod pgoutput;
use clean::*;
pub use connect::replication_config;
pub use decode::Envelope;
use decode::*;
use dispatch::*;

/// How often the parked queue is looked at when nothing else happens.
const PARKED_EVERY: Duration = Duration::from_millis(500);

/// How often a partition with nothing parked looks for parked events
/// (another relay parks nothing for this stream; an operator's `failed
/// retry` of an event that held no aggregate waits up to this long).
const PARKED_NONE_EVERY: Duration = Duration::from_secs(5);

/// Replication messages the client reads ahead of the reader task (its
/// default, 8,192, would hold a whole huge transaction of large rows in
/// memory while the sink is slow).
const READ_AHEAD: usize = 16;

/// How often the confirmed position is recorded (one UPDATE; see
/// `PgStore::note_confirmed`).
const CONFIRMED_NOTE_INTERVAL: Duration = Duration::from_secs(30);

impl Relay {
    /// A logical source: wait for the capture lease, stream while holding
    /// it, go back to waiting when it is lost. Runs until `shutdown`.
    pub(crate) async fn run_capture(
        self: Arc<Self>,
        mut leases: watch::Receiver<LeaseView>,
        shutdown: CancellationToken,
    ) {
        if self.queues().is_none() {
            tracing::error!("a streaming source on a store that cannot stream");
            return;
        }
        let mut standby_logged = false;
        while !shutdown.is_cancelled() {
            let view = leases.borrow_and_update().clone();
            let held = Instant::now() < view.valid_until && view.lanes.contains(&CAPTURE_LANE);
            if !held {
                if !standby_logged {
                    tracing::info!(
                        "standby: waiting for the capture lease (another relay streams)"
                    );
                    standby_logged = true;
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = leases.changed() => {},
                    _ = tokio::time::sleep(self.config.lease_ttl / 3) => {},
                }
                continue;
            }
            standby_logged = false;
            let span = tracing::info_span!("capture");
            let streamed = match self.queues() {
                Some(Queues::Pg(pg)) => {
                    self.clone()
                        .stream(pg, &view, leases.clone(), &shutdown)
                        .instrument(span)
                        .await
                }
                Some(Queues::MySql(my)) => {
                    self.clone()
                        .stream_binlog(my, &view, leases.clone(), &shutdown)
                        .instrument(span)
                        .await
                }
                None => return,
            };
            match streamed {
                Ok(()) => {}
                Err(e) => {
                    self.health.store_failed(&e);
                    tracing::warn!(
                        "capture stopped, resuming from the slot's confirmed position: {e:#}"
                    );
                    sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                }
            }
        }
    }

    /// Stream from the slot while the capture lease of `view` holds.
    ///
    /// The reader decodes the stream; this dispatcher hands each event to
    /// one of `relay.concurrency` partition workers by its aggregate (so an
    /// aggregate is only ever in one worker, which handles its events in
    /// order), and every transaction end to all of them as a numbered mark.
    /// A mark is confirmed to the slot once every worker reported it: all
    /// events before it are handled by then, whichever worker had them.
    async fn stream(
        self: Arc<Self>,
        pg: &PgStore,
        view: &LeaseView,
        leases: watch::Receiver<LeaseView>,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        let Some(logical) = self.capture.clone() else {
            bail!("not a logical source");
        };
        // A promotion may have taken the slot (before PostgreSQL 17): say
        // what may have been missed; re-create it and re-read the table
        // where the pending rows are exactly what may have been missed.
        match pg.check_slot().await? {
            SlotCheck::Present => {}
            c if pg.recovers_from(&c) => {
                tracing::warn!("{}", pg.slot_gone(&c));
                for line in pg.setup_capture().await? {
                    tracing::warn!("{line}");
                }
            }
            c => bail!("{}", pg.slot_gone(&c)),
        }
        if logical.input == LogicalInput::Table {
            let adopted = pg
                .bounded(
                    "taking over events that failed in lease mode",
                    pg.adopt_lease_failures(),
                )
                .await?;
            if adopted > 0 {
                tracing::info!(
                    adopted,
                    "events that failed in lease mode are parked: their aggregates wait behind them \
                     and `outroute failed retry` retries them"
                );
            }
            let epoch = view.epoch_of(CAPTURE_LANE).unwrap_or(-1);
            let guard = LeaseGuard::new(leases.clone(), view, vec![CAPTURE_LANE]);
            if !self.backfill(pg, guard, epoch, shutdown).await? {
                return Ok(());
            }
        }
        let client = self.connect_slot(pg, &logical).await?;
        tracing::info!(slot = %logical.slot, "streaming from the replication slot");
        metrics::counter!(m::LEASE_HANDOVERS, "source" => self.source.clone()).increment(1);
        let batch = self.config.batch_size as usize;
        let (tx, mut rx) = mpsc::channel::<Result<Item>>(4 * batch);
        let (confirm_tx, confirm_rx) = watch::channel(Lsn(0));
        let table_oid = match logical.input {
            LogicalInput::Table => pg.table_oid().await?,
            LogicalInput::Messages => None,
        };
        let reader = Reader {
            input: logical.input,
            prefix: logical.message_prefix.clone(),
            table: self.store_table.clone(),
            table_oid,
            relations: pgoutput::Relations::default(),
            shapes: Default::default(),
            open: None,
            budget: Budget::of(&self.config),
        };
        let reader = tokio::spawn(reader.run(client, tx, confirm_rx).in_current_span());
        let _stop_reader = AbortOnDrop(reader);

        let Partitions {
            k,
            feeds,
            mut workers,
            mut progress,
            stop,
        } = self.clone().start_partitions(view, &leases, shutdown);
        let _stop_workers = stop.clone().drop_guard();
        // The cleaner deletes the rows before each confirmed mark (marks
        // that come within CLEANUP_LINGER of each other share a statement),
        // then confirms the slot up to it.
        let (cleaner, cleanups) = mpsc::channel::<CleanupJob>(4);
        let cleaner_task = tokio::spawn(
            self.clone()
                .clean(
                    cleanups,
                    confirm_tx,
                    LeaseGuard::new(leases.clone(), view, vec![CAPTURE_LANE]),
                )
                .in_current_span(),
        );
        let _stop_cleaner = AbortOnDrop(cleaner_task);
        // Marks not yet confirmed (number, position, the sequence numbers of
        // the events handed out before it).
        let mut marks: std::collections::VecDeque<(u64, Lsn, CapturedRows)> = Default::default();
        let mut since_mark = CapturedRows::default();
        let by_id = pg.deletes_by_id();
        let mut next_mark = 0u64;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    // Graceful: the workers finish their in-flight batches,
                    // then what they reported is confirmed.
                    if let Some(all) = progress.finish(&stop, &mut workers).await {
                        let _ = cleaner.send(confirmable(&mut marks, all)).await;
                    }
                    drop(cleaner);
                    // Let the cleaner finish and the reader pass the position on.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    return Ok(());
                }
                ended = workers.join_next() => return worker_ended(ended),
                Some(all) = progress.next() => {
                    let Some(all) = all else { continue };
                    if marks.front().is_some_and(|(n, _, _)| *n <= all)
                        && cleaner.send(confirmable(&mut marks, all)).await.is_err()
                    {
                        bail!("the cleanup task stopped; resuming from the confirmed position");
                    }
                }
                item = rx.recv() => {
                    let item = match item {
                        None => bail!("the replication reader stopped"),
                        Some(Err(e)) => return Err(e),
                        Some(Ok(item)) => item,
                    };
                    let (lsn, at) = match item {
                        Item::Event(c, room) => {
                            match &c.row {
                                Ok(e) => since_mark.push(e.sequence, by_id.then_some(e.id.as_str())),
                                Err(m) if m.sequence > 0 => {
                                    since_mark.push(m.sequence, by_id.then_some(m.id.as_str()))
                                }
                                Err(_) => {}
                            }
                            let w = Partition::of_aggregate(&aggregate_key(&c), k);
                            // A worker that ended: join_next says why.
                            let _ = feeds[w].send(Feed::Event(c, room)).await;
                            continue;
                        }
                        Item::Commit { end, at } => (end, Some(at)),
                        Item::Idle { at } => (at, None),
                    };
                    marks.push_back((next_mark, lsn, std::mem::take(&mut since_mark)));
                    for f in &feeds {
                        let _ = f.send(Feed::Mark(next_mark, at)).await;
                    }
                    next_mark += 1;
                }
            }
        }
    }

    /// Publish the rows written before the slot existed (recorded by
    /// `outroute migrate` when it created the slot) from the table, batch
    /// after batch in order, before the stream starts: the stream will never
    /// bring them. Handled like streamed events (an aggregate with a parked
    /// queue parks them behind it; failures park), then their rows are
    /// cleaned up and the progress recorded, fenced by the capture lease.
    /// A crash re-publishes at most the batch in flight. False: stopped
    /// (shutdown or lease lost) before the end.
    async fn backfill(
        &self,
        pg: &PgStore,
        mut lease: LeaseGuard,
        epoch: i64,
        stop: &CancellationToken,
    ) -> Result<bool> {
        let mut outage_backoff = Duration::from_millis(100);
        let mut published = 0usize;
        let mut announced = false;
        loop {
            if stop.is_cancelled() || !lease.still_valid() {
                return Ok(false);
            }
            let Some(claims) = pg
                .bounded(
                    "reading the backfill",
                    pg.backfill_batch(self.config.batch_size),
                )
                .await?
            else {
                return Ok(true);
            };
            let Some(last) = claims.last().map(|c| (c.sequence(), c.id().to_string())) else {
                if !pg
                    .bounded(
                        "recording backfill progress",
                        pg.backfill_progress(None, epoch),
                    )
                    .await?
                {
                    return Ok(false);
                }
                tracing::info!(
                    published,
                    "published the rows written before the slot; streaming"
                );
                return Ok(true);
            };
            if !announced {
                tracing::info!(
                    "publishing the rows written before the slot existed, from the table"
                );
                announced = true;
            }
            let by_id = pg.deletes_by_id();
            let mut rows = CapturedRows::default();
            for c in &claims {
                rows.push(c.sequence(), by_id.then_some(c.id()));
            }
            let held = pg
                .bounded("reading held aggregates", pg.held_aggregates())
                .await?;
            let Some((report, _)) = self
                .hand_on(claims, &held, &mut lease, stop, &mut outage_backoff)
                .await?
            else {
                return Ok(false);
            };
            published += report.published;
            failpoint::hit("mid-mark");
            pg.delete_captured(&rows).await?;
            if !pg
                .bounded(
                    "recording backfill progress",
                    pg.backfill_progress(Some((last.0, &last.1)), epoch),
                )
                .await?
            {
                return Ok(false);
            }
        }
    }

    /// Publish the parked events whose turn came: the due head of each
    /// aggregate's queue and the due events behind it, in order. Returns how
    /// many left the queue.
    pub(crate) async fn retry_parked(
        &self,
        queues: Queues<'_>,
        aggregates: &HeldAggregates,
        lease: &mut LeaseGuard,
    ) -> Result<u64> {
        let mut claims = queues.heads(aggregates, self.config.batch_size).await?;
        if claims.is_empty() {
            return Ok(0);
        }
        lease.stamp(&mut claims);
        let n = claims.len();
        let report = self.process(claims, Some(lease)).await?;
        tracing::debug!(
            events = n,
            published = report.published,
            "parked events retried"
        );
        Ok(report.published as u64)
    }

    /// The record of a captured event that waits behind an earlier event of
    /// its aggregate: parked with its attempts unchanged.
    pub(crate) fn waiting(&self, claim: &Claim) -> Failure {
        let attempts = crate::pipeline::attempts_so_far(claim);
        self.record(
            claim,
            None,
            attempts,
            "waiting behind an earlier event of its aggregate".into(),
            FailureKind::Retry {
                delay: Duration::ZERO,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aggregate_lands_in_one_partition_whether_owned_or_borrowed() {
        // The dispatcher hashes borrowed keys, `Partition::own` the parked
        // queues' owned ones: both must pick the same worker.
        for (t, id) in [("order", "o-1"), ("", ""), ("a", "bc"), ("ab", "c")] {
            let owned = (t.to_string(), id.to_string());
            assert_eq!(aggregate_hash(&owned), aggregate_hash(&(t, id)));
            assert_eq!(
                Partition::of_aggregate(&owned, 7),
                Partition::of_aggregate(&(t, id), 7)
            );
        }
        // ("a", "bc") and ("ab", "c") are different aggregates.
        assert_ne!(aggregate_hash(&("a", "bc")), aggregate_hash(&("ab", "c")));
    }

    #[test]
    fn timestamps_in_iso_text() {
        let t = parse_timestamp("2026-12-01 19:56:00.123456+00").unwrap();
        assert_eq!(t.timestamp_micros() % 1_000_000, 123_456);
        let z = parse_timestamp("2026-12-01 21:56:00+02").unwrap();
        assert_eq!(z, parse_timestamp("2026-12-01 19:56:00+00").unwrap());
        assert!(parse_timestamp("2026-12-01 19:56:00").is_some());
        assert!(parse_timestamp("yesterday").is_none());
    }

    #[test]
    fn a_column_two_keys_map_reaches_both() {
        // `t_outbox`-like: the aggregate id doubles as the event id here.
        let mut t = TableConfig::canonical();
        t.id = "aggregate_id".into();
        t.sequence = None;
        t.event_version = None;
        t.headers = None;
        let cols = [
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "payload",
            "created_at",
        ];
        let rel = pgoutput::Relation {
            namespace: "public".into(),
            name: "outbox".into(),
            columns: cols.iter().map(|c| c.to_string()).collect(),
            types: vec![25, 25, 25, 3802, 1184],
        };
        let shape = RowShape::of(&rel, &t);
        let text = |s: &str| pgoutput::Value::Text(s.into());
        let values = vec![
            text("order"),
            text("o-1"),
            text("order-paid"),
            text(r#"{"total":1}"#),
            text("2026-12-01 19:56:00.5+00"),
        ];
        let e = shape.row(&t, values).validate().unwrap();
        assert_eq!((e.id.as_str(), e.aggregate_id.as_str()), ("o-1", "o-1"));
        assert_eq!(
            (e.aggregate_type.as_str(), e.event_type.as_str()),
            ("order", "order-paid")
        );
        assert_eq!(e.payload, br#"{"total":1}"#.to_vec());
        // Without a sequence column the commit-time order stands in.
        assert_eq!(e.sequence, e.created_at.timestamp_micros());
    }

    #[test]
    fn envelopes_become_rows_or_reasons() {
        let at = Utc::now();
        let ok = envelope_event(
            br#"{"id":"e1","aggregate_type":"order","aggregate_id":"42","event_type":"order-paid","payload":{"total": 10},"headers":{"traceparent":"00-x"}}"#,
            Lsn(100),
            at,
        )
        .unwrap();
        assert_eq!(ok.id, "e1");
        assert_eq!(ok.sequence, 100);
        assert_eq!(ok.payload, br#"{"total": 10}"#.to_vec());
        assert_eq!(ok.traceparent(), Some("00-x"));
        let bad = envelope_event(b"{not json", Lsn(200), at).unwrap_err();
        assert!(
            bad.reason.contains("not an outroute envelope"),
            "{}",
            bad.reason
        );
        let no_payload = envelope_event(
            br#"{"id":"e2","aggregate_id":"1","event_type":"x"}"#,
            Lsn(300),
            at,
        )
        .unwrap_err();
        assert_eq!(no_payload.reason, "payload is NULL");
        let no_id = envelope_event(
            br#"{"id":" ","aggregate_id":"1","event_type":"x","payload":{}}"#,
            Lsn(400),
            at,
        )
        .unwrap_err();
        assert_eq!(no_id.reason, "the envelope's `id` is empty");
        assert_eq!(no_id.id, format!("lsn-{}", Lsn(400).to_pg_string()));
    }
}
