//! The outbox store: where the guarantees live.
//!
//! * **Claim** reads the next pending events of the lanes this relay owns,
//!   in outbox order, skipping events that wait for a retry and every later
//!   event of an aggregate that has an earlier event waiting or failed under
//!   the `block` policy. Claiming writes nothing: the lane lease is the
//!   claim (see `postgres.rs` for why).
//! * **Mark** sets rows published (or deletes them) only after the broker
//!   acknowledged, fenced by the lane lease: a relay that lost its lane
//!   cannot mark rows another relay now owns.
//! * **Retry / fail** record attempts, the next attempt time and the reason
//!   in `outroute_event_state` (so tables that have nowhere to put them still
//!   work), mirrored into the table's own columns when it has them.
//!
//! PostgreSQL is the production store (many relays); MySQL/MariaDB serves
//! the same contract in lease mode (`mysql.rs`); SQLite is the embedded
//! default for one relay and the quickstart.
//!
//! One concern, one file: the store interface every backend implements (its
//! types and the one enum that dispatches to PostgreSQL, MySQL or SQLite); splitting
//! it would separate a method from its contract.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::config::{Config, StoreConfig};
use crate::event::{Event, Malformed, RawRow};

pub mod mysql;
pub mod postgres;
pub mod sqlite;

/// What one retention round did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Purged {
    pub deleted: u64,
    /// The round stopped at its size limit: another may delete more now.
    pub more: bool,
}

/// What one claim took: its rows, and whether it took every row then
/// claimable in its lanes (it stopped at neither its row limit nor
/// `relay.max_batch_bytes`): a sleeping source that claimed them all needs
/// no further claim until the next insert notifies (`relay/sleep.rs`).
#[derive(Debug, Default)]
pub struct Claimed {
    pub claims: Vec<Claim>,
    pub drained: bool,
}

/// One claimed row: an event, or a row that cannot be one.
#[derive(Debug, Clone)]
pub struct Claim {
    pub lane: i32,
    /// Where the claim found the row (PostgreSQL `ctid`), so the mark can
    /// go straight to it; re-checked by id when marking.
    pub tid: Option<String>,
    /// The event has a retry/failure state row (cleared when marked).
    pub has_state: bool,
    /// Routes held back for this event by earlier events of its aggregate
    /// (`*`: every route): on these it waits, on the others it goes.
    pub held: Vec<String>,
    /// Fan-out legs already acknowledged by an earlier attempt (see
    /// [`Failure::done_legs`]): not sent again.
    pub done_legs: Vec<String>,
    /// The lane's lease epoch when the row was claimed (set by the relay):
    /// the mark refuses the row if the lane changed hands since, even if it
    /// came back to this relay.
    pub epoch: Option<i64>,
    /// Set for events read from a replication slot (`capture = "logical"`).
    pub captured: Option<Captured>,
    /// The route this copy of the event goes to, set when its batch is
    /// planned: routes are subscriptions, so an event several routes select
    /// is one claim per route, each ordered, retried and failed on its own
    /// (see `pipeline.rs`). `None` before planning, and for an event no
    /// route takes.
    pub route: Option<usize>,
    pub row: Result<Event, Malformed>,
}

/// The marker in [`Claim::done_legs`] saying a route has delivered the
/// event (every message acknowledged, or none to send): a later attempt for
/// the event's other routes does not run that route again.
pub fn route_done(route: &str) -> String {
    [route, ":done"].concat()
}

/// A fan-out leg's name in [`Claim::done_legs`]: route, sink, topic and the
/// message's count among the route's messages to that topic.
pub fn leg(route: &str, sink: &str, topic: &str, nth: &str) -> String {
    [route, ":", sink, "/", topic, "#", nth].concat()
}

/// Where a logically captured event came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Captured {
    /// Commit LSN of the producer's transaction: orders events across
    /// transactions (then `sequence` within one).
    pub commit_lsn: i64,
    /// Read back from the parked queue (`outroute_event_state`) instead of
    /// the stream: "marked" by deleting its state row.
    pub parked: bool,
    /// When the producer's transaction committed (from the stream's commit
    /// record); `None` for events read back from the table or the parked
    /// queue.
    pub committed_at: Option<DateTime<Utc>>,
}

/// A logically captured event as it waits in `outroute_event_state.event`
/// (the stream has moved on and the table row may be gone): everything
/// needed to route it again. The payload stays a string so its bytes are
/// exactly the producer's.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ParkedEvent {
    pub sequence: i64,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    #[serde(default)]
    pub event_version: u32,
    #[serde(default)]
    pub payload: String,
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    pub created_at: DateTime<Utc>,
    /// Set for a row that could not become an event: the reason.
    #[serde(default)]
    pub malformed: Option<String>,
    /// And the row as it was read (the table row may be gone): shown by
    /// `outroute failed show`, repaired with `outroute failed edit`, read
    /// again when the event is retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row: Option<RawRow>,
}

impl ParkedEvent {
    pub fn of(row: &Result<Event, Malformed>) -> Self {
        match row {
            Ok(e) => ParkedEvent {
                sequence: e.sequence,
                aggregate_type: e.aggregate_type.clone(),
                aggregate_id: e.aggregate_id.clone(),
                event_type: e.event_type.clone(),
                event_version: e.event_version,
                payload: String::from_utf8_lossy(&e.payload).into_owned(),
                headers: e.headers.clone(),
                created_at: e.created_at,
                malformed: None,
                row: None,
            },
            Err(m) => ParkedEvent {
                sequence: m.sequence,
                aggregate_type: m.aggregate_type.clone(),
                aggregate_id: m.aggregate_id.clone(),
                event_type: m.event_type.clone(),
                event_version: 0,
                payload: String::new(),
                headers: Vec::new(),
                created_at: Utc::now(),
                malformed: Some(m.reason.clone()),
                row: m.raw.as_deref().cloned(),
            },
        }
    }

    /// The event again (`attempts`: from its state row).
    #[allow(clippy::result_large_err)]
    pub fn into_row(self, id: String, attempts: u32) -> Result<Event, Malformed> {
        match (self.malformed, self.row) {
            // The row it was read as is checked again: one repaired since
            // (`outroute failed edit`) becomes its event.
            (Some(_), Some(row)) => {
                RawRow {
                    // The record's id (`unpark` goes by it); a row read
                    // without one stays without (ids are not edited).
                    id: if row.id.is_empty() { String::new() } else { id },
                    attempts: i32::try_from(attempts).unwrap_or(i32::MAX),
                    ..row
                }
                .validate()
            }
            (Some(reason), None) => Err(Malformed {
                id,
                sequence: self.sequence,
                aggregate_type: self.aggregate_type,
                aggregate_id: self.aggregate_id,
                event_type: self.event_type,
                reason,
                raw: None,
            }),
            (None, _) => Ok(Event {
                id,
                sequence: self.sequence,
                aggregate_type: self.aggregate_type,
                aggregate_id: self.aggregate_id,
                event_type: self.event_type,
                event_version: self.event_version,
                payload: self.payload.into_bytes(),
                headers: self.headers,
                created_at: self.created_at,
                attempts,
            }),
        }
    }
}

impl Claim {
    /// What the event holds in memory, roughly: its payload and headers
    /// (what `relay.max_batch_bytes` bounds in claims and captured batches).
    pub fn bytes(&self) -> u64 {
        let n = match &self.row {
            Ok(e) => {
                e.payload.len()
                    + e.headers
                        .iter()
                        .map(|(k, v)| k.len() + v.len())
                        .sum::<usize>()
            }
            Err(m) => m.raw.as_ref().map_or(0, |r| {
                r.payload.as_ref().map_or(0, String::len)
                    + r.headers.as_ref().map_or(0, String::len)
            }),
        };
        n as u64
    }

    /// The row's place in outbox order.
    pub fn sequence(&self) -> i64 {
        match &self.row {
            Ok(e) => e.sequence,
            Err(m) => m.sequence,
        }
    }

    pub fn id(&self) -> &str {
        match &self.row {
            Ok(e) => &e.id,
            Err(m) => &m.id,
        }
    }

    /// When the event became visible, as well as it is known: the commit
    /// time for a streamed event, else the row's `created_at` (the
    /// producer's transaction start, so a little early).
    pub fn committed_at(&self) -> Option<DateTime<Utc>> {
        match (&self.captured, &self.row) {
            (
                Some(Captured {
                    committed_at: Some(at),
                    ..
                }),
                _,
            ) => Some(*at),
            (_, Ok(e)) => Some(e.created_at),
            (_, Err(_)) => None,
        }
    }
}

/// A row whose columns could not be read fails alone, keeping what can be
/// read of its aggregate and order so the failure holds back the right one.
fn unreadable<R>(r: &R, id: String, e: sqlx::Error) -> Malformed
where
    R: sqlx::Row,
    &'static str: sqlx::ColumnIndex<R>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let text = |col: &'static str| {
        r.try_get::<Option<String>, _>(col)
            .ok()
            .flatten()
            .unwrap_or_default()
    };
    Malformed {
        id,
        sequence: r
            .try_get::<Option<i64>, _>("seq")
            .ok()
            .flatten()
            .unwrap_or(0),
        aggregate_type: text("aggregate_type"),
        aggregate_id: text("aggregate_id"),
        event_type: text("event_type"),
        reason: format!("unreadable row: {e}"),
        raw: None,
    }
}

/// An event that did not go through: what to record.
#[derive(Debug, Clone)]
pub struct Failure {
    pub id: String,
    pub lane: i32,
    /// The lane's lease epoch when the event was claimed (see
    /// [`Claim::epoch`]): a relay whose lane changed hands since, even if it
    /// came back, records nothing.
    pub epoch: Option<i64>,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub sequence: i64,
    /// Attempts so far, including this one.
    pub attempts: u32,
    pub reason: String,
    pub route: Option<String>,
    pub plugin: Option<String>,
    pub plugin_version: Option<String>,
    pub kind: FailureKind,
    /// Legs (`route:sink/topic#n`, and `route:done` for a route that
    /// delivered the event) that were acknowledged: while
    /// one sink is down, the legs that reached the others are not re-sent
    /// on every retry.
    pub done_legs: Vec<String>,
    /// A logically captured event waits in the state table itself (the
    /// stream has moved on): its commit LSN and the event.
    pub parked: Option<(i64, ParkedEvent)>,
    /// The routes the event still waits for (`None`: every route); later
    /// events of its aggregate are held back on these only.
    pub waiting_routes: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FailureKind {
    /// Try again after this delay (measured on the database's clock, so
    /// relays on hosts with skewed clocks agree); later events of the
    /// aggregate wait.
    Retry { delay: std::time::Duration },
    /// Failed for good. `hold`: later events of the aggregate wait for an
    /// operator (policy `block`).
    Failed { hold: bool },
}

/// A failed event as `outroute failed list/show` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct FailedEvent {
    pub id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub seq: i64,
    pub attempts: i32,
    pub reason: Option<String>,
    pub route: Option<String>,
    pub plugin: Option<String>,
    pub plugin_version: Option<String>,
    pub first_error_at: DateTime<Utc>,
    pub failed_at: Option<DateTime<Utc>>,
    pub discarded_at: Option<DateTime<Utc>>,
    pub holds_aggregate: bool,
    /// A captured row that could not become an event, as it was read
    /// (parked records only; fix it with `outroute failed edit`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub row: Option<serde_json::Value>,
}

/// Where a page of published events ended: its last (order key, id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub seq: i64,
    pub id: String,
}

impl Cursor {
    /// The cursor after this claim.
    pub fn after(c: &Claim) -> Self {
        let seq = match &c.row {
            Ok(e) => e.sequence,
            Err(m) => m.sequence,
        };
        Cursor {
            seq,
            id: c.id().to_string(),
        }
    }
}

/// Filters for `failed list|retry|discard` and `replay`.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub ids: Vec<String>,
    pub route: Option<String>,
    pub event_type: Option<String>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    pub include_discarded: bool,
    pub limit: Option<i64>,
}

/// One action taken from the operator console, as the audit log keeps it.
#[derive(Debug, Clone, Serialize)]
pub struct AuditEntry {
    pub at: DateTime<Utc>,
    /// The source whose store holds the entry (the events' source).
    pub source: String,
    /// The console token's name.
    pub who: String,
    /// `retry`, `discard` or `resume`.
    pub action: String,
    /// What it named: event ids, a route.
    pub subject: String,
    /// What came of it, e.g. `2 event(s) put back in line`.
    pub outcome: String,
}

impl AuditEntry {
    fn from_row(
        (at, source, who, action, subject, outcome): (
            DateTime<Utc>,
            String,
            String,
            String,
            String,
            String,
        ),
    ) -> Self {
        AuditEntry {
            at,
            source,
            who,
            action,
            subject,
            outcome,
        }
    }
}

/// What `outroute status` shows.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Status {
    pub table: String,
    pub backlog: i64,
    pub oldest_pending_age_seconds: Option<f64>,
    pub retrying: i64,
    pub failed: i64,
    pub backlog_by_aggregate_type: Vec<(String, i64)>,
    /// Per route: events its plugin answered with no messages (marked
    /// published, nothing sent), since the table was migrated.
    pub events_without_messages: Vec<(String, i64)>,
    /// Routes whose plugin kept breaking its limits: their events wait.
    pub quarantined_routes: Vec<QuarantinedRoute>,
    pub relays: Vec<RelayStatus>,
    /// Connections the relays hold to this source's database (PostgreSQL:
    /// its `pg_stat_activity`, every relay together; a sleeping source's
    /// relay holds one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relay_connections: Option<i64>,
    /// The replication slot of a `capture = "logical"` source.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<SlotStatus>,
    /// The recorded binlog position of a `capture = "binlog"` source.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub binlog: Option<mysql::BinlogStatus>,
}

/// A logical source's replication slot, as `status` and the metrics show it.
#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct SlotStatus {
    pub slot: String,
    /// A relay is streaming from it (its backend pid).
    pub active_pid: Option<i32>,
    pub confirmed_flush_lsn: Option<String>,
    /// WAL written since the confirmed position: what the slot keeps.
    pub lag_bytes: i64,
    /// `reserved`, `extended`, `unreserved` or `lost` (past `max_slot_wal_keep_size`).
    pub wal_status: Option<String>,
}

/// A quarantined route as the store records it.
#[derive(Debug, Clone, Serialize)]
pub struct QuarantinedRoute {
    pub route: String,
    pub since: DateTime<Utc>,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct RelayStatus {
    pub relay_id: String,
    pub hostname: String,
    pub pid: i32,
    pub heartbeat_age_seconds: f64,
    pub lanes: Vec<i32>,
    /// Each lane's lease epoch (same order as `lanes`): how many times the
    /// lane changed hands.
    pub epochs: Vec<i64>,
}

/// Result of a lease round: the lanes this relay may claim from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Leases {
    pub lanes: Vec<i32>,
    /// Each lane's lease epoch (same order as `lanes`): bumped on every
    /// hand-over, so a relay that lost a lane and got it back can tell.
    pub epochs: Vec<i64>,
    /// Lanes newly taken over this round (metric: lease hand-overs).
    pub acquired: usize,
    /// Live relays sharing the lanes.
    pub relays: i64,
}

/// The store: PostgreSQL, MySQL/MariaDB or SQLite.
pub enum Store {
    Postgres(Box<postgres::PgStore>),
    MySql(Box<mysql::MySqlStore>),
    Sqlite(sqlite::SqliteStore),
}

macro_rules! dispatch {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            Store::Postgres($s) => $e,
            Store::MySql($s) => $e,
            Store::Sqlite($s) => $e,
        }
    };
}

/// A statement of the relay's: on PostgreSQL and MySQL given up after
/// `store.statement_timeout` ([`postgres::PgStore::bounded`]; `$what` names
/// it in the error). SQLite is a local file: nothing to wait for.
macro_rules! bounded {
    ($self:ident, $what:expr, $s:ident => $e:expr) => {
        match $self {
            Store::Postgres($s) => $s.bounded($what, $e).await,
            Store::MySql($s) => $s.bounded($what, $e).await,
            Store::Sqlite($s) => $e.await,
        }
    };
}

impl Store {
    /// Connect to source `source` of `config` (`config.sources`).
    pub async fn connect(config: &Config, source: &str, relay_id: &str) -> anyhow::Result<Store> {
        let sc: &StoreConfig = config.source(source)?;
        let key = config.source_key(source);
        if sc.url.starts_with("sqlite:") {
            Ok(Store::Sqlite(sqlite::SqliteStore::connect(&key, sc).await?))
        } else if sc.is_mysql() {
            let pooled = config.sources.values().filter(|s| s.is_pooled()).count();
            let my = mysql::MySqlStore::connect(config, &key, sc, relay_id, pooled).await?;
            Ok(Store::MySql(Box::new(my)))
        } else {
            let pg = postgres::PgStore::connect(config, &key, sc, relay_id).await?;
            Ok(Store::Postgres(Box::new(pg)))
        }
    }

    /// Create the coordination tables, and the canonical outbox table when
    /// `outbox` is set. Idempotent.
    pub async fn migrate(&self, outbox: bool) -> anyhow::Result<()> {
        dispatch!(self, s => s.migrate(outbox).await)
    }

    /// Check the mapped table and columns (after migrations).
    pub async fn check_table(&mut self) -> anyhow::Result<()> {
        dispatch!(self, s => s.check_table().await)
    }

    /// The `CREATE INDEX` statement the claim needs when the table has no
    /// usable lane index (after `check_table`); `None` when it has one.
    pub fn missing_index(&self) -> Option<&str> {
        match self {
            Store::Postgres(s) => s.missing_index(),
            Store::MySql(s) => s.missing_index(),
            Store::Sqlite(_) => None,
        }
    }

    /// The PostgreSQL store, if that is what this is (diagnostics, tests).
    pub fn postgres(&self) -> Option<&postgres::PgStore> {
        match self {
            Store::Postgres(s) => Some(s),
            _ => None,
        }
    }

    /// Create the lane index if it is missing (CONCURRENTLY: producers keep
    /// writing). Returns the statement run, `None` if nothing was needed.
    /// `marking = queue`: the table's pending rows are listed in
    /// `outroute_queue` (its "lane index" is the queue and its trigger).
    pub fn queue_marking(&self) -> bool {
        match self {
            Store::Postgres(s) => s.queue_marking(),
            _ => false,
        }
    }

    pub async fn create_lane_index(&mut self) -> anyhow::Result<Option<String>> {
        match self {
            Store::Postgres(s) => s.create_lane_index().await,
            Store::MySql(s) => s.create_lane_index().await,
            Store::Sqlite(_) => Ok(None),
        }
    }

    /// Renew/acquire/release lane leases; returns the lanes to claim from.
    /// On PostgreSQL and MySQL given up after a quarter of `relay.lease_ttl` at most,
    /// so a round lost to a dead connection is retried on another one
    /// before the lease lapses.
    pub async fn lease_round(&self) -> anyhow::Result<Leases> {
        match self {
            Store::Postgres(s) => {
                s.bounded_by(s.lease_ttl() / 4, "renewing lane leases", s.lease_round())
                    .await
            }
            Store::MySql(s) if s.binlog() => {
                s.bounded_by(
                    s.lease_ttl() / 4,
                    "renewing the capture lease",
                    s.capture_lease(),
                )
                .await
            }
            Store::MySql(s) => {
                s.bounded_by(s.lease_ttl() / 4, "renewing lane leases", s.lease_round())
                    .await
            }
            Store::Sqlite(s) => s.lease_round().await,
        }
    }

    /// Give all lanes back (graceful shutdown).
    pub async fn release_all(&self) -> anyhow::Result<()> {
        bounded!(self, "releasing the lanes", s => s.release_all())
    }

    /// Name the routes that read this source: a claim needs them to know
    /// whether an event with no state row may still go on some route while
    /// earlier events of its aggregate hold others (PostgreSQL; SQLite holds
    /// the whole aggregate).
    pub fn set_routes(&self, names: Vec<String>) {
        if let Store::Postgres(s) = self {
            s.set_routes(names);
        }
    }

    pub async fn claim(&self, lanes: &[i32], limit: u32) -> anyhow::Result<Claimed> {
        bounded!(self, "claiming events", s => s.claim(lanes, limit))
    }

    /// Move the lanes' claim floors up past what they published (tables
    /// with a sequence column; see `postgres/floor.rs`, `mysql/floor.rs`).
    /// Returns whether a floor was lowered (a row turned up below it).
    pub async fn raise_floors(&self, lanes: &[i32]) -> bool {
        let raised = match self {
            Store::Postgres(s) => {
                let raise = async { Ok(s.raise_floors(lanes).await) };
                s.bounded("raising claim floors", raise).await
            }
            Store::MySql(s) => {
                s.bounded("raising claim floors", s.raise_floors(lanes))
                    .await
            }
            _ => return false,
        };
        raised.unwrap_or_else(|e| {
            tracing::warn!("{e:#}");
            false
        })
    }

    /// Delete queue entries whose row is gone or failed by hand, walking
    /// these lanes on from `after` (PostgreSQL, `marking = queue`; see
    /// [`postgres::PgStore::drop_orphans`]).
    pub async fn drop_orphans(
        &self,
        lanes: &[i32],
        after: &[i64],
    ) -> anyhow::Result<postgres::OrphanWalk> {
        match self {
            Store::Postgres(s) => {
                s.bounded(
                    "removing orphaned queue entries",
                    s.drop_orphans(lanes, after),
                )
                .await
            }
            _ => Ok(postgres::OrphanWalk::default()),
        }
    }

    /// Mark these claimed events published; returns how many were marked
    /// (rows in lanes this relay no longer owns are not).
    pub async fn mark_published(&self, claims: &[&Claim]) -> anyhow::Result<u64> {
        bounded!(self, "marking events published", s => s.mark_published(claims))
    }

    /// Add to the per-route counts of events published without messages.
    pub async fn count_without_messages(&self, by_route: &[(String, u64)]) -> anyhow::Result<()> {
        bounded!(self, "counting events published without messages", s => s.count_without_messages(by_route))
    }

    /// Record that `route` is quarantined (every relay follows the record).
    pub async fn quarantine_route(&self, route: &str, reason: &str) -> anyhow::Result<()> {
        bounded!(self, "recording a quarantine", s => s.quarantine_route(route, reason))
    }

    /// Clear `route`'s quarantine and make its waiting events due now;
    /// returns whether it was quarantined and how many events were made due.
    pub async fn resume_route(&self, route: &str) -> anyhow::Result<(bool, u64)> {
        bounded!(self, "resuming a route", s => s.resume_route(route))
    }

    /// Make `route`'s waiting events due now (a resume recorded while a
    /// relay was deferring them); returns how many.
    pub async fn make_waiting_due(&self, route: &str) -> anyhow::Result<u64> {
        bounded!(self, "making a resumed route's events due", s => s.make_waiting_due(route))
    }

    /// The quarantined routes.
    pub async fn quarantined_routes(&self) -> anyhow::Result<Vec<QuarantinedRoute>> {
        bounded!(self, "reading quarantined routes", s => s.quarantined_routes())
    }

    /// Record retries and failures; returns how many were recorded.
    pub async fn record_failures(&self, failures: &[Failure]) -> anyhow::Result<u64> {
        bounded!(self, "recording failed and retried events", s => s.record_failures(failures))
    }

    /// Failed events now (not discarded), per route (`-`: none took it):
    /// the failed-events gauge and `status`.
    pub async fn failed_by_route(&self) -> anyhow::Result<Vec<(String, i64)>> {
        bounded!(self, "counting failed events", s => s.failed_by_route())
    }

    /// When each of `ids` first failed (those never failed are left out):
    /// a dead letter's `outroute-failure-first-error-at`.
    pub async fn first_errors(
        &self,
        ids: &[String],
    ) -> anyhow::Result<Vec<(String, DateTime<Utc>)>> {
        bounded!(self, "reading when events first failed", s => s.first_errors(ids))
    }

    pub async fn status(&self) -> anyhow::Result<Status> {
        dispatch!(self, s => s.status().await)
    }

    /// Pending events and the age of the oldest (for metrics).
    pub async fn backlog(&self) -> anyhow::Result<(i64, Option<f64>)> {
        bounded!(self, "counting the backlog", s => s.backlog())
    }

    pub async fn failed_list(&self, f: &Filter) -> anyhow::Result<Vec<FailedEvent>> {
        dispatch!(self, s => s.failed_list(f).await)
    }

    /// Put failed events back in line (attempts reset); returns the count.
    pub async fn failed_retry(&self, f: &Filter) -> anyhow::Result<u64> {
        dispatch!(self, s => s.failed_retry(f).await)
    }

    /// Change fields of a parked record's row that could not become an
    /// event (`outroute failed edit`); it is read again when retried.
    pub async fn failed_edit(&self, id: &str, set: &[(String, String)]) -> anyhow::Result<()> {
        match self {
            Store::Postgres(s) => s.failed_edit(id, set).await,
            Store::MySql(_) | Store::Sqlite(_) => anyhow::bail!(
                "only events parked by log-based capture keep their row in the failure record; \
                 edit the outbox row itself, then `outroute failed retry`"
            ),
        }
    }

    /// Give up on failed events for good (they stop holding their aggregate).
    pub async fn failed_discard(&self, f: &Filter) -> anyhow::Result<u64> {
        dispatch!(self, s => s.failed_discard(f).await)
    }

    /// The row of event `id` as the table holds it now, and whether it is
    /// marked published (`None`: no such row, e.g. cleaned up after
    /// log-based capture, or deleted by `marking = delete`).
    pub async fn event_row(&self, id: &str) -> anyhow::Result<Option<(Claim, bool)>> {
        dispatch!(self, s => s.event_row(id).await)
    }

    /// The live relays of this source and the lanes each holds (lane -1:
    /// the capture lease of log-based capture), as every relay of the
    /// fleet recorded them; SQLite has one relay and records none.
    pub async fn fleet(&self) -> anyhow::Result<Vec<RelayStatus>> {
        match self {
            Store::Postgres(s) => s.live_relays().await,
            Store::MySql(s) => s.live_relays().await,
            Store::Sqlite(_) => Ok(Vec::new()),
        }
    }

    /// Append one console action to the audit log.
    pub async fn audit(&self, a: &AuditEntry) -> anyhow::Result<()> {
        dispatch!(self, s => s.audit(a).await)
    }

    /// Source `source`'s latest `limit` audit entries, newest first.
    pub async fn audit_recent(&self, source: &str, limit: i64) -> anyhow::Result<Vec<AuditEntry>> {
        dispatch!(self, s => s.audit_recent(source, limit).await)
    }

    /// Published events matching `f`, in outbox order (order key, then id),
    /// after `after`: keyset pagination that never skips rows sharing an
    /// order key (tied `created_at`) across a page boundary.
    pub async fn published(
        &self,
        f: &Filter,
        after: Option<&Cursor>,
        limit: i64,
    ) -> anyhow::Result<Vec<Claim>> {
        dispatch!(self, s => s.published_page(f, after, limit, false).await)
    }

    /// Published events newest first, before `before`.
    pub async fn published_newest(
        &self,
        f: &Filter,
        before: Option<&Cursor>,
        limit: i64,
    ) -> anyhow::Result<Vec<Claim>> {
        dispatch!(self, s => s.published_page(f, before, limit, true).await)
    }

    /// Count of published events matching `f` (replay progress).
    pub async fn published_count(&self, f: &Filter) -> anyhow::Result<i64> {
        dispatch!(self, s => s.published_count(f).await)
    }

    /// One retention round: delete up to `batch` published rows older than
    /// `older_than`.
    pub async fn purge_published(
        &self,
        older_than: std::time::Duration,
        batch: i64,
    ) -> anyhow::Result<Purged> {
        bounded!(self, "deleting published events (retention)", s => s.purge_published(older_than, batch))
    }

    /// The relay id this store leases under.
    pub fn relay_id(&self) -> &str {
        match self {
            Store::Postgres(s) => s.relay_id(),
            Store::MySql(s) => s.relay_id(),
            Store::Sqlite(_) => "embedded",
        }
    }

    /// The PostgreSQL store of a `capture = "logical"` source.
    pub fn logical(&self) -> Option<&postgres::PgStore> {
        match self {
            Store::Postgres(s) if s.logical().is_some() => Some(s),
            _ => None,
        }
    }

    /// The MySQL/MariaDB store of a MySQL source.
    pub fn mysql(&self) -> Option<&mysql::MySqlStore> {
        match self {
            Store::MySql(m) => Some(m),
            _ => None,
        }
    }

    /// The MySQL/MariaDB store of a `capture = "binlog"` source.
    pub fn binlog(&self) -> Option<&mysql::MySqlStore> {
        match self {
            Store::MySql(s) if s.binlog() => Some(s),
            _ => None,
        }
    }

    /// Connections this source's pool holds now (PostgreSQL and MySQL).
    pub fn pool_connections(&self) -> Option<u32> {
        match self {
            Store::Postgres(s) => Some(s.pool_connections()),
            Store::MySql(s) => Some(s.pool_connections()),
            Store::Sqlite(_) => None,
        }
    }

    /// Is the database reachable?
    pub async fn ping(&self) -> bool {
        match self {
            Store::Postgres(s) => s
                .bounded("ping", async { Ok(s.ping().await) })
                .await
                .unwrap_or(false),
            Store::MySql(s) => s
                .bounded("ping", async { Ok(s.ping().await) })
                .await
                .unwrap_or(false),
            Store::Sqlite(s) => s.ping().await,
        }
    }
}
