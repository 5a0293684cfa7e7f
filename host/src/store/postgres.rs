//! PostgreSQL store: leases, claims, marks and failure state for any outbox
//! table shape.
//!
//! ## Files
//! This file holds the connection and the design; the work is split by
//! concern: `postgres/sql.rs` (the table's SQL, generated once per table
//! shape), `postgres/schema.rs` (migrations and start-up checks, lane index),
//! `postgres/claim.rs` (leases, claims, floor rounds, orphan sweep),
//! `postgres/mark.rs` (marks and failure records), `postgres/operator.rs`
//! (status, backlog, quarantine records, failed events, replay pages,
//! retention), `postgres/cost.rs` (`EXPLAIN` costs), `postgres/floor.rs`
//! (claim floors) and `postgres/logical.rs` (log capture's store side).
//!
//! ## Ordering design: lanes
//! Every aggregate hashes onto one of `relay.lanes` lanes
//! (`hashtext(aggregate_type || '/' || aggregate_id) % lanes`). A lane has
//! at most one live owner, recorded in `outroute_lanes` with a lease that the
//! owner renews every `lease_ttl / 3`. Relays take a fair share of lanes
//! (`ceil(lanes / live relays)`), stop claiming from extra lanes and let
//! their leases lapse, so a new relay picks them up after at most one TTL.
//!
//! Because a lane has one owner, claiming needs no row locks and no writes:
//! a claim is one `SELECT` (measured: row-lease designs that UPDATE lease
//! columns at claim cost an extra write per row). Within a batch the relay
//! keeps per-aggregate order itself.
//!
//! ## Cost: per batch, never per backlog
//! The lane index (`CREATE INDEX … ON t ((<lane expression>), <order>, <id>)
//! WHERE <pending>`; `outroute migrate` builds it for the canonical table,
//! `outroute migrate --table` for an existing one) lets the claim walk each
//! owned lane from its oldest pending row and stop at a full batch: one
//! index descent per lane plus the rows returned, whatever the backlog or
//! history, and whatever the planner statistics (the plan is checked with
//! `EXPLAIN` at start-up; a table without a usable index is claimed by a
//! scan, with a warning naming the `CREATE INDEX`). Marking goes straight to
//! each row by the `ctid` the claim saw, re-checking id, pending state and
//! lane ownership — owner, unexpired lease and the lane's epoch at claim
//! time — in the same statement, so a relay whose lease lapsed (GC pause,
//! network cut) marks nothing, even if the lane came back to it since. A
//! lapsed lane is taken over by the next lease round of another relay
//! (`FOR UPDATE SKIP LOCKED`: it never waits for the old owner; the old
//! owner's sends are cut off by its own lease deadline, see `pipeline.rs`).
//! The ownership check is a plain read: lease renewal never waits behind a
//! mark. Worst case after a lapse is a
//! duplicate publish carrying the same event id, never a loss or a reorder of
//! first deliveries.
//!
//! `marking = queue` replaces the lane index with a narrow list of the
//! pending rows, `outroute_queue` (source, lane, seq), filled by an insert
//! trigger: a claim walks only pending entries and fetches each row by its
//! sequence number, a mark deletes the entry, and no outbox row is ever
//! rewritten (measured: about 40 % less PostgreSQL work per event than the
//! `published_at` stamp, with every row kept). Floors are not needed there.
//!
//! Published rows leave dead entries in the lane index until VACUUM; each
//! lane's claim starts at a *floor* past them (`postgres/floor.rs`: raised
//! only where no row can still appear below it), so a long drain stays as
//! fast at its end as at its start even with autovacuum off.
//!
//! A failing event holds back only its own aggregate: its retry time is
//! stored in `outroute_event_state.blocks_until`, and the claim skips every
//! later event of an aggregate with an earlier blocking state row (an index
//! probe per row walked, made only while the source has any state row at
//! all). A held aggregate's backlog is measured by the floor rounds and
//! then skipped by the claims of its lane (`postgres/floor.rs`).
//!
//! Background work is bounded too: the backlog gauge counts at most
//! [`BACKLOG_EXACT`] rows, and retention runs in one relay at a time.
//!
//! Cost per batch: 1 claim round-trip, 1 mark round-trip, plus one per
//! failed event; lease upkeep is 2–3 statements every `lease_ttl / 3`.
//!
//! One concern, one file: the connection to one source's database and the
//! design every `postgres/` file follows; most of its length is that design,
//! written once here.

use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{ConnectOptions, Row};

use super::{
    AuditEntry, Claim, Claimed, Cursor, FailedEvent, Failure, FailureKind, Filter, Leases,
    QuarantinedRoute, RelayStatus, Status,
};
use crate::config::{Config, Logical, LogicalInput, Marking, Ordering, TableConfig};
use crate::event::RawRow;

mod backlog;
mod claim;
mod cost;
mod floor;
mod logical;
mod mark;
mod operator;
mod schema;
mod sql;
mod wake;
pub use floor::ROUND_INTERVAL as FLOOR_ROUND_INTERVAL;
use sql::*;
/// How often a relay removes queue entries whose row was deleted or
/// failed by hand (see [`PgStore::drop_orphans`]).
pub const ORPHAN_SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// How long a pooled connection may stay unused before it is closed. The
/// pool hands out its least recently used connection first, so a sleeping
/// source's lease rounds (every `lease_ttl / 3`, 3.3 s by default) would keep
/// every connection alive under a longer limit; under this one they come
/// down to the one the rounds use.
const IDLE_CONNECTION: Duration = Duration::from_secs(5);

/// A resumed route's waiting events (deferred by its quarantine), due now.
const MAKE_WAITING_DUE: &str = "UPDATE outroute_event_state SET next_attempt_at = now(), blocks_until = now(), updated_at = now() \
     WHERE source = $1 AND (route = $2 OR $2 = ANY(waiting_routes)) AND failed_at IS NULL AND blocks_until > now()";

/// Queue entries looked at per lane by one [`PgStore::drop_orphans`] round.
pub const ORPHAN_WALK: i64 = 64;

/// Rounds per sweep: a sweep walks at most `ORPHAN_ROUNDS × ORPHAN_WALK`
/// entries per lane, then the next one goes on from there, so a deep queue
/// is covered over several sweeps at a bounded cost to the database.
pub const ORPHAN_ROUNDS: usize = 4;

/// What one [`PgStore::drop_orphans`] round did.
#[derive(Debug, Default)]
pub struct OrphanWalk {
    /// Entries deleted.
    pub dropped: u64,
    /// The lanes with entries left after the walk, each with the last
    /// sequence number walked (where the next round starts); a lane not
    /// listed was walked to its end.
    pub more: Vec<(i32, i64)>,
}
pub use logical::{CAPTURE_LANE, CLEANUP_CHUNK, CapturedRows, HeldAggregates, SlotCheck};

/// A pooled connection idle longer than this is pinged before use
/// (HikariCP's "alive bypass window" is the same idea, at 500 ms too).
const IDLE_BEFORE_PING: Duration = Duration::from_millis(500);

/// A connection given back within this long of a statement the relay gave
/// up on ([`PgStore::bounded`]) is pinged with this deadline before it
/// rejoins the pool, and dropped if the ping does not answer in time.
const ABANDONED_CHECK: Duration = Duration::from_secs(2);

/// When the relay last gave up on a statement (see [`PgStore::bounded`]).
#[derive(Debug, Default)]
struct Abandoned(std::sync::Mutex<Option<std::time::Instant>>);

impl Abandoned {
    fn now(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
    }

    fn recent(&self) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|at| at.elapsed() < ABANDONED_CHECK)
    }
}

pub struct PgStore {
    pool: PgPool,
    /// `store.statement_timeout`: see [`PgStore::bounded`].
    statement_timeout: Duration,
    abandoned: std::sync::Arc<Abandoned>,
    /// The source's config key (`store` or `sources.<name>`), for errors.
    key: String,
    source: String,
    relay_id: String,
    lanes: u32,
    lease_ttl: Duration,
    ordering: Ordering,
    batch_size: u32,
    /// `relay.max_batch_bytes`: a claim stops reading rows once their
    /// payloads reach it (see [`PgStore::claim`]).
    max_batch_bytes: u64,
    /// The most rows the next claim asks for: after a claim that reached
    /// `max_batch_bytes`, one more than it took; doubled back after each
    /// claim that did not.
    claim_rows: std::sync::atomic::AtomicU32,
    cfg: TableConfig,
    sql: Option<TableSql>,
    /// The claim statement: by lane index, or by scan when the table has
    /// no usable lane index (chosen in `check_table`).
    claim_sql: String,
    /// The claim statement for when a lane has a skip (see
    /// `postgres/floor.rs`): the same, walking each lane in two stretches.
    claim_skip_sql: String,
    /// Set when the claim cannot use a lane index: the statement that
    /// would make it cheap.
    missing_index: Option<String>,
    /// The pending queue's trigger notifies a sleeping source's relays
    /// (set by `check_table`; see `postgres/wake.rs`).
    wakes: bool,
    /// Where each lane's claim starts (lane-index claims of tables with a
    /// sequence column; see `postgres/floor.rs`).
    floors: std::sync::Mutex<floor::Floors>,
    /// The names of the routes that read this source (the claim's `$4`:
    /// what an event with no state row may still be waiting for), set by
    /// the relay serving it; empty until then, which holds an aggregate
    /// on every route while an earlier event of it blocks.
    routes: std::sync::RwLock<Vec<String>>,
    /// The floor round statement, when the claim uses floors.
    floor_sql: Option<String>,
    /// Why the claim uses no floors although the table has a sequence
    /// column (`config check --store` says it).
    floors_off: Option<String>,
    /// `capture = "logical"`: the slot and publication read (see
    /// `postgres/logical.rs`); leases are then the one capture lease.
    logical: Option<Logical>,
    /// Logical table input: the sequence column has a unique index, so
    /// captured rows can be deleted by runs of numbers (else by id: a run
    /// could take an unread or failed row sharing a number).
    seq_unique: bool,
    /// Queue marking's retention walks the table by sequence number from
    /// here (`i64::MIN`: the bottom), so rows it must keep (failed, or
    /// still pending) are stepped over once per pass, not on every round.
    purge_from: std::sync::atomic::AtomicI64,
}

/// The source's name from its config key (`store` → `default`,
/// `sources.<name>` → `<name>`): the `source` label of its metrics.
pub(super) fn source_name(key: &str) -> &str {
    key.strip_prefix("sources.")
        .unwrap_or(crate::config::DEFAULT_SOURCE)
}

/// The URL's options with `store.password` and `store.tls` applied.
pub(crate) fn connect_options(
    key: &str,
    sc: &crate::config::StoreConfig,
) -> Result<PgConnectOptions> {
    use crate::config::PgTlsMode as M;
    use sqlx::postgres::PgSslMode;
    let mut opts = sc
        .url
        .parse::<PgConnectOptions>()
        .map_err(|e| anyhow!("{key}.url: {e}"))?;
    if let Some(p) = &sc.password {
        opts = opts.password(p.expose());
    }
    if let Some(t) = &sc.tls {
        opts = opts.ssl_mode(match t.mode {
            M::Disable => PgSslMode::Disable,
            M::Prefer => PgSslMode::Prefer,
            M::Require => PgSslMode::Require,
            M::VerifyCa => PgSslMode::VerifyCa,
            M::VerifyFull => PgSslMode::VerifyFull,
        });
        if let Some(ca) = &t.ca_file {
            opts = opts.ssl_root_cert(ca);
        }
        if let (Some(cert), Some(key)) = (&t.cert_file, &t.key_file) {
            opts = opts.ssl_client_cert(cert).ssl_client_key(key);
        }
    }
    Ok(opts)
}

/// A failed first connection, said so an operator knows which setting to
/// look at (the password itself is never shown).
fn connect_error(key: &str, sc: &crate::config::StoreConfig, e: sqlx::Error) -> anyhow::Error {
    let url = crate::config::redact_url(&sc.url);
    let tls_problem = matches!(e, sqlx::Error::Tls(_))
        || e.to_string().contains("certificate")
        || e.to_string().contains("UnknownIssuer");
    let hint = match &e {
        _ if tls_problem => match sc.tls.as_ref().and_then(|t| t.ca_file.as_ref()) {
            Some(ca) => format!(
                " (TLS: the server's certificate is not trusted by {key}.tls.ca_file {} or is not issued for this host)",
                ca.display()
            ),
            None => format!(
                " (TLS: the server's certificate is not trusted by the system's roots; set {key}.tls.ca_file)"
            ),
        },
        sqlx::Error::Database(d) if d.code().as_deref() == Some("28P01") => {
            format!(
                " (wrong password, or not the server meant: check {key}.password / {key}.password_file, and the host and port)"
            )
        }
        sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("53300" | "53400")) => {
            format!(
                " (the server is at its connection limit, max_connections: this source opens up to \
                 {key}.max_connections = {} connections; the source waits and retries. Lower \
                 {key}.max_connections or relay.concurrency, or raise the server's max_connections)",
                sc.max_connections.max(2)
            )
        }
        sqlx::Error::Database(d) if d.code().as_deref() == Some("28000") => {
            format!(
                " (the server's pg_hba.conf refuses this role, database or connection type: TLS may be required, see {key}.tls)"
            )
        }
        _ => String::new(),
    };
    anyhow!("{key}: cannot connect to {url}: {e}{hint}")
}

impl PgStore {
    /// Connect to the source `sc` (`key`: its config key, for errors).
    pub async fn connect(
        config: &Config,
        key: &str,
        sc: &crate::config::StoreConfig,
        relay_id: &str,
    ) -> Result<Self> {
        let opts = connect_options(key, sc)?
            .application_name("outroute")
            // The claim must walk the lane index in order. A planner that
            // knows the table's row count but has no column statistics (an
            // index build records the first, only ANALYZE the second) guesses
            // a few rows per lane and prefers a bitmap scan plus sort, which
            // reads the whole lane. Both only cost more here; nothing is
            // forbidden.
            //
            // No JIT: the relay's statements are short, and a planner with
            // no statistics can cost one (the lease round's CTEs) above
            // `jit_above_cost`; compiling it then took each new backend
            // hundreds of milliseconds of CPU, and 200 sources' lease rounds
            // kept a 2-core server saturated (measured: 23 s per round).
            .options([
                ("enable_bitmapscan", "off"),
                ("enable_sort", "off"),
                ("jit", "off"),
            ])
            .log_statements(tracing::log::LevelFilter::Trace)
            .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(2));
        let abandoned = std::sync::Arc::new(Abandoned::default());
        let postgres_sources = config.sources.values().filter(|s| s.is_pooled()).count();
        let pool = match PgPoolOptions::new()
            .max_connections(sc.pool_size(&config.relay, postgres_sources))
            // Connections close after a while unused: a quiet (or sleeping)
            // source keeps the one its lease rounds use, not one per worker.
            .min_connections(0)
            .idle_timeout(Some(IDLE_CONNECTION))
            // sqlx pings every connection it hands out (a round trip
            // before each claim and each mark). A connection used within
            // the last half second has just proven itself (sqlx also pings
            // it when it comes back); only one idle longer is pinged, so a
            // connection that died with a server restart is still replaced
            // before use. One the server closes inside the window (a
            // restart) fails its next statement once, as a restart
            // mid-statement does (a claim is retried, an unmarked batch
            // goes out again). One cut silently inside the window (a
            // network partition) hangs that statement, as one cut
            // mid-statement always could, until `store.statement_timeout`
            // gives it up (`bounded`). Measured
            // (`scripts/bench --only latency`, 1,000 events/s to Kafka,
            // alternated): claims over 2 ms 1.05–1.49 % → 0.50–0.84 %,
            // relay 0.13–0.14 → 0.12–0.13 cores.
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > IDLE_BEFORE_PING {
                        use sqlx::Connection;
                        conn.ping().await?;
                    }
                    Ok(true)
                })
            })
            // sqlx pings a connection given back, with no deadline: one
            // whose statement `bounded` gave up on (the server does not
            // answer) would hang there for good, holding its place in the
            // pool. Right after such a statement, connections given back
            // are pinged here first, with a deadline, and dropped when it
            // passes; otherwise this costs nothing.
            .after_release({
                let abandoned = abandoned.clone();
                move |conn, _| {
                    let check = abandoned.recent();
                    Box::pin(async move {
                        if check {
                            use sqlx::Connection;
                            match tokio::time::timeout(ABANDONED_CHECK, conn.ping()).await {
                                Ok(r) => r?,
                                Err(_) => {
                                    return Err(sqlx::Error::Io(std::io::Error::new(
                                        std::io::ErrorKind::TimedOut,
                                        "no answer to a ping after a statement was given up",
                                    )));
                                }
                            }
                        }
                        Ok(true)
                    })
                }
            })
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(opts.clone())
            .await
        {
            Ok(pool) => pool,
            // The pool only says it timed out; one direct attempt says why
            // (connection refused, no such host, …).
            Err(sqlx::Error::PoolTimedOut) => {
                use sqlx::Connection;
                let why = match tokio::time::timeout(
                    Duration::from_secs(5),
                    sqlx::PgConnection::connect_with(&opts),
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
        let logical = sc.logical(source_name(key));
        Ok(PgStore {
            pool,
            statement_timeout: sc.statement_timeout,
            abandoned,
            key: key.to_string(),
            // The key of this source's coordination rows: the table, or for
            // tableless capture the message prefix.
            source: match &logical {
                Some(l) if l.input == LogicalInput::Messages => {
                    format!("messages:{}", l.message_prefix)
                }
                _ => sc.table().name,
            },
            logical,
            relay_id: relay_id.to_string(),
            lanes: sc.lanes.unwrap_or(config.relay.lanes),
            lease_ttl: config.relay.lease_ttl,
            ordering: config.relay.ordering,
            batch_size: config.relay.batch_size,
            max_batch_bytes: config.relay.max_batch_bytes,
            claim_rows: std::sync::atomic::AtomicU32::new(u32::MAX),
            cfg: sc.table(),
            sql: None,
            claim_sql: String::new(),
            claim_skip_sql: String::new(),
            missing_index: None,
            wakes: false,
            floors: Default::default(),
            routes: Default::default(),
            floor_sql: None,
            floors_off: None,
            seq_unique: false,
            purge_from: std::sync::atomic::AtomicI64::new(i64::MIN),
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// How long a lane lease lasts without renewal (`relay.lease_ttl`).
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// How long a statement may go unanswered (`store.statement_timeout`).
    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout
    }

    /// Run one of the relay's statements (`what` names it in the error)
    /// under `store.statement_timeout`. Past it the statement is given up:
    /// its connection goes back to the pool, is pinged with a deadline (see
    /// `after_release` in [`PgStore::connect`]) and dropped when the server
    /// does not answer, and the caller retries on another connection.
    /// Giving up is safe wherever the relay runs a statement: nothing is
    /// marked, recorded or confirmed unless its statement returned.
    pub async fn bounded<T>(
        &self,
        what: &str,
        statement: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        self.bounded_by(self.statement_timeout, what, statement)
            .await
    }

    /// [`PgStore::bounded`] with a shorter deadline (`limit`, at most
    /// `store.statement_timeout`).
    pub async fn bounded_by<T>(
        &self,
        limit: Duration,
        what: &str,
        statement: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let limit = limit.min(self.statement_timeout);
        // Pinned here, so a given-up statement (and its connection) is
        // dropped on return, after `abandoned` is set: its release sees it.
        let mut statement = std::pin::pin!(statement);
        match tokio::time::timeout(limit, statement.as_mut()).await {
            Ok(r) => r,
            Err(_) => {
                self.abandoned.now();
                metrics::counter!(crate::metrics::STATEMENTS_ABANDONED, "source" => source_name(&self.key).to_string())
                    .increment(1);
                bail!(
                    "{what}: the database did not answer within {} ({}.statement_timeout); gave the statement up, retrying on another connection",
                    humantime::format_duration(limit),
                    self.key
                )
            }
        }
    }

    fn sql(&self) -> Result<&TableSql> {
        self.sql
            .as_ref()
            .ok_or_else(|| anyhow!("store used before check_table"))
    }

    /// Heartbeat this relay, forget relays silent for 10 TTLs, and count
    /// the live ones (lane shares, `status`).
    pub(super) async fn heartbeat(&self) -> Result<i64> {
        let ttl = self.lease_ttl.as_secs_f64();
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO outroute_relays (source, relay_id, hostname, pid) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (source, relay_id) DO UPDATE SET heartbeat_at = now()",
        )
        .bind(&self.source)
        .bind(&self.relay_id)
        .bind(this_host())
        .bind(std::process::id() as i32)
        .execute(&mut *tx)
        .await?;
        // Forget relays that stopped heartbeating long ago.
        sqlx::query("DELETE FROM outroute_relays WHERE source = $1 AND heartbeat_at < now() - make_interval(secs => $2 * 10)")
            .bind(&self.source)
            .bind(ttl)
            .execute(&mut *tx)
            .await?;
        let relays: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outroute_relays WHERE source = $1 AND heartbeat_at > now() - make_interval(secs => $2)",
        )
        .bind(&self.source)
        .bind(ttl)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(relays)
    }

    /// Live relays of this source with the lanes they hold (for `status`).
    pub(in crate::store) async fn live_relays(&self) -> Result<Vec<RelayStatus>> {
        sqlx::query(
            "SELECT r.relay_id, r.hostname, r.pid, extract(epoch from now() - r.heartbeat_at)::float8, \
               COALESCE(array_agg(l.lane ORDER BY l.lane) FILTER (WHERE l.lane IS NOT NULL), '{}'), \
               COALESCE(array_agg(l.epoch ORDER BY l.lane) FILTER (WHERE l.lane IS NOT NULL), '{}') \
             FROM outroute_relays r LEFT JOIN outroute_lanes l ON l.source = r.source AND l.owner = r.relay_id AND l.lease_until > now() \
             WHERE r.source = $1 AND r.heartbeat_at > now() - make_interval(secs => $2) GROUP BY 1, 2, 3, 4 ORDER BY 1",
        )
        .bind(&self.source)
        .bind(self.lease_ttl.as_secs_f64())
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| {
            Ok(RelayStatus {
                relay_id: r.try_get(0)?,
                hostname: r.try_get(1)?,
                pid: r.try_get(2)?,
                heartbeat_age_seconds: r.try_get(3)?,
                lanes: r.try_get(4)?,
                epochs: r.try_get(5)?,
            })
        })
        .collect::<Result<Vec<_>>>()
    }

    /// Connections any relay holds to this database (for `status`): the
    /// pools' (`outroute`) and the log streams' (`outroute <relay id>`).
    pub(super) async fn relay_connections(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND (application_name = 'outroute' OR application_name LIKE 'outroute %') \
             AND pid <> pg_backend_pid()",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// Connections this relay's pool holds open (in use or idle).
    pub fn pool_connections(&self) -> u32 {
        self.pool.size()
    }

    /// Per route, events published without messages (for `status`).
    pub(super) async fn events_without_messages(&self) -> Result<Vec<(String, i64)>> {
        Ok(sqlx::query_as(
            "SELECT route, events_without_messages FROM outroute_route_counts \
             WHERE source = $1 AND events_without_messages > 0 ORDER BY route",
        )
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?)
    }

    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }
}

/// Positions of the columns every claim statement returns: `select_cols`,
/// then `tid`, `state_attempts` and `held_routes` (read by position: a
/// lookup by name hashes the name, thirteen times per row).
mod col {
    pub const ID: usize = 0;
    pub const SEQ: usize = 1;
    pub const AGGREGATE_TYPE: usize = 2;
    pub const AGGREGATE_ID: usize = 3;
    pub const EVENT_TYPE: usize = 4;
    pub const EVENT_VERSION: usize = 5;
    pub const PAYLOAD: usize = 6;
    pub const HEADERS: usize = 7;
    pub const CREATED_AT: usize = 8;
    pub const LANE: usize = 9;
    pub const TID: usize = 10;
    pub const STATE_ATTEMPTS: usize = 11;
    pub const HELD_ROUTES: usize = 12;
    /// The names, in order (checked against the SQL in a unit test).
    #[cfg(test)]
    pub const NAMES: [&str; 13] = [
        "id",
        "seq",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "event_version",
        "payload",
        "headers",
        "created_at",
        "lane",
        "tid",
        "state_attempts",
        "held_routes",
    ];
}

/// A claim statement's row as a claim. `payload_is_json`: the payload
/// column is `json`/`jsonb` (not parsed again).
///
/// Read unchecked: the statement casts every column to the type read here
/// (`::text`, `::bigint`, `::timestamptz`, the lane and attempts `int`), so
/// sqlx's per-value type-compatibility check — most of the cost of reading
/// a row, measured — proves nothing; a value of another type still fails
/// to decode, as an error.
pub(super) fn to_claim(r: &PgRow, payload_is_json: bool) -> Result<Claim> {
    let id: Option<String> = r.try_get_unchecked(col::ID)?;
    let tid: Option<String> = r.try_get_unchecked(col::TID)?;
    let lane: i32 = r.try_get_unchecked(col::LANE)?;
    let state_attempts: Option<i32> = r.try_get_unchecked(col::STATE_ATTEMPTS)?;
    let read = |id: String| -> Result<RawRow, sqlx::Error> {
        Ok(RawRow {
            id,
            sequence: r.try_get_unchecked(col::SEQ)?,
            aggregate_type: r.try_get_unchecked(col::AGGREGATE_TYPE)?,
            aggregate_id: r.try_get_unchecked(col::AGGREGATE_ID)?,
            event_type: r.try_get_unchecked(col::EVENT_TYPE)?,
            event_version: r.try_get_unchecked(col::EVENT_VERSION)?,
            payload: r.try_get_unchecked(col::PAYLOAD)?,
            headers: r.try_get_unchecked(col::HEADERS)?,
            created_at: r.try_get_unchecked(col::CREATED_AT)?,
            attempts: state_attempts.unwrap_or(0),
            payload_is_json,
        })
    };
    // A row that cannot even be read fails on its own, with the reason;
    // one without an id goes by its place in the table (`TableSql::id_key`).
    let row = match id.filter(|id| !id.is_empty()) {
        None => {
            let key = format!("{NO_ID}{}", tid.as_deref().unwrap_or("?"));
            let mut m = super::unreadable(r, key.clone(), sqlx::Error::RowNotFound);
            m.reason = format!(
                "id is NULL or empty: the row is kept as `{key}` (its place in the table) until its id is set"
            );
            Err(m)
        }
        Some(id) => match read(id.clone()) {
            Ok(raw) => raw.validate(),
            Err(e) => Err(super::unreadable(r, id, e)),
        },
    };
    Ok(Claim {
        lane,
        tid,
        held: r
            .try_get_unchecked::<Option<Vec<String>>, _>(col::HELD_ROUTES)?
            .unwrap_or_default(),
        has_state: state_attempts.is_some(),
        done_legs: Vec::new(),
        epoch: None,
        captured: None,
        route: None,
        row,
    })
}

/// This machine's name, as recorded with the relay's heartbeat (read once:
/// every lease round sends it).
pub(super) fn this_host() -> &'static str {
    static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        hostname::get()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_columns_come_in_the_order_to_claim_reads_them() {
        let s = TableSql::new(&TableConfig::canonical(), 16, "uuid");
        let queued = TableSql::new(
            &TableConfig {
                marking: Marking::Queue { column: None },
                ..TableConfig::canonical()
            },
            16,
            "uuid",
        );
        let by_queue = queued.claim_by_queue(Ordering::Aggregate, true);
        // The mark deletes the entry the claim walked: its lane, not the row's.
        assert!(by_queue.contains("qq.lane AS lane"), "{by_queue}");
        for sql in [
            format!("{}, {}", s.select_cols, s.claim_extras(Ordering::Aggregate)),
            s.claim_by_lane(Ordering::Aggregate, true),
            s.claim_by_lane(Ordering::Aggregate, false),
            by_queue,
        ] {
            let mut at = 0;
            for name in col::NAMES {
                let alias = format!(" AS {name}");
                let found = sql[at..]
                    .find(&alias)
                    .unwrap_or_else(|| panic!("`{alias}` missing or out of order in {sql}"));
                at += found + alias.len();
            }
        }
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote("app.outbox"), "\"app\".\"outbox\"");
        assert_eq!(literal("it's"), "'it''s'");
    }

    #[test]
    fn legacy_status_table_sql() {
        let t = TableConfig {
            name: "t_outbox".into(),
            id: "event_id".into(),
            sequence: None,
            aggregate_type: Some("aggregate_type".into()),
            aggregate_type_value: None,
            aggregate_id: "aggregate_id".into(),
            event_type: "event_type".into(),
            event_version: None,
            payload: "payload".into(),
            headers: None,
            created_at: "create_time".into(),
            attempts: Some("retry_count".into()),
            last_error: None,
            failed_at: None,
            marking: Marking::Status {
                column: "status".into(),
                pending: "PENDING".into(),
                sent: "SENT".into(),
                failed: None,
            },
        };
        let s = TableSql::new(&t, 16, "character varying");
        assert_eq!(s.pending, "o.\"status\" = 'PENDING'");
        assert!(s.seq.contains("extract(epoch from o.\"create_time\""));
        assert!(s.lane.ends_with("% 16)"));
        assert_eq!(s.ids_param(3), "$3::text[]::character varying[]");
        // The claim orders by the raw columns, and the index is written
        // with the same expressions, unqualified, over the same rows.
        assert_eq!(s.order, "o.\"create_time\", o.\"event_id\"");
        assert_eq!(
            s.index_ddl,
            format!(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"t_outbox_outroute_lanes16\" ON \"t_outbox\" \
                 (({}), \"create_time\", \"event_id\") WHERE \"status\" = 'PENDING'",
                s.lane.replace("o.", "")
            )
        );
    }
}
