//! MySQL/MariaDB store: leases, claims, marks and failure state for the
//! canonical outbox table or an existing one mapped onto it, on MySQL
//! 8.0.16+ and MariaDB 10.6+ (lease mode).
//!
//! ## Files
//! This file holds the connection, the design and the schema (migrations,
//! the lane column and index, the mapped table's checks);
//! `mysql/table.rs` the SQL of the table mapping; `mysql/claim.rs` the lease rounds and the
//! claim, `mysql/floor.rs` where each lane's claim starts, `mysql/mark.rs` marks and failure records, `mysql/operator.rs`
//! what operators and the metrics read or change (status, backlog,
//! quarantine records, failed events, replay pages, retention);
//! `mysql/binlog.rs` what binlog capture (`capture = "binlog"`) needs of
//! the store.
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
//!   late-committing row is simply found by the next claim. A marked row's
//!   old index entry stays in the pending range, delete-marked, until
//!   InnoDB's purge removes it; under a deep drain purge lags, so a deep
//!   walk starts at its lane's *claim floor* (`mysql/floor.rs`), which only
//!   rises past rows no running transaction can still commit below.
//!
//! ## Cost: per batch, never per backlog
//! The lane index `outbox_outroute_lanes<N> (outroute_lane<N>,
//! published_at, failed_at, seq)` (on a mapped table: the lane column, the
//! marking and `failed_at` columns, then the order) over an invisible
//! virtual column (no storage, added without a table rewrite, unseen by
//! `SELECT *` and by an `INSERT` without a column list) puts each lane's
//! pending rows together in outbox order: a claim descends once per lane
//! and reads the rows it returns.
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
use crate::config::{Config, Ordering, StoreConfig};
use crate::event::RawRow;

mod binlog;
mod claim;
mod floor;
mod mark;
mod operator;
mod table;

pub use binlog::{BinlogPosition, BinlogStatus, Gtids, valid_gtid_position};
use claim::to_claim;
use table::{RowKey, TableSql};

/// Connections close after this long unused (min 0): a quiet source keeps
/// only what its lease rounds use.
const IDLE_CONNECTION: Duration = Duration::from_secs(5);

/// Most statements one claim runs (see the module header).
pub const CLAIM_ROUNDS: usize = 3;

/// "For ever" in `blocks_until` (a failed event under `block`).
const FOREVER: &str = "'9999-12-31 23:59:59'";
/// "Never" in `blocks_until` and `lease_until`.
const NEVER: &str = "'1000-01-01 00:00:00'";

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
    /// The table mapping's SQL.
    sql: TableSql,
    lanes: u32,
    lease_ttl: Duration,
    ordering: Ordering,
    max_batch_bytes: u64,
    /// The table has its lane column and index (`check_table`): claims
    /// walk it. Without them a claim computes each row's lane and scans
    /// (`missing_index` says how to fix it).
    lane_index: bool,
    missing_index: Option<String>,
    /// The lanes whose last walk came back short (fewer rows than asked):
    /// a claim of only such lanes is shallow (see `MySqlStore::claim`).
    empty: std::sync::Mutex<std::collections::HashSet<i32>>,
    /// Where each lane's deep walk starts (`mysql/floor.rs`).
    floors: std::sync::Mutex<floor::Floors>,
    /// Binlog capture's marks, grouped (`mysql/mark.rs`).
    marks: mark::MarkGroup,
    /// `capture = "binlog"`: the replication connection's options.
    binlog: Option<mysql_async::Opts>,
}

/// The lane column and its index for `lanes` lanes.
fn lane_column(lanes: u32) -> String {
    format!("outroute_lane{lanes}")
}

fn lane_index_name(lanes: u32) -> String {
    format!("outbox_outroute_lanes{lanes}")
}

/// The replication connection's options for binlog capture: the
/// source's URL (host, port, user, password, database; `ssl-mode` and
/// `ssl-ca` as sqlx reads them) and its `password`.
fn replication_opts(key: &str, sc: &StoreConfig) -> Result<mysql_async::Opts> {
    let url = url::Url::parse(&sc.url).map_err(|e| anyhow!("{key}.url: {e}"))?;
    let decode = percent_decode;
    let mut b = mysql_async::OptsBuilder::default()
        .ip_or_hostname(url.host_str().unwrap_or("localhost"))
        .tcp_port(url.port().unwrap_or(3306))
        .user((!url.username().is_empty()).then(|| decode(url.username())))
        .pass(
            sc.password
                .as_ref()
                .map(|p| p.expose().to_string())
                .or_else(|| url.password().map(decode)),
        )
        .db_name(Some(url.path().trim_start_matches('/').to_string()).filter(|d| !d.is_empty()))
        .prefer_socket(false)
        .tcp_keepalive(Some(Duration::from_secs(10)))
        .stmt_cache_size(0);
    let param = |k: &str| {
        url.query_pairs()
            .find(|(n, _)| n.eq_ignore_ascii_case(k))
            .map(|(_, v)| v.to_string())
    };
    let mode = param("ssl-mode")
        .or_else(|| param("sslmode"))
        .unwrap_or_default();
    let mode = mode.to_ascii_lowercase().replace('-', "_");
    if matches!(mode.as_str(), "required" | "verify_ca" | "verify_identity") {
        let mut ssl = mysql_async::SslOpts::default();
        if let Some(ca) = param("ssl-ca").or_else(|| param("sslrootcert")) {
            ssl = ssl.with_root_certs(vec![std::path::PathBuf::from(ca).into()]);
        }
        ssl = match mode.as_str() {
            "required" => ssl.with_danger_accept_invalid_certs(true),
            "verify_ca" => ssl.with_danger_skip_domain_validation(true),
            _ => ssl,
        };
        b = b.ssl_opts(ssl);
    }
    Ok(b.into())
}

/// A URL part with its `%XX` escapes decoded.
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
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

/// Most values one `IN (…)` list of the event path binds; longer lists
/// go in several statements.
const MAX_IN_LIST: usize = 4096;

/// An `IN (…)` list's values padded with its last one to the next power
/// of two. sqlx prepares each statement text once per connection and
/// keeps it (a cache of 100); a list of every length from 1 to 500 made
/// most marks and claims a new text, prepared (parsed) then run: two
/// round trips and a parse each time. Padded, a kind of statement has a
/// dozen texts; repeating a value in `IN` changes nothing it matches.
fn padded<T: Clone>(values: &[T]) -> Vec<T> {
    let mut v = values.to_vec();
    if let Some(last) = values.last() {
        v.resize(values.len().next_power_of_two(), last.clone());
    }
    v
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
                    // The relay's own writes (marks, records) log only the
                    // row's key and the columns they change: a full image
                    // of a marked 1 KB row is ~2 KB of binlog per event,
                    // written, shipped to replicas and read back by binlog
                    // capture (measured, 100,000 1 KB events drained:
                    // mariadbd's CPU per event 56.6 → 44.9 µs in lease
                    // mode, 26.4 → 20.8 µs with binlog capture). Needs
                    // BINLOG ADMIN (or SUPER); without it the server's
                    // setting stays, which is only slower.
                    if let Err(e) = conn
                        .execute("SET SESSION binlog_row_image = 'MINIMAL'")
                        .await
                    {
                        tracing::debug!("keeping the server's binlog_row_image: {e}");
                    }
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
            sql: TableSql::new(&sc.table(), lanes),
            lanes,
            lease_ttl: config.relay.lease_ttl,
            ordering: config.relay.ordering,
            max_batch_bytes: config.relay.max_batch_bytes,
            lane_index: false,
            missing_index: None,
            empty: std::sync::Mutex::new(std::collections::HashSet::new()),
            floors: std::sync::Mutex::new(floor::Floors::default()),
            marks: mark::MarkGroup::default(),
            binlog: (sc.capture == crate::config::CaptureMode::Binlog)
                .then(|| replication_opts(key, sc))
                .transpose()?,
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
        // A mapped table is the producers' own: only the canonical one is created.
        if outbox && self.sql.canonical {
            let mut o = sqlx::migrate!("../migrations/mysql/outbox");
            o.set_ignore_missing(true);
            o.run(&self.pool)
                .await
                .context("applying MySQL outbox migrations")?;
        }
        Ok(())
    }

    /// Check the table is there (a mapped one: with every mapped column
    /// and a unique, NOT NULL id) and whether it has this lane count's
    /// lane column and index; make sure every lane has its lease row.
    pub async fn check_table(&mut self) -> Result<()> {
        let name = &self.sql.cfg.name;
        let schema = self.sql.schema.as_deref();
        let bare = self.sql.bare_name.as_str();
        let columns: Vec<(String, String)> = sqlx::query_as(
            "SELECT CAST(column_name AS CHAR), CAST(is_nullable AS CHAR) FROM information_schema.columns \
             WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ?",
        )
        .bind(schema)
        .bind(bare)
        .fetch_all(&self.pool)
        .await?;
        if columns.is_empty() {
            bail!(
                "{}.table.name: table `{name}` does not exist ({})",
                self.key,
                if self.sql.canonical {
                    "run `outroute migrate`"
                } else {
                    "a mapped table is the producers' own: check the name and the database in the URL"
                }
            );
        }
        if !self.sql.canonical {
            self.check_mapped(&columns).await?;
        }
        let index: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.statistics WHERE table_schema = COALESCE(?, DATABASE()) \
             AND table_name = ? AND index_name = ? AND seq_in_index = 1 AND column_name = ?",
        )
        .bind(schema)
        .bind(bare)
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
        if self.binlog() {
            self.check_binlog().await?;
        }
        Ok(())
    }

    /// A mapped table has every mapped column, and an id marks can
    /// address one row by: NOT NULL, and unique on its own.
    async fn check_mapped(&self, columns: &[(String, String)]) -> Result<()> {
        let cfg = &self.sql.cfg;
        let name = &cfg.name;
        let has = |c: &str| columns.iter().find(|(n, _)| n.eq_ignore_ascii_case(c));
        let mut mapped = cfg.columns();
        let marking_col = match &cfg.marking {
            crate::config::Marking::PublishedAt { column }
            | crate::config::Marking::Status { column, .. } => Some(column),
            _ => None,
        };
        if let Some(c) = marking_col {
            mapped.push(("marking.column", c));
        }
        let missing: Vec<String> = mapped
            .iter()
            .filter(|(_, c)| has(c).is_none())
            .map(|(k, c)| format!("{}.table.{k} = `{c}`", self.key))
            .collect();
        if !missing.is_empty() {
            let present: Vec<&str> = columns.iter().map(|(n, _)| n.as_str()).collect();
            bail!(
                "{}: not a column of `{name}` (its columns: {})",
                missing.join(", "),
                present.join(", ")
            );
        }
        let id = &cfg.id;
        let nullable = has(id).is_some_and(|(_, n)| n == "YES");
        let unique: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT index_name FROM information_schema.statistics \
               WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ? AND non_unique = 0 \
               GROUP BY index_name HAVING count(*) = 1 AND max(column_name) = ?) u",
        )
        .bind(self.sql.schema.as_deref())
        .bind(&self.sql.bare_name)
        .bind(id)
        .fetch_one(&self.pool)
        .await?;
        if nullable || unique == 0 {
            bail!(
                "{key}.table.id: `{id}` must be NOT NULL and unique on its own (a PRIMARY KEY, or a UNIQUE \
                 index on `{id}` alone): the relay marks rows by their id, and a duplicate would mark another \
                 event published. `{name}`'s `{id}` is {what}. Fix it once (ALTER TABLE `{name}` {fix}) or map \
                 another id column.",
                key = self.key,
                what = match (nullable, unique == 0) {
                    (true, true) => "nullable and not unique",
                    (true, false) => "nullable",
                    _ => "not unique",
                },
                fix = if nullable {
                    format!("MODIFY `{id}` … NOT NULL, ADD UNIQUE (`{id}`)")
                } else {
                    format!("ADD UNIQUE (`{id}`), ALGORITHM=INPLACE, LOCK=NONE")
                },
            );
        }
        Ok(())
    }

    /// The statements that add the lane column (instant: an invisible
    /// virtual column at the end of the table, which producers' `SELECT *`
    /// and column-less `INSERT`s never see) and build its index without
    /// blocking producers (`ALGORITHM=INPLACE, LOCK=NONE`: inserts and
    /// updates go on while it builds; only other DDL waits).
    fn lane_index_ddl(&self) -> Vec<String> {
        let col = lane_column(self.lanes);
        vec![
            format!(
                "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {col} INT AS {lane} VIRTUAL INVISIBLE",
                t = self.sql.table,
                lane = self.sql.lane_bare,
            ),
            format!(
                "ALTER TABLE {t} ADD INDEX {idx} ({col}, {tail}), ALGORITHM=INPLACE, LOCK=NONE",
                t = self.sql.table,
                idx = lane_index_name(self.lanes),
                tail = self.sql.index_tail,
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

#[cfg(test)]
mod tests {
    use super::padded;

    #[test]
    fn in_lists_are_padded_to_a_power_of_two_with_their_last_value() {
        assert!(padded::<i64>(&[]).is_empty());
        assert_eq!(padded(&[7]), vec![7]);
        assert_eq!(padded(&[1, 2, 3]), vec![1, 2, 3, 3]);
        let many: Vec<i64> = (0..300).collect();
        let p = padded(&many);
        assert_eq!(p.len(), 512);
        assert_eq!(&p[..300], &many[..]);
        assert!(p[300..].iter().all(|v| *v == 299));
        // Every length from 1 to 4096 gives one of 13 statement texts.
        let lengths: std::collections::BTreeSet<usize> =
            (1..=4096).map(|n| padded(&vec![0u8; n]).len()).collect();
        assert_eq!(lengths.len(), 13);
    }
}
