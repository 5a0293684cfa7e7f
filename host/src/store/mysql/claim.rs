//! The event path's reading half on MySQL/MariaDB: lease rounds (which
//! lanes this relay claims from) and the claim (each owned lane's pending
//! rows in outbox order, per batch whatever the backlog; see `mysql.rs`).

use super::*;
use chrono::NaiveDateTime;

/// Nothing of the source waits for a retry or holds an aggregate back
/// now: no state row is retrying (`failed_at IS NULL`) and none blocks
/// (`blocks_until` in the future); both are index probes. Evaluated once
/// per lane walk, not per row. Parameters: source, source.
const QUIET: &str = "(NOT EXISTS (SELECT 1 FROM outroute_event_state q FORCE INDEX (outroute_event_state_failed) \
       WHERE q.source = ? AND q.failed_at IS NULL) \
     AND NOT EXISTS (SELECT 1 FROM outroute_event_state q FORCE INDEX (outroute_event_state_blocks) \
       WHERE q.source = ? AND q.blocks_until > UTC_TIMESTAMP(6)))";

impl MySqlStore {
    /// One lease round, in one transaction: heartbeat this relay, forget
    /// relays silent for ten TTLs, count the live ones (all three
    /// [`MySqlStore::heartbeat`]), renew the lanes
    /// this relay holds, take free or lapsed ones up to its fair share
    /// (`SKIP LOCKED`: never waits for another relay's round). A relay
    /// over its share lets the extra leases lapse soon.
    pub async fn lease_round(&self) -> Result<Leases> {
        let ttl = micros(self.lease_ttl);
        let mut tx = self.pool.begin().await?;
        let relays = self.heartbeat(&mut tx).await?;
        sqlx::query(
            "UPDATE outroute_lanes SET lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             WHERE source = ? AND owner = ? AND lease_until > UTC_TIMESTAMP(6) AND lane >= 0 AND lane < ?",
        )
        .bind(ttl)
        .bind(&self.source)
        .bind(&self.relay_id)
        .bind(self.lanes as i32)
        .execute(&mut *tx)
        .await?;
        let mut held: Vec<(i32, i64)> = sqlx::query_as(
            "SELECT lane, epoch FROM outroute_lanes WHERE source = ? AND owner = ? \
             AND lease_until > UTC_TIMESTAMP(6) AND lane >= 0 AND lane < ? ORDER BY lane",
        )
        .bind(&self.source)
        .bind(&self.relay_id)
        .bind(self.lanes as i32)
        .fetch_all(&mut *tx)
        .await?;
        let relays = relays.max(1);
        let fair = (i64::from(self.lanes) + relays - 1) / relays;
        let want = fair - held.len() as i64;
        let mut acquired = 0;
        if want > 0 {
            let free: Vec<i32> = sqlx::query_scalar(
                "SELECT lane FROM outroute_lanes WHERE source = ? AND lane >= 0 AND lane < ? \
                 AND (owner IS NULL OR lease_until <= UTC_TIMESTAMP(6)) ORDER BY lane LIMIT ? \
                 FOR UPDATE SKIP LOCKED",
            )
            .bind(&self.source)
            .bind(self.lanes as i32)
            .bind(want)
            .fetch_all(&mut *tx)
            .await?;
            if !free.is_empty() {
                let mut qb: QueryBuilder<MySql> =
                    QueryBuilder::new("UPDATE outroute_lanes SET epoch = epoch + 1, owner = ");
                qb.push_bind(&self.relay_id)
                    .push(", lease_until = UTC_TIMESTAMP(6) + INTERVAL ")
                    .push_bind(ttl)
                    .push(" MICROSECOND WHERE source = ")
                    .push_bind(&self.source)
                    .push(" AND lane IN (");
                let mut sep = qb.separated(", ");
                for lane in &free {
                    sep.push_bind(*lane);
                }
                qb.push(")");
                qb.build().execute(&mut *tx).await?;
                let mut qb: QueryBuilder<MySql> =
                    QueryBuilder::new("SELECT lane, epoch FROM outroute_lanes WHERE source = ");
                qb.push_bind(&self.source).push(" AND lane IN (");
                let mut sep = qb.separated(", ");
                for lane in &free {
                    sep.push_bind(*lane);
                }
                qb.push(")");
                let taken: Vec<(i32, i64)> = qb.build_query_as().fetch_all(&mut *tx).await?;
                acquired = taken.len();
                // Another relay may have left anything in them: deep.
                let mut empty = self.empty.lock().unwrap_or_else(|p| p.into_inner());
                for (lane, _) in &taken {
                    empty.remove(lane);
                }
                drop(empty);
                held.extend(taken);
            }
        }
        tx.commit().await.context("renewing lane leases")?;
        held.sort_unstable();
        if held.len() as i64 > fair {
            // Over our share (another relay joined): stop claiming from the
            // extra lanes now and let their leases lapse within a third of
            // a TTL, so the newcomer takes them (in-flight batches finish
            // well within it).
            let extra: Vec<i32> = held
                .split_off(fair.max(0) as usize)
                .into_iter()
                .map(|(lane, _)| lane)
                .collect();
            tracing::info!(lanes = ?extra, "releasing lanes over the fair share");
            let mut qb: QueryBuilder<MySql> = QueryBuilder::new(
                "UPDATE outroute_lanes SET lease_until = UTC_TIMESTAMP(6) + INTERVAL ",
            );
            qb.push_bind(ttl / 3)
                .push(" MICROSECOND WHERE source = ")
                .push_bind(&self.source)
                .push(" AND owner = ")
                .push_bind(&self.relay_id)
                .push(" AND lane IN (");
            let mut sep = qb.separated(", ");
            for lane in &extra {
                sep.push_bind(*lane);
            }
            qb.push(")");
            qb.build().execute(&self.pool).await?;
        }
        let (lanes, epochs) = held.into_iter().unzip();
        Ok(Leases {
            lanes,
            epochs,
            acquired,
            relays,
        })
    }

    /// Say this relay is alive (`outroute_relays`), in a lease round's
    /// transaction; forget relays silent for ten TTLs. Returns the live
    /// relays of the source, this one included.
    pub(super) async fn heartbeat(&self, tx: &mut sqlx::Transaction<'_, MySql>) -> Result<i64> {
        let ttl = micros(self.lease_ttl);
        sqlx::query(
            "INSERT INTO outroute_relays (source, relay_id, hostname, pid, started_at, heartbeat_at) \
             VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6)) \
             ON DUPLICATE KEY UPDATE heartbeat_at = UTC_TIMESTAMP(6)",
        )
        .bind(&self.source)
        .bind(&self.relay_id)
        .bind(this_host())
        .bind(std::process::id() as i32)
        .execute(&mut **tx)
        .await?;
        sqlx::query(
            "DELETE FROM outroute_relays WHERE source = ? AND relay_id <> ? \
             AND heartbeat_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
        )
        .bind(&self.source)
        .bind(&self.relay_id)
        .bind(ttl.saturating_mul(10))
        .execute(&mut **tx)
        .await?;
        let relays: i64 = sqlx::query_scalar(
            "SELECT 1 + count(*) FROM outroute_relays WHERE source = ? AND relay_id <> ? \
             AND heartbeat_at > UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
        )
        .bind(&self.source)
        .bind(&self.relay_id)
        .bind(ttl)
        .fetch_one(&mut **tx)
        .await?;
        Ok(relays)
    }

    /// Give every lane back and leave the relay list (graceful shutdown).
    pub async fn release_all(&self) -> Result<()> {
        sqlx::query(&format!(
            "UPDATE outroute_lanes SET owner = NULL, lease_until = {NEVER} WHERE source = ? AND owner = ?"
        ))
        .bind(&self.source)
        .bind(&self.relay_id)
        .execute(&self.pool)
        .await?;
        sqlx::query("DELETE FROM outroute_relays WHERE source = ? AND relay_id = ?")
            .bind(&self.source)
            .bind(&self.relay_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// One walk of a claim over `lanes` lanes (one: `= ?`; more: `IN
    /// (…)`, the shallow claim): their pending rows (after the last row an
    /// earlier round of the claim left, when `after`) in outbox
    /// order, skipping rows waiting for a retry or failed, and (unless
    /// `ordering = "none"`) rows of an aggregate an earlier event holds
    /// back, up to `LIMIT ?`; each row says its lane (`lane_of`). While no
    /// event of the source is retrying or holding anything back
    /// ([`QUIET`], one probe per walk), rows skip those per-row probes
    /// (measured: 15 % of a claim's time).
    /// Parameters: source, lane…, [after…], source, source, [source], limit.
    fn lane_walk(&self, lanes: usize, after: bool) -> String {
        let s = &self.sql;
        let (index, lane) = if self.lane_index {
            (
                format!(" FORCE INDEX ({})", lane_index_name(self.lanes)),
                format!("o.{}", lane_column(self.lanes)),
            )
        } else {
            (String::new(), s.lane.clone())
        };
        let hold = match self.ordering {
            Ordering::None => String::new(),
            Ordering::Aggregate | Ordering::Strict => format!(
                " AND NOT EXISTS (SELECT 1 FROM outroute_event_state b FORCE INDEX (outroute_event_state_aggregate) \
                   WHERE b.source = ? AND b.aggregate_type = {at} AND b.aggregate_id = {ai} \
                   AND {before} AND b.blocks_until > UTC_TIMESTAMP(6))",
                at = s.aggregate_type_bin,
                ai = s.aggregate_id_bin,
                before = s.before(),
            ),
        };
        let after = if after {
            format!(" AND {}", s.after())
        } else {
            String::new()
        };
        let which = if lanes == 1 {
            "= ?".to_string()
        } else {
            format!("IN ({})", vec!["?"; lanes].join(", "))
        };
        // Over several lanes (the shallow claim), lane by lane in the lane
        // index's order, not by `order` across lanes: a filesort of this
        // range evaluated `lane IN (…)` on the virtual lane column without
        // reading its base columns (MariaDB 10.11, the shape of
        // MDEV-28610), and dropped pending rows at random. In index order
        // nothing is sorted; the claim puts the rows in the relay's lane
        // order afterwards anyway.
        let order = if lanes > 1 && self.lane_index {
            format!("{lane}, {}", s.order)
        } else {
            s.order.clone()
        };
        format!(
            "(SELECT CAST({lane} AS SIGNED) AS lane_of, {cols}, st.event_id IS NOT NULL AS has_state, \
               COALESCE(st.attempts, 0) AS attempts, CAST(COALESCE(st.done_legs, '[]') AS CHAR) AS done_legs \
             FROM {table} o{index} \
             LEFT JOIN outroute_event_state st ON st.source = ? AND st.event_id = {id} \
             WHERE {lane} {which} AND {pending}{after} \
               AND ({quiet} OR ((st.event_id IS NULL OR (st.failed_at IS NULL AND st.next_attempt_at <= UTC_TIMESTAMP(6))){hold})) \
             ORDER BY {order} LIMIT ?)",
            cols = s.cols,
            table = s.table,
            id = s.id_bin,
            pending = s.pending,
            quiet = QUIET,
        )
    }

    /// One statement of a claim: `order`'s lanes walked, each from after
    /// its last row so far (`after`), for up to `share` rows each.
    async fn walk(
        &self,
        order: &[i32],
        after: &HashMap<i32, Last>,
        share: i64,
    ) -> Result<Vec<MySqlRow>> {
        let sql = order
            .iter()
            .map(|lane| self.lane_walk(1, after.contains_key(lane)))
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        let mut q = sqlx::query(&sql);
        for lane in order {
            q = q.bind(&self.source).bind(*lane);
            match after.get(lane) {
                None => {}
                Some(Last::Seq(seq)) => q = q.bind(*seq),
                Some(Last::Time(at, id)) => q = q.bind(*at).bind(*at).bind(id.clone()),
            }
            q = q.bind(&self.source).bind(&self.source);
            if self.ordering != Ordering::None {
                q = q.bind(&self.source);
            }
            q = q.bind(share);
        }
        q.fetch_all(&self.pool).await.context("claiming events")
    }

    /// The shallow claim: every lane of `lanes` in one statement, pending
    /// rows in outbox order up to `limit` (see [`MySqlStore::claim`]).
    async fn walk_all(&self, lanes: &[i32], limit: u32) -> Result<Vec<MySqlRow>> {
        let lanes = padded(lanes);
        let sql = self.lane_walk(lanes.len(), false);
        let mut q = sqlx::query(&sql).bind(&self.source);
        for lane in lanes {
            q = q.bind(lane);
        }
        q = q.bind(&self.source).bind(&self.source);
        if self.ordering != Ordering::None {
            q = q.bind(&self.source);
        }
        q.bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .context("claiming events")
    }

    /// `EXPLAIN FORMAT=JSON` of the shallow claim over `lanes`: what the
    /// server will do with it (a test checks that nothing is sorted).
    pub async fn explain_shallow(&self, lanes: &[i32], limit: u32) -> Result<String> {
        let lanes = padded(lanes);
        let sql = self.lane_walk(lanes.len(), false);
        let sql = format!(
            "EXPLAIN FORMAT=JSON {}",
            sql.trim_start_matches('(').trim_end_matches(')')
        );
        let mut q = sqlx::query_scalar(&sql).bind(&self.source);
        for lane in lanes {
            q = q.bind(lane);
        }
        q = q.bind(&self.source).bind(&self.source);
        if self.ordering != Ordering::None {
            q = q.bind(&self.source);
        }
        Ok(q.bind(i64::from(limit)).fetch_one(&self.pool).await?)
    }

    /// Claim up to `limit` events from `lanes`, in one of two ways:
    ///
    /// * **Shallow** (every lane's last walk came back short): one statement
    ///   over all the lanes, reading every pending row they have (few, or
    ///   the last claim would have found them) in outbox order. A claim
    ///   statement costs MariaDB ~0.3 ms per lane branch to plan whatever it
    ///   finds, so the per-lane walk below cost a caught-up relay at
    ///   steady load 10 ms per claim over 32 lanes; this costs one.
    /// * **Deep** (a lane left rows last time, or its claim failed, or none
    ///   ran yet: the backlog may be anything): each lane walked through the lane
    ///   index for its share of the batch, the lanes that had more walked
    ///   on with what is left, at most [`CLAIM_ROUNDS`] statements; the
    ///   first lane walked alone for the whole batch first, so a batch takes
    ///   as few lanes as it can and the source's other workers find lanes
    ///   of their own. A lane that returns less than its share (never under
    ///   [`MIN_SHARE`]) is short, even if the batch filled before its rows:
    ///   with shares of one row, a claim under steady load found no lane
    ///   short and stayed deep, a 63-branch statement (~19 ms of MariaDB)
    ///   per claim.
    ///
    /// Rows come back lane by lane in the order given (the relay turns it
    /// every claim), each lane in outbox order; the claim stops at
    /// `relay.max_batch_bytes` of payload.
    pub async fn claim(&self, lanes: &[i32], limit: u32) -> Result<Claimed> {
        if lanes.is_empty() || limit == 0 {
            return Ok(Claimed {
                claims: Vec::new(),
                drained: true,
            });
        }
        // Shallow only if every lane came back short last time.
        let deep = {
            let empty = self.empty.lock().unwrap_or_else(|p| p.into_inner());
            !lanes.iter().all(|l| empty.contains(l))
        };
        // A claim that fails, or is given up mid-statement (the store's
        // statement timeout drops it), leaves its lanes deep: it may have
        // failed for reading too much.
        let mut guard = DeepUnlessDone {
            store: self,
            lanes,
            done: false,
        };
        let (claimed, short, full) = self.claim_walks(lanes, limit, deep).await?;
        guard.done = true;
        // What the walks found: lanes that came back short, and lanes that
        // filled what they were asked (or were cut off).
        let mut empty = self.empty.lock().unwrap_or_else(|p| p.into_inner());
        empty.extend(short);
        for l in full {
            empty.remove(&l);
        }
        Ok(claimed)
    }

    /// Make the next claim of `lanes` deep (each lane walked from its
    /// start): binlog capture's drain ends only on a deep claim that found
    /// nothing, as a shallow one after a cut claim was seen to miss rows.
    pub fn claim_deep_next(&self, lanes: &[i32]) {
        let mut empty = self.empty.lock().unwrap_or_else(|p| p.into_inner());
        for l in lanes {
            empty.remove(l);
        }
    }

    /// The walks of one claim (see [`MySqlStore::claim`]): the claim, the
    /// lanes that came back short, and those that did not.
    async fn claim_walks(
        &self,
        lanes: &[i32],
        limit: u32,
        deep: bool,
    ) -> Result<(Claimed, Vec<i32>, Vec<i32>)> {
        let mut short: Vec<i32> = Vec::new();
        let place: HashMap<i32, usize> = lanes.iter().enumerate().map(|(i, l)| (*l, i)).collect();
        let mut claims: Vec<(usize, Claim)> = Vec::new();
        let mut more = false;
        if !deep {
            let rows = self.walk_all(lanes, limit).await?;
            for r in &rows {
                let lane = lane_of(r)?;
                claims.push((
                    place.get(&lane).copied().unwrap_or(usize::MAX),
                    to_claim(r, lane)?,
                ));
            }
            more = rows.len() >= limit as usize;
            if !more {
                short = lanes.to_vec();
            }
        } else {
            let mut order: Vec<i32> = lanes.to_vec();
            // Each lane from its floor (`mysql/floor.rs`), past the
            // entries of rows it published.
            let mut after: HashMap<i32, Last> = self
                .floors_of(lanes)
                .into_iter()
                .map(|(l, f)| (l, Last::Seq(f.saturating_sub(1))))
                .collect();
            let mut bytes = 0u64;
            let alone = order.len() > 1;
            for round in 0..CLAIM_ROUNDS {
                let left = limit as usize - claims.len().min(limit as usize);
                if order.is_empty() || left == 0 || bytes >= self.max_batch_bytes {
                    break;
                }
                let walking: &[i32] = if alone && round == 0 {
                    &order[..1]
                } else {
                    &order
                };
                // Never a share under `MIN_SHARE` (or what is left): a
                // lane that returns less than a share of one or two says
                // nothing about its depth, so a claim asking tiny shares
                // could never find its lanes short and every claim stayed
                // deep. What is walked past the batch is cut below.
                let share = left.div_ceil(walking.len()).max(left.min(MIN_SHARE)) as i64;
                let rows = self.walk(walking, &after, share).await?;
                let mut per_lane: HashMap<i32, i64> = HashMap::new();
                for r in &rows {
                    let lane = lane_of(r)?;
                    let c = to_claim(r, lane)?;
                    *per_lane.entry(lane).or_default() += 1;
                    after.insert(lane, self.last(r, &c));
                    bytes += c.bytes();
                    claims.push((place.get(&lane).copied().unwrap_or(usize::MAX), c));
                }
                // Lanes that filled their share may have more; a lane walked
                // alone that did not is done, the others are still to walk.
                let walked: Vec<i32> = walking.to_vec();
                short.extend(
                    walked
                        .iter()
                        .filter(|l| per_lane.get(l).copied().unwrap_or(0) < share),
                );
                order.retain(|l| {
                    !walked.contains(l) || per_lane.get(l).copied().unwrap_or(0) >= share
                });
                more = walked
                    .iter()
                    .any(|l| per_lane.get(l).copied().unwrap_or(0) >= share);
                if alone && round == 0 && more {
                    // The first lane filled the batch.
                    break;
                }
            }
        }
        // Lane by lane in this claim's lane order, each in outbox order
        // (the walks of later rounds continue their lane's earlier rows).
        claims.sort_by_key(|(place, c)| (*place, c.sequence()));
        let mut out = Vec::with_capacity(claims.len().min(limit as usize));
        let mut kept_bytes = 0u64;
        let mut cut = false;
        for (_, c) in claims {
            if out.len() >= limit as usize
                || (kept_bytes >= self.max_batch_bytes && !out.is_empty())
            {
                cut = true;
                break;
            }
            kept_bytes += c.bytes();
            out.push(c);
        }
        // A lane that came back short had fewer than its share pending,
        // whether or not the batch was cut: the next shallow claim reads at
        // most that many of it (plus what arrived since).
        let full: Vec<i32> = lanes
            .iter()
            .filter(|l| !short.contains(l))
            .copied()
            .collect();
        self.floors_saw(out.iter().map(|c| (c.lane, c.sequence())));
        let claimed = Claimed {
            drained: !more && !cut && kept_bytes < self.max_batch_bytes,
            claims: out,
        };
        Ok((claimed, short, full))
    }
}

/// The smallest share of a deep claim's later rounds: a lane found with
/// fewer pending rows than this is short, and a shallow claim over lanes
/// all short reads at most this many rows per lane (plus what producers
/// added since).
const MIN_SHARE: usize = 16;

/// Marks a claim's lanes deep when dropped before the claim finished.
struct DeepUnlessDone<'a> {
    store: &'a MySqlStore,
    lanes: &'a [i32],
    done: bool,
}

impl Drop for DeepUnlessDone<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut empty = self.store.empty.lock().unwrap_or_else(|p| p.into_inner());
            for l in self.lanes {
                empty.remove(l);
            }
        }
    }
}

/// The lane a claimed row belongs to.
fn lane_of(r: &MySqlRow) -> Result<i32> {
    let lane: i64 = r.try_get("lane_of")?;
    i32::try_from(lane).map_err(|_| anyhow!("claim: a row of no lane ({lane})"))
}

/// Where a lane's walk stopped: its last row's sequence number, or (a
/// table ordered by `created_at`) its time and id. A row whose time is
/// NULL ends the lane's walk for this claim (`> NULL` matches nothing).
#[derive(Debug, Clone)]
enum Last {
    Seq(i64),
    Time(Option<NaiveDateTime>, String),
}

impl MySqlStore {
    fn last(&self, r: &MySqlRow, c: &Claim) -> Last {
        if self.sql.by_seq {
            Last::Seq(c.sequence())
        } else {
            Last::Time(
                r.try_get::<Option<NaiveDateTime>, _>("created_at")
                    .ok()
                    .flatten(),
                c.id().to_string(),
            )
        }
    }
}

/// A claimed (or replayed) row as a [`Claim`] of `lane`.
pub(super) fn to_claim(r: &MySqlRow, lane: i32) -> Result<Claim> {
    let id: String = r.try_get("id")?;
    let read = || -> Result<RawRow, sqlx::Error> {
        let created: Option<DateTime<Utc>> = r.try_get("created_at")?;
        Ok(RawRow {
            id: id.clone(),
            sequence: r.try_get("seq")?,
            aggregate_type: r.try_get("aggregate_type")?,
            aggregate_id: r.try_get("aggregate_id")?,
            event_type: r.try_get("event_type")?,
            event_version: r.try_get("event_version")?,
            payload: utf8(r, "payload")?,
            headers: utf8(r, "headers")?,
            created_at: created,
            attempts: r.try_get::<i64, _>("attempts").unwrap_or(0) as i32,
            // A CHECK (JSON_VALID) column; checked again all the same (a
            // mapped table may have none).
            payload_is_json: false,
        })
    };
    let row = match read() {
        Ok(raw) => raw.validate(),
        Err(e) => Err(crate::store::unreadable(r, id.clone(), e)),
    };
    let done_legs = r
        .try_get::<String, _>("done_legs")
        .ok()
        .and_then(|j| serde_json::from_str(&j).ok())
        .unwrap_or_default();
    Ok(Claim {
        lane,
        tid: None,
        has_state: r.try_get::<i64, _>("has_state").unwrap_or(1) != 0,
        held: Vec::new(),
        done_legs,
        epoch: None,
        captured: None,
        route: None,
        row,
    })
}

/// A LONGTEXT column read as the bytes it holds (its binary collation makes
/// the driver call it a BLOB), as UTF-8.
fn utf8(r: &MySqlRow, col: &str) -> Result<Option<String>, sqlx::Error> {
    r.try_get::<Option<Vec<u8>>, _>(col)?
        .map(|b| {
            String::from_utf8(b).map_err(|e| sqlx::Error::ColumnDecode {
                index: col.to_string(),
                source: Box::new(e),
            })
        })
        .transpose()
}
