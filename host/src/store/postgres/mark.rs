//! Finishing work: marking claimed rows published (fenced by the lane's
//! owner and epoch at claim time) and recording failures, retries and
//! deferrals in `outroute_event_state`.

use super::*;

impl PgStore {
    /// Mark these claimed rows published. Each row is found by where the
    /// claim saw it (`ctid`: a direct heap fetch) and re-checked by id,
    /// pending state and lane ownership, so the cost is per row marked
    /// whatever the table's size or statistics. A row that moved since the
    /// claim (a producer updated it) is not marked: it is claimed again and
    /// re-published with the same id. The lease check is a plain read:
    /// renewing a lease never waits for a mark.
    pub async fn mark_published(&self, claims: &[&Claim]) -> Result<u64> {
        if claims.is_empty() {
            return Ok(0);
        }
        let args = self.mark_args(claims)?;
        let q = self.mark_sql(!args.with_state.is_empty())?;
        let marked: Vec<String> = args
            .bind(sqlx::query_scalar(&q))
            .fetch_all(&self.pool)
            .await
            .context("marking events published")?;
        Ok(marked.len() as u64)
    }

    /// The mark's parameters for these claims (see [`Self::mark_sql`]).
    pub(super) fn mark_args<'c>(&'c self, claims: &[&'c Claim]) -> Result<MarkArgs<'c>> {
        let queue = matches!(self.sql()?.cfg.marking, Marking::Queue { .. });
        let (tids, ids) = if queue {
            // One entry per claim, aligned with lanes and sequences. A claim
            // without a ctid (none comes from the queue's claim) gets one
            // that matches no entry: it is not marked, and is claimed again.
            claims
                .iter()
                .map(|c| (c.tid.as_deref().unwrap_or("(0,0)"), c.id()))
                .unzip()
        } else {
            tids_and_ids(claims)
        };
        Ok(MarkArgs {
            source: &self.source,
            relay_id: &self.relay_id,
            ids,
            with_state: claims
                .iter()
                .filter(|c| c.has_state)
                .map(|c| c.id())
                .collect(),
            tids,
            epochs: claims.iter().map(|c| c.epoch).collect(),
            queue: queue.then(|| {
                (
                    claims.iter().map(|c| c.lane).collect(),
                    claims.iter().map(|c| c.sequence()).collect(),
                )
            }),
        })
    }

    /// The mark statement; parameters: $1 source, $2 relay id, $3 ids,
    /// $4 ids with a state row, $5 ctids, $6 lane epochs at claim time
    /// (NULL: owner and expiry only).
    pub(super) fn mark_sql(&self, clear_state: bool) -> Result<String> {
        let s = self.sql()?;
        let rows = "unnest($5::text[]::tid[], $3::text[], $6::bigint[]) AS m(tid, id, epoch)";
        let change = match &s.cfg.marking {
            Marking::PublishedAt { column } => {
                format!(
                    "UPDATE {} o SET {} = now() FROM {rows}",
                    s.table,
                    quote(column)
                )
            }
            Marking::Status { column, sent, .. } => {
                format!(
                    "UPDATE {} o SET {} = {} FROM {rows}",
                    s.table,
                    quote(column),
                    literal(sent)
                )
            }
            Marking::Delete => format!("DELETE FROM {} o USING {rows}", s.table),
            // Marked by its own statement below.
            Marking::Queue { .. } => String::new(),
        };
        let clear = if clear_state {
            ", cleared AS (DELETE FROM outroute_event_state st WHERE st.source = $1 \
               AND st.event_id = ANY($4::text[]) AND st.event_id IN (SELECT id FROM marked))"
        } else {
            ""
        };
        if let Marking::Queue { .. } = &s.cfg.marking {
            // Each queue entry looked up by the ctid its claim saw ($5)
            // and taken only if that slot still holds the same entry
            // (source, lane and sequence: a slot VACUUM freed may hold
            // another one by now) and the lease check passes; then
            // deleted by ctid. A TID fetch per entry instead of an index
            // descent: measured ~1.4 µs of PostgreSQL per event less.
            // Both are correlated probes inside `ARRAY(…)` (`OFFSET 0`
            // keeps the lease check one), never a join: given the real
            // array, a planner without statistics would rather hash the
            // source's whole queue. Returns the ids of the events marked.
            return Ok(format!(
                "WITH gone AS (DELETE FROM outroute_queue WHERE ctid = ANY(ARRAY( \
                   SELECT (SELECT qq.ctid FROM outroute_queue qq WHERE qq.ctid = m.tid \
                     AND qq.source = $1 AND qq.lane = m.lane AND qq.seq = m.seq) \
                   FROM unnest($5::text[]::tid[], $7::int[], $8::bigint[], $6::bigint[]) AS m(tid, lane, seq, epoch) \
                   WHERE EXISTS (SELECT 1 FROM outroute_lanes l WHERE l.source = $1 AND l.lane = m.lane \
                     AND l.owner = $2 AND l.lease_until > now() AND (m.epoch IS NULL OR l.epoch = m.epoch) OFFSET 0))) \
                 RETURNING lane, seq), \
                 marked AS (SELECT m.id FROM unnest($7::int[], $8::bigint[], $3::text[]) AS m(lane, seq, id) \
                   WHERE (m.lane, m.seq) IN (SELECT lane, seq FROM gone)){clear} \
                 SELECT id FROM marked"
            ));
        }
        // Each (ctid, id) pair is one TID fetch. The ctid must be the only
        // condition an index could serve: the rest sits inside a CASE, which
        // the planner cannot match to an index. Otherwise, with no
        // statistics, it may take the small-looking lane index for the id
        // (its last column) or for the pending predicate and walk every
        // pending row. The lease check is a per-row probe of the row's own
        // lane row (`OFFSET 0` keeps it one).
        let change = format!("{change} WHERE o.ctid = m.tid AND");
        Ok(format!(
            "WITH marked AS ({change} \
               CASE WHEN {id}::text = m.id AND {pending} \
                 THEN EXISTS (SELECT 1 FROM outroute_lanes l WHERE l.source = $1 AND l.lane = {lane} \
                   AND l.owner = $2 AND l.lease_until > now() \
                   AND (m.epoch IS NULL OR l.epoch = m.epoch) OFFSET 0) \
                 ELSE FALSE END \
               RETURNING {id}::text AS id){clear} \
             SELECT id FROM marked",
            id = s.id,
            pending = s.row_pending,
            lane = s.lane,
        ))
    }

    pub async fn record_failures(&self, failures: &[Failure]) -> Result<u64> {
        self.record_failures_as(failures, true).await
    }

    /// [`PgStore::record_failures`]; `alias`: a streamed event whose id
    /// another waiting or failed event of the source already has is
    /// recorded under an id of its own (see below).
    pub(super) async fn record_failures_as(
        &self,
        failures: &[Failure],
        alias: bool,
    ) -> Result<u64> {
        let s = self.sql()?;
        let mut recorded = 0;
        for f in failures {
            // blocks_until: the retry time, 'infinity' (failed, policy block)
            // or '-infinity' (failed, policy skip).
            let (delay, blocks, failed) = match f.kind {
                FailureKind::Retry { delay } => (delay.as_secs_f64(), "retry", false),
                FailureKind::Failed { hold: true } => (0.0, "hold", true),
                FailureKind::Failed { hold: false } => (0.0, "none", true),
            };
            let next = "now() + make_interval(secs => $10)";
            let blocks_sql = format!(
                "CASE $8 WHEN 'hold' THEN 'infinity'::timestamptz WHEN 'none' THEN '-infinity'::timestamptz ELSE {next} END"
            );
            // The lease check locks the lane row (`FOR SHARE`): a hand-over
            // of the lane waits for this record to commit, so the new owner's
            // claims see it, and a record that waited for a hand-over is
            // re-checked against the new owner and records nothing. (A plain
            // read let a hold that began before expiry commit after the new
            // owner published the event: its aggregate blocked for good.)
            // A renewal waits for it too: one statement, rarely run.
            // A streamed event that already has a state row is a re-read
            // after a crash: the row is further along (maybe failed or
            // discarded by an operator) and stays as it is.
            let conflict = if f.parked.is_some() {
                // (a no-op update, so it counts as recorded: only a lost lease
                // records nothing)
                // Only the same event at the same stream position is a re-read; another
                // event under a taken id records nothing, so its batch is not
                // confirmed (loud, never a silent loss).
                // (a row published from the table before streaming began
                // and streamed again is recorded at the slot's start: an
                // earlier position)
                "DO UPDATE SET updated_at = st.updated_at \
                   WHERE st.commit_lsn <= EXCLUDED.commit_lsn AND st.seq = EXCLUDED.seq"
                    .to_string()
            } else {
                "DO UPDATE SET attempts = EXCLUDED.attempts, \
                   next_attempt_at = EXCLUDED.next_attempt_at, blocks_until = EXCLUDED.blocks_until, \
                   last_error = EXCLUDED.last_error, route = EXCLUDED.route, plugin = EXCLUDED.plugin, \
                   plugin_version = EXCLUDED.plugin_version, failed_at = EXCLUDED.failed_at, \
                   discarded_at = NULL, updated_at = now(), done_legs = EXCLUDED.done_legs, \
                   waiting_routes = EXCLUDED.waiting_routes, \
                   event = COALESCE(EXCLUDED.event, st.event), commit_lsn = COALESCE(EXCLUDED.commit_lsn, st.commit_lsn)"
                    .to_string()
            };
            let insert = format!(
                "INSERT INTO outroute_event_state AS st (source, event_id, aggregate_type, aggregate_id, seq, event_type, \
                   attempts, next_attempt_at, blocks_until, last_error, route, plugin, plugin_version, failed_at, done_legs, \
                   event, commit_lsn, waiting_routes) \
                 SELECT $1, $3, $4, $5, $6, $7, $9, {next}, {blocks_sql}, $11, $12, $13, $14, CASE WHEN $15 THEN now() END, $17, \
                   $18::text::jsonb, $19, $21 \
                 WHERE EXISTS (SELECT 1 FROM outroute_lanes WHERE source = $1 AND owner = $2 AND lane = $16 AND lease_until > now() \
                   AND ($20::bigint IS NULL OR epoch = $20) FOR SHARE) \
                 ON CONFLICT (source, event_id) {conflict}"
            );
            // Failed for good in lease mode: in the same statement (one
            // round trip, nothing half done after a crash) the row's own
            // failed marker is set and, under `marking = queue`, its entry
            // leaves the pending queue (`failed retry` puts it back). A
            // queued row off the queue without its marker would count as
            // published.
            let mut q = format!("WITH recorded AS ({insert} RETURNING 1)");
            if self.logical.is_none() && f.parked.is_none() {
                if failed && matches!(s.cfg.marking, Marking::Queue { .. }) {
                    q.push_str(
                        ", off AS (DELETE FROM outroute_queue WHERE source = $1 AND lane = $16 AND seq = $6 \
                           AND EXISTS (SELECT 1 FROM recorded))",
                    );
                }
                // The table's own attempts / last_error / failed columns, in
                // the same statement. Values are cast to the column's own
                // type, which cuts a reason too long for a `varchar(n)`.
                let mut sets = Vec::new();
                if let Some(c) = &s.cfg.attempts {
                    sets.push(format!("{} = $9::{}", quote(c), s.column_type(c)));
                }
                if let Some(c) = &s.cfg.last_error {
                    sets.push(format!("{} = $11::{}", quote(c), s.column_type(c)));
                }
                if failed {
                    if let Some(c) = &s.cfg.failed_at {
                        sets.push(format!("{} = now()", quote(c)));
                    }
                    if let Marking::Status {
                        column,
                        failed: Some(v),
                        ..
                    } = &s.cfg.marking
                    {
                        sets.push(format!(
                            "{} = {}::{}",
                            quote(column),
                            literal(v),
                            s.column_type(column)
                        ));
                    }
                }
                if !sets.is_empty() {
                    // Under the queue the sequence number is unique: found
                    // by it (on a partitioned outbox, usually the key).
                    let by_seq = if matches!(s.cfg.marking, Marking::Queue { .. }) {
                        format!("{} = $6 AND ", s.seq)
                    } else {
                        String::new()
                    };
                    q.push_str(&format!(
                        ", mirrored AS (UPDATE {table} o SET {sets} WHERE {by_seq}{row} AND EXISTS (SELECT 1 FROM recorded))",
                        table = s.table,
                        sets = sets.join(", "),
                        row = s.is_one_of("ARRAY[$3::text]"),
                    ));
                }
            }
            q.push_str(" SELECT count(*) FROM recorded");
            let (commit_lsn, event) = match &f.parked {
                Some((lsn, ev)) => (Some(*lsn), Some(serde_json::to_string(ev)?)),
                None => (None, None),
            };
            let done: i64 = sqlx::query_scalar(&q)
                .bind(&self.source)
                .bind(&self.relay_id)
                .bind(&f.id)
                .bind(&f.aggregate_type)
                .bind(&f.aggregate_id)
                .bind(f.sequence)
                .bind(&f.event_type)
                .bind(blocks)
                .bind(f.attempts as i32)
                .bind(delay)
                .bind(&f.reason)
                .bind(&f.route)
                .bind(&f.plugin)
                .bind(&f.plugin_version)
                .bind(failed)
                .bind(f.lane)
                .bind(&f.done_legs)
                .bind(event)
                .bind(commit_lsn)
                .bind(f.epoch)
                .bind(&f.waiting_routes)
                .fetch_one(&self.pool)
                .await
                .context("recording a failed attempt")?;
            if done == 0 {
                // A streamed event whose id is taken by another event of
                // the source that still waits or failed (a table without a
                // unique id, ids reused, NULLs): recorded, failed, under an
                // id of its own (`<id>@<commit lsn>/<seq>`, the id it goes
                // by from now on), so that it fails alone and the stream
                // moves on. (Recording nothing would leave the batch
                // unconfirmed, and the stream would restart at it forever.)
                // Nothing is recorded when the capture lease is lost.
                if alias && let Some((lsn, _)) = &f.parked {
                    let own = format!("{}@{lsn}/{}", f.id, f.sequence);
                    let mut taken = f.clone();
                    taken.reason = format!(
                        "id `{}` is taken by another event of this source that waits or failed (ids must be unique \
                         per source): this event is kept as `{own}`; {}",
                        f.id, f.reason
                    );
                    taken.id = own;
                    taken.kind = FailureKind::Failed { hold: false };
                    recorded +=
                        Box::pin(self.record_failures_as(std::slice::from_ref(&taken), false))
                            .await?;
                }
                continue; // fenced: the lane is no longer ours
            }
            recorded += 1;
            if self.logical.is_some() {
                continue; // the table row is not the record of a captured event
            }
        }
        Ok(recorded)
    }
}

/// The mark statement's parameters, in order ($1 … $8).
pub(super) struct MarkArgs<'c> {
    pub(super) source: &'c str,
    pub(super) relay_id: &'c str,
    pub(super) ids: Vec<&'c str>,
    pub(super) with_state: Vec<&'c str>,
    pub(super) tids: Vec<&'c str>,
    pub(super) epochs: Vec<Option<i64>>,
    /// Under queue marking: each claim's lane and sequence.
    pub(super) queue: Option<(Vec<i32>, Vec<i64>)>,
}

/// The (ctid, id) pairs the mark looks up, as two parallel arrays.
pub(super) fn tids_and_ids<'c>(claims: &[&'c Claim]) -> (Vec<&'c str>, Vec<&'c str>) {
    claims
        .iter()
        .filter_map(|c| Some((c.tid.as_deref()?, c.id())))
        .unzip()
}

impl<'c> MarkArgs<'c> {
    pub(super) fn bind<'q, O>(
        &'q self,
        q: sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        let q = q
            .bind(self.source)
            .bind(self.relay_id)
            .bind(&self.ids)
            .bind(&self.with_state)
            .bind(&self.tids)
            .bind(&self.epochs);
        match &self.queue {
            Some((lanes, seqs)) => q.bind(lanes).bind(seqs),
            None => q,
        }
    }
}
