//! Binlog capture (`capture = "binlog"`): events come from MariaDB's
//! binary log instead of a claim of the table; rows are still marked
//! published as in lease mode, and the stream's position is recorded in
//! `outroute_binlog`.
//!
//! ```text
//!  producer tx commits ─► binlog (ROW) ─► reader: GTIDs, the table's inserts (commit order)
//!                                                   │
//!  record GTID position ◄─ every worker past it ◄─ Relay::process: publish, mark the rows
//! ```
//!
//! The rule that makes it safe: **the recorded position only moves past a
//! transaction once every event of it was published and its row marked,
//! or recorded in `outroute_event_state` (retrying, failed, or waiting
//! behind an earlier event of its aggregate)**, and its row stays pending
//! in the table until it goes. A crash anywhere makes the next owner start
//! at the recorded position and publish what followed again, with the
//! same ids: duplicates, never a loss. An event that waits is read back
//! from the table, in order, when its turn comes (`store/mysql/binlog.rs`):
//! the table is the parked queue, so nothing needs copying out of it.
//!
//! Order, partition workers, the capture lease (lane -1: one relay
//! streams, standbys take over once it lapses) and the memory budget are
//! those of logical capture (`capture/mod.rs`, `dispatch.rs`).
//!
//! Start: the first time (no recorded position), and whenever the server
//! no longer has the recorded position (its binlog was purged), the
//! stream starts at the position of a consistent snapshot, and the rows
//! still pending in the table are published first (a lease-mode drain):
//! what they hold is exactly what the stream will not bring. So a purged
//! binlog costs duplicates at most, never events.

use super::*;
use crate::store::mysql::{BinlogPosition, MySqlStore};

mod reader;
use reader::{Got, Reader};

/// How often the handled position is recorded (one short transaction);
/// a restart publishes again at most what followed it.
const SAVE_EVERY: Duration = Duration::from_secs(1);

/// How often a position that moved past no event is recorded: the
/// recording is itself a transaction in the binlog, so recording it every
/// tick would keep an idle source writing for ever.
const QUIET_SAVE_EVERY: Duration = Duration::from_secs(60);

impl Relay {
    /// Stream from the binary log while the capture lease of `view` holds.
    pub(super) async fn stream_binlog(
        self: Arc<Self>,
        my: &MySqlStore,
        view: &LeaseView,
        leases: watch::Receiver<LeaseView>,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        let epoch = view.epoch_of(CAPTURE_LANE).unwrap_or(-1);
        let Some((opts, server_id)) = my.replication() else {
            bail!("not a binlog source");
        };
        let (mut position, bound) = match my
            .bounded("reading the binlog position", my.binlog_position())
            .await?
        {
            Some(p) => (p, None),
            None => {
                tracing::info!(
                    "no binlog position recorded: starting at a snapshot's position, after the table's pending rows"
                );
                self.fresh_position(my, epoch).await?
            }
        };
        // Rows the drain published that the stream will bring again: it
        // passes them over.
        let mut drained = HashSet::new();
        if !position.backfilled {
            let guard = LeaseGuard::new(leases.clone(), view, vec![CAPTURE_LANE]);
            let Some(above) = self.drain_table(my, guard, shutdown, bound).await? else {
                return Ok(());
            };
            drained = above;
            position.backfilled = true;
            if !my.save_position(&position, epoch).await? {
                return Ok(());
            }
        }
        let (schema, columns) = my
            .bounded("reading the table's columns", my.binlog_columns())
            .await?;
        let reader = Reader::new(
            self.store_table.clone(),
            self.store_table == crate::config::TableConfig::canonical(),
            schema,
            columns,
            &position.gtid,
            Budget::of(&self.config),
        )?;
        let batch = self.config.batch_size as usize;
        let (tx, mut rx) = mpsc::channel::<Result<Got>>(4 * batch);
        let reader = tokio::spawn(reader.run(opts, server_id, tx).in_current_span());
        let _stop_reader = AbortOnDrop(reader);
        metrics::counter!(m::LEASE_HANDOVERS, "source" => self.source.clone()).increment(1);

        let Partitions {
            k,
            feeds,
            mut workers,
            mut progress,
            stop,
        } = self.clone().start_partitions(view, &leases, shutdown);
        let _stop_workers = stop.clone().drop_guard();
        // Marks not yet handled by every worker (number, the position after
        // them, whether events came since the mark before).
        let mut marks: std::collections::VecDeque<(u64, String, bool)> = Default::default();
        let mut next_mark = 0u64;
        // The position after the last mark every worker handled, and
        // whether events came since the last record.
        let mut handled: Option<(String, bool)> = None;
        let mut saved_at = Instant::now();
        let mut save = tokio::time::interval(SAVE_EVERY);
        save.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut lease = LeaseGuard::new(leases.clone(), view, vec![CAPTURE_LANE]);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    // Graceful: the workers finish their in-flight batches,
                    // then what they reached is recorded.
                    if let Some(all) = progress.finish(&stop, &mut workers).await {
                        handled = merge(handled, handled_up_to(&mut marks, all));
                    }
                    if let Some((gtid, _)) = handled {
                        self.save(my, &gtid, epoch).await?;
                    }
                    return Ok(());
                }
                ended = workers.join_next() => return worker_ended(ended),
                // Before the marks: a replayed backlog keeps them coming
                // without a pause, and the position must still be recorded.
                _ = save.tick() => {
                    if !lease.still_valid() {
                        tracing::warn!("capture lease lost: stopping the stream (a standby takes over)");
                        return Ok(());
                    }
                    // Progress past events goes on record every tick; past
                    // other tables' transactions (and the relay's own
                    // writes, which the binlog holds too) only now and then.
                    let due = handled.as_ref().is_some_and(|(_, events)| *events)
                        || saved_at.elapsed() >= QUIET_SAVE_EVERY;
                    if due && let Some((gtid, _)) = handled.take() {
                        if !self.save(my, &gtid, epoch).await? {
                            return Ok(());
                        }
                        saved_at = Instant::now();
                    }
                }
                Some(all) = progress.next() => {
                    if let Some(all) = all {
                        handled = merge(handled, handled_up_to(&mut marks, all));
                    }
                }
                item = rx.recv() => {
                    let got = match item {
                        None => bail!("the binlog reader stopped"),
                        Some(Err(e)) => return Err(e),
                        Some(Ok(got)) => got,
                    };
                    match got {
                        Got::Event(c, room) => {
                            if !drained.is_empty() && drained.remove(c.id()) {
                                continue;
                            }
                            let w = Partition::of_aggregate(&aggregate_key(&c), k);
                            // A worker that ended: join_next says why.
                            let _ = feeds[w].send(Feed::Event(c, Some(room))).await;
                        }
                        Got::Commit(gtid, events, at) => {
                            marks.push_back((next_mark, gtid, events));
                            for f in &feeds {
                                let _ = f.send(Feed::Mark(next_mark, at)).await;
                            }
                            next_mark += 1;
                        }
                        Got::Purged(why) => {
                            // Nothing was streamed yet: start over at a
                            // snapshot, after the table's pending rows.
                            tracing::warn!(
                                position = %position.gtid,
                                "the server's binary log no longer has the recorded position ({why}): \
                                 starting at a snapshot's position after publishing the table's pending rows \
                                 (events the purged binlog held are still pending in the table: none is lost, \
                                 some may go out twice)"
                            );
                            stop.cancel();
                            while workers.join_next().await.is_some() {}
                            my.bounded("forgetting the binlog position", my.forget_position(epoch))
                                .await?;
                            return Ok(());
                        }
                    }
                }
            }
        }
    }

    /// Record `gtid` as handled (fenced by the capture lease). False: the
    /// lease is lost.
    async fn save(&self, my: &MySqlStore, gtid: &str, epoch: i64) -> Result<bool> {
        let p = BinlogPosition {
            gtid: gtid.to_string(),
            backfilled: true,
        };
        let saved = my
            .bounded("recording the binlog position", my.save_position(&p, epoch))
            .await?;
        if !saved {
            tracing::warn!(
                "capture lease lost before recording the position; the next owner starts from the recorded one"
            );
        }
        Ok(saved)
    }

    /// A snapshot's position, recorded as not backfilled yet (the table's
    /// pending rows come first), and the snapshot's highest sequence
    /// number.
    async fn fresh_position(
        &self,
        my: &MySqlStore,
        epoch: i64,
    ) -> Result<(BinlogPosition, Option<i64>)> {
        let (gtid, bound) = my
            .bounded(
                "reading a snapshot's binlog position",
                my.snapshot_position(),
            )
            .await?;
        let p = BinlogPosition {
            gtid,
            backfilled: false,
        };
        if !my.save_position(&p, epoch).await? {
            bail!("capture lease lost while recording the start position");
        }
        Ok((p, bound))
    }

    /// Publish the table's pending rows, batch after batch as lease mode
    /// claims them (each aggregate in order, rows that wait skipped),
    /// until a claim finds all there is. Returns the ids of the rows it
    /// published above `bound` (the snapshot's highest sequence number):
    /// committed after the stream's start, the stream brings them again.
    /// `None`: stopped (shutdown or lease lost) before the end.
    async fn drain_table(
        &self,
        my: &MySqlStore,
        mut lease: LeaseGuard,
        stop: &CancellationToken,
        bound: Option<i64>,
    ) -> Result<Option<HashSet<String>>> {
        let mut above = HashSet::new();
        let lanes: Vec<i32> = (0..my.lane_count() as i32).collect();
        let mut backoff = Duration::from_millis(100);
        let mut published = 0usize;
        let none = HeldAggregates::new();
        let mut deep_checked = false;
        loop {
            if stop.is_cancelled() || !lease.still_valid() {
                return Ok(None);
            }
            let claimed = my
                .bounded(
                    "reading the table's pending rows",
                    my.claim(&lanes, self.config.batch_size),
                )
                .await?;
            // The drain ends on a deep claim (every lane walked from its
            // start) that found all there is: the stream starts after the
            // rows the drain leaves, so one it misses stays pending for
            // good. (A shallow claim did miss rows: MariaDB's filesort of
            // it evaluated the virtual lane column unread, see
            // `MySqlStore::lane_walk`; the shallow claim now sorts nothing,
            // and the drain still ends on a deep one.)
            if claimed.claims.is_empty() {
                if deep_checked {
                    break;
                }
                my.claim_deep_next(&lanes);
                deep_checked = true;
                continue;
            }
            let deep_drained = deep_checked && claimed.drained;
            deep_checked = false;
            let mut claims = claimed.claims;
            for c in &mut claims {
                c.lane = CAPTURE_LANE;
                if bound.is_some_and(|b| c.sequence() > b) {
                    above.insert(c.id().to_string());
                }
            }
            let Some((report, _)) = self
                .hand_on(claims, &none, &mut lease, stop, &mut backoff)
                .await?
            else {
                return Ok(None);
            };
            published += report.published;
            if deep_drained {
                break;
            }
            if claimed.drained {
                my.claim_deep_next(&lanes);
                deep_checked = true;
            }
        }
        if published > 0 {
            tracing::info!(
                published,
                "published the table's pending rows; streaming from the binary log"
            );
        }
        Ok(Some(above))
    }
}

/// Take the marks up to `all` off the queue: the position after the last,
/// and whether any of them ended a transaction with events.
fn handled_up_to(
    marks: &mut std::collections::VecDeque<(u64, String, bool)>,
    all: u64,
) -> Option<(String, bool)> {
    let mut last: Option<(String, bool)> = None;
    while marks.front().is_some_and(|(n, _, _)| *n <= all) {
        if let Some((_, gtid, events)) = marks.pop_front() {
            let before = last.as_ref().is_some_and(|(_, e)| *e);
            last = Some((gtid, events || before));
        }
    }
    last
}

/// The newer of two handled positions, with events if either had some.
fn merge(old: Option<(String, bool)>, new: Option<(String, bool)>) -> Option<(String, bool)> {
    match (old, new) {
        (Some((_, a)), Some((gtid, b))) => Some((gtid, a || b)),
        (old, None) => old,
        (None, new) => new,
    }
}
