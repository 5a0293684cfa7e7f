//! SQLite store: the embedded default. Same table contract and the same
//! claim/mark/failure semantics as PostgreSQL, for a single relay (SQLite
//! has one writer, so there are no lanes to share: every event is lane 0).
//! Only the canonical table is supported here.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use chrono::{DateTime, Utc};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
};
use sqlx::{QueryBuilder, Row, Sqlite};

use super::{
    Claim, Cursor, FailedEvent, Failure, FailureKind, Filter, Leases, QuarantinedRoute, Status,
};
use crate::config::{StoreConfig, TableConfig};
use crate::event::RawRow;

static MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");

/// A resumed route's waiting events (deferred by its quarantine), due now.
const MAKE_WAITING_DUE: &str = "UPDATE outroute_event_state SET next_attempt_at = ?3, blocks_until = ?3, updated_at = ?3 \
     WHERE source = ?1 AND route = ?2 AND failed_at IS NULL AND blocks_until > ?3";

const SOURCE: &str = "outbox";

pub struct SqliteStore {
    pool: SqlitePool,
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

// Columns a producer could fill with the wrong type are read as text, so a
// bad value becomes a reason on that event rather than a failed claim.
const COLS: &str = "o.id AS id, o.seq AS seq, CAST(o.aggregate_type AS TEXT) AS aggregate_type, \
    CAST(o.aggregate_id AS TEXT) AS aggregate_id, CAST(o.event_type AS TEXT) AS event_type, \
    CAST(o.event_version AS TEXT) AS event_version, CAST(o.payload AS TEXT) AS payload, \
    CAST(o.headers AS TEXT) AS headers, CAST(o.created_at AS TEXT) AS created_at";

impl SqliteStore {
    pub async fn connect(key: &str, c: &StoreConfig) -> Result<Self> {
        if c.table() != TableConfig::canonical() {
            bail!(
                "{key}.table: the SQLite store supports only the canonical table; map existing tables on PostgreSQL"
            );
        }
        let opts = SqliteConnectOptions::from_str(&c.url)
            .with_context(|| format!("{key}.url: `{}`", c.url))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(c.max_connections.clamp(1, 4))
            .connect_with(opts)
            .await
            .with_context(|| format!("{key}: opening {}", c.url))?;
        Ok(SqliteStore { pool })
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    pub async fn migrate(&self, _outbox: bool) -> Result<()> {
        MIGRATIONS
            .run(&self.pool)
            .await
            .context("applying SQLite migrations")?;
        Ok(())
    }

    pub async fn check_table(&mut self) -> Result<()> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'outbox'",
        )
        .fetch_one(&self.pool)
        .await?;
        if n == 0 {
            bail!("store.table.name: table `outbox` does not exist (run `outroute migrate`)");
        }
        Ok(())
    }

    pub async fn lease_round(&self) -> Result<Leases> {
        Ok(Leases {
            lanes: vec![0],
            epochs: vec![0],
            acquired: 0,
            relays: 1,
        })
    }

    pub async fn release_all(&self) -> Result<()> {
        Ok(())
    }

    pub async fn claim(&self, _lanes: &[i32], limit: u32) -> Result<super::Claimed> {
        let q = format!(
            "SELECT {COLS}, COALESCE(st.attempts, 0) AS attempts, COALESCE(st.done_legs, '[]') AS done_legs FROM outbox o \
             LEFT JOIN outroute_event_state st ON st.source = ?1 AND st.event_id = o.id \
             WHERE o.published_at IS NULL AND o.failed_at IS NULL \
               AND (st.event_id IS NULL OR (st.failed_at IS NULL AND st.next_attempt_at <= ?2)) \
               AND NOT EXISTS (SELECT 1 FROM outroute_event_state b WHERE b.source = ?1 \
                 AND b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id \
                 AND b.seq < o.seq AND b.blocks_until > ?2) \
             ORDER BY o.seq LIMIT ?3"
        );
        let rows = sqlx::query(&q)
            .bind(SOURCE)
            .bind(now_ms())
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await
            .context("claiming events")?;
        let claims = rows.iter().map(to_claim).collect::<Result<Vec<_>>>()?;
        Ok(super::Claimed {
            drained: (claims.len() as u32) < limit,
            claims,
        })
    }

    pub async fn mark_published(&self, claims: &[&Claim]) -> Result<u64> {
        let ids: Vec<&str> = claims.iter().map(|c| c.id()).collect();
        if ids.is_empty() {
            return Ok(0);
        }
        let mut tx = self.pool.begin().await?;
        let mut qb: QueryBuilder<Sqlite> = QueryBuilder::new(
            "UPDATE outbox SET published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE published_at IS NULL AND id IN (",
        );
        let mut sep = qb.separated(", ");
        for id in &ids {
            sep.push_bind(*id);
        }
        qb.push(")");
        let n = qb.build().execute(&mut *tx).await?.rows_affected();
        let mut qb: QueryBuilder<Sqlite> = QueryBuilder::new(
            "DELETE FROM outroute_event_state WHERE source = 'outbox' AND event_id IN (",
        );
        let mut sep = qb.separated(", ");
        for id in ids {
            sep.push_bind(id);
        }
        qb.push(")");
        qb.build().execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(n)
    }

    pub async fn record_failures(&self, failures: &[Failure]) -> Result<u64> {
        let mut tx = self.pool.begin().await?;
        for f in failures {
            let now = now_ms();
            let (next, blocks, failed_at) = match f.kind {
                FailureKind::Retry { delay } => {
                    let at = now.saturating_add(delay.as_millis() as i64);
                    (at, at, None)
                }
                FailureKind::Failed { hold } => {
                    (now, if hold { i64::MAX } else { i64::MIN }, Some(now))
                }
            };
            sqlx::query(
                "INSERT INTO outroute_event_state (source, event_id, aggregate_type, aggregate_id, seq, event_type, attempts, \
                   next_attempt_at, blocks_until, last_error, route, plugin, plugin_version, first_error_at, updated_at, failed_at, done_legs) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?14, ?15, ?16) \
                 ON CONFLICT (source, event_id) DO UPDATE SET attempts = excluded.attempts, next_attempt_at = excluded.next_attempt_at, \
                   blocks_until = excluded.blocks_until, last_error = excluded.last_error, route = excluded.route, \
                   plugin = excluded.plugin, plugin_version = excluded.plugin_version, updated_at = excluded.updated_at, \
                   failed_at = excluded.failed_at, discarded_at = NULL, done_legs = excluded.done_legs",
            )
            .bind(SOURCE)
            .bind(&f.id)
            .bind(&f.aggregate_type)
            .bind(&f.aggregate_id)
            .bind(f.sequence)
            .bind(&f.event_type)
            .bind(f.attempts as i64)
            .bind(next)
            .bind(blocks)
            .bind(&f.reason)
            .bind(&f.route)
            .bind(&f.plugin)
            .bind(&f.plugin_version)
            .bind(now)
            .bind(failed_at)
            .bind(serde_json::to_string(&f.done_legs).unwrap_or_else(|_| "[]".into()))
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "UPDATE outbox SET attempts = ?2, last_error = ?3, \
                   failed_at = CASE WHEN ?4 THEN strftime('%Y-%m-%dT%H:%M:%fZ', 'now') ELSE failed_at END WHERE id = ?1",
            )
            .bind(&f.id)
            .bind(f.attempts as i64)
            .bind(&f.reason)
            .bind(failed_at.is_some())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(failures.len() as u64)
    }

    pub async fn backlog(&self) -> Result<(i64, Option<f64>)> {
        let row = sqlx::query(
            "SELECT count(*), (julianday('now') - julianday(min(created_at))) * 86400.0 FROM outbox \
             WHERE published_at IS NULL AND failed_at IS NULL",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }

    /// Failed events now (not discarded), per route (`-`: none took it).
    pub async fn failed_by_route(&self) -> Result<Vec<(String, i64)>> {
        Ok(sqlx::query_as(
            "SELECT COALESCE(route, '-'), count(*) FROM outroute_event_state \
             WHERE source = ?1 AND failed_at IS NOT NULL AND discarded_at IS NULL GROUP BY 1 ORDER BY 1",
        )
        .bind(SOURCE)
        .fetch_all(&self.pool)
        .await?)
    }

    /// When each of `ids` first failed (those never failed are left out).
    pub async fn first_errors(&self, ids: &[String]) -> Result<Vec<(String, DateTime<Utc>)>> {
        let mut out = Vec::new();
        for chunk in ids.chunks(500) {
            let mut qb: QueryBuilder<Sqlite> = QueryBuilder::new(
                "SELECT event_id, first_error_at FROM outroute_event_state WHERE source = ",
            );
            qb.push_bind(SOURCE).push(" AND event_id IN (");
            let mut sep = qb.separated(", ");
            for id in chunk {
                sep.push_bind(id);
            }
            qb.push(")");
            for (id, ms) in qb
                .build_query_as::<(String, i64)>()
                .fetch_all(&self.pool)
                .await?
            {
                if let Some(at) = DateTime::<Utc>::from_timestamp_millis(ms) {
                    out.push((id, at));
                }
            }
        }
        Ok(out)
    }

    pub async fn status(&self) -> Result<Status> {
        let (backlog, oldest) = self.backlog().await?;
        let row = sqlx::query(
            "SELECT COALESCE(sum(failed_at IS NULL), 0), COALESCE(sum(failed_at IS NOT NULL AND discarded_at IS NULL), 0) \
             FROM outroute_event_state WHERE source = ?1",
        )
        .bind(SOURCE)
        .fetch_one(&self.pool)
        .await?;
        let by_type = sqlx::query(
            "SELECT aggregate_type, count(*) FROM outbox WHERE published_at IS NULL AND failed_at IS NULL \
             GROUP BY 1 ORDER BY 2 DESC LIMIT 50",
        )
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect::<Result<Vec<_>>>()?;
        let events_without_messages: Vec<(String, i64)> = sqlx::query_as(
            "SELECT route, events_without_messages FROM outroute_route_counts \
             WHERE source = ?1 AND events_without_messages > 0 ORDER BY route",
        )
        .bind(SOURCE)
        .fetch_all(&self.pool)
        .await?;
        Ok(Status {
            table: SOURCE.into(),
            backlog,
            oldest_pending_age_seconds: oldest,
            retrying: row.try_get(0)?,
            failed: row.try_get(1)?,
            backlog_by_aggregate_type: by_type,
            events_without_messages,
            quarantined_routes: self.quarantined_routes().await?,
            relays: Vec::new(),
            relay_connections: None,
            slot: None,
            binlog: None,
        })
    }

    pub async fn quarantine_route(&self, route: &str, reason: &str) -> Result<()> {
        sqlx::query(
            "INSERT INTO outroute_route_counts (source, route, quarantined_since, quarantine_reason) \
             VALUES (?1, ?2, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), ?3) \
             ON CONFLICT (source, route) DO UPDATE SET \
               quarantined_since = COALESCE(quarantined_since, excluded.quarantined_since), \
               quarantine_reason = excluded.quarantine_reason",
        )
        .bind(SOURCE)
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
             WHERE source = ?1 AND route = ?2 AND quarantined_since IS NOT NULL",
        )
        .bind(SOURCE)
        .bind(route)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let due = sqlx::query(MAKE_WAITING_DUE)
            .bind(SOURCE)
            .bind(route)
            .bind(now_ms())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok((was > 0, due))
    }

    pub async fn make_waiting_due(&self, route: &str) -> Result<u64> {
        Ok(sqlx::query(MAKE_WAITING_DUE)
            .bind(SOURCE)
            .bind(route)
            .bind(now_ms())
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    pub async fn quarantined_routes(&self) -> Result<Vec<QuarantinedRoute>> {
        let rows: Vec<(String, String, Option<String>)> = sqlx::query_as(
            "SELECT route, quarantined_since, quarantine_reason FROM outroute_route_counts \
             WHERE source = ?1 AND quarantined_since IS NOT NULL ORDER BY route",
        )
        .bind(SOURCE)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(route, since, reason)| QuarantinedRoute {
                route,
                since: parse_time(&since).unwrap_or_else(Utc::now),
                reason: reason.unwrap_or_default(),
            })
            .collect())
    }

    pub async fn count_without_messages(&self, by_route: &[(String, u64)]) -> Result<()> {
        for (route, n) in by_route {
            sqlx::query(
                "INSERT INTO outroute_route_counts (source, route, events_without_messages) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (source, route) DO UPDATE SET \
                   events_without_messages = events_without_messages + excluded.events_without_messages",
            )
            .bind(SOURCE)
            .bind(route)
            .bind(*n as i64)
            .execute(&self.pool)
            .await?;
        }
        Ok(())
    }

    fn failed_query<'a>(head: &str, f: &'a Filter) -> QueryBuilder<'a, Sqlite> {
        let mut qb = QueryBuilder::new(head);
        qb.push(" WHERE source = 'outbox' AND failed_at IS NOT NULL");
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
        let mut qb = Self::failed_query(
            "SELECT event_id, aggregate_type, aggregate_id, event_type, seq, attempts, last_error, route, plugin, \
               plugin_version, first_error_at, failed_at, discarded_at, blocks_until = 9223372036854775807 FROM outroute_event_state",
            f,
        );
        qb.push(" ORDER BY seq LIMIT ")
            .push_bind(f.limit.unwrap_or(1000));
        let rows = qb.build().fetch_all(&self.pool).await?;
        let ts = |ms: Option<i64>| ms.and_then(DateTime::<Utc>::from_timestamp_millis);
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
                    first_error_at: ts(r.try_get(10)?).unwrap_or_default(),
                    failed_at: ts(r.try_get(11)?),
                    discarded_at: ts(r.try_get(12)?),
                    holds_aggregate: r.try_get(13)?,
                    row: None,
                })
            })
            .collect()
    }

    pub async fn failed_retry(&self, f: &Filter) -> Result<u64> {
        let mut tx = self.pool.begin().await?;
        let mut qb = Self::failed_query(
            "UPDATE outroute_event_state SET failed_at = NULL, discarded_at = NULL, attempts = 0, \
               next_attempt_at = 0, blocks_until = -9223372036854775808",
            f,
        );
        qb.push(" RETURNING event_id");
        let ids: Vec<String> = qb
            .build()
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()?;
        for id in &ids {
            sqlx::query("UPDATE outbox SET failed_at = NULL, attempts = 0 WHERE id = ?1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(ids.len() as u64)
    }

    pub async fn failed_discard(&self, f: &Filter) -> Result<u64> {
        let mut qb = Self::failed_query(
            "UPDATE outroute_event_state SET discarded_at = CAST(strftime('%s','now') AS INTEGER) * 1000, \
               blocks_until = -9223372036854775808",
            f,
        );
        Ok(qb.build().execute(&self.pool).await?.rows_affected())
    }

    fn published_query<'a>(head: &str, f: &'a Filter) -> QueryBuilder<'a, Sqlite> {
        let mut qb = QueryBuilder::new(head);
        qb.push(" WHERE o.published_at IS NOT NULL");
        if let Some(s) = f.since {
            qb.push(" AND julianday(o.created_at) >= julianday(")
                .push_bind(s.to_rfc3339())
                .push(")");
        }
        if let Some(u) = f.until {
            qb.push(" AND julianday(o.created_at) < julianday(")
                .push_bind(u.to_rfc3339())
                .push(")");
        }
        for (col, v) in [
            ("aggregate_type", &f.aggregate_type),
            ("aggregate_id", &f.aggregate_id),
            ("event_type", &f.event_type),
        ] {
            if let Some(v) = v {
                qb.push(format!(" AND o.{col} = ")).push_bind(v.as_str());
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
        let (cmp, dir, start) = if newest {
            (" < ", " DESC", i64::MAX)
        } else {
            (" > ", "", i64::MIN)
        };
        let mut qb =
            Self::published_query(&format!("SELECT {COLS}, 0 AS attempts FROM outbox o"), f);
        let (seq, id) = cursor
            .map(|c| (c.seq, c.id.clone()))
            .unwrap_or((start, String::new()));
        qb.push(format!(" AND (o.seq{cmp}"))
            .push_bind(seq)
            .push(" OR (o.seq = ")
            .push_bind(seq)
            .push(format!(" AND o.id{cmp}"))
            .push_bind(id)
            .push(format!(")) ORDER BY o.seq{dir}, o.id{dir} LIMIT "))
            .push_bind(limit);
        let rows = qb.build().fetch_all(&self.pool).await?;
        rows.iter().map(to_claim).collect()
    }

    pub async fn published_count(&self, f: &Filter) -> Result<i64> {
        let mut qb = Self::published_query("SELECT count(*) FROM outbox o", f);
        Ok(qb.build().fetch_one(&self.pool).await?.try_get(0)?)
    }

    pub async fn purge_published(&self, older_than: Duration, batch: i64) -> Result<super::Purged> {
        let cutoff = Utc::now() - chrono::Duration::from_std(older_than).unwrap_or_default();
        let deleted = sqlx::query(
            "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE published_at IS NOT NULL \
               AND julianday(published_at) < julianday(?1) LIMIT ?2)",
        )
        .bind(cutoff.to_rfc3339())
        .bind(batch)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(super::Purged {
            deleted,
            more: deleted >= batch as u64,
        })
    }

    /// The row of event `id` as the table holds it now, and whether it
    /// is marked published.
    pub async fn event_row(&self, id: &str) -> Result<Option<(Claim, bool)>> {
        let row = sqlx::query(&format!(
            "SELECT {COLS}, 0 AS attempts, o.published_at IS NOT NULL AS is_published \
             FROM outbox o WHERE o.id = ?1 LIMIT 1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| Ok((to_claim(&r)?, r.try_get::<bool, _>("is_published")?)))
            .transpose()
    }

    /// Append one console action to the audit log.
    pub async fn audit(&self, a: &super::AuditEntry) -> Result<()> {
        sqlx::query(
            "INSERT INTO outroute_audit (at, source, who, action, subject, outcome) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )
        .bind(a.at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
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
    pub async fn audit_recent(&self, source: &str, limit: i64) -> Result<Vec<super::AuditEntry>> {
        let rows: Vec<(String, String, String, String, String, String)> = sqlx::query_as(
            "SELECT at, source, who, action, subject, outcome FROM outroute_audit \
             WHERE source = ?1 ORDER BY id DESC LIMIT ?2",
        )
        .bind(source)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(
                |(at, source, who, action, subject, outcome)| super::AuditEntry {
                    at: DateTime::parse_from_rfc3339(&at)
                        .map(|t| t.with_timezone(&Utc))
                        .unwrap_or_default(),
                    source,
                    who,
                    action,
                    subject,
                    outcome,
                },
            )
            .collect())
    }

    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }
}

fn to_claim(r: &SqliteRow) -> Result<Claim> {
    let id: String = r.try_get("id")?;
    let read = || -> Result<RawRow, sqlx::Error> {
        let created: Option<String> = r.try_get("created_at")?;
        Ok(RawRow {
            id: id.clone(),
            sequence: r.try_get("seq")?,
            aggregate_type: r.try_get("aggregate_type")?,
            aggregate_id: r.try_get("aggregate_id")?,
            event_type: r.try_get("event_type")?,
            event_version: r.try_get("event_version")?,
            payload: r.try_get("payload")?,
            headers: r.try_get("headers")?,
            created_at: created.and_then(|c| parse_time(&c)),
            attempts: r.try_get::<i64, _>("attempts")? as i32,
            payload_is_json: false,
        })
    };
    let row = match read() {
        Ok(raw) => raw.validate(),
        Err(e) => Err(super::unreadable(r, id.clone(), e)),
    };
    // Only claims carry done legs (replay's published rows have none).
    let done_legs = r
        .try_get::<String, _>("done_legs")
        .ok()
        .and_then(|j| serde_json::from_str(&j).ok())
        .unwrap_or_default();
    Ok(Claim {
        lane: 0,
        tid: None,
        has_state: true,
        held: Vec::new(),
        done_legs,
        epoch: None,
        captured: None,
        route: None,
        row,
    })
}

/// SQLite timestamps: RFC 3339 or `YYYY-MM-DD HH:MM:SS[.fff]` (UTC).
fn parse_time(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .map(|d| d.with_timezone(&Utc))
        .ok()
        .or_else(|| {
            chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f")
                .ok()
                .map(|n| n.and_utc())
        })
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_both_time_formats() {
        assert!(super::parse_time("2026-01-02T03:04:05.123Z").is_some());
        assert!(super::parse_time("2026-01-02 03:04:05").is_some());
        assert!(super::parse_time("yesterday").is_none());
    }
}
