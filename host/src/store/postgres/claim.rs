//! Taking work: lane leases (who owns which lane), the claim of a batch from
//! the owned lanes (starting at each lane's floor, stepping over held
//! aggregates), the floor rounds that keep claims short, and the sweep of
//! queue entries whose row is gone. Never marks.

use super::*;

impl PgStore {
    /// A claim statement's arguments (`$1`–`$9`, see [`TableSql::segments`]):
    /// with `starts`, their stretches (`$1`–`$5` when no lane has a skip);
    /// without (a claim by scan), the lanes.
    pub(super) fn bind_claim<'q>(
        &self,
        q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        lanes: &'q [i32],
        starts: Option<&'q floor::Starts>,
        limit: u32,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        let q = q
            .bind(self.source.clone())
            .bind(starts.map_or(lanes, |f| &f.lanes[..]))
            .bind(limit as i64)
            .bind(self.routes());
        match starts {
            Some(f) if f.any_skip() => q
                .bind(&f.from)
                .bind(&f.part)
                .bind(&f.skip_from)
                .bind(&f.skip_to)
                .bind(&f.skip_fingerprint),
            Some(f) => q.bind(&f.from),
            None => q,
        }
    }

    /// The claim statement for these starts: with skips only when a lane
    /// has one (the usual claim stays the plain walk from the floors).
    pub(super) fn claim_for(&self, starts: Option<&floor::Starts>) -> &str {
        match starts {
            Some(f) if f.any_skip() => &self.claim_skip_sql,
            _ => &self.claim_sql,
        }
    }

    /// Under `marking = queue`: walk the next [`ORPHAN_WALK`] entries of
    /// each of `lanes` after the sequence number given for it in `after`
    /// (`i64::MIN`: from the lowest) and delete those whose row is
    /// gone (a pending row deleted by hand) or says it is not pending (its
    /// `failed_at` set by hand). Claims step over such an entry, but every
    /// claim that walks past it pays for it until it is removed. The entry
    /// and its row are written in one transaction, so an entry is never
    /// seen before its row; a relay that fails an event for good deletes
    /// its entry itself (`failed retry` queues it again).
    pub async fn drop_orphans(&self, lanes: &[i32], after: &[i64]) -> Result<OrphanWalk> {
        self.drop_orphans_on(&self.pool, lanes, after).await
    }

    /// [`PgStore::drop_orphans`] on `conn` (a sleeping source's LISTEN
    /// connection, or the pool).
    pub async fn drop_orphans_on<'c>(
        &self,
        conn: impl sqlx::PgExecutor<'c>,
        lanes: &[i32],
        after: &[i64],
    ) -> Result<OrphanWalk> {
        if !self.queue_marking() || lanes.is_empty() {
            return Ok(OrphanWalk::default());
        }
        let rows: Vec<(i32, i64, i64, i64)> = sqlx::query_as(&self.orphan_sql()?)
            .bind(lanes)
            .bind(after)
            .fetch_all(conn)
            .await
            .context("removing orphaned queue entries")?;
        let mut walk = OrphanWalk::default();
        for (lane, last, walked, dropped) in rows {
            walk.dropped += dropped.max(0) as u64;
            if walked >= ORPHAN_WALK {
                walk.more.push((lane, last));
            }
        }
        Ok(walk)
    }

    /// The orphan walk: per lane (`$1`, from `$2`) its next entries in
    /// order, each with whether its row is gone or not pending, then the
    /// delete of those; returns per lane the last sequence walked, the
    /// entries walked and the entries deleted.
    ///
    /// The row probe sits inside the per-lane walk (a LATERAL kept apart by
    /// `OFFSET 0`), as in the claim, so that sorting a lane is never the
    /// cheap-looking plan: with it outside, the same statement run from
    /// psql on a never-analysed queue of 400,000 entries read each lane
    /// whole through a bitmap scan and sorted it to keep 64 entries (258 ms
    /// a round instead of 10). The relay's own connections turn bitmap
    /// scans and sorts off (see `connect`), which hid that; the shape must
    /// not depend on it (a pooler may drop those settings). The delete goes
    /// by ctid alone (a TID scan; with the source beside it, a planner
    /// without statistics may read the source's whole queue). Entries are never updated, so a ctid seen by the
    /// statement's snapshot names that entry (or one deleted since, which
    /// the delete then skips).
    pub(super) fn orphan_sql(&self) -> Result<String> {
        let s = self.sql()?;
        Ok(format!(
            "WITH walk AS MATERIALIZED ( \
               SELECT e.lane, e.seq, e.tid, e.orphan FROM unnest($1::int[], $2::bigint[]) AS l(lane, after) \
               CROSS JOIN LATERAL (SELECT qq.lane, qq.seq, qq.ctid AS tid, r.orphan FROM outroute_queue qq \
                 CROSS JOIN LATERAL (SELECT NOT EXISTS (SELECT 1 FROM {table} o \
                   WHERE {seqcol} = qq.seq AND {row_pending}) AS orphan OFFSET 0) r \
                 WHERE qq.source = {src} AND qq.lane = l.lane AND qq.seq > l.after \
                 ORDER BY qq.seq LIMIT {ORPHAN_WALK}) e), \
             gone AS (DELETE FROM outroute_queue \
               WHERE ctid = ANY(ARRAY(SELECT w.tid FROM walk w WHERE w.orphan)) RETURNING lane) \
             SELECT w.lane, max(w.seq)::bigint, count(*)::bigint, \
               (SELECT count(*) FROM gone g WHERE g.lane = w.lane)::bigint \
             FROM walk w GROUP BY w.lane",
            src = literal(&self.cfg.name),
            table = s.table,
            seqcol = s.seq,
            row_pending = s.row_pending,
        ))
    }

    /// Renew and take lanes (never the capture lease's row, lane -1, a
    /// source that streamed the log before may have left), on the pool.
    pub async fn lease_round(&self) -> Result<Leases> {
        if self.logical.is_some() {
            return self.capture_lease().await;
        }
        self.lease_round_on(&self.pool).await
    }

    /// A lease round on `conn` (the pool, or a sleeping source's LISTEN
    /// connection): one statement that heartbeats this relay, forgets
    /// relays silent for ten TTLs, counts the live ones, renews the lanes
    /// this relay holds, takes free or lapsed ones up to its fair share and
    /// renews its asleep record (the trigger ignores stale ones), so an
    /// idle source costs its database one statement per round. A relay
    /// over its share (another one joined) lets the extra leases lapse
    /// soon, in a second statement.
    pub async fn lease_round_on<'c>(&self, conn: impl sqlx::PgExecutor<'c>) -> Result<Leases> {
        let round: (i64, Vec<i32>, Vec<i64>, Vec<i32>, Vec<i64>) = sqlx::query_as(if self.wakes {
            LEASE_ROUND_WAKES
        } else {
            LEASE_ROUND
        })
        .bind(&self.source)
        .bind(&self.relay_id)
        .bind(self.lease_ttl.as_secs_f64())
        .bind(self.lanes as i64)
        .bind(this_host())
        .bind(std::process::id() as i32)
        .fetch_one(conn)
        .await
        .context("renewing lane leases")?;
        let (relays, kept, kept_epochs, taken, taken_epochs) = round;
        let relays_alive = relays.max(1);
        let fair = (self.lanes as i64 + relays_alive - 1) / relays_alive;
        let acquired = taken.len();
        let mut held: Vec<(i32, i64)> = kept
            .into_iter()
            .zip(kept_epochs)
            .chain(taken.into_iter().zip(taken_epochs))
            .collect();
        held.sort_unstable();
        if (held.len() as i64) > fair {
            // Over our share: stop claiming from the extra lanes now and let
            // their leases lapse so another relay can take them after one TTL
            // (in-flight batches finish well within it).
            let extra: Vec<i32> = held
                .split_off(fair as usize)
                .into_iter()
                .map(|(lane, _)| lane)
                .collect();
            tracing::info!(lanes = ?extra, "releasing lanes over the fair share");
            sqlx::query("UPDATE outroute_lanes SET lease_until = now() + make_interval(secs => $3) WHERE source = $1 AND owner = $2 AND lane = ANY($4) AND lease_until > now() + make_interval(secs => $3)")
                .bind(&self.source)
                .bind(&self.relay_id)
                .bind(self.lease_ttl.as_secs_f64() / 3.0)
                .bind(&extra)
                .execute(&self.pool)
                .await?;
        }
        let (lanes, epochs): (Vec<i32>, Vec<i64>) = held.into_iter().unzip();
        // A lane taken over by another relay starts from the bottom if it
        // comes back (its floor is still valid, but costs nothing to redo).
        self.floors_mut().forget_except(&lanes);
        Ok(Leases {
            lanes,
            epochs,
            acquired,
            relays,
        })
    }

    pub async fn release_all(&self) -> Result<()> {
        sqlx::query("UPDATE outroute_lanes SET owner = NULL, lease_until = '-infinity' WHERE source = $1 AND owner = $2")
            .bind(&self.source)
            .bind(&self.relay_id)
            .execute(&self.pool)
            .await?;
        sqlx::query("DELETE FROM outroute_relays WHERE source = $1 AND relay_id = $2")
            .bind(&self.source)
            .bind(&self.relay_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn claim(&self, lanes: &[i32], limit: u32) -> Result<Claimed> {
        self.claim_on(&self.pool, lanes, limit).await
    }

    /// A claim on `conn` (the pool, or a sleeping source's LISTEN
    /// connection: the first event after a quiet spell waits for no new
    /// connection). The fan-out legs of retried events, rare and never
    /// while asleep, are read on the pool.
    pub async fn claim_on<'c>(
        &self,
        conn: impl sqlx::PgExecutor<'c>,
        lanes: &[i32],
        limit: u32,
    ) -> Result<Claimed> {
        if lanes.is_empty() {
            return Ok(Claimed {
                claims: Vec::new(),
                drained: true,
            });
        }
        let starts = self.current_floors(lanes);
        let json = self.sql()?.payload_is_json;
        // Bounded in bytes as well as rows: rows are read as they come and
        // the claim stops at the one whose payload reaches
        // `relay.max_batch_bytes` (the rest of the answer is read and
        // dropped by the connection; the next claims ask for only as many
        // rows as fitted, growing back after claims that fit whole).
        use std::sync::atomic::Ordering::Relaxed;
        let asked = limit.min(self.claim_rows.load(Relaxed)).max(1);
        let mut claims: Vec<Claim> = Vec::new();
        let mut bytes = 0u64;
        {
            let mut rows = self
                .bind_claim(
                    sqlx::query(self.claim_for(starts.as_ref())),
                    lanes,
                    starts.as_ref(),
                    asked,
                )
                .fetch(conn);
            while let Some(r) = rows.try_next().await.context("claiming events")? {
                let c = to_claim(&r, json)?;
                bytes += c.bytes();
                claims.push(c);
                if bytes >= self.max_batch_bytes {
                    break;
                }
            }
        }
        let drained = bytes < self.max_batch_bytes && (claims.len() as u32) < asked;
        let rows = if bytes >= self.max_batch_bytes {
            claims.len() as u32 + 1
        } else if claims.len() as u32 >= asked && asked < limit {
            asked.saturating_mul(2)
        } else {
            u32::MAX
        };
        self.claim_rows.store(rows, Relaxed);
        if !claims.is_empty() {
            self.floors_mut()
                .saw(claims.iter().map(|c| (c.lane, c.sequence())));
        }
        // Retried events only (rare): which fan-out legs already went.
        let retried: Vec<&str> = claims
            .iter()
            .filter(|c| c.has_state)
            .map(|c| c.id())
            .collect();
        if !retried.is_empty() {
            let legs: Vec<(String, Vec<String>)> = sqlx::query_as(
                "SELECT event_id, done_legs FROM outroute_event_state \
                 WHERE source = $1 AND event_id = ANY($2) AND cardinality(done_legs) > 0",
            )
            .bind(&self.source)
            .bind(&retried)
            .fetch_all(&self.pool)
            .await
            .context("reading acknowledged fan-out legs")?;
            if !legs.is_empty() {
                let legs: std::collections::HashMap<String, Vec<String>> =
                    legs.into_iter().collect();
                for c in claims.iter_mut() {
                    if let Some(l) = legs.get(c.id()) {
                        c.done_legs = l.clone();
                    }
                }
            }
        }
        Ok(Claimed { claims, drained })
    }

    /// Name the routes that read this source (see [`PgStore::routes`]).
    pub fn set_routes(&self, names: Vec<String>) {
        // A row a skip passes as held may be taken by a new route.
        self.floors_mut().forget_skips();
        *self.routes.write().unwrap_or_else(|e| e.into_inner()) = names;
    }

    pub(super) fn routes(&self) -> Vec<String> {
        self.routes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(super) fn floors_mut(&self) -> std::sync::MutexGuard<'_, floor::Floors> {
        // A poisoned lock only means a panic elsewhere mid-update; floors
        // are re-checked by every round and sweep.
        self.floors.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The floors and skips of these lanes, when the claim statement takes
    /// them (`$5`–`$8`); `None` for a claim by scan.
    pub(super) fn current_floors(&self, lanes: &[i32]) -> Option<floor::Starts> {
        if self.missing_index.is_some() {
            return None;
        }
        Some(match self.floor_sql {
            Some(_) => self.floors_mut().starts(lanes),
            None => floor::Starts::bottom(lanes),
        })
    }

    /// The skip a lane's claims take now (see `postgres/floor.rs`): the
    /// holder's sequence number and the end (tests, diagnosis).
    pub fn claim_skip(&self, lane: i32) -> Option<(i64, i64)> {
        self.floors_mut().skip(lane).map(|k| (k.from, k.to))
    }

    /// Run a floor round for those of these lanes that are due one (see
    /// `postgres/floor.rs`); the relay calls it every
    /// [`FLOOR_ROUND_INTERVAL`] beside its claims, so a claim is always one
    /// statement. Floors only save work: a failed round is logged and
    /// claims go on from the floors they have. Returns whether a floor was
    /// lowered (a row turned up below it: a sleeping source must claim).
    pub async fn raise_floors(&self, lanes: &[i32]) -> bool {
        self.raise_floors_on(&self.pool, lanes).await
    }

    /// [`PgStore::raise_floors`] on `conn` (a sleeping source's LISTEN
    /// connection, or the pool).
    pub async fn raise_floors_on<'c>(
        &self,
        conn: impl sqlx::PgExecutor<'c>,
        lanes: &[i32],
    ) -> bool {
        let Some(sql) = &self.floor_sql else {
            return false;
        };
        // `seen` is read here, before the round's statement (see floor.rs).
        let (
            floors,
            floor::Due {
                lanes,
                sweep,
                seen,
                skip_from,
                skip_to,
                candidate_to,
            },
        ) = {
            let f = self.floors_mut();
            match f.due(lanes, std::time::Instant::now()) {
                Some(due) => (f.of(&due.lanes), due),
                None => return false,
            }
        };
        let lanes = &lanes[..];
        // Per lane: xmin, xmax, first, state, below, holder, resume and
        // the two fingerprints (see `floor_round_with`).
        type Row = (
            i64,
            i64,
            Option<i64>,
            Option<i64>,
            Option<i64>,
            Option<i64>,
            Option<i64>,
            Option<String>,
            Option<String>,
        );
        let rows: Result<Vec<Row>, _> = sqlx::query_as(sql)
            .bind(&self.source)
            .bind(lanes)
            .bind(&floors)
            .bind(&sweep)
            .bind(&skip_from)
            .bind(&skip_to)
            .bind(&candidate_to)
            .bind(self.routes())
            .fetch_all(conn)
            .await;
        let rows = match rows {
            Ok(r) if r.len() == lanes.len() => r,
            Ok(r) => {
                tracing::warn!(
                    lanes = lanes.len(),
                    rows = r.len(),
                    "claim floor round: unexpected row count"
                );
                return false;
            }
            Err(e) => {
                tracing::warn!("claim floor round failed (claims start lower): {e:#}");
                return false;
            }
        };
        let round = floor::Round {
            seen,
            xmin: rows.first().map_or(0, |r| r.0),
            xmax: rows.first().map_or(0, |r| r.1),
            first: rows.iter().map(|r| r.2).collect(),
            state: rows.iter().map(|r| r.3).collect(),
            below: rows.iter().map(|r| r.4).collect(),
            swept: sweep,
            holder: rows.iter().map(|r| r.5).collect(),
            resume: rows.iter().map(|r| r.6).collect(),
            fingerprint_now: rows.iter().map(|r| r.7.clone()).collect(),
            fingerprint_candidate: rows.iter().map(|r| r.8.clone()).collect(),
        };
        let lowered = self
            .floors_mut()
            .apply(lanes, &round, std::time::Instant::now());
        let any = !lowered.is_empty();
        for (lane, seq) in lowered {
            metrics::counter!(crate::metrics::FLOOR_LOWERED, "source" => source_name(&self.key).to_string())
                .increment(1);
            tracing::warn!(
                lane,
                seq,
                "a pending row turned up below the lane's claim floor (a transaction that took its \
                 sequence number long before it committed): the lane is walked from it again"
            );
        }
        any
    }

    /// Look below every floor on the next [`Self::raise_floors`] instead of
    /// waiting for the sweep interval.
    pub fn sweep_floors_soon(&self) {
        self.floors_mut().sweep_soon(std::time::Instant::now());
    }
}

macro_rules! lease_round_ctes {
    () => {
        "WITH me AS (INSERT INTO outroute_relays (source, relay_id, hostname, pid) \
           VALUES ($1, $2, $5, $6) \
           ON CONFLICT (source, relay_id) DO UPDATE SET heartbeat_at = now()), \
         gone AS (DELETE FROM outroute_relays WHERE source = $1 AND relay_id <> $2 \
           AND heartbeat_at < now() - make_interval(secs => $3 * 10)), \
         alive AS (SELECT 1 + count(*) AS n FROM outroute_relays WHERE source = $1 \
           AND relay_id <> $2 AND heartbeat_at > now() - make_interval(secs => $3)), \
         kept AS (UPDATE outroute_lanes SET lease_until = now() + make_interval(secs => $3) \
           WHERE source = $1 AND owner = $2 AND lease_until > now() AND lane >= 0 \
           RETURNING lane, epoch), \
         taken AS (UPDATE outroute_lanes l SET owner = $2, \
             lease_until = now() + make_interval(secs => $3), epoch = l.epoch + 1 \
           FROM (SELECT lane FROM outroute_lanes WHERE source = $1 AND lane >= 0 \
                 AND (owner IS NULL OR lease_until <= now()) ORDER BY lane \
                 LIMIT greatest(0, ($4 + (SELECT n FROM alive) - 1) / (SELECT n FROM alive) \
                   - (SELECT count(*) FROM kept)) \
                 FOR UPDATE SKIP LOCKED) free \
           WHERE l.source = $1 AND l.lane = free.lane RETURNING l.lane, l.epoch) "
    };
}

macro_rules! lease_round_answer {
    () => {
        "(SELECT n FROM alive), \
         ARRAY(SELECT lane FROM kept ORDER BY lane), ARRAY(SELECT epoch FROM kept ORDER BY lane), \
         ARRAY(SELECT lane FROM taken ORDER BY lane), ARRAY(SELECT epoch FROM taken ORDER BY lane)"
    };
}

/// One lease round (see [`PgStore::lease_round_on`]): `$1` source, `$2`
/// relay id, `$3` lease TTL in seconds, `$4` lanes, `$5` host, `$6` pid.
/// Every part sees the statement's one snapshot: the live relays are the
/// others heard from within a TTL plus this one; lanes renewed (held and
/// not lapsed) and lanes taken (free or lapsed) are disjoint.
const LEASE_ROUND: &str = concat!(lease_round_ctes!(), "SELECT ", lease_round_answer!());

/// [`LEASE_ROUND`] that also renews this relay's asleep record, on a
/// source whose trigger notifies sleepers (`store/postgres/wake.rs`).
const LEASE_ROUND_WAKES: &str = concat!(
    lease_round_ctes!(),
    ", asleep AS (UPDATE outroute_wake SET since = now() WHERE source = $1 AND relay = $2 AND asleep) ",
    "SELECT ",
    lease_round_answer!()
);
