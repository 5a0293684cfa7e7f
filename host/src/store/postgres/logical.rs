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
//! * **Cleanup.** Captured rows are deleted by their sequence numbers after
//!   they were handled (published or parked): one `DELETE … WHERE seq =
//!   ANY(…)` per 5,000 rows or per 100 ms of confirmed marks, whichever
//!   comes first, never an UPDATE per event (by id when the sequence column
//!   has no unique index).
//!
//! Files: this one the slot, the publication and the capture lease;
//! `backfill.rs` rows written before the slot, `parked.rs` the parked
//! queue, `cleanup.rs` deleting handled rows.

use std::collections::HashSet;

use anyhow::{Context, Result, bail};
use futures::TryStreamExt;
use sqlx::Row;

use super::{PgStore, TableSql, quote};
use crate::config::{Cleanup, LogicalInput};
use crate::failpoint;
use crate::store::{Captured, Claim, Leases, ParkedEvent, SlotStatus, Status};

mod backfill;
mod cleanup;
mod parked;
pub use cleanup::{CLEANUP_CHUNK, CapturedRows};
use parked::HOLDING;

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
        let relay_connections = Some(self.relay_connections().await?);
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
            relay_connections,
            slot: self.slot_status().await?,
            binlog: None,
        })
    }
}
