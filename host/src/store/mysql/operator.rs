//! What operators and the background tasks read and change beside the
//! event path on MySQL/MariaDB: `status` and the backlog gauge, route
//! quarantine records, `failed list/retry/discard`, `replay`'s pages and
//! retention.

use super::*;
use crate::store::{
    AuditEntry, Cursor, FailedEvent, Filter, Purged, QuarantinedRoute, RelayStatus, Status,
};

/// The backlog gauge counts pending rows exactly up to this many; past it
/// the count is the span of sequence numbers still pending (an upper
/// bound: a deep backlog is deep either way, and counting a million rows
/// every few seconds would cost the database more than it tells).
pub const BACKLOG_EXACT: i64 = 10_000;

/// A resumed route's waiting events (deferred by its quarantine), due now.
const MAKE_WAITING_DUE: &str = "UPDATE outroute_event_state SET next_attempt_at = UTC_TIMESTAMP(6), \
       blocks_until = UTC_TIMESTAMP(6), updated_at = UTC_TIMESTAMP(6) \
     WHERE source = ? AND route = ? AND failed_at IS NULL AND blocks_until > UTC_TIMESTAMP(6)";

impl MySqlStore {
    /// Pending events (exact up to [`BACKLOG_EXACT`]) and the age of the
    /// oldest, in seconds, read through an index, pending rows only: the
    /// canonical table's `published_at` index, a mapped table's lane
    /// index (each lane's first pending row; without the index a mapped
    /// table is scanned, as its claims are).
    pub async fn backlog(&self) -> Result<(i64, Option<f64>)> {
        let s = &self.sql;
        // The index pending rows are read through, and (the lane index)
        // the lanes to read.
        let mapped_lanes = !s.canonical && self.lane_index;
        let (index, lanes) = if s.canonical {
            (
                " FORCE INDEX (outbox_published_at)".to_string(),
                String::new(),
            )
        } else if mapped_lanes {
            let all = (0..self.lanes)
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            (
                format!(" FORCE INDEX ({})", lane_index_name(self.lanes)),
                format!("o.{} IN ({all}) AND ", lane_column(self.lanes)),
            )
        } else {
            (String::new(), String::new())
        };
        let first = |lane: &str| {
            format!(
                "SELECT {seq} AS seq, {c} AS c FROM {t} o{index} WHERE {lane}{p} ORDER BY {o} LIMIT 1",
                seq = s.seq,
                c = s.created_at,
                t = s.table,
                p = s.pending,
                o = s.order
            )
        };
        // Through the lane index the oldest is the first of each lane's
        // firsts (one `ORDER BY` over every lane would sort them all).
        let firsts = if mapped_lanes {
            (0..self.lanes)
                .map(|l| {
                    format!(
                        "({})",
                        first(&format!("o.{} = {l} AND ", lane_column(self.lanes)))
                    )
                })
                .collect::<Vec<_>>()
                .join(" UNION ALL ")
        } else {
            first("")
        };
        let oldest_sql = format!(
            "SELECT seq, TIMESTAMPDIFF(MICROSECOND, c, UTC_TIMESTAMP(6)) FROM ({firsts}) f ORDER BY seq LIMIT 1"
        );
        let exact: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM (SELECT 1 FROM {t} o{index} WHERE {lanes}{p} LIMIT {BACKLOG_EXACT}) p",
            t = s.table,
            p = s.pending
        ))
        .fetch_one(&self.pool)
        .await?;
        let oldest: Option<(Option<i64>, Option<i64>)> = sqlx::query_as(&oldest_sql)
            .fetch_optional(&self.pool)
            .await?;
        let count = match (&s.cfg.sequence, oldest) {
            // Past the exact count: the span of sequence numbers still
            // pending (a table ordered by time says "at least").
            (Some(seq), Some((Some(first), _))) if exact >= BACKLOG_EXACT => {
                let last: Option<i64> = sqlx::query_scalar(&format!(
                    "SELECT CAST(max({}) AS SIGNED) FROM {}",
                    table::quote(seq),
                    s.table
                ))
                .fetch_one(&self.pool)
                .await?;
                last.map_or(exact, |last| (last - first + 1).max(exact))
            }
            _ => exact,
        };
        Ok((
            count,
            oldest.and_then(|(_, us)| us).map(|us| us as f64 / 1e6),
        ))
    }

    /// Failed events now (not discarded), per route (`-`: none took it).
    pub async fn failed_by_route(&self) -> Result<Vec<(String, i64)>> {
        Ok(sqlx::query_as(
            "SELECT CAST(COALESCE(route, '-') AS CHAR), CAST(count(*) AS SIGNED) FROM outroute_event_state \
             WHERE source = ? AND failed_at IS NOT NULL AND discarded_at IS NULL GROUP BY 1 ORDER BY 1",
        )
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?)
    }

    /// When each of `ids` first failed (those never failed are left out).
    pub async fn first_errors(&self, ids: &[String]) -> Result<Vec<(String, DateTime<Utc>)>> {
        let mut out = Vec::new();
        for chunk in ids.chunks(MAX_IN_LIST) {
            let mut qb: QueryBuilder<MySql> = QueryBuilder::new(
                "SELECT CAST(event_id AS CHAR), first_error_at FROM outroute_event_state WHERE source = ",
            );
            qb.push_bind(&self.source).push(" AND event_id IN (");
            let mut sep = qb.separated(", ");
            for id in chunk {
                sep.push_bind(id);
            }
            qb.push(")");
            out.extend(
                qb.build_query_as::<(String, DateTime<Utc>)>()
                    .fetch_all(&self.pool)
                    .await?,
            );
        }
        Ok(out)
    }

    pub async fn status(&self) -> Result<Status> {
        let (_, oldest) = self.backlog().await?;
        let (retrying, failed): (i64, i64) = sqlx::query_as(
            "SELECT CAST(COALESCE(SUM(failed_at IS NULL), 0) AS SIGNED), \
               CAST(COALESCE(SUM(failed_at IS NOT NULL AND discarded_at IS NULL), 0) AS SIGNED) \
             FROM outroute_event_state WHERE source = ?",
        )
        .bind(&self.source)
        .fetch_one(&self.pool)
        .await?;
        // An operator's question, answered exactly (this reads every
        // pending row, unlike the relay's bounded gauge).
        let mut by_type: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT {at}, count(*) FROM {t} o{index} WHERE {p} GROUP BY 1 ORDER BY 2 DESC",
            at = self.sql.aggregate_type_text,
            t = self.sql.table,
            index = if self.sql.canonical {
                " FORCE INDEX (outbox_published_at)"
            } else {
                ""
            },
            p = self.sql.pending,
        ))
        .fetch_all(&self.pool)
        .await?;
        let backlog = by_type.iter().map(|(_, n)| n).sum();
        by_type.truncate(50);
        let events_without_messages: Vec<(String, i64)> = sqlx::query_as(
            "SELECT CAST(route AS CHAR), events_without_messages FROM outroute_route_counts \
             WHERE source = ? AND events_without_messages > 0 ORDER BY route",
        )
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?;
        Ok(Status {
            table: self.source.clone(),
            backlog,
            oldest_pending_age_seconds: oldest,
            retrying,
            failed,
            backlog_by_aggregate_type: by_type,
            events_without_messages,
            quarantined_routes: self.quarantined_routes().await?,
            relays: self.live_relays().await?,
            relay_connections: None,
            slot: None,
            binlog: match self.binlog() {
                true => Some(self.binlog_status().await?),
                false => None,
            },
        })
    }

    /// Relays heard from within a lease TTL, with the lanes they hold.
    pub(in crate::store) async fn live_relays(&self) -> Result<Vec<RelayStatus>> {
        let rows: Vec<(String, String, i32, i64)> = sqlx::query_as(
            "SELECT CAST(relay_id AS CHAR), CAST(hostname AS CHAR), pid, TIMESTAMPDIFF(MICROSECOND, heartbeat_at, UTC_TIMESTAMP(6)) \
             FROM outroute_relays WHERE source = ? \
               AND heartbeat_at > UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND ORDER BY relay_id",
        )
        .bind(&self.source)
        .bind(micros(self.lease_ttl))
        .fetch_all(&self.pool)
        .await?;
        let lanes: Vec<(String, i32, i64)> = sqlx::query_as(
            "SELECT CAST(owner AS CHAR), lane, epoch FROM outroute_lanes WHERE source = ? AND owner IS NOT NULL \
               AND lease_until > UTC_TIMESTAMP(6) ORDER BY lane",
        )
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(relay_id, hostname, pid, age)| RelayStatus {
                lanes: lanes
                    .iter()
                    .filter(|(owner, _, _)| *owner == relay_id)
                    .map(|(_, lane, _)| *lane)
                    .collect(),
                epochs: lanes
                    .iter()
                    .filter(|(owner, _, _)| *owner == relay_id)
                    .map(|(_, _, epoch)| *epoch)
                    .collect(),
                relay_id,
                hostname,
                pid,
                heartbeat_age_seconds: age as f64 / 1e6,
            })
            .collect())
    }

    pub async fn quarantine_route(&self, route: &str, reason: &str) -> Result<()> {
        sqlx::query(
            "INSERT INTO outroute_route_counts (source, route, quarantined_since, quarantine_reason) \
             VALUES (?, ?, UTC_TIMESTAMP(6), ?) \
             ON DUPLICATE KEY UPDATE quarantined_since = COALESCE(quarantined_since, VALUES(quarantined_since)), \
               quarantine_reason = VALUES(quarantine_reason)",
        )
        .bind(&self.source)
        .bind(route)
        .bind(reason)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn resume_route(&self, route: &str) -> Result<(bool, u64)> {
        let mut tx = self.pool.begin().await?;
        let was = sqlx::query(
            "UPDATE outroute_route_counts SET quarantined_since = NULL, quarantine_reason = NULL \
             WHERE source = ? AND route = ? AND quarantined_since IS NOT NULL",
        )
        .bind(&self.source)
        .bind(route)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let due = sqlx::query(MAKE_WAITING_DUE)
            .bind(&self.source)
            .bind(route)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok((was > 0, due))
    }

    pub async fn make_waiting_due(&self, route: &str) -> Result<u64> {
        Ok(sqlx::query(MAKE_WAITING_DUE)
            .bind(&self.source)
            .bind(route)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    pub async fn quarantined_routes(&self) -> Result<Vec<QuarantinedRoute>> {
        let rows: Vec<(String, DateTime<Utc>, Option<String>)> = sqlx::query_as(
            "SELECT CAST(route AS CHAR), quarantined_since, CAST(quarantine_reason AS CHAR) FROM outroute_route_counts \
             WHERE source = ? AND quarantined_since IS NOT NULL ORDER BY route",
        )
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(route, since, reason)| QuarantinedRoute {
                route,
                since,
                reason: reason.unwrap_or_default(),
            })
            .collect())
    }

    pub async fn count_without_messages(&self, by_route: &[(String, u64)]) -> Result<()> {
        for (route, n) in by_route {
            sqlx::query(
                "INSERT INTO outroute_route_counts (source, route, events_without_messages) VALUES (?, ?, ?) \
                 ON DUPLICATE KEY UPDATE events_without_messages = events_without_messages + VALUES(events_without_messages)",
            )
            .bind(&self.source)
            .bind(route)
            .bind(i64::try_from(*n).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await?;
        }
        Ok(())
    }

    /// `… WHERE` the failed events `f` selects.
    fn failed_query<'a>(&'a self, head: &str, f: &'a Filter) -> QueryBuilder<'a, MySql> {
        let mut qb = QueryBuilder::new(head);
        qb.push(" WHERE source = ")
            .push_bind(self.source.as_str())
            .push(" AND failed_at IS NOT NULL");
        if !f.include_discarded {
            qb.push(" AND discarded_at IS NULL");
        }
        if !f.ids.is_empty() {
            qb.push(" AND event_id IN (");
            let mut sep = qb.separated(", ");
            for id in &f.ids {
                sep.push_bind(id.as_str());
            }
            qb.push(")");
        }
        for (col, v) in [
            ("route", &f.route),
            ("event_type", &f.event_type),
            ("aggregate_type", &f.aggregate_type),
            ("aggregate_id", &f.aggregate_id),
        ] {
            if let Some(v) = v {
                qb.push(format!(" AND {col} = ")).push_bind(v.as_str());
            }
        }
        qb
    }

    pub async fn failed_list(&self, f: &Filter) -> Result<Vec<FailedEvent>> {
        let head = format!(
            "SELECT CAST(event_id AS CHAR), CAST(aggregate_type AS CHAR), CAST(aggregate_id AS CHAR), \
               CAST(event_type AS CHAR), seq, attempts, CAST(last_error AS CHAR), CAST(route AS CHAR), \
               CAST(plugin AS CHAR), CAST(plugin_version AS CHAR), first_error_at, failed_at, discarded_at, blocks_until = {FOREVER} AS holds \
             FROM outroute_event_state"
        );
        let mut qb = self.failed_query(&head, f);
        qb.push(" ORDER BY seq LIMIT ")
            .push_bind(f.limit.unwrap_or(1000));
        let rows = qb.build().fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| {
                Ok(FailedEvent {
                    id: r.try_get(0)?,
                    aggregate_type: r.try_get(1)?,
                    aggregate_id: r.try_get(2)?,
                    event_type: r.try_get(3)?,
                    seq: r.try_get(4)?,
                    attempts: r.try_get(5)?,
                    reason: r.try_get(6)?,
                    route: r.try_get(7)?,
                    plugin: r.try_get(8)?,
                    plugin_version: r.try_get(9)?,
                    first_error_at: r.try_get(10)?,
                    failed_at: r.try_get(11)?,
                    discarded_at: r.try_get(12)?,
                    holds_aggregate: r.try_get::<i64, _>(13)? != 0,
                    row: None,
                })
            })
            .collect()
    }

    /// Put failed events back in line (attempts reset, the row's own
    /// failed marker cleared); returns how many.
    pub async fn failed_retry(&self, f: &Filter) -> Result<u64> {
        let mut tx = self.pool.begin().await?;
        // The ids first (MySQL's UPDATE returns no rows), locked so a
        // concurrent retry or discard waits.
        let mut qb =
            self.failed_query("SELECT CAST(event_id AS CHAR) FROM outroute_event_state", f);
        qb.push(" FOR UPDATE");
        let ids: Vec<String> = qb
            .build()
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()?;
        if ids.is_empty() {
            return Ok(0);
        }
        let mut qb: QueryBuilder<MySql> = QueryBuilder::new(format!(
            "UPDATE outroute_event_state SET failed_at = NULL, discarded_at = NULL, attempts = 0, \
               next_attempt_at = UTC_TIMESTAMP(6), blocks_until = {NEVER}, updated_at = UTC_TIMESTAMP(6) \
             WHERE source = "
        ));
        qb.push_bind(&self.source).push(" AND event_id IN (");
        let mut sep = qb.separated(", ");
        for id in &ids {
            sep.push_bind(id.as_str());
        }
        qb.push(")");
        qb.build().execute(&mut *tx).await?;
        // The row's own failure columns, where it has them.
        let cfg = &self.sql.cfg;
        let mut set = Vec::new();
        if let Some(c) = &cfg.failed_at {
            set.push(format!("o.{} = NULL", table::quote(c)));
        }
        if let Some(c) = &cfg.attempts {
            set.push(format!("o.{} = 0", table::quote(c)));
        }
        if let crate::config::Marking::Status {
            column,
            pending,
            failed: Some(failed),
            ..
        } = &cfg.marking
        {
            let c = format!("o.{}", table::quote(column));
            set.push(format!(
                "{c} = IF({c} = {f}, {p}, {c})",
                f = table::literal(failed),
                p = table::literal(pending)
            ));
        }
        if !set.is_empty() {
            let mut qb: QueryBuilder<MySql> = QueryBuilder::new(format!(
                "UPDATE {t} o SET {set} WHERE {id} IN (",
                t = self.sql.table,
                set = set.join(", "),
                id = self.sql.id
            ));
            let mut sep = qb.separated(", ");
            for id in &ids {
                sep.push_bind(id.as_str());
            }
            qb.push(")");
            qb.build().execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(ids.len() as u64)
    }

    /// Give up on failed events for good: they stop holding their aggregate.
    pub async fn failed_discard(&self, f: &Filter) -> Result<u64> {
        let head = format!(
            "UPDATE outroute_event_state SET discarded_at = UTC_TIMESTAMP(6), blocks_until = {NEVER}, \
               updated_at = UTC_TIMESTAMP(6)"
        );
        let mut qb = self.failed_query(&head, f);
        Ok(qb.build().execute(&self.pool).await?.rows_affected())
    }

    /// `SELECT … WHERE` published rows match `f` (none under `delete`).
    fn published_query<'a>(&self, head: &str, f: &'a Filter) -> QueryBuilder<'a, MySql> {
        let s = &self.sql;
        let mut qb = QueryBuilder::new(head);
        qb.push(format!(
            " WHERE {}",
            s.published.as_deref().unwrap_or("FALSE")
        ));
        if let Some(since) = f.since {
            qb.push(format!(" AND {} >= ", s.created_at))
                .push_bind(since);
        }
        if let Some(u) = f.until {
            qb.push(format!(" AND {} < ", s.created_at)).push_bind(u);
        }
        for (expr, v) in [
            (&s.aggregate_type_bin, &f.aggregate_type),
            (&s.aggregate_id_bin, &f.aggregate_id),
            (&s.event_type_bin, &f.event_type),
        ] {
            if let Some(v) = v {
                qb.push(format!(" AND {expr} = ")).push_bind(v.as_str());
            }
        }
        qb
    }

    /// A page of published events in outbox order after `cursor`, or
    /// (`newest`) in reverse order before it.
    pub async fn published_page(
        &self,
        f: &Filter,
        cursor: Option<&Cursor>,
        limit: i64,
        newest: bool,
    ) -> Result<Vec<Claim>> {
        let s = &self.sql;
        let (cmp, dir, start) = if newest {
            ("<", " DESC", i64::MAX)
        } else {
            (">", "", i64::MIN)
        };
        let head = format!(
            "SELECT {cols}, 0 AS attempts, 0 AS has_state, '[]' AS done_legs, \
               CAST({lane} AS SIGNED) AS lane FROM {t} o",
            cols = s.cols,
            lane = s.lane,
            t = s.table,
        );
        let mut qb = self.published_query(&head, f);
        let seq = cursor.map_or(start, |c| c.seq);
        if s.by_seq {
            // A sequence column orders alone (the canonical `seq` is
            // unique; the id only breaks ties for the contract).
            qb.push(format!(" AND {} {cmp} ", s.seq))
                .push_bind(seq)
                .push(format!(" ORDER BY {}{dir} LIMIT ", s.seq));
        } else {
            // Time, then the id, as the cursor has them.
            let id = cursor.map_or(String::new(), |c| c.id.clone());
            qb.push(format!(" AND ({} {cmp} ", s.seq))
                .push_bind(seq)
                .push(format!(" OR ({} = ", s.seq))
                .push_bind(seq)
                .push(format!(" AND {} {cmp} ", s.id_bin))
                .push_bind(id)
                .push(format!(
                    ")) ORDER BY {}{dir}, {}{dir} LIMIT ",
                    s.seq, s.id_bin
                ));
        }
        qb.push_bind(limit);
        let rows = qb.build().fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| to_claim(r, r.try_get::<i64, _>("lane").unwrap_or(0) as i32))
            .collect()
    }

    pub async fn published_count(&self, f: &Filter) -> Result<i64> {
        let head = format!("SELECT count(*) FROM {} o", self.sql.table);
        let mut qb = self.published_query(&head, f);
        Ok(qb.build().fetch_one(&self.pool).await?.try_get(0)?)
    }

    /// One retention round: delete up to `batch` rows published more than
    /// `older_than` ago, oldest first, through the `published_at` index.
    /// One relay at a time (a named lock held for the round; the others
    /// skip it).
    pub async fn purge_published(&self, older_than: Duration, batch: i64) -> Result<Purged> {
        let mut conn = self.pool.acquire().await?;
        let lock = format!("outroute purge {}", self.source);
        let ours: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await?;
        if ours != Some(1) {
            return Ok(Purged::default());
        }
        let s = &self.sql;
        // Published before the window: by `published_at` where the table
        // has it (the canonical table through its index), else by
        // `created_at` (a status table keeps no publish time). A mapped
        // table without an index on that column is scanned each round.
        let (Some(published), age) = (
            &s.published_bare,
            match &s.cfg.marking {
                crate::config::Marking::PublishedAt { column } => table::quote(column),
                _ => table::quote(&s.cfg.created_at),
            },
        ) else {
            return Ok(Purged::default());
        };
        let deleted = sqlx::query(&format!(
            "DELETE FROM {t} WHERE {published} \
               AND {age} < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND ORDER BY {age} LIMIT ?",
            t = s.table,
        ))
        .bind(micros(older_than))
        .bind(batch)
        .execute(&mut *conn)
        .await;
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        let deleted = deleted?.rows_affected();
        released?;
        Ok(Purged {
            deleted,
            more: deleted >= u64::try_from(batch).unwrap_or(0),
        })
    }

    /// The row of event `id` as the table holds it now, and whether it
    /// is marked published.
    pub async fn event_row(&self, id: &str) -> Result<Option<(Claim, bool)>> {
        let s = &self.sql;
        let q = format!(
            "SELECT {cols}, 0 AS attempts, 0 AS has_state, '[]' AS done_legs, \
               CAST({lane} AS SIGNED) AS lane, CAST(COALESCE(({published}), FALSE) AS SIGNED) AS is_published \
             FROM {t} o WHERE {id} = ? LIMIT 1",
            cols = s.cols,
            lane = s.lane,
            published = s.published.as_deref().unwrap_or("FALSE"),
            t = s.table,
            id = s.id_bin,
        );
        let row = sqlx::query(&q).bind(id).fetch_optional(&self.pool).await?;
        row.map(|r| {
            let lane = r.try_get::<i64, _>("lane").unwrap_or(0) as i32;
            Ok((
                to_claim(&r, lane)?,
                r.try_get::<i64, _>("is_published")? != 0,
            ))
        })
        .transpose()
    }

    /// Append one console action to the audit log.
    pub async fn audit(&self, a: &AuditEntry) -> Result<()> {
        sqlx::query(
            "INSERT INTO outroute_audit (at, source, who, action, subject, outcome) VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(a.at)
        .bind(&a.source)
        .bind(&a.who)
        .bind(&a.action)
        .bind(&a.subject)
        .bind(&a.outcome)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Source `source`'s latest `limit` audit entries, newest first.
    pub async fn audit_recent(&self, source: &str, limit: i64) -> Result<Vec<AuditEntry>> {
        let rows: Vec<(DateTime<Utc>, String, String, String, String, String)> = sqlx::query_as(
            "SELECT at, source, who, action, subject, outcome FROM outroute_audit \
             WHERE source = ? ORDER BY at DESC, id DESC LIMIT ?",
        )
        .bind(source)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(AuditEntry::from_row).collect())
    }
}
