//! The store side of log-based capture (`capture = "logical"`): the slot and
//! publication, the one capture lease, the parked queue and the bulk cleanup.
//!
//! * **Slot and publication.** `outroute migrate` creates a `pgoutput` slot
//!   and a publication of the outbox table's inserts (or an empty one for
//!   tableless `pg_logical_emit_message` capture). The relay refuses to start
//!   when `wal_level` is not `logical` or either is missing, naming the
//!   setting or the key.
//! * **Capture lease.** One relay streams from the slot at a time: the owner
//!   of lane `-1` in `outroute_lanes` (renewed every `lease_ttl / 3`, epoch
//!   bumped on every hand-over). PostgreSQL itself lets only one session hold
//!   a slot; the lease decides *which* relay, bounds how long a frozen owner
//!   can keep sending, and fences the parked-queue writes.
//! * **Parked queue.** An event that cannot go out when the stream brings it
//!   (retry, failed under `block`, quarantined route, or waiting behind an
//!   earlier event of its aggregate) is written to `outroute_event_state`
//!   *with the event itself* before the slot's position moves past it. Per
//!   aggregate the queue is ordered by (commit LSN, sequence); only its head
//!   is ever retried, and while an aggregate has a queue the stream's later
//!   events of it join the queue. `failed retry|discard` work on it as in
//!   lease mode.
//! * **Cleanup.** Captured rows are deleted by ranges of the sequence column
//!   after they were handled (published or parked): one index range scan per
//!   run of consecutive sequence numbers, never an UPDATE per event (by id
//!   when the sequence column has no unique index).

use std::collections::HashSet;

use anyhow::{Context, Result, bail};
use futures::TryStreamExt;
use sqlx::Row;

use super::{PgStore, TableSql, quote};
use crate::config::{Cleanup, LogicalInput};
use crate::failpoint;
use crate::store::{Captured, Claim, Leases, ParkedEvent, SlotStatus, Status};

/// What became of a log-capture source's slot (see [`PgStore::check_slot`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotCheck {
    /// The slot is there.
    Present,
    /// PostgreSQL was promoted since the slot was last seen (timeline
    /// `from` -> `to`) and the slot did not survive it; `confirmed`: the
    /// last position recorded as confirmed on the old timeline.
    LostInFailover {
        from: i64,
        to: i64,
        confirmed: Option<String>,
    },
    /// The slot is gone, and no promotion explains it.
    Missing,
}

/// Aggregates with parked events, each with the routes its parked events
/// wait for (`*`: every route).
pub type HeldAggregates = std::collections::HashMap<(String, String), Vec<String>>;

/// The lane number of the capture lease in `outroute_lanes`.
pub const CAPTURE_LANE: i32 = -1;

/// Most captured rows one cleanup statement deletes (at ~10 µs an index
/// probe, well within any `statement_timeout`).
pub const CLEANUP_CHUNK: usize = 5_000;

/// The table rows of handled captured events, for the cleanup: their
/// sequence numbers, and their ids when the sequence column is not known
/// to be unique ([`PgStore::deletes_by_id`]).
#[derive(Debug, Default)]
pub struct CapturedRows {
    pub seqs: Vec<i64>,
    pub ids: Vec<String>,
}

impl CapturedRows {
    /// Add one handled event's row.
    pub fn push(&mut self, seq: i64, id: Option<&str>) {
        self.seqs.push(seq);
        // (An empty id — a malformed row's NULL — names no row, and would
        // fail the whole statement's cast to the id column's type.)
        if let Some(id) = id.filter(|id| !id.is_empty()) {
            self.ids.push(id.to_string());
        }
    }

    pub fn append(&mut self, mut other: CapturedRows) {
        self.seqs.append(&mut other.seqs);
        self.ids.append(&mut other.ids);
    }

    /// (Every id comes with its row's sequence number.)
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

/// The parked events that still hold their aggregate: waiting, retrying,
/// or failed under the `block` policy (not discarded, not failed under `skip`).
const HOLDING: &str = "source = $1 AND event IS NOT NULL AND discarded_at IS NULL \
     AND NOT (failed_at IS NOT NULL AND blocks_until < 'infinity')";

impl PgStore {
    /// The logical-capture settings, if this source streams.
    pub fn logical(&self) -> Option<&crate::config::Logical> {
        self.logical.as_ref()
    }

    /// This relay's id (lease owner).
    pub fn relay_id(&self) -> &str {
        &self.relay_id
    }

    /// The key of this source's coordination rows.
    pub fn source_key(&self) -> &str {
        &self.source
    }

    async fn wal_level(&self) -> Result<String> {
        Ok(sqlx::query_scalar("SELECT current_setting('wal_level')")
            .fetch_one(&self.pool)
            .await?)
    }

    /// Refuse a server or database that cannot serve this source: `wal_level`
    /// not `logical`, the slot or the publication missing.
    /// The mapped table's oid, as the server resolves its name (the search
    /// path for an unqualified one); `None` when there is no such table.
    pub async fn table_oid(&self) -> Result<Option<u32>> {
        let oid: Option<i64> = sqlx::query_scalar("SELECT to_regclass($1)::oid::bigint")
            .bind(quote(&self.cfg.name))
            .fetch_one(&self.pool)
            .await
            .context("resolving the outbox table")?;
        Ok(oid.and_then(|o| u32::try_from(o).ok()))
    }

    pub(super) async fn check_capture(&self) -> Result<()> {
        let Some(l) = &self.logical else {
            return Ok(());
        };
        let level = self.wal_level().await?;
        if level != "logical" {
            bail!(
                "{}.capture: `logical` needs the server setting `wal_level = logical` (it is `{level}`): \
                 set it in postgresql.conf and restart PostgreSQL, or use `capture = \"lease\"`",
                self.key
            );
        }
        let slot: Option<(Option<String>, bool)> = sqlx::query_as(
            "SELECT plugin::text, database = current_database() FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&l.slot)
        .fetch_optional(&self.pool)
        .await?;
        match slot {
            None => match self.check_slot().await? {
                // The relay re-creates it and re-reads the table.
                c @ SlotCheck::LostInFailover { .. } if self.recovers_from(&c) => {}
                c => bail!("{}", self.slot_gone(&c)),
            },
            Some((plugin, same_db)) if plugin.as_deref() != Some("pgoutput") || !same_db => bail!(
                "{}.logical.slot: slot `{}` is not a pgoutput slot of this database (plugin {:?})",
                self.key,
                l.slot,
                plugin
            ),
            Some(_) => {}
        }
        let publication: Option<bool> =
            sqlx::query_scalar("SELECT p.pubinsert FROM pg_publication p WHERE p.pubname = $1")
                .bind(&l.publication)
                .fetch_optional(&self.pool)
                .await?;
        match publication {
            None => bail!(
                "{}.logical.publication: publication `{}` does not exist (run `outroute migrate`)",
                self.key,
                l.publication
            ),
            Some(false) if l.input == LogicalInput::Table => bail!(
                "{}.logical.publication: publication `{}` does not publish inserts",
                self.key,
                l.publication
            ),
            Some(_) => {}
        }
        if l.input == LogicalInput::Table {
            let listed: bool = sqlx::query_scalar(
                // (by catalog join: casting every listed name to regclass
                // fails for roles without superuser, "permission denied
                // for schema pg_toast")
                "SELECT EXISTS (SELECT 1 FROM pg_publication_tables pt \
                   JOIN pg_namespace n ON n.nspname = pt.schemaname \
                   JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename \
                   WHERE pt.pubname = $1 AND c.oid = to_regclass($2))",
            )
            .bind(&l.publication)
            .bind(quote(&self.cfg.name))
            .fetch_one(&self.pool)
            .await?;
            if !listed && self.partitioned().await? {
                bail!(
                    "{}.logical.publication: publication `{}` publishes the partitions of `{}` under \
                     their own names (ALTER PUBLICATION {} SET (publish_via_partition_root = true))",
                    self.key,
                    l.publication,
                    self.cfg.name,
                    quote(&l.publication)
                );
            }
            if !listed {
                bail!(
                    "{}.logical.publication: publication `{}` does not include table `{}` \
                     (ALTER PUBLICATION {} ADD TABLE {})",
                    self.key,
                    l.publication,
                    self.cfg.name,
                    quote(&l.publication),
                    quote(&self.cfg.name)
                );
            }
            if self.backfill_interrupted().await? {
                bail!("{}", self.interrupted_migrate());
            }
        }
        Ok(())
    }

    /// `outroute migrate` for a logical source: the publication and the
    /// slot, each created if missing. Returns what was done, one line each.
    pub async fn setup_capture(&self) -> Result<Vec<String>> {
        let Some(l) = &self.logical else {
            return Ok(Vec::new());
        };
        let level = self.wal_level().await?;
        if level != "logical" {
            bail!(
                "{}.capture: `logical` needs the server setting `wal_level = logical` (it is `{level}`): \
                 set it in postgresql.conf and restart PostgreSQL",
                self.key
            );
        }
        let mut done = Vec::new();
        let has_pub: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
                .bind(&l.publication)
                .fetch_one(&self.pool)
                .await?;
        if has_pub {
            done.push(format!("publication `{}`: present", l.publication));
        } else {
            let ddl = match l.input {
                // A partitioned table's inserts are published under its own
                // name (else each partition's, which the relay would not
                // recognise as the outbox).
                LogicalInput::Table => format!(
                    "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert'{})",
                    quote(&l.publication),
                    quote(&self.cfg.name),
                    if self.partitioned().await? {
                        ", publish_via_partition_root = true"
                    } else {
                        ""
                    }
                ),
                // Logical messages are sent whatever the publication holds.
                LogicalInput::Messages => format!(
                    "CREATE PUBLICATION {} WITH (publish = 'insert')",
                    quote(&l.publication)
                ),
            };
            sqlx::query(&ddl)
                .execute(&self.pool)
                .await
                .with_context(|| format!("{}.logical.publication: {ddl}", self.key))?;
            done.push(format!("created publication: {ddl}"));
        }
        let has_slot: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
        )
        .bind(&l.slot)
        .fetch_one(&self.pool)
        .await?;
        let table = l.input == LogicalInput::Table;
        if has_slot {
            done.push(format!("replication slot `{}`: present", l.slot));
            if table && self.backfill_interrupted().await? {
                // An earlier migrate created the slot and stopped before it
                // recorded the rows written before it: record them now.
                // Rows committed since the slot was created are then both
                // in the table's record and in the stream: published twice
                // (same id), never lost.
                let lsn: String = sqlx::query_scalar(
                    "SELECT coalesce(confirmed_flush_lsn, restart_lsn)::text FROM pg_replication_slots \
                     WHERE slot_name = $1",
                )
                .bind(&l.slot)
                .fetch_one(&self.pool)
                .await?;
                done.push(format!(
                    "an earlier `outroute migrate` stopped right after creating slot `{}`: recording \
                     the rows written before it now (rows committed since may be published twice)",
                    l.slot
                ));
                done.push(self.record_backfill(&lsn).await?);
                self.end_backfill_marker().await?;
            }
            return Ok(done);
        }
        // Recorded before the slot exists, so that a migrate stopping right
        // after creating it is noticed (the relay refuses to stream, the next
        // migrate records the rows).
        let keep_note = if table {
            self.begin_backfill(l.cleanup).await?
        } else {
            None
        };
        // PostgreSQL 17 and later carry a failover slot over to a standby
        // (with `sync_replication_slots` there): it then survives a promotion.
        let failover: bool =
            sqlx::query_scalar("SELECT current_setting('server_version_num')::int >= 170000")
                .fetch_one(&self.pool)
                .await?;
        let lsn: String = sqlx::query_scalar(if failover {
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
        } else {
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
        })
        .bind(&l.slot)
        .fetch_one(&self.pool)
        .await
        .with_context(|| {
            format!(
                "{}.logical.slot: creating slot `{}` (the role needs REPLICATION; \
                 max_replication_slots may be used up)",
                self.key, l.slot
            )
        })?;
        done.push(format!(
            "created replication slot `{}` (pgoutput{}) at {lsn}: it keeps WAL until the relay \
             confirms it, bounded by the server's max_slot_wal_keep_size",
            l.slot,
            if failover { ", failover" } else { "" }
        ));
        self.record_slot(Some(&lsn)).await?;
        match keep_note {
            Some(note) => {
                done.push(note);
                // (A marker left by an earlier migrate whose slot creation
                // failed would keep relays waiting.)
                self.end_backfill_marker().await?;
            }
            None if table => {
                failpoint::hit("slot-created");
                done.push(self.record_backfill(&lsn).await?);
                self.end_backfill_marker().await?;
            }
            None => {}
        }
        Ok(done)
    }

    /// The server's current timeline (it goes up by one at each promotion).
    async fn timeline(&self) -> Result<i64> {
        sqlx::query_scalar(
            "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int::bigint",
        )
        .fetch_one(&self.pool)
        .await
        .context("reading the server's timeline")
    }

    /// Record that the slot is there on the current timeline (and, with
    /// `confirmed`, how far it was confirmed).
    async fn record_slot(&self, confirmed: Option<&str>) -> Result<()> {
        let Some(l) = &self.logical else {
            return Ok(());
        };
        let timeline = self.timeline().await?;
        sqlx::query(
            "INSERT INTO outroute_capture_slot (source, slot, timeline, confirmed_lsn) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (source) DO UPDATE SET slot = excluded.slot, timeline = excluded.timeline, \
               confirmed_lsn = coalesce(excluded.confirmed_lsn, outroute_capture_slot.confirmed_lsn), \
               updated_at = now()",
        )
        .bind(&self.source)
        .bind(&l.slot)
        .bind(timeline)
        .bind(confirmed)
        .execute(&self.pool)
        .await
        .context("recording the replication slot")?;
        Ok(())
    }

    /// The relay confirmed the slot up to `lsn` (recorded now and then:
    /// after a promotion it says where missed messages may begin).
    pub async fn note_confirmed(&self, lsn: &str) -> Result<()> {
        sqlx::query(
            "UPDATE outroute_capture_slot SET confirmed_lsn = $2, updated_at = now() WHERE source = $1",
        )
        .bind(&self.source)
        .bind(lsn)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Is the slot there? If not, did a promotion take it (the record says
    /// it existed on an earlier timeline)? A slot that is there is recorded
    /// on the current timeline, with its confirmed position.
    pub async fn check_slot(&self) -> Result<SlotCheck> {
        let Some(l) = &self.logical else {
            return Ok(SlotCheck::Missing);
        };
        let present: Option<Option<String>> = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&l.slot)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(confirmed) = present {
            self.record_slot(confirmed.as_deref()).await?;
            return Ok(SlotCheck::Present);
        }
        let record: Option<(i64, Option<String>)> = match sqlx::query_as(
            "SELECT timeline, confirmed_lsn FROM outroute_capture_slot WHERE source = $1",
        )
        .bind(&self.source)
        .fetch_optional(&self.pool)
        .await
        {
            Ok(r) => r,
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => None,
            Err(e) => return Err(e.into()),
        };
        let now = self.timeline().await?;
        Ok(match record {
            Some((was, confirmed)) if was < now => SlotCheck::LostInFailover {
                from: was,
                to: now,
                confirmed,
            },
            _ => SlotCheck::Missing,
        })
    }

    /// Can the relay make up for a slot lost in a promotion by itself? Yes
    /// for rows of a table that are deleted or marked once published: the
    /// ones still pending are exactly those that may have been missed.
    pub fn recovers_from(&self, c: &SlotCheck) -> bool {
        matches!(c, SlotCheck::LostInFailover { .. })
            && self
                .logical
                .as_ref()
                .is_some_and(|l| l.input == LogicalInput::Table && l.cleanup != Cleanup::Keep)
    }

    /// What a missing slot means, and what to do (for the log and health).
    pub fn slot_gone(&self, c: &SlotCheck) -> String {
        let (slot, input, cleanup) = match &self.logical {
            Some(l) => (l.slot.as_str(), l.input, l.cleanup),
            None => ("", LogicalInput::Table, Cleanup::Delete),
        };
        match c {
            SlotCheck::Present => format!("{}.logical.slot: slot `{slot}` is there", self.key),
            SlotCheck::Missing => format!(
                "{}.logical.slot: replication slot `{slot}` does not exist (run `outroute migrate`)",
                self.key
            ),
            SlotCheck::LostInFailover {
                from,
                to,
                confirmed,
            } => {
                let since = confirmed
                    .as_deref()
                    .map_or("the slot's creation".to_string(), str::to_string);
                let missed = if input == LogicalInput::Messages {
                    format!(
                        "logical messages emitted on timeline {from} after {since} (the last position \
                         recorded as confirmed) and before a new slot exists on timeline {to} are in no \
                         table and were not captured: check what the producers emitted in that range"
                    )
                } else if cleanup == Cleanup::Keep {
                    format!(
                        "with cleanup = \"keep\" the published rows of `{}` stay in it, so outroute cannot \
                         tell which rows written after {since} were missed",
                        self.cfg.name
                    )
                } else {
                    format!(
                        "the rows of `{}` still pending are re-read from the table",
                        self.cfg.name
                    )
                };
                let then = if self.recovers_from(c) {
                    "; the relay creates the slot again (events it published after the last confirmed \
                     position may go out twice, with the same ids)"
                } else {
                    "; then run `outroute migrate` to create the slot again"
                };
                format!(
                    "{}.logical.slot: PostgreSQL was promoted (timeline {from} -> {to}) and replication slot \
                     `{slot}` did not survive it (before PostgreSQL 17 a slot is not carried over to a \
                     standby): {missed}{then}",
                    self.key
                )
            }
        }
    }

    /// Events that failed (or wait for a retry) in lease mode, before the
    /// source switched to log capture, become parked records: their rows are
    /// read from the table into the record, so their aggregates stay held
    /// behind them and `failed retry` retries them from the record (a state
    /// row without one is invisible to log capture). Rows gone from the
    /// table stay as they are (nothing to publish). Returns how many were
    /// taken over. Cheap when there are none (one indexed read).
    pub async fn adopt_lease_failures(&self) -> Result<u64> {
        if self
            .logical
            .as_ref()
            .is_none_or(|l| l.input != LogicalInput::Table)
        {
            return Ok(0);
        }
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT event_id FROM outroute_event_state WHERE source = $1 AND event IS NULL \
               AND discarded_at IS NULL",
        )
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?;
        if ids.is_empty() {
            return Ok(0);
        }
        let s = self.sql()?;
        let rows = sqlx::query(&format!(
            "SELECT {cols} FROM {table} o WHERE {row}",
            cols = s.row_columns("o.ctid::text"),
            table = s.table,
            row = s.is_one_of("$1::text[]"),
        ))
        .bind(&ids)
        .fetch_all(&self.pool)
        .await
        .context("reading the rows of events that failed in lease mode")?;
        let mut adopted = 0;
        for r in &rows {
            let c = super::to_claim(r, s.payload_is_json)?;
            let record = serde_json::to_string(&ParkedEvent::of(&c.row))?;
            // Commit position 0: ahead of every streamed event of its
            // aggregate, as it was in the table.
            adopted += sqlx::query(
                "UPDATE outroute_event_state SET event = $3::jsonb, commit_lsn = 0, updated_at = now() \
                 WHERE source = $1 AND event_id = $2 AND event IS NULL",
            )
            .bind(&self.source)
            .bind(c.id())
            .bind(&record)
            .execute(&self.pool)
            .await?
            .rows_affected();
        }
        Ok(adopted)
    }

    /// Is the outbox a partitioned table?
    async fn partitioned(&self) -> Result<bool> {
        Ok(sqlx::query_scalar(
            "SELECT coalesce((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)), false)",
        )
        .bind(quote(&self.cfg.name))
        .fetch_one(&self.pool)
        .await?)
    }

    /// The key of the row that says "`outroute migrate` is creating the
    /// slot" (see [`PgStore::begin_backfill`]). A key of its own, not a
    /// state of the source's row: a relay of an earlier version, which
    /// knows nothing of it, must not take it for a finished backfill.
    fn backfill_marker(&self) -> String {
        format!("{} (creating the slot)", self.source)
    }

    fn interrupted_migrate(&self) -> String {
        format!(
            "{}.logical.slot: `outroute migrate` did not finish creating slot `{}` (it is still running, \
             or it stopped before it recorded the rows written before the slot): run `outroute migrate` again",
            self.key,
            self.logical.as_ref().map_or("", |l| l.slot.as_str())
        )
    }

    /// Did a migrate stop between creating the slot and recording the rows
    /// written before it (or is one doing so now)?
    async fn backfill_interrupted(&self) -> Result<bool> {
        match sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM outroute_capture_backfill WHERE source = $1)",
        )
        .bind(self.backfill_marker())
        .fetch_one(&self.pool)
        .await
        {
            Ok(b) => Ok(b),
            // Coordination tables not migrated yet: nothing was recorded.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Right before the slot is created: record that it is being created
    /// (the marker row), so that relays do not stream until the rows
    /// written before it are recorded, and the next migrate finishes the
    /// job if this one stops. Returns the note to print instead when nothing
    /// will be recorded: with `cleanup = "keep"` a re-created slot records
    /// nothing, because the kept rows the old slot streamed look pending and
    /// would all go out again.
    async fn begin_backfill(&self, cleanup: Cleanup) -> Result<Option<String>> {
        let existed: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM outroute_capture_backfill WHERE source = $1)",
        )
        .bind(&self.source)
        .fetch_one(&self.pool)
        .await?;
        if existed && cleanup == Cleanup::Keep {
            return Ok(Some(format!(
                "the slot was re-created: rows committed while no slot existed are not streamed \
                 (with cleanup = \"keep\" the unmarked rows of `{}` include every row the old \
                 slot streamed, so outroute cannot tell which ones were missed)",
                self.cfg.name
            )));
        }
        sqlx::query(
            "INSERT INTO outroute_capture_backfill (source, upto) VALUES ($1, 0) \
             ON CONFLICT (source) DO UPDATE SET created_at = now()",
        )
        .bind(self.backfill_marker())
        .execute(&self.pool)
        .await
        .context("recording that the slot is being created")?;
        Ok(None)
    }

    /// The rows written before the slot are recorded: relays may stream.
    async fn end_backfill_marker(&self) -> Result<()> {
        sqlx::query("DELETE FROM outroute_capture_backfill WHERE source = $1")
            .bind(self.backfill_marker())
            .execute(&self.pool)
            .await
            .context("clearing the slot-creation marker")?;
        Ok(())
    }

    /// Right after the slot was created: every row committed before it is
    /// visible now (and never in the stream); every row committed later is
    /// in the stream. Record the highest order value of the pending rows
    /// now: the relay publishes the pending rows up to it from the table
    /// before it streams (rows committed later with a lower value come
    /// twice, with the same id — never none).
    async fn record_backfill(&self, slot_lsn: &str) -> Result<String> {
        let s = TableSql::new(&self.cfg, self.lanes, "text");
        let (upto, n): (Option<i64>, i64) = sqlx::query_as(&format!(
            "SELECT max({seq}), count(*) FROM {table} o WHERE {pending}",
            seq = s.seq,
            table = s.table,
            pending = s.pending
        ))
        .fetch_one(&self.pool)
        .await
        .context("reading the rows written before the slot")?;
        // Nothing to publish is recorded too (finished at once): a later
        // re-created slot then knows one existed before.
        sqlx::query(
            "INSERT INTO outroute_capture_backfill (source, upto, slot_lsn, finished_at) \
               VALUES ($1, coalesce($2, 0), ($3::pg_lsn - '0/0'::pg_lsn)::bigint, CASE WHEN $2 IS NULL THEN now() END) \
             ON CONFLICT (source) DO UPDATE SET upto = excluded.upto, slot_lsn = excluded.slot_lsn, \
               done_seq = NULL, done_id = NULL, created_at = now(), finished_at = excluded.finished_at",
        )
        .bind(&self.source)
        .bind(upto)
        .bind(slot_lsn)
        .execute(&self.pool)
        .await?;
        let Some(upto) = upto else {
            return Ok(format!(
                "no pending rows in `{}` before the slot",
                self.cfg.name
            ));
        };
        Ok(format!(
            "{n} pending rows of `{}` were written before the slot: the relay publishes them from \
             the table (in order, up to {upto}) before it starts streaming",
            self.cfg.name
        ))
    }

    /// The next rows written before the slot, after the last batch handled
    /// (`None`: no backfill is due, or it finished). Claims as the stream's
    /// events: the capture lane, and the slot's creation LSN as their commit
    /// position (after every event an earlier slot parked, before every
    /// streamed one). Events lease mode failed or an operator discarded are
    /// not published again.
    pub async fn backfill_batch(&self, limit: u32) -> Result<Option<Vec<Claim>>> {
        // The source's record, or the marker of a slot being created (first).
        let due: Option<(bool, i64)> = match sqlx::query_as(
            "SELECT source = $2, slot_lsn FROM outroute_capture_backfill \
             WHERE (source = $1 AND finished_at IS NULL) OR source = $2 ORDER BY source = $2 DESC LIMIT 1",
        )
        .bind(&self.source)
        .bind(self.backfill_marker())
        .fetch_optional(&self.pool)
        .await
        {
            Ok(due) => due,
            // A relay upgraded before `outroute migrate` ran: nothing recorded.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => None,
            Err(e) => return Err(e.into()),
        };
        let slot_lsn = match due {
            None => return Ok(None),
            Some((true, _)) => bail!("{}", self.interrupted_migrate()),
            Some((false, lsn)) => lsn,
        };
        let s = self.sql()?;
        let min = i64::MIN;
        let q = format!(
            "SELECT {cols} FROM {table} o, outroute_capture_backfill b \
             WHERE b.source = $1 AND {seq} <= b.upto AND {seq} >= coalesce(b.done_seq, {min}) \
               AND ({seq} > coalesce(b.done_seq, {min}) OR {id}::text > coalesce(b.done_id, '')) \
               AND {pending} \
               AND NOT EXISTS (SELECT 1 FROM outroute_event_state s WHERE s.source = $1 \
                   AND s.event_id = {id}::text AND (s.failed_at IS NOT NULL OR s.discarded_at IS NOT NULL)) \
             ORDER BY {seq}, {id}::text LIMIT $2",
            cols = s.row_columns("NULL::text"),
            table = s.table,
            seq = s.seq,
            id = s.id,
            pending = s.pending,
        );
        // Bounded in bytes too: the batch ends with the row whose payload
        // reaches `relay.max_batch_bytes` (progress is per row handled).
        let mut claims = Vec::new();
        let mut bytes = 0u64;
        {
            let mut rows = sqlx::query(&q)
                .bind(&self.source)
                .bind(i64::from(limit))
                .fetch(&self.pool);
            while let Some(r) = rows
                .try_next()
                .await
                .context("reading rows written before the slot")?
            {
                let mut c = super::to_claim(&r, s.payload_is_json)?;
                c.lane = CAPTURE_LANE;
                c.captured = Some(Captured {
                    commit_lsn: slot_lsn,
                    parked: false,
                    committed_at: None,
                });
                bytes += c.bytes();
                claims.push(c);
                if bytes >= self.max_batch_bytes {
                    break;
                }
            }
        }
        // Lease mode's record of an event still retrying (no event stored):
        // the backfill is its next attempt, parked like a streamed one if
        // it fails again.
        let ids: Vec<&str> = claims.iter().map(|c| c.id()).collect();
        sqlx::query(
            "DELETE FROM outroute_event_state WHERE source = $1 AND event_id = ANY($2) \
               AND event IS NULL AND failed_at IS NULL AND discarded_at IS NULL",
        )
        .bind(&self.source)
        .bind(&ids)
        .execute(&self.pool)
        .await
        .context("clearing lease-mode retry records of rows written before the slot")?;
        Ok(Some(claims))
    }

    /// Record how far the backfill got (`last` row handled), or that it
    /// finished (`None`), fenced by the capture lease `epoch`. False: the
    /// lease was lost.
    pub async fn backfill_progress(&self, last: Option<(i64, &str)>, epoch: i64) -> Result<bool> {
        let n = sqlx::query(
            "UPDATE outroute_capture_backfill SET \
               done_seq = coalesce($2, done_seq), done_id = coalesce($3, done_id), \
               finished_at = CASE WHEN $2 IS NULL THEN now() END \
             WHERE source = $1 AND finished_at IS NULL \
               AND EXISTS (SELECT 1 FROM outroute_lanes WHERE source = $1 AND lane = $4 AND owner = $5 \
                           AND epoch = $6 AND lease_until > now())",
        )
        .bind(&self.source)
        .bind(last.map(|l| l.0))
        .bind(last.map(|l| l.1))
        .bind(CAPTURE_LANE)
        .bind(&self.relay_id)
        .bind(epoch)
        .execute(&self.pool)
        .await
        .context("recording the backfill's progress")?
        .rows_affected();
        Ok(n > 0)
    }

    /// `outroute slot drop`: drop the slot (refused while a relay streams).
    pub async fn drop_slot(&self) -> Result<bool> {
        let Some(l) = &self.logical else {
            bail!("{}: not a `capture = \"logical\"` source", self.key);
        };
        let active: Option<Option<i32>> =
            sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
                .bind(&l.slot)
                .fetch_optional(&self.pool)
                .await?;
        match active {
            None => Ok(false),
            Some(Some(pid)) => bail!(
                "slot `{}` is in use by backend {pid} (a relay is streaming): stop the relays first",
                l.slot
            ),
            Some(None) => {
                sqlx::query("SELECT pg_drop_replication_slot($1)")
                    .bind(&l.slot)
                    .execute(&self.pool)
                    .await?;
                Ok(true)
            }
        }
    }

    /// The slot's position and what it keeps.
    pub async fn slot_status(&self) -> Result<Option<SlotStatus>> {
        let Some(l) = &self.logical else {
            return Ok(None);
        };
        let row = sqlx::query(
            "SELECT active_pid, confirmed_flush_lsn::text, \
               COALESCE((pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, 0), wal_status \
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&l.slot)
        .fetch_optional(&self.pool)
        .await?;
        let Some(r) = row else {
            return Ok(None);
        };
        Ok(Some(SlotStatus {
            slot: l.slot.clone(),
            active_pid: r.try_get(0)?,
            confirmed_flush_lsn: r.try_get(1)?,
            lag_bytes: r.try_get(2)?,
            wal_status: r.try_get(3)?,
        }))
    }

    /// A relay that just took the capture lease ends the session of a
    /// previous owner that still holds the slot (frozen, or cut off without
    /// PostgreSQL noticing yet). That owner is already fenced by its lease.
    pub async fn take_over_slot(&self) -> Result<bool> {
        let Some(l) = &self.logical else {
            return Ok(false);
        };
        let ended: Option<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
             WHERE slot_name = $1 AND active_pid IS NOT NULL",
        )
        .bind(&l.slot)
        .fetch_optional(&self.pool)
        .await?;
        Ok(ended.unwrap_or(false))
    }

    /// Acquire or renew the capture lease (and heartbeat): `lanes` is
    /// `[CAPTURE_LANE]` while this relay owns the slot, empty on a standby.
    pub(super) async fn capture_lease(&self) -> Result<Leases> {
        let ttl = self.lease_ttl.as_secs_f64();
        let relays = self.heartbeat().await?;
        sqlx::query(
            "INSERT INTO outroute_lanes (source, lane) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(&self.source)
        .bind(CAPTURE_LANE)
        .execute(&self.pool)
        .await?;
        // Renew our live lease, or take a free or lapsed one (a new epoch:
        // whatever the previous owner still does is fenced).
        let got: Option<(i64, bool)> = sqlx::query_as(
            "UPDATE outroute_lanes l SET lease_until = now() + make_interval(secs => $3), owner = $2, \
               epoch = CASE WHEN l.owner = $2 AND l.lease_until > now() THEN l.epoch ELSE l.epoch + 1 END \
             FROM (SELECT lane, owner = $2 AND lease_until > now() AS renewing FROM outroute_lanes \
                   WHERE source = $1 AND lane = $4 FOR UPDATE) cur \
             WHERE l.source = $1 AND l.lane = $4 \
               AND (cur.renewing OR l.owner IS NULL OR l.lease_until <= now()) \
             RETURNING l.epoch, NOT cur.renewing",
        )
        .bind(&self.source)
        .bind(&self.relay_id)
        .bind(ttl)
        .bind(CAPTURE_LANE)
        .fetch_optional(&self.pool)
        .await?;
        Ok(match got {
            Some((epoch, acquired)) => Leases {
                lanes: vec![CAPTURE_LANE],
                epochs: vec![epoch],
                acquired: acquired as usize,
                relays,
            },
            None => Leases {
                relays,
                ..Leases::default()
            },
        })
    }

    /// The aggregates with parked events, each with the routes they wait
    /// for (`*`: every route): the stream's later events of the aggregate
    /// wait behind them on those routes, and go on the others.
    pub async fn held_aggregates(&self) -> Result<HeldAggregates> {
        let rows: Vec<(String, String, Vec<String>)> = sqlx::query_as(&format!(
            "SELECT aggregate_type, aggregate_id, array_agg(DISTINCT r) FROM outroute_event_state \
               CROSS JOIN LATERAL unnest(coalesce(waiting_routes, '{{*}}'::text[])) r \
             WHERE {HOLDING} GROUP BY aggregate_type, aggregate_id"
        ))
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|(t, i, r)| ((t, i), r)).collect())
    }

    /// The parked events whose turn came: for each aggregate whose queue
    /// head is due (not failed, retry time reached), the head and the due
    /// events right behind it, in (commit LSN, sequence) order; at most
    /// `limit` in all, oldest heads first, and no more than the one that
    /// reaches `relay.max_batch_bytes`. A long queue drains at batch
    /// speed; the pipeline keeps the order within the batch.
    pub async fn parked_heads(
        &self,
        aggregates: &HeldAggregates,
        limit: u32,
    ) -> Result<Vec<Claim>> {
        let (types, ids): (Vec<&str>, Vec<&str>) = aggregates
            .keys()
            .map(|(t, i)| (t.as_str(), i.as_str()))
            .unzip();
        let q = format!(
            "WITH heads AS ( \
               SELECT DISTINCT ON (aggregate_type, aggregate_id) aggregate_type, aggregate_id, commit_lsn, seq, \
                 failed_at, next_attempt_at \
               FROM outroute_event_state WHERE {HOLDING} \
                 AND (aggregate_type, aggregate_id) IN (SELECT * FROM unnest($3::text[], $4::text[])) \
               ORDER BY aggregate_type, aggregate_id, commit_lsn, seq), \
             due AS (SELECT * FROM heads WHERE failed_at IS NULL AND next_attempt_at <= now() \
               ORDER BY commit_lsn, seq LIMIT $2) \
             SELECT q.event_id, q.event::text, q.commit_lsn, q.attempts, q.done_legs, q.ready, \
               d.aggregate_type, d.aggregate_id, q.seq \
             FROM due d CROSS JOIN LATERAL ( \
               SELECT s.event_id, s.event, s.commit_lsn, s.seq, s.attempts, s.done_legs, \
                 (s.failed_at IS NULL AND s.next_attempt_at <= now()) AS ready \
               FROM outroute_event_state s WHERE s.source = $1 AND s.event IS NOT NULL AND s.discarded_at IS NULL \
                 AND NOT (s.failed_at IS NOT NULL AND s.blocks_until < 'infinity') \
                 AND s.aggregate_type = d.aggregate_type AND s.aggregate_id = d.aggregate_id \
               ORDER BY s.commit_lsn, s.seq LIMIT $2) q \
             ORDER BY d.commit_lsn, d.seq, d.aggregate_type, d.aggregate_id, q.commit_lsn, q.seq"
        );
        let mut rows = sqlx::query(&q)
            .bind(&self.source)
            .bind(limit as i64)
            .bind(&types)
            .bind(&ids)
            .fetch(&self.pool);
        let mut claims = Vec::new();
        let mut bytes = 0u64;
        // Per aggregate, the due prefix of its queue.
        let mut stopped: HashSet<(String, String)> = HashSet::new();
        while let Some(r) = rows.try_next().await.context("reading parked events")? {
            if claims.len() >= limit as usize || bytes >= self.max_batch_bytes {
                break;
            }
            let aggregate: (String, String) = (r.try_get(6)?, r.try_get(7)?);
            let ready: bool = r.try_get(5)?;
            if stopped.contains(&aggregate) {
                continue;
            }
            if !ready {
                stopped.insert(aggregate);
                continue;
            }
            let id: String = r.try_get(0)?;
            let text: String = r.try_get(1)?;
            let commit_lsn: Option<i64> = r.try_get(2)?;
            let attempts: i32 = r.try_get(3)?;
            let done_legs: Vec<String> = r.try_get(4)?;
            // A record that cannot be read fails that event alone, with
            // the reason (its aggregate waits, as for any failed event).
            let row = match serde_json::from_str::<ParkedEvent>(&text) {
                Ok(parked) => parked.into_row(id, attempts.max(0) as u32),
                Err(e) => Err(crate::event::Malformed {
                    id,
                    sequence: r.try_get(8)?,
                    aggregate_type: aggregate.0,
                    aggregate_id: aggregate.1,
                    event_type: String::new(),
                    reason: format!("its parked record cannot be read: {e}"),
                    raw: None,
                }),
            };
            let claim = Claim {
                lane: CAPTURE_LANE,
                tid: None,
                has_state: true,
                held: Vec::new(),
                done_legs,
                epoch: None,
                captured: Some(Captured {
                    commit_lsn: commit_lsn.unwrap_or(0),
                    parked: true,
                    committed_at: None,
                }),
                route: None,
                row,
            };
            bytes += claim.bytes();
            claims.push(claim);
        }
        Ok(claims)
    }

    /// Parked events published: their state rows go, fenced by the capture
    /// lease epoch they were read under.
    pub async fn unpark(&self, claims: &[&Claim]) -> Result<u64> {
        let ids: Vec<&str> = claims.iter().map(|c| c.id()).collect();
        let Some(epoch) = claims.iter().find_map(|c| c.epoch) else {
            return Ok(0);
        };
        let n = sqlx::query(
            "DELETE FROM outroute_event_state WHERE source = $1 AND event_id = ANY($2) \
               AND EXISTS (SELECT 1 FROM outroute_lanes WHERE source = $1 AND lane = $3 AND owner = $4 \
                           AND epoch = $5 AND lease_until > now())",
        )
        .bind(&self.source)
        .bind(&ids)
        .bind(CAPTURE_LANE)
        .bind(&self.relay_id)
        .bind(epoch)
        .execute(&self.pool)
        .await
        .context("removing published parked events")?
        .rows_affected();
        Ok(n)
    }

    /// Delete the rows of handled captured events, a statement per
    /// [`CLEANUP_CHUNK`] rows, each under `store.statement_timeout`: by
    /// their sequence numbers (one index probe each, exactly the rows
    /// handled), or by id when the sequence column is not unique (a number
    /// would also take an unread or lease-mode failed row sharing it).
    ///
    /// (It used to delete runs of consecutive numbers, a statement per run:
    /// with producers committing concurrently runs are a few rows long, and
    /// the round trips cost the relay 15 % of its CPU in a drain. And it
    /// used to be one statement, however many rows: one producer transaction
    /// of a million rows then never finished within the timeout, and the
    /// stream re-published that transaction over and over.)
    pub async fn delete_captured(&self, rows: &CapturedRows) -> Result<u64> {
        let mut deleted = 0;
        if self.seq_unique {
            for seqs in rows.seqs.chunks(CLEANUP_CHUNK) {
                deleted += self
                    .bounded("deleting captured rows", self.delete_chunk(seqs, &[]))
                    .await?;
            }
        } else {
            for ids in rows.ids.chunks(CLEANUP_CHUNK) {
                deleted += self
                    .bounded("deleting captured rows", self.delete_chunk(&[], ids))
                    .await?;
            }
        }
        Ok(deleted)
    }

    /// One statement of [`PgStore::delete_captured`]: `seqs` or `ids`.
    async fn delete_chunk(&self, seqs: &[i64], ids: &[String]) -> Result<u64> {
        let Some(seq) = self.cleanup_column() else {
            return Ok(0);
        };
        if seqs.is_empty() && ids.is_empty() {
            return Ok(0);
        }
        let sql = if self.seq_unique {
            format!(
                "DELETE FROM {} WHERE {} = ANY($1::int8[])",
                quote(&self.cfg.name),
                quote(seq)
            )
        } else {
            let s = self.sql()?;
            format!(
                "DELETE FROM {} o WHERE {} = ANY({})",
                s.table,
                s.id,
                s.ids_param(1)
            )
        };
        let q = sqlx::query(&sql);
        let q = if self.seq_unique {
            q.bind(seqs)
        } else {
            q.bind(ids)
        };
        Ok(q.execute(&self.pool)
            .await
            .context("deleting captured rows")?
            .rows_affected())
    }

    /// Whether [`CapturedRows`] must carry ids: the sequence column is not
    /// known to be unique.
    pub fn deletes_by_id(&self) -> bool {
        !self.seq_unique && self.cleanup_column().is_some()
    }

    /// The sequence column, when captured rows are cleaned up at all
    /// (table input, `cleanup = "delete"`, a sequence column mapped).
    fn cleanup_column(&self) -> Option<&str> {
        let l = self.logical.as_ref()?;
        (l.cleanup == Cleanup::Delete && l.input == LogicalInput::Table)
            .then_some(self.cfg.sequence.as_deref())
            .flatten()
    }

    /// Backlog of a logical source: parked events not failed, and the age
    /// of the oldest (the stream's own backlog is the slot lag).
    pub(super) async fn parked_backlog(&self) -> Result<(i64, Option<f64>)> {
        let (n, oldest): (i64, Option<f64>) = sqlx::query_as(&format!(
            "SELECT count(*), extract(epoch from now() - min((event->>'created_at')::timestamptz))::float8 \
             FROM outroute_event_state WHERE {HOLDING} AND failed_at IS NULL"
        ))
        .bind(&self.source)
        .fetch_one(&self.pool)
        .await?;
        Ok((n, oldest))
    }

    pub(super) async fn logical_status(&self) -> Result<Status> {
        let (backlog, oldest) = self.parked_backlog().await?;
        let counts = sqlx::query(
            "SELECT count(*) FILTER (WHERE failed_at IS NULL AND discarded_at IS NULL), \
               count(*) FILTER (WHERE failed_at IS NOT NULL AND discarded_at IS NULL) \
             FROM outroute_event_state WHERE source = $1",
        )
        .bind(&self.source)
        .fetch_one(&self.pool)
        .await?;
        let by_type: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT aggregate_type, count(*) FROM outroute_event_state WHERE {HOLDING} AND failed_at IS NULL \
             GROUP BY 1 ORDER BY 2 DESC LIMIT 50"
        ))
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?;
        let relays = self.live_relays().await?;
        let events_without_messages = self.events_without_messages().await?;
        Ok(Status {
            table: self.source.clone(),
            backlog,
            oldest_pending_age_seconds: oldest,
            retrying: counts.try_get(0)?,
            failed: counts.try_get(1)?,
            backlog_by_aggregate_type: by_type,
            events_without_messages,
            quarantined_routes: self.quarantined_routes().await?,
            relays,
            slot: self.slot_status().await?,
        })
    }
}
