//! Rows written before the slot existed: when `outroute migrate` creates a
//! slot for a table that already has pending rows (a switch from lease mode,
//! a slot made again) it records them, and the relay that takes the capture
//! lease publishes them from the table — in order, progress recorded per
//! batch under the lease epoch — before it streams. Events lease mode had
//! failed or was retrying become parked records first.

use super::*;

impl PgStore {
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
            let c = super::super::to_claim(r, s.payload_is_json)?;
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
    pub(super) async fn partitioned(&self) -> Result<bool> {
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
    pub(super) fn backfill_marker(&self) -> String {
        format!("{} (creating the slot)", self.source)
    }

    pub(super) fn interrupted_migrate(&self) -> String {
        format!(
            "{}.logical.slot: `outroute migrate` did not finish creating slot `{}` (it is still running, \
             or it stopped before it recorded the rows written before the slot): run `outroute migrate` again",
            self.key,
            self.logical.as_ref().map_or("", |l| l.slot.as_str())
        )
    }

    /// Did a migrate stop between creating the slot and recording the rows
    /// written before it (or is one doing so now)?
    pub(super) async fn backfill_interrupted(&self) -> Result<bool> {
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
    pub(super) async fn begin_backfill(&self, cleanup: Cleanup) -> Result<Option<String>> {
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
    pub(super) async fn end_backfill_marker(&self) -> Result<()> {
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
    pub(super) async fn record_backfill(&self, slot_lsn: &str) -> Result<String> {
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
                let mut c = super::super::to_claim(&r, s.payload_is_json)?;
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
}
