//! MySQL/MariaDB store: leases, claims, marks and failure state for the
//! canonical outbox table on MySQL 8.0.16+ and MariaDB 10.6+ (lease mode).
//!
//! ## Files
//! This file holds the connection, the design and the schema (migrations,
//! the lane column and index); `mysql/claim.rs` the lease rounds and the
//! claim, `mysql/mark.rs` marks and failure records, `mysql/operator.rs`
//! what operators and the metrics read or change (status, backlog,
//! quarantine records, failed events, replay pages, retention).
//!
//! ## The same contract as PostgreSQL
//! Lanes, leases, epochs, fencing and failure state mean exactly what they
//! mean in `postgres.rs`: every aggregate hashes onto one of the source's
//! lanes (`CRC32(CONCAT(aggregate_type, ':', aggregate_id)) % lanes`), a
//! lane has one live owner (`outroute_lanes`, renewed every `lease_ttl / 3`,
//! taken over with `FOR UPDATE SKIP LOCKED` once lapsed, its epoch bumped),
//! a claim is a plain read, a mark is fenced by owner, unexpired lease and
//! the lane's epoch at claim time, and a failing event holds back only the
//! later events of its own aggregate.
//!
//! ## InnoDB, and what producers pay
//! * Every connection runs at `READ COMMITTED` in UTC. A claim is a
//!   consistent (non-locking) read: it takes no row, gap or next-key lock,
//!   so a producer's insert never waits for it, and no snapshot outlives a
//!   statement. A mark updates rows by primary key: record locks on those
//!   rows only (no gap locks at `READ COMMITTED`), rows producers no longer
//!   touch.
//! * AUTO_INCREMENT values commit out of order (a transaction takes its
//!   number at insert and may commit after a later one). The claim never
//!   skips ahead of anything: each lane is walked from its oldest pending
//!   row on every claim (pending rows only, through the lane index), so a
//!   late-committing row is simply found by the next claim. PostgreSQL needs
//!   claim floors because its index keeps dead entries until VACUUM; here a
//!   published row's index entry moves out of the pending range at once.
//!
//! ## Cost: per batch, never per backlog
//! The lane index `outbox_outroute_lanes<N> (outroute_lane<N>,
//! published_at, failed_at, seq)` over a virtual column (no storage, added
//! without a table rewrite) puts each lane's pending rows together in outbox
//! order: a claim descends once per lane and reads the rows it returns.
//! Each lane's walk stops at its share of the batch; lanes that still had
//! rows are walked on (`seq > last`) with what is left of the batch, so one
//! busy lane still fills a batch (at most [`CLAIM_ROUNDS`] statements).
//! The plan is forced (`FORCE INDEX`) rather than left to statistics.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use chrono::{DateTime, Utc};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::{ConnectOptions, Executor, MySql, QueryBuilder, Row};

use super::{Claim, Claimed, Failure, FailureKind, Leases};
use crate::config::{Config, Ordering, StoreConfig, TableConfig};
use crate::event::RawRow;

mod claim;
mod mark;
mod operator;

use claim::to_claim;

/// Connections close after this long unused (min 0): a quiet source keeps
/// only what its lease rounds use.
const IDLE_CONNECTION: Duration = Duration::from_secs(5);

/// Most statements one claim runs (see the module header).
pub const CLAIM_ROUNDS: usize = 3;

/// "For ever" in `blocks_until` (a failed event under `block`).
const FOREVER: &str = "'9999-12-31 23:59:59'";
/// "Never" in `blocks_until` and `lease_until`.
const NEVER: &str = "'1000-01-01 00:00:00'";

/// The columns a claim and a replay page read. Columns a producer could
/// fill with an unexpected type are read as text, so a bad value becomes a
/// reason on that event rather than a failed claim. Short text is read
/// through `CAST(… AS CHAR)` (the tables' binary collation, `utf8mb4_bin`,
/// makes the driver see a column as bytes); payload and headers are read
/// as the bytes they are and checked as UTF-8 here (the CAST copies every
/// payload once more: measured 18 % of a claim's time).
const COLS: &str = "o.seq AS seq, CAST(o.id AS CHAR) AS id, CAST(o.aggregate_type AS CHAR) AS aggregate_type, \
    CAST(o.aggregate_id AS CHAR) AS aggregate_id, CAST(o.event_type AS CHAR) AS event_type, \
    CAST(o.event_version AS CHAR) AS event_version, o.payload AS payload, \
    o.headers AS headers, o.created_at AS created_at";

/// A pending row's `published_at` (and "never" in the coordination
/// tables' times): not NULL, so marking overwrites it in place (see the
/// canonical table's migration).
const PENDING: &str = "'1000-01-01 00:00:00'";

pub struct MySqlStore {
    pool: MySqlPool,
    statement_timeout: Duration,
    /// The source's config key (`store` or `sources.<name>`), for errors.
    key: String,
    /// The key of this source's coordination rows: the table's name.
    source: String,
    relay_id: String,
    lanes: u32,
    lease_ttl: Duration,
    ordering: Ordering,
    max_batch_bytes: u64,
    /// The table has its lane column and index (`check_table`): claims
    /// walk it. Without them a claim computes each row's lane and scans
    /// (`missing_index` says how to fix it).
    lane_index: bool,
    missing_index: Option<String>,
    /// The last claim left a lane with more rows than it took: the next
    /// walks its first lane alone first (see `mysql/claim.rs`).
    deep: std::sync::atomic::AtomicBool,
}

/// The lane column and its index for `lanes` lanes.
fn lane_column(lanes: u32) -> String {
    format!("outroute_lane{lanes}")
}

fn lane_index_name(lanes: u32) -> String {
    format!("outbox_outroute_lanes{lanes}")
}

/// Every aggregate's lane, as SQL over the outbox row `o`.
fn lane_expr(lanes: u32) -> String {
    format!("(CRC32(CONCAT(o.aggregate_type, ':', o.aggregate_id)) % {lanes})")
}

/// A first connection that failed, said so an operator knows which
/// setting to look at (the password itself is never shown).
fn connect_error(key: &str, sc: &StoreConfig, e: sqlx::Error) -> anyhow::Error {
    let url = crate::config::redact_url(&sc.url);
    let hint = match &e {
        sqlx::Error::Database(d) if d.code().as_deref() == Some("28000") => format!(
            " (access denied: check the user, {key}.password / {key}.password_file, and the host the server sees)"
        ),
        sqlx::Error::Database(d) if d.code().as_deref() == Some("42000") => {
            " (no such database, or the user may not use it)".to_string()
        }
        sqlx::Error::Database(d) if d.code().as_deref() == Some("08004") => format!(
            " (the server is at its connection limit, max_connections: this source opens up to \
             {key}.max_connections = {} connections)",
            sc.max_connections.max(2)
        ),
        _ => String::new(),
    };
    anyhow!("{key}: cannot connect to {url}: {e}{hint}")
}

/// The host name this relay reports in `outroute_relays`.
fn this_host() -> &'static str {
    static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        hostname::get()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default()
    })
}

/// A duration as whole microseconds (for `INTERVAL ? MICROSECOND`).
fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

impl MySqlStore {
    /// Connect to the source `sc` (`key`: its config key, for errors).
    pub async fn connect(
        config: &Config,
        key: &str,
        sc: &StoreConfig,
        relay_id: &str,
        pooled_sources: usize,
    ) -> Result<Self> {
        if sc.table() != TableConfig::canonical() {
            bail!(
                "{key}.table: MySQL/MariaDB sources support only the canonical table for now \
                 (`outroute migrate` creates it); map existing tables on PostgreSQL"
            );
        }
        let mut opts = MySqlConnectOptions::from_str(&sc.url)
            .map_err(|e| anyhow!("{key}.url: {e}"))?
            .timezone(Some("+00:00".into()))
            .log_statements(tracing::log::LevelFilter::Trace)
            .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(2));
        if let Some(p) = &sc.password {
            opts = opts.password(p.expose());
        }
        let pool = match MySqlPoolOptions::new()
            .max_connections(sc.pool_size(&config.relay, pooled_sources))
            .min_connections(0)
            .idle_timeout(Some(IDLE_CONNECTION))
            .acquire_timeout(Duration::from_secs(5))
            .after_connect(|conn, _| {
                Box::pin(async move {
                    // Consistent reads take no locks and see only committed
                    // rows; no gap locks on updates (see the module header).
                    conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .await?;
                    Ok(())
                })
            })
            .connect_with(opts.clone())
            .await
        {
            Ok(pool) => pool,
            Err(sqlx::Error::PoolTimedOut) => {
                use sqlx::Connection;
                let why = match tokio::time::timeout(
                    Duration::from_secs(5),
                    sqlx::MySqlConnection::connect_with(&opts),
                )
                .await
                {
                    Ok(Err(e)) => e,
                    _ => sqlx::Error::PoolTimedOut,
                };
                return Err(connect_error(key, sc, why));
            }
            Err(e) => return Err(connect_error(key, sc, e)),
        };
        let lanes = sc.lanes.unwrap_or(config.relay.lanes);
        Ok(MySqlStore {
            pool,
            statement_timeout: sc.statement_timeout,
            key: key.to_string(),
            source: sc.table().name,
            relay_id: relay_id.to_string(),
            lanes,
            lease_ttl: config.relay.lease_ttl,
            ordering: config.relay.ordering,
            max_batch_bytes: config.relay.max_batch_bytes,
            lane_index: false,
            missing_index: None,
            deep: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    pub fn relay_id(&self) -> &str {
        &self.relay_id
    }

    /// How long a lane lease lasts without renewal (`relay.lease_ttl`).
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// Run one of the relay's statements, giving it up after
    /// `store.statement_timeout` (`what` names it in the error): a
    /// connection cut silently would otherwise hang it for good. The
    /// dropped future closes its connection; the next one is fresh.
    pub async fn bounded<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        self.bounded_by(self.statement_timeout, what, f).await
    }

    pub async fn bounded_by<T>(
        &self,
        limit: Duration,
        what: &str,
        f: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(limit, f).await {
            Ok(r) => r,
            Err(_) => bail!(
                "{what}: no answer from the database within {} ({}.statement_timeout)",
                humantime::format_duration(limit),
                self.key
            ),
        }
    }

    pub async fn migrate(&self, outbox: bool) -> Result<()> {
        // Two migration sets share `_sqlx_migrations`; each ignores the other's versions.
        let mut c = sqlx::migrate!("../migrations/mysql/coordination");
        c.set_ignore_missing(true);
        c.run(&self.pool)
            .await
            .context("applying MySQL coordination migrations")?;
        if outbox {
            let mut o = sqlx::migrate!("../migrations/mysql/outbox");
            o.set_ignore_missing(true);
            o.run(&self.pool)
                .await
                .context("applying MySQL outbox migrations")?;
        }
        Ok(())
    }

    /// Check the table is there and whether it has this lane count's lane
    /// column and index; make sure every lane has its lease row.
    pub async fn check_table(&mut self) -> Result<()> {
        let table = &self.source;
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind(table)
        .fetch_one(&self.pool)
        .await?;
        if n == 0 {
            bail!(
                "{}.table.name: table `{table}` does not exist (run `outroute migrate`)",
                self.key
            );
        }
        let index: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.statistics WHERE table_schema = DATABASE() \
             AND table_name = ? AND index_name = ? AND seq_in_index = 1 AND column_name = ?",
        )
        .bind(table)
        .bind(lane_index_name(self.lanes))
        .bind(lane_column(self.lanes))
        .fetch_one(&self.pool)
        .await?;
        self.lane_index = index > 0;
        self.missing_index = (!self.lane_index).then(|| self.lane_index_ddl().join(";\n  "));
        let mut qb: QueryBuilder<MySql> =
            QueryBuilder::new("INSERT IGNORE INTO outroute_lanes (source, lane) ");
        qb.push_values(0..self.lanes as i32, |mut b, lane| {
            b.push_bind(&self.source).push_bind(lane);
        });
        qb.build().execute(&self.pool).await?;
        Ok(())
    }

    /// The statements that add the lane column (instant: a virtual column
    /// at the end of the table) and build its index without blocking
    /// producers (`ALGORITHM=INPLACE, LOCK=NONE`: inserts and updates go
    /// on while it builds; only other DDL waits).
    fn lane_index_ddl(&self) -> Vec<String> {
        let col = lane_column(self.lanes);
        vec![
            format!(
                "ALTER TABLE `{t}` ADD COLUMN IF NOT EXISTS {col} INT AS \
                 (CRC32(CONCAT(aggregate_type, ':', aggregate_id)) % {n}) VIRTUAL",
                t = self.source,
                n = self.lanes
            ),
            format!(
                "ALTER TABLE `{t}` ADD INDEX {idx} ({col}, published_at, failed_at, seq), \
                 ALGORITHM=INPLACE, LOCK=NONE",
                t = self.source,
                idx = lane_index_name(self.lanes)
            ),
        ]
    }

    /// The lane column and index statements when the table lacks them.
    pub fn missing_index(&self) -> Option<&str> {
        self.missing_index.as_deref()
    }

    /// Add the lane column and index if missing; returns what was run.
    pub async fn create_lane_index(&mut self) -> Result<Option<String>> {
        if self.lane_index {
            return Ok(None);
        }
        let ddl = self.lane_index_ddl();
        let mariadb = self.is_mariadb().await;
        for s in &ddl {
            // MySQL has no `ADD COLUMN IF NOT EXISTS`: a column left by an
            // earlier, interrupted run is fine.
            let s = if mariadb {
                s.clone()
            } else {
                s.replace(" IF NOT EXISTS", "")
            };
            match sqlx::query(&s).execute(&self.pool).await {
                Ok(_) => {}
                Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("42S21") => {}
                Err(e) => return Err(e).with_context(|| format!("running {s}")),
            }
        }
        self.check_table().await?;
        Ok(Some(ddl.join(";\n  ")))
    }

    async fn is_mariadb(&self) -> bool {
        sqlx::query_scalar::<_, String>("SELECT VERSION()")
            .fetch_one(&self.pool)
            .await
            .is_ok_and(|v| v.contains("MariaDB"))
    }

    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }

    /// Connections this source's pool holds now.
    pub fn pool_connections(&self) -> u32 {
        self.pool.size()
    }
}
