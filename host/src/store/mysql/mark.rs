//! The event path's writing half on MySQL/MariaDB: marking claimed rows
//! published and recording retries and failures, both fenced by the lane's
//! owner, unexpired lease and epoch at claim time.

use super::*;

/// Binlog capture's marks, grouped. Under flat-out producers the stream
/// hands each partition a few events at a time, and each batch's mark was
/// a lease read and a commit of its own: ~730 of each a second for ~2,500
/// events (session 40). A mark joins the waiting group and takes the
/// statement slot; whoever gets it marks everything waiting in one
/// statement (group commit, as InnoDB does with its log flushes), so a
/// mark waits at most for the one statement ahead of it. A caller given
/// up mid-statement (the statement timeout) fails the marks it took.
#[derive(Default)]
pub(super) struct MarkGroup {
    waiting: std::sync::Mutex<Vec<Waiter>>,
    slot: tokio::sync::Mutex<()>,
}

impl MarkGroup {
    fn lock_waiting(&self) -> std::sync::MutexGuard<'_, Vec<Waiter>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Waiter {
    rows: Vec<Marked>,
    done: tokio::sync::oneshot::Sender<std::result::Result<u64, String>>,
}

/// A row to mark: its key, its state row's event id if it has one, the
/// lane and epoch it was claimed under.
#[derive(Debug, Clone)]
struct Marked {
    key: MarkKey,
    state_id: Option<String>,
    lane: i32,
    epoch: Option<i64>,
}

#[derive(Debug, Clone)]
enum MarkKey {
    Seq(i64),
    Id(String),
}

impl MySqlStore {
    /// The lanes of `lanes` this relay still holds, with their epochs (a
    /// plain read: a lease round never waits for a mark).
    async fn held_lanes(&self, lanes: &[i32]) -> Result<HashMap<i32, i64>> {
        let mut qb: QueryBuilder<MySql> =
            QueryBuilder::new("SELECT lane, epoch FROM outroute_lanes WHERE source = ");
        qb.push_bind(&self.source)
            .push(" AND owner = ")
            .push_bind(&self.relay_id)
            .push(" AND lease_until > UTC_TIMESTAMP(6) AND lane IN (");
        let mut sep = qb.separated(", ");
        for lane in padded(lanes) {
            sep.push_bind(lane);
        }
        qb.push(")");
        let rows: Vec<(i32, i64)> = qb.build_query_as().fetch_all(&self.pool).await?;
        Ok(rows.into_iter().collect())
    }

    /// For each of these claims (or failures): does this relay still hold
    /// its lane at the epoch it claimed it under (`None`: owner and lease
    /// only)? One read of the lanes.
    async fn fence<T>(
        &self,
        items: &[T],
        lane_epoch: impl Fn(&T) -> (i32, Option<i64>),
    ) -> Result<Vec<bool>> {
        let mut lanes: Vec<i32> = items.iter().map(|t| lane_epoch(t).0).collect();
        lanes.sort_unstable();
        lanes.dedup();
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        let held = self.held_lanes(&lanes).await?;
        Ok(items
            .iter()
            .map(|t| {
                let (lane, epoch) = lane_epoch(t);
                held.get(&lane)
                    .is_some_and(|e| epoch.is_none_or(|want| want == *e))
            })
            .collect())
    }

    /// Of these claims (or failures), those [`Self::fence`] lets through.
    async fn fenced<'a, T>(
        &self,
        items: &'a [T],
        lane_epoch: impl Fn(&T) -> (i32, Option<i64>),
    ) -> Result<Vec<&'a T>> {
        let mine = self.fence(items, lane_epoch).await?;
        Ok(items
            .iter()
            .zip(mine)
            .filter(|(_, m)| *m)
            .map(|(t, _)| t)
            .collect())
    }

    /// Mark these claimed rows published, fenced by lane ownership and
    /// epoch: rows of lanes this relay lost are not marked (another relay
    /// publishes them again, with the same id). Rows already published are
    /// not counted. An event's state row goes with it (one transaction; a
    /// batch without state rows is one autocommitted statement). Under
    /// binlog capture the marks of the stream's partitions are grouped
    /// ([`MarkGroup`]).
    pub async fn mark_published(&self, claims: &[&Claim]) -> Result<u64> {
        let rows: Vec<Marked> = claims
            .iter()
            .map(|c| Marked {
                key: match self.sql.key {
                    RowKey::Seq => MarkKey::Seq(c.sequence()),
                    RowKey::Id => MarkKey::Id(c.id().to_string()),
                },
                state_id: c.has_state.then(|| c.id().to_string()),
                lane: c.lane,
                epoch: c.epoch,
            })
            .collect();
        if self.binlog() {
            return self.mark_grouped(rows).await;
        }
        Ok(self.mark_rows(&rows).await?.1)
    }

    /// One mark statement (and the state rows' delete) for `rows`: which
    /// of them the fence let through, and how many rows it marked.
    async fn mark_rows(&self, rows: &[Marked]) -> Result<(Vec<bool>, u64)> {
        let mine = self.fence(rows, |r| (r.lane, r.epoch)).await?;
        let marked: Vec<&Marked> = rows
            .iter()
            .zip(&mine)
            .filter(|(_, m)| **m)
            .map(|(r, _)| r)
            .collect();
        if marked.is_empty() {
            return Ok((mine, 0));
        }
        let with_state: Vec<&str> = marked
            .iter()
            .filter_map(|r| r.state_id.as_deref())
            .collect();
        let mut n = 0;
        if with_state.is_empty() {
            // The usual batch: one statement, committed by itself.
            for chunk in marked.chunks(MAX_IN_LIST) {
                n += self
                    .mark_statement(chunk)
                    .build()
                    .execute(&self.pool)
                    .await
                    .context("marking events published")?
                    .rows_affected();
            }
            return Ok((mine, n));
        }
        let mut tx = self.pool.begin().await?;
        for chunk in marked.chunks(MAX_IN_LIST) {
            n += self
                .mark_statement(chunk)
                .build()
                .execute(&mut *tx)
                .await?
                .rows_affected();
        }
        for chunk in with_state.chunks(MAX_IN_LIST) {
            let mut qb: QueryBuilder<MySql> =
                QueryBuilder::new("DELETE FROM outroute_event_state WHERE source = ");
            qb.push_bind(&self.source).push(" AND event_id IN (");
            let mut sep = qb.separated(", ");
            for id in padded(chunk) {
                sep.push_bind(id);
            }
            qb.push(")");
            qb.build().execute(&mut *tx).await?;
        }
        tx.commit().await.context("marking events published")?;
        Ok((mine, n))
    }

    /// Binlog capture's mark: joins the group waiting for the next
    /// statement; whoever holds the statement slot marks everything
    /// waiting at once (see [`MarkGroup`]). Counts the rows the fence let
    /// through: a stream that resumed before rows it had already marked
    /// brings them again; they went out again (duplicates), and are not a
    /// lost lease.
    async fn mark_grouped(&self, rows: Vec<Marked>) -> Result<u64> {
        let (done, mut result) = tokio::sync::oneshot::channel();
        self.marks.lock_waiting().push(Waiter { rows, done });
        let answer = tokio::select! {
            biased;
            r = &mut result => r,
            _slot = self.marks.slot.lock() => {
                // Another holder may have marked this one's rows meanwhile.
                match result.try_recv() {
                    Ok(r) => Ok(r),
                    Err(_) => {
                        let group = std::mem::take(&mut *self.marks.lock_waiting());
                        let all: Vec<Marked> =
                            group.iter().flat_map(|w| w.rows.iter().cloned()).collect();
                        let outcome = self.mark_rows(&all).await.map_err(|e| format!("{e:#}"));
                        let mut at = 0;
                        for w in group {
                            let n = w.rows.len();
                            let _ = w.done.send(outcome.as_ref().map(|(mine, _)| {
                                mine[at..at + n].iter().filter(|m| **m).count() as u64
                            }).map_err(Clone::clone));
                            at += n;
                        }
                        result.await
                    }
                }
            }
        };
        match answer {
            Ok(Ok(n)) => Ok(n),
            Ok(Err(e)) => Err(anyhow!(e)),
            Err(_) => bail!(
                "marking events published: the grouped mark was given up (its statement timed out)"
            ),
        }
    }

    /// Record retries and failures (fenced like marks); returns how many
    /// were recorded. Times are the database's, so relays on hosts with
    /// skewed clocks agree on when a retry is due.
    pub async fn record_failures(&self, failures: &[Failure]) -> Result<u64> {
        let mine = self.fenced(failures, |f| (f.lane, f.epoch)).await?;
        if mine.is_empty() {
            return Ok(0);
        }
        let mut tx = self.pool.begin().await?;
        for f in &mine {
            // A retry is due, and holds its aggregate, until now + delay;
            // a failure holds it for ever (`block`) or not at all.
            let (next, blocks, failed, delay) = match f.kind {
                FailureKind::Retry { delay } => (
                    "UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND",
                    "UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND",
                    "NULL",
                    Some(micros(delay)),
                ),
                FailureKind::Failed { hold } => (
                    "UTC_TIMESTAMP(6)",
                    if hold { FOREVER } else { NEVER },
                    "UTC_TIMESTAMP(6)",
                    None,
                ),
            };
            let sql = format!(
                "INSERT INTO outroute_event_state (source, event_id, aggregate_type, aggregate_id, seq, event_type, \
                   attempts, next_attempt_at, blocks_until, last_error, route, plugin, plugin_version, \
                   first_error_at, updated_at, failed_at, done_legs) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, {n}, {b}, ?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), {failed}, ?) \
                 ON DUPLICATE KEY UPDATE attempts = VALUES(attempts), next_attempt_at = VALUES(next_attempt_at), \
                   blocks_until = VALUES(blocks_until), last_error = VALUES(last_error), route = VALUES(route), \
                   plugin = VALUES(plugin), plugin_version = VALUES(plugin_version), updated_at = VALUES(updated_at), \
                   failed_at = VALUES(failed_at), discarded_at = NULL, done_legs = VALUES(done_legs)",
                n = next,
                b = blocks,
            );
            let mut q = sqlx::query(&sql)
                .bind(&self.source)
                .bind(&f.id)
                .bind(&f.aggregate_type)
                .bind(&f.aggregate_id)
                .bind(f.sequence)
                .bind(&f.event_type)
                .bind(f.attempts as i64);
            if let Some(d) = delay {
                q = q.bind(d).bind(d);
            }
            q.bind(&f.reason)
                .bind(&f.route)
                .bind(&f.plugin)
                .bind(&f.plugin_version)
                .bind(serde_json::to_string(&f.done_legs).unwrap_or_else(|_| "[]".into()))
                .execute(&mut *tx)
                .await?;
            // Mirrored into the row (the columns it has), which says
            // whether it failed for good.
            let failed_for_good = matches!(f.kind, FailureKind::Failed { .. });
            if let Some(set) = self.failure_columns(failed_for_good) {
                let sql = format!(
                    "UPDATE {t} o SET {set} WHERE {key} = ? AND {unpublished}",
                    t = self.sql.table,
                    key = self.sql.key_col(),
                    unpublished = self.sql.unpublished,
                );
                let mut q = sqlx::query(&sql);
                if self.sql.cfg.attempts.is_some() {
                    q = q.bind(f.attempts as i64);
                }
                if self.sql.cfg.last_error.is_some() {
                    q = q.bind(&f.reason);
                }
                q = match self.sql.key {
                    RowKey::Seq => q.bind(f.sequence),
                    RowKey::Id => q.bind(&f.id),
                };
                q.execute(&mut *tx).await?;
            }
        }
        tx.commit()
            .await
            .context("recording failed and retried events")?;
        Ok(mine.len() as u64)
    }

    /// `UPDATE`/`DELETE … WHERE <unpublished> AND <key> IN (…)`: the
    /// mark of these rows, as the table's marking style has it.
    fn mark_statement(&self, rows: &[&Marked]) -> QueryBuilder<'static, MySql> {
        let mut qb = self.mark_head();
        let mut sep = qb.separated(", ");
        for row in padded(rows) {
            match &row.key {
                MarkKey::Seq(seq) => sep.push_bind(*seq),
                MarkKey::Id(id) => sep.push_bind(id.clone()),
            };
        }
        qb.push(")");
        qb
    }

    /// `UPDATE`/`DELETE … WHERE <unpublished> AND <key> IN (`.
    fn mark_head(&self) -> QueryBuilder<'static, MySql> {
        let s = &self.sql;
        let set = match &s.cfg.marking {
            crate::config::Marking::PublishedAt { column } => {
                format!("o.{} = UTC_TIMESTAMP(6)", table::quote(column))
            }
            crate::config::Marking::Status { column, sent, .. } => {
                format!("o.{} = {}", table::quote(column), table::literal(sent))
            }
            crate::config::Marking::Delete | crate::config::Marking::Queue { .. } => {
                return QueryBuilder::new(format!(
                    "DELETE o FROM {t} o WHERE {key} IN (",
                    t = s.table,
                    key = s.key_col()
                ));
            }
        };
        QueryBuilder::new(format!(
            "UPDATE {t} o SET {set} WHERE {unpublished} AND {key} IN (",
            t = s.table,
            unpublished = s.unpublished,
            key = s.key_col()
        ))
    }

    /// The row's own failure columns for a retry or (`failed`) a failure
    /// for good: attempts and last error (bound in that order, when
    /// mapped), `failed_at` and a failed status. `None`: the table has
    /// none of them.
    fn failure_columns(&self, failed: bool) -> Option<String> {
        let cfg = &self.sql.cfg;
        let mut set = Vec::new();
        if let Some(c) = &cfg.attempts {
            set.push(format!("o.{} = ?", table::quote(c)));
        }
        if let Some(c) = &cfg.last_error {
            set.push(format!("o.{} = ?", table::quote(c)));
        }
        if let Some(c) = &cfg.failed_at {
            let v = if failed { "UTC_TIMESTAMP(6)" } else { "NULL" };
            set.push(format!("o.{} = {v}", table::quote(c)));
        }
        if let crate::config::Marking::Status {
            column,
            failed: Some(value),
            ..
        } = &cfg.marking
            && failed
        {
            set.push(format!(
                "o.{} = {}",
                table::quote(column),
                table::literal(value)
            ));
        }
        (!set.is_empty()).then(|| set.join(", "))
    }
}
