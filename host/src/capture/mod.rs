//! Log-based capture (`capture = "logical"`): events come from PostgreSQL's
//! write-ahead log through a logical replication slot instead of a claim of
//! the table, and "marking" is advancing the slot.
//!
//! ```text
//!  producer tx commits ─► WAL ─► slot (pgoutput) ─► reader task: decode rows / messages
//!                                                          │ (commit order)
//!  confirm slot position ◄─ delete captured rows ◄─ park what cannot go ◄─ Relay::process
//! ```
//!
//! The one rule that makes it safe: **the slot's confirmed position only
//! moves past a transaction once every event of it was acknowledged by every
//! destination or written, whole, to the parked queue** (`outroute_event_state`
//! with the event itself; see `store/postgres/logical.rs`). A crash anywhere
//! makes the next reader start at the confirmed position and re-publish what
//! followed, with the same event ids: duplicates, never a loss.
//!
//! Order: events arrive in commit order (then insert order within a
//! transaction). An aggregate whose event cannot go now gets a parked queue;
//! every later event of it joins that queue, and the queue is drained in
//! (commit LSN, sequence) order by [`Relay::retry_parked`], in the same task
//! as the stream, so the aggregate is released only after its last parked
//! event went out. Other aggregates never wait.
//!
//! One relay streams at a time: the owner of the capture lease (lane -1).
//! Standbys wait for it; when the owner dies its lease lapses after
//! `relay.lease_ttl`, a standby takes it, ends the old session if PostgreSQL
//! still thinks it is alive, and starts at the confirmed position.
//!
//! Failover: before PostgreSQL 17 a slot does not survive the promotion of
//! a standby. Each stream start checks the slot (`PgStore::check_slot`): one
//! missing on a later timeline than recorded is named as such; for table
//! input whose published rows leave the table (or are marked) the slot is
//! created again and the pending rows re-read, otherwise the source stops
//! and names the LSN range that may have been missed.
//!
//! Memory: the captured events the relay holds at once (read from the
//! stream and not yet handled) are bounded in bytes by a [`Budget`] of
//! `(relay.concurrency × 2 + 1) × relay.max_batch_bytes`; the reader waits
//! for room before it passes an event on, and up to [`READ_AHEAD`] more
//! messages wait in the replication client. One event larger than the
//! budget still goes, alone.
//!
//! Inputs: inserts into the outbox table (`logical.input = "table"`, the
//! mapped columns in text form), or logical messages
//! (`pg_logical_emit_message(true, '<prefix>', <envelope>)`, no table; the
//! envelope is [`Envelope`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use chrono::{DateTime, NaiveDateTime, Utc};
use pgwire_replication::{
    Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent, SslMode, TlsConfig,
};
use serde::Deserialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::{Logical, LogicalInput, StoreConfig, TableConfig};
use crate::event::{Event, Malformed, RawRow};
use crate::failpoint;
use crate::metrics as m;
use crate::pipeline::{LeaseGuard, LeaseView};
use crate::relay::{AbortOnDrop, BatchReport, Relay, sleep_or_cancel};
use crate::store::postgres::{CAPTURE_LANE, CapturedRows, HeldAggregates, PgStore, SlotCheck};
use crate::store::{Captured, Claim, Failure, FailureKind};

pub mod pgoutput;

/// How often the parked queue is looked at when nothing else happens.
const PARKED_EVERY: Duration = Duration::from_millis(500);

/// Replication messages the client reads ahead of the reader task (its
/// default, 8,192, would hold a whole huge transaction of large rows in
/// memory while the sink is slow).
const READ_AHEAD: usize = 16;

/// Bytes of captured events the relay holds at once: the reader takes an
/// event's share ([`Room`]) before passing it on, and gives it back when
/// the batch that handled it ends. A slow or failing sink so stops the
/// reading instead of filling the memory; the replication client then
/// stops reading the socket (and keeps the connection alive).
#[derive(Clone)]
struct Budget {
    room: Arc<Semaphore>,
    /// The whole budget, in KiB.
    units: u32,
}

/// An event's share of the [`Budget`]: given back when dropped.
type Room = OwnedSemaphorePermit;

impl Budget {
    /// `(concurrency × BATCHES_IN_FLIGHT + 1)` batches of `max_batch_bytes`:
    /// every worker's batches out, and the next one being gathered.
    fn of(config: &crate::config::RelayConfig) -> Self {
        let batches = u64::from(config.concurrency.max(1)) * BATCHES_IN_FLIGHT as u64 + 1;
        let kib = (batches.saturating_mul(config.max_batch_bytes) / 1024).clamp(1, u32::MAX as u64);
        let units = kib as u32;
        Budget {
            room: Arc::new(Semaphore::new(units as usize)),
            units,
        }
    }

    /// Wait for room for `bytes` (at most the whole budget, so an event
    /// larger than it still goes, alone).
    async fn take(&self, bytes: u64) -> Result<Room> {
        let want = bytes.div_ceil(1024).clamp(1, u64::from(self.units)) as u32;
        self.room
            .clone()
            .acquire_many_owned(want)
            .await
            .map_err(|_| anyhow!("the capture budget was closed"))
    }
}

/// How often the confirmed position is recorded (one UPDATE; see
/// `PgStore::note_confirmed`).
const CONFIRMED_NOTE_INTERVAL: Duration = Duration::from_secs(30);

/// The envelope of a tableless event: the content of
/// `pg_logical_emit_message(true, '<prefix>', '<envelope JSON>')`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    pub id: String,
    #[serde(default)]
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    #[serde(default)]
    pub event_version: Option<serde_json::Value>,
    pub payload: Option<Box<serde_json::value::RawValue>>,
    #[serde(default)]
    pub headers: Option<serde_json::Value>,
}

/// What the reader task hands the capture loop, in stream order.
#[derive(Debug)]
enum Item {
    /// A captured event and, once the reader took it, its share of the
    /// [`Budget`].
    Event(Box<Claim>, Option<Room>),
    /// The end of a transaction: once its events are handled the slot may
    /// be confirmed up to `end`.
    Commit { end: Lsn, at: DateTime<Utc> },
    /// Nothing is open on the server's side up to `at`: confirmable once
    /// everything before it is handled.
    Idle { at: Lsn },
}

/// The replication connection of `sc`: the URL's host, port, user and
/// database, the source's password. Timestamps come in ISO, UTC.
pub fn replication_config(
    key: &str,
    sc: &StoreConfig,
    l: &Logical,
    relay_id: &str,
) -> Result<ReplicationConfig> {
    let url = url::Url::parse(&sc.url).map_err(|e| anyhow!("{key}.url: {e}"))?;
    let decode = |s: &str| {
        url::form_urlencoded::parse(format!("x={s}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default()
    };
    let host = url
        .host_str()
        .map(|h| h.trim_matches(['[', ']']).to_string())
        .unwrap_or_else(|| "localhost".into());
    let user = match url.username() {
        "" => std::env::var("USER").unwrap_or_else(|_| "postgres".into()),
        u => decode(u),
    };
    let password = match (&sc.password, url.password()) {
        (Some(p), _) => p.expose().to_string(),
        (None, Some(p)) => decode(p),
        (None, None) => String::new(),
    };
    let database = url.path().trim_start_matches('/').to_string();
    let database = if database.is_empty() {
        user.clone()
    } else {
        decode(&database)
    };
    let tls = replication_tls(key, sc, &url, &host)?;
    Ok(ReplicationConfig::new(
        host,
        user,
        password,
        database,
        l.slot.clone(),
        l.publication.clone(),
    )
    .with_port(url.port().unwrap_or(5432))
    .with_options("-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601")
    .with_application_name(format!("outroute {relay_id}"))
    .with_status_interval(Duration::from_millis(100))
    .with_wakeup_interval(Duration::from_secs(1))
    .with_buffer_size(READ_AHEAD)
    .with_tls(tls))
}

/// TLS of the replication connection, as the source's queries have it:
/// the mode the query pool resolved (`[store.tls]`, the URL's `sslmode` or
/// its aliases, `PGSSLMODE`; unset is `prefer`: TLS when the server offers
/// it), and the files from `[store.tls]`, else the URL (`sslrootcert`,
/// `sslcert`, `sslkey` or sqlx's aliases), else `PGSSLROOTCERT`,
/// `PGSSLCERT`, `PGSSLKEY`.
fn replication_tls(key: &str, sc: &StoreConfig, url: &url::Url, host: &str) -> Result<TlsConfig> {
    use sqlx::postgres::PgSslMode;
    let file = |names: &[&str], env: &str| {
        names
            .iter()
            .find_map(|n| {
                url.query_pairs()
                    .find(|(k, _)| k == n)
                    .map(|(_, v)| v.into_owned())
            })
            .or_else(|| std::env::var(env).ok())
            .map(std::path::PathBuf::from)
    };
    let mode = match crate::store::postgres::connect_options(key, sc)?.get_ssl_mode() {
        PgSslMode::Disable => SslMode::Disable,
        PgSslMode::Allow | PgSslMode::Prefer => SslMode::Prefer,
        PgSslMode::Require => SslMode::Require,
        PgSslMode::VerifyCa => SslMode::VerifyCa,
        PgSslMode::VerifyFull => SslMode::VerifyFull,
    };
    let t = sc.tls.as_ref();
    let ca = t
        .and_then(|t| t.ca_file.clone())
        .or_else(|| file(&["sslrootcert", "ssl-root-cert", "ssl-ca"], "PGSSLROOTCERT"));
    let (cert, client_key) = match t.and_then(|t| t.cert_file.clone().zip(t.key_file.clone())) {
        Some((c, k)) => (Some(c), Some(k)),
        None => (
            file(&["sslcert", "ssl-cert"], "PGSSLCERT"),
            file(&["sslkey", "ssl-key"], "PGSSLKEY"),
        ),
    };
    if cert.is_some() != client_key.is_some() {
        bail!("{key}: a client certificate needs both the certificate and its key");
    }
    Ok(TlsConfig {
        mode,
        ca_pem_path: ca,
        // An IP host is verified against the certificate's IP addresses
        // (as libpq does); the crate wants it named to allow that.
        sni_hostname: host
            .parse::<std::net::IpAddr>()
            .is_ok()
            .then(|| host.to_string()),
        client_cert_pem_path: cert,
        client_key_pem_path: client_key,
    })
}

/// A timestamp in PostgreSQL's ISO text form, with or without a zone.
/// (The formats are parsed once: parsing them per row was most of the cost.)
fn parse_timestamp(s: &str) -> Option<DateTime<Utc>> {
    use chrono::format::{Item, Parsed, StrftimeItems, parse};
    use std::sync::LazyLock;
    static ZONED: LazyLock<Vec<Item<'static>>> = LazyLock::new(|| {
        StrftimeItems::new("%Y-%m-%d %H:%M:%S%.f%#z")
            .parse_to_owned()
            .unwrap_or_default()
    });
    static PLAIN: LazyLock<Vec<Item<'static>>> = LazyLock::new(|| {
        StrftimeItems::new("%Y-%m-%d %H:%M:%S%.f")
            .parse_to_owned()
            .unwrap_or_default()
    });
    let mut zoned = Parsed::new();
    if parse(&mut zoned, s, ZONED.iter()).is_ok()
        && let Ok(t) = zoned.to_datetime()
    {
        return Some(t.with_timezone(&Utc));
    }
    let mut plain = Parsed::new();
    parse(&mut plain, s, PLAIN.iter()).ok()?;
    plain
        .to_naive_datetime_with_offset(0)
        .ok()
        .map(|n: NaiveDateTime| n.and_utc())
}

/// Column positions of the mapped columns in one published relation.
struct RowShape {
    id: Option<usize>,
    sequence: Option<usize>,
    aggregate_type: Option<usize>,
    aggregate_id: Option<usize>,
    event_type: Option<usize>,
    event_version: Option<usize>,
    payload: Option<usize>,
    headers: Option<usize>,
    created_at: Option<usize>,
    /// The payload column is `json`/`jsonb` (see [`RawRow::payload_is_json`]).
    payload_is_json: bool,
    /// How many keys map each column: a value mapped once moves out of the
    /// decoded row, one mapped twice is copied.
    uses: Vec<u8>,
}

impl RowShape {
    fn of(rel: &pgoutput::Relation, t: &TableConfig) -> Self {
        let pos = |c: &Option<String>| {
            c.as_ref()
                .and_then(|c| rel.columns.iter().position(|n| n == c))
        };
        let req = |c: &String| rel.columns.iter().position(|n| n == c);
        let payload = req(&t.payload);
        let mut shape = RowShape {
            payload_is_json: payload
                .and_then(|i| rel.types.get(i))
                .is_some_and(|ty| pgoutput::JSON_TYPES.contains(ty)),
            uses: vec![0; rel.columns.len()],
            id: req(&t.id),
            sequence: pos(&t.sequence),
            aggregate_type: pos(&t.aggregate_type),
            aggregate_id: req(&t.aggregate_id),
            event_type: req(&t.event_type),
            event_version: pos(&t.event_version),
            payload,
            headers: pos(&t.headers),
            created_at: req(&t.created_at),
        };
        for i in [
            shape.id,
            shape.sequence,
            shape.aggregate_type,
            shape.aggregate_id,
            shape.event_type,
            shape.event_version,
            shape.payload,
            shape.headers,
            shape.created_at,
        ]
        .into_iter()
        .flatten()
        {
            shape.uses[i] = shape.uses[i].saturating_add(1);
        }
        shape
    }

    fn row(&self, t: &TableConfig, mut values: Vec<pgoutput::Value>) -> RawRow {
        // Each value moves out of the decoded row, unless two keys map its
        // column: then each gets a copy.
        let mut text = |i: Option<usize>| {
            let i = i?;
            match values.get_mut(i) {
                Some(pgoutput::Value::Text(s)) if self.uses.get(i) == Some(&1) => {
                    Some(std::mem::take(s))
                }
                Some(pgoutput::Value::Text(s)) => Some(s.clone()),
                _ => None,
            }
        };
        let created_at = text(self.created_at).and_then(|s| parse_timestamp(&s));
        let sequence = match t.sequence {
            Some(_) => text(self.sequence).and_then(|s| s.parse::<i64>().ok()),
            None => created_at.map(|c| c.timestamp_micros()),
        };
        RawRow {
            id: text(self.id).unwrap_or_default(),
            sequence,
            aggregate_type: match &t.aggregate_type {
                Some(_) => text(self.aggregate_type),
                None => t.aggregate_type_value.clone(),
            },
            aggregate_id: text(self.aggregate_id),
            event_type: text(self.event_type),
            event_version: text(self.event_version),
            payload: text(self.payload),
            headers: text(self.headers),
            created_at,
            attempts: 0,
            payload_is_json: self.payload_is_json,
        }
    }
}

/// A logical message's envelope as an event (`sequence`: the message's
/// LSN), or the reason it cannot be one.
#[allow(clippy::result_large_err)]
fn envelope_event(content: &[u8], lsn: Lsn, at: DateTime<Utc>) -> Result<Event, Malformed> {
    let lsn_seq = lsn.as_u64() as i64;
    // Without a usable id the message's position names it.
    let unnamed = |reason: String| Malformed {
        id: format!("lsn-{}", lsn.to_pg_string()),
        sequence: lsn_seq,
        aggregate_type: String::new(),
        aggregate_id: String::new(),
        event_type: String::new(),
        reason,
        raw: None,
    };
    let env: Envelope = match serde_json::from_slice(content) {
        Ok(e) => e,
        Err(e) => {
            return Err(unnamed(format!(
                "logical message is not an outroute envelope: {e}"
            )));
        }
    };
    if env.id.trim().is_empty() {
        // Every event is known by its id (state row, `ce_id`): an empty
        // one would be taken for every other envelope without one.
        return Err(unnamed("the envelope's `id` is empty".into()));
    }
    RawRow {
        id: env.id,
        sequence: Some(lsn_seq),
        aggregate_type: Some(env.aggregate_type.unwrap_or_default()),
        aggregate_id: env.aggregate_id,
        event_type: env.event_type,
        event_version: env.event_version.map(|v| match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        }),
        payload: env.payload.map(|p| p.get().to_string()),
        headers: env.headers.map(|h| h.to_string()),
        created_at: Some(at),
        attempts: 0,
        // A `RawValue`: serde_json has just checked it.
        payload_is_json: true,
    }
    .validate()
}

/// Postgres micros since 2000-01-01 → UTC.
fn pg_time(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros + 946_684_800_000_000).unwrap_or_else(Utc::now)
}

/// The reader: owns the replication session, decodes what it brings into
/// [`Item`]s, and reports confirmed positions back to the server.
struct Reader {
    input: LogicalInput,
    prefix: String,
    table: TableConfig,
    /// The mapped table's oid, resolved at start: a relation is ours by it,
    /// never by a name another schema may share.
    table_oid: Option<u32>,
    relations: pgoutput::Relations,
    shapes: std::collections::HashMap<u32, RowShape>,
    /// Inside a transaction: its commit LSN, commit time.
    open: Option<(i64, DateTime<Utc>)>,
    budget: Budget,
}

impl Reader {
    async fn run(
        mut self,
        mut client: ReplicationClient,
        out: mpsc::Sender<Result<Item>>,
        mut confirmed: watch::Receiver<Lsn>,
    ) {
        loop {
            let ev = tokio::select! {
                ev = client.recv() => ev,
                changed = confirmed.changed() => {
                    if changed.is_err() { break; }
                    client.update_applied_lsn(*confirmed.borrow_and_update());
                    continue;
                }
            };
            let item = match ev {
                Ok(Some(ev)) => match self.decode(ev) {
                    Ok(Some(Item::Event(c, _))) => {
                        // Wait for room, passing confirmations on meanwhile.
                        let take = self.budget.take(c.bytes());
                        tokio::pin!(take);
                        let room = loop {
                            tokio::select! {
                                room = &mut take => break room,
                                changed = confirmed.changed() => {
                                    if changed.is_err() { break Err(anyhow!("the capture loop stopped")); }
                                    client.update_applied_lsn(*confirmed.borrow_and_update());
                                }
                            }
                        };
                        room.map(|room| Item::Event(c, Some(room)))
                    }
                    Ok(Some(item)) => Ok(item),
                    Ok(None) => continue,
                    Err(e) => Err(e),
                },
                Ok(None) => Err(anyhow!("the replication stream ended")),
                Err(e) => Err(anyhow!("replication stream: {e}")),
            };
            let stop = item.is_err();
            if out.send(item).await.is_err() || stop {
                break;
            }
        }
        client.stop();
        let _ = client.shutdown().await;
    }

    fn decode(&mut self, ev: ReplicationEvent) -> Result<Option<Item>> {
        Ok(match ev {
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            } => {
                self.open = Some((final_lsn.as_u64() as i64, pg_time(commit_time_micros)));
                None
            }
            ReplicationEvent::Commit {
                end_lsn,
                commit_time_micros,
                ..
            } => {
                self.open = None;
                Some(Item::Commit {
                    end: end_lsn,
                    at: pg_time(commit_time_micros),
                })
            }
            ReplicationEvent::KeepAlive { wal_end, .. } if self.open.is_none() => {
                Some(Item::Idle { at: wal_end })
            }
            ReplicationEvent::KeepAlive { .. } | ReplicationEvent::StoppedAt { .. } => None,
            ReplicationEvent::Message {
                transactional,
                lsn,
                prefix,
                content,
            } => {
                if self.input != LogicalInput::Messages || prefix != self.prefix {
                    return Ok(None);
                }
                let (commit_lsn, at) = match (transactional, self.open) {
                    (true, Some(o)) => o,
                    // Outside a transaction there is no commit to keep to:
                    // such a message is not part of any business change.
                    _ => {
                        tracing::warn!(lsn = %lsn.to_pg_string(), "ignoring a non-transactional outroute message: use pg_logical_emit_message(true, …)");
                        return Ok(None);
                    }
                };
                let row = envelope_event(&content, lsn, at);
                Some(Item::Event(Box::new(captured(row, commit_lsn, at)), None))
            }
            ReplicationEvent::XLogData { data, .. } => {
                if self.input != LogicalInput::Table {
                    return Ok(None);
                }
                match pgoutput::decode(&data).map_err(|e| anyhow!(e))? {
                    pgoutput::Change::Relation(oid, rel) => {
                        let t = &self.table;
                        let (schema, name) = match t.name.split_once('.') {
                            Some((s, n)) => (s.to_string(), n.to_string()),
                            None => ("public".to_string(), t.name.clone()),
                        };
                        let ours = match self.table_oid {
                            Some(table) => oid == table,
                            None => rel.name == name && rel.namespace == schema,
                        };
                        if ours {
                            let shape = RowShape::of(&rel, t);
                            if shape.id.is_none() || shape.payload.is_none() {
                                bail!(
                                    "table `{}` as published lacks the mapped id or payload column",
                                    t.name
                                );
                            }
                            self.shapes.insert(oid, shape);
                        }
                        self.relations.insert(oid, rel);
                        None
                    }
                    pgoutput::Change::Insert(oid, values) => {
                        let (Some(shape), Some((commit_lsn, at))) =
                            (self.shapes.get(&oid), self.open)
                        else {
                            return Ok(None);
                        };
                        let row = shape.row(&self.table, values).validate();
                        Some(Item::Event(Box::new(captured(row, commit_lsn, at)), None))
                    }
                    pgoutput::Change::Other(_) => None,
                }
            }
        })
    }
}

fn captured(row: Result<Event, Malformed>, commit_lsn: i64, at: DateTime<Utc>) -> Claim {
    Claim {
        lane: CAPTURE_LANE,
        tid: None,
        has_state: false,
        held: Vec::new(),
        done_legs: Vec::new(),
        epoch: None,
        captured: Some(Captured {
            commit_lsn,
            parked: false,
            committed_at: Some(at),
        }),
        route: None,
        row,
    }
}

/// The aggregate of a claim (also of a malformed row, as far as known).
fn aggregate_of(c: &Claim) -> (String, String) {
    let (t, id) = aggregate_key(c);
    (t.to_string(), id.to_string())
}

/// [`aggregate_of`], borrowed.
fn aggregate_key(c: &Claim) -> (&str, &str) {
    match &c.row {
        Ok(e) => (&e.aggregate_type, &e.aggregate_id),
        Err(m) => (&m.aggregate_type, &m.aggregate_id),
    }
}

/// A hash of the aggregate, fixed for the process: the dispatcher and every
/// worker agree on it. (A `(String, String)` hashes as its two `str`s.)
fn aggregate_hash<A: std::hash::Hash>(aggregate: &A) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0).hash_one(aggregate)
}

/// Work for the cleaner: the rows to delete and the slot position to
/// confirm after.
struct CleanupJob {
    rows: CapturedRows,
    confirm: Option<Lsn>,
}

/// Take the marks up to `all` off the queue: their events' rows and the
/// last one's position.
fn confirmable(
    marks: &mut std::collections::VecDeque<(u64, Lsn, CapturedRows)>,
    all: u64,
) -> CleanupJob {
    let mut rows = CapturedRows::default();
    let mut confirm = None;
    while marks.front().is_some_and(|(n, _, _)| *n <= all) {
        if let Some((_, lsn, r)) = marks.pop_front() {
            rows.append(r);
            confirm = Some(lsn);
        }
    }
    CleanupJob { rows, confirm }
}

/// What the dispatcher hands a partition worker, in stream order.
enum Feed {
    Event(Box<Claim>, Option<Room>),
    /// Mark `n`: every event before it has been handed out. Reported back
    /// once this worker handled everything it got before it. With the
    /// commit time of the transaction it ends, if it ends one.
    Mark(u64, Option<DateTime<Utc>>),
}

/// Which aggregates a partition worker owns.
#[derive(Clone, Copy)]
struct Partition {
    index: usize,
    of: usize,
}

impl Partition {
    /// The partition of an aggregate (a hash fixed for the process: every
    /// worker and the dispatcher agree).
    fn of_aggregate<A: std::hash::Hash>(aggregate: &A, of: usize) -> usize {
        (aggregate_hash(aggregate) % of.max(1) as u64) as usize
    }

    fn own(&self, all: HeldAggregates) -> HeldAggregates {
        all.into_iter()
            .filter(|(a, _)| Self::of_aggregate(a, self.of) == self.index)
            .collect()
    }
}

/// Batches a partition worker has out at once (see [`Relay::partition`]).
const BATCHES_IN_FLIGHT: usize = 2;

/// A partition worker's state between batches.
struct Worker {
    part: Partition,
    /// Aggregates with a parked queue, and the routes it holds: their
    /// stream events wait behind it on those routes.
    held: HeldAggregates,
    outage_backoff: Duration,
    /// Batches handed on, oldest first.
    out: std::collections::VecDeque<Out>,
    reached: mpsc::UnboundedSender<(usize, u64)>,
}

/// What `hand_on` returns, and the backoff it left.
type HandedOn = (
    Result<Option<(BatchReport, Vec<(String, String)>)>>,
    Duration,
);

/// Wait for the oldest batch out to end and take its outcome (`None`: it
/// carries only a mark). Cancel-safe: nothing is taken until the task ended.
async fn oldest(out: &mut std::collections::VecDeque<Out>) -> Option<HandedOn> {
    let task = out.front_mut()?.task.as_mut()?;
    let ended = (&mut task.0).await;
    if let Some(o) = out.front_mut() {
        o.task = None;
    }
    Some(ended.unwrap_or_else(|e| {
        (
            Err(anyhow!("a capture batch stopped: {e}")),
            Duration::from_millis(100),
        )
    }))
}

/// A batch handed on (or only a mark, queued behind the batches out).
struct Out {
    task: Option<AbortOnDrop<HandedOn>>,
    /// It holds `relay.batch_size` events (a backlog is being drained).
    full: bool,
    /// Hashes of its aggregates (see [`aggregate_hash`]).
    aggregates: Vec<u64>,
    mark: Option<u64>,
    last_commit: Option<DateTime<Utc>>,
}

/// One partition's batch: events in stream order and the last mark seen.
#[derive(Default)]
struct Batch {
    claims: Vec<Claim>,
    /// The last mark received with (after) these events.
    mark: Option<u64>,
    /// Commit time of the last transaction ended in the batch.
    last_commit: Option<DateTime<Utc>>,
    /// Its events' share of the capture [`Budget`], given back when the
    /// batch ends.
    room: Option<Room>,
}

impl Relay {
    /// A logical source: wait for the capture lease, stream while holding
    /// it, go back to waiting when it is lost. Runs until `shutdown`.
    pub(crate) async fn run_capture(
        self: Arc<Self>,
        mut leases: watch::Receiver<LeaseView>,
        shutdown: CancellationToken,
    ) {
        let Some(pg) = self.store.logical() else {
            tracing::error!("capture = \"logical\" on a store without a slot");
            return;
        };
        let mut standby_logged = false;
        while !shutdown.is_cancelled() {
            let view = leases.borrow_and_update().clone();
            let held = Instant::now() < view.valid_until && view.lanes.contains(&CAPTURE_LANE);
            if !held {
                if !standby_logged {
                    tracing::info!(
                        "standby: waiting for the capture lease (another relay streams from the slot)"
                    );
                    standby_logged = true;
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = leases.changed() => {},
                    _ = tokio::time::sleep(self.config.lease_ttl / 3) => {},
                }
                continue;
            }
            standby_logged = false;
            let span = tracing::info_span!("capture");
            match self
                .clone()
                .stream(pg, &view, leases.clone(), &shutdown)
                .instrument(span)
                .await
            {
                Ok(()) => {}
                Err(e) => {
                    self.health.store_failed(&e);
                    tracing::warn!(
                        "capture stopped, resuming from the slot's confirmed position: {e:#}"
                    );
                    sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                }
            }
        }
    }

    /// Stream from the slot while the capture lease of `view` holds.
    ///
    /// The reader decodes the stream; this dispatcher hands each event to
    /// one of `relay.concurrency` partition workers by its aggregate (so an
    /// aggregate is only ever in one worker, which handles its events in
    /// order), and every transaction end to all of them as a numbered mark.
    /// A mark is confirmed to the slot once every worker reported it: all
    /// events before it are handled by then, whichever worker had them.
    async fn stream(
        self: Arc<Self>,
        pg: &PgStore,
        view: &LeaseView,
        leases: watch::Receiver<LeaseView>,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        let Some(logical) = self.capture.clone() else {
            bail!("not a logical source");
        };
        // A promotion may have taken the slot (before PostgreSQL 17): say
        // what may have been missed; re-create it and re-read the table
        // where the pending rows are exactly what may have been missed.
        match pg.check_slot().await? {
            SlotCheck::Present => {}
            c if pg.recovers_from(&c) => {
                tracing::warn!("{}", pg.slot_gone(&c));
                for line in pg.setup_capture().await? {
                    tracing::warn!("{line}");
                }
            }
            c => bail!("{}", pg.slot_gone(&c)),
        }
        if logical.input == LogicalInput::Table {
            let adopted = pg
                .bounded(
                    "taking over events that failed in lease mode",
                    pg.adopt_lease_failures(),
                )
                .await?;
            if adopted > 0 {
                tracing::info!(
                    adopted,
                    "events that failed in lease mode are parked: their aggregates wait behind them \
                     and `outroute failed retry` retries them"
                );
            }
            let epoch = view.epoch_of(CAPTURE_LANE).unwrap_or(-1);
            let guard = LeaseGuard::new(leases.clone(), view, vec![CAPTURE_LANE]);
            if !self.backfill(pg, guard, epoch, shutdown).await? {
                return Ok(());
            }
        }
        let client = self.connect_slot(pg, &logical).await?;
        tracing::info!(slot = %logical.slot, "streaming from the replication slot");
        metrics::counter!(m::LEASE_HANDOVERS, "source" => self.source.clone()).increment(1);
        let batch = self.config.batch_size as usize;
        let (tx, mut rx) = mpsc::channel::<Result<Item>>(4 * batch);
        let (confirm_tx, confirm_rx) = watch::channel(Lsn(0));
        let table_oid = match logical.input {
            LogicalInput::Table => pg.table_oid().await?,
            LogicalInput::Messages => None,
        };
        let reader = Reader {
            input: logical.input,
            prefix: logical.message_prefix.clone(),
            table: self.store_table.clone(),
            table_oid,
            relations: pgoutput::Relations::default(),
            shapes: Default::default(),
            open: None,
            budget: Budget::of(&self.config),
        };
        let reader = tokio::spawn(reader.run(client, tx, confirm_rx).in_current_span());
        let _stop_reader = AbortOnDrop(reader);

        let k = self.config.concurrency.max(1) as usize;
        let (reached_tx, mut reached_rx) = mpsc::unbounded_channel::<(usize, u64)>();
        let stop = shutdown.child_token();
        let _stop_workers = stop.clone().drop_guard();
        let mut feeds = Vec::with_capacity(k);
        let mut workers = tokio::task::JoinSet::new();
        for w in 0..k {
            let (feed_tx, feed_rx) = mpsc::channel::<Feed>(4 * batch);
            feeds.push(feed_tx);
            let worker = self.clone().partition(
                Partition { index: w, of: k },
                feed_rx,
                reached_tx.clone(),
                LeaseGuard::new(leases.clone(), view, vec![CAPTURE_LANE]),
                stop.clone(),
            );
            workers.spawn(worker.in_current_span());
        }
        // The cleaner deletes the rows before each confirmed mark (one
        // statement per mark), then confirms the slot up to it.
        let (cleaner, cleanups) = mpsc::channel::<CleanupJob>(4);
        let cleaner_task = tokio::spawn(
            self.clone()
                .clean(
                    cleanups,
                    confirm_tx,
                    LeaseGuard::new(leases.clone(), view, vec![CAPTURE_LANE]),
                )
                .in_current_span(),
        );
        let _stop_cleaner = AbortOnDrop(cleaner_task);
        // Marks not yet confirmed (number, position, the sequence numbers of
        // the events handed out before it), and how far each worker got.
        let mut marks: std::collections::VecDeque<(u64, Lsn, CapturedRows)> = Default::default();
        let mut since_mark = CapturedRows::default();
        let by_id = pg.deletes_by_id();
        let mut next_mark = 0u64;
        let mut reached: Vec<Option<u64>> = vec![None; k];
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    // Graceful: the workers finish their in-flight batches,
                    // then what they reported is confirmed.
                    stop.cancel();
                    while workers.join_next().await.is_some() {}
                    while let Ok((w, mark)) = reached_rx.try_recv() {
                        reached[w] = Some(reached[w].map_or(mark, |r| r.max(mark)));
                    }
                    if let Some(all) = reached.iter().copied().min().flatten() {
                        let _ = cleaner.send(confirmable(&mut marks, all)).await;
                    }
                    drop(cleaner);
                    // Let the cleaner finish and the reader pass the position on.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    return Ok(());
                }
                ended = workers.join_next() => {
                    return match ended {
                        Some(Ok(Ok(()))) | None => Ok(()),
                        Some(Ok(Err(e))) => Err(e),
                        Some(Err(e)) => Err(anyhow!("a capture worker stopped: {e}")),
                    };
                }
                Some((w, mark)) = reached_rx.recv() => {
                    reached[w] = Some(reached[w].map_or(mark, |r| r.max(mark)));
                    let Some(all) = reached.iter().copied().min().flatten() else { continue };
                    if marks.front().is_some_and(|(n, _, _)| *n <= all)
                        && cleaner.send(confirmable(&mut marks, all)).await.is_err()
                    {
                        bail!("the cleanup task stopped; resuming from the confirmed position");
                    }
                }
                item = rx.recv() => {
                    let item = match item {
                        None => bail!("the replication reader stopped"),
                        Some(Err(e)) => return Err(e),
                        Some(Ok(item)) => item,
                    };
                    let (lsn, at) = match item {
                        Item::Event(c, room) => {
                            match &c.row {
                                Ok(e) => since_mark.push(e.sequence, by_id.then_some(e.id.as_str())),
                                Err(m) if m.sequence > 0 => {
                                    since_mark.push(m.sequence, by_id.then_some(m.id.as_str()))
                                }
                                Err(_) => {}
                            }
                            let w = Partition::of_aggregate(&aggregate_key(&c), k);
                            // A worker that ended: join_next says why.
                            let _ = feeds[w].send(Feed::Event(c, room)).await;
                            continue;
                        }
                        Item::Commit { end, at } => (end, Some(at)),
                        Item::Idle { at } => (at, None),
                    };
                    marks.push_back((next_mark, lsn, std::mem::take(&mut since_mark)));
                    for f in &feeds {
                        let _ = f.send(Feed::Mark(next_mark, at)).await;
                    }
                    next_mark += 1;
                }
            }
        }
    }

    /// Publish the rows written before the slot existed (recorded by
    /// `outroute migrate` when it created the slot) from the table, batch
    /// after batch in order, before the stream starts: the stream will never
    /// bring them. Handled like streamed events (an aggregate with a parked
    /// queue parks them behind it; failures park), then their rows are
    /// cleaned up and the progress recorded, fenced by the capture lease.
    /// A crash re-publishes at most the batch in flight. False: stopped
    /// (shutdown or lease lost) before the end.
    async fn backfill(
        &self,
        pg: &PgStore,
        mut lease: LeaseGuard,
        epoch: i64,
        stop: &CancellationToken,
    ) -> Result<bool> {
        let mut outage_backoff = Duration::from_millis(100);
        let mut published = 0usize;
        let mut announced = false;
        loop {
            if stop.is_cancelled() || !lease.held() {
                return Ok(false);
            }
            let Some(claims) = pg
                .bounded(
                    "reading the backfill",
                    pg.backfill_batch(self.config.batch_size),
                )
                .await?
            else {
                return Ok(true);
            };
            let Some(last) = claims.last().map(|c| (c.sequence(), c.id().to_string())) else {
                if !pg
                    .bounded(
                        "recording backfill progress",
                        pg.backfill_progress(None, epoch),
                    )
                    .await?
                {
                    return Ok(false);
                }
                tracing::info!(
                    published,
                    "published the rows written before the slot; streaming"
                );
                return Ok(true);
            };
            if !announced {
                tracing::info!(
                    "publishing the rows written before the slot existed, from the table"
                );
                announced = true;
            }
            let by_id = pg.deletes_by_id();
            let mut rows = CapturedRows::default();
            for c in &claims {
                rows.push(c.sequence(), by_id.then_some(c.id()));
            }
            let held = pg
                .bounded("reading held aggregates", pg.held_aggregates())
                .await?;
            let Some((report, _)) = self
                .hand_on(claims, &held, &mut lease, stop, &mut outage_backoff)
                .await?
            else {
                return Ok(false);
            };
            published += report.published;
            failpoint::hit("mid-mark");
            pg.delete_captured(&rows).await?;
            if !pg
                .bounded(
                    "recording backfill progress",
                    pg.backfill_progress(Some((last.0, &last.1)), epoch),
                )
                .await?
            {
                return Ok(false);
            }
        }
    }

    /// Hand a batch of captured events on: those of an aggregate in `held`
    /// join its parked queue untouched; the rest go through `process`, again
    /// and again with backoff while every publish fails (the slot is not
    /// confirmed meanwhile). Returns the report and the aggregates whose
    /// events joined a queue; `None` when stopped, or the lease lost,
    /// during an outage.
    async fn hand_on(
        &self,
        mut claims: Vec<Claim>,
        held: &HeldAggregates,
        lease: &mut LeaseGuard,
        stop: &CancellationToken,
        backoff: &mut Duration,
    ) -> Result<Option<(BatchReport, Vec<(String, String)>)>> {
        lease.stamp(&mut claims);
        // (The usual case, nothing parked, needs no per-event lookup.)
        // An aggregate held on every route joins its queue untouched; one
        // held on some routes goes on the others (`Claim::held`), and what
        // its held routes did not take is parked by `process`.
        let (queue, mut go): (Vec<Claim>, Vec<Claim>) = if held.is_empty() {
            (Vec::new(), claims)
        } else {
            let mut claims = claims;
            for c in claims.iter_mut() {
                if let Some(routes) = held.get(&aggregate_of(c)) {
                    c.held.clone_from(routes);
                }
            }
            claims
                .into_iter()
                .partition(|c| c.held.iter().any(|r| r == "*"))
        };
        let report = loop {
            let mut report = self.process(go, Some(&mut *lease)).await?;
            if !report.outage {
                break report;
            }
            go = std::mem::take(&mut report.unsent);
            tracing::warn!(backoff = ?*backoff, reason = report.outage_reason.as_deref().unwrap_or(""), "every publish failed; backing off (the slot is not confirmed)");
            sleep_or_cancel(crate::backoff::jitter(*backoff), stop).await;
            *backoff = (*backoff * 2).min(Duration::from_secs(10));
            if stop.is_cancelled() || !lease.held() {
                return Ok(None);
            }
        };
        *backoff = Duration::from_millis(100);
        let waiting: Vec<Failure> = queue.iter().map(|c| self.waiting(c)).collect();
        if !waiting.is_empty() {
            let n = self.store.record_failures(&waiting).await?;
            if (n as usize) < waiting.len() {
                bail!("capture lease lost while parking events; not confirming");
            }
        }
        Ok(Some((report, queue.iter().map(aggregate_of).collect())))
    }

    /// One partition worker: its aggregates' parked queues and stream
    /// events, batch after batch, in order. Returns `Ok` when the lease or
    /// the stream ends, `Err` when the stream must restart.
    ///
    /// Up to [`BATCHES_IN_FLIGHT`] batches are out at once: while one that
    /// is not full waits for its acknowledgements the next is collected and
    /// handed on, so an event that arrives meanwhile is not held up by it. A batch never
    /// holds an aggregate that one still out holds (collecting stops at the
    /// first such event), so each aggregate's events still go one batch
    /// after the other, in stream order; batches finish, and report their
    /// marks, in the order they started.
    async fn partition(
        self: Arc<Self>,
        part: Partition,
        mut feed: mpsc::Receiver<Feed>,
        reached: mpsc::UnboundedSender<(usize, u64)>,
        mut lease: LeaseGuard,
        stop: CancellationToken,
    ) -> Result<()> {
        let Some(pg) = self.store.logical() else {
            bail!("not a logical source");
        };
        // This partition's parked queues as the database has them: every
        // relay that owned the slot before wrote its parked events there.
        let mut w = Worker {
            held: part.own(
                pg.bounded("reading held aggregates", pg.held_aggregates())
                    .await?,
            ),
            outage_backoff: Duration::from_millis(100),
            out: Default::default(),
            part,
            reached,
        };
        // The next item of the feed, when collecting stopped before it.
        let mut carry: Option<Feed> = None;
        let mut last_parked = Instant::now() - PARKED_EVERY;
        // The last round moved events: the next comes at once (a long queue
        // drains at batch speed), otherwise every PARKED_EVERY.
        let mut parked_moving = false;
        // The parked queues' time came while batches were out.
        let mut parked_due = false;
        while !stop.is_cancelled() {
            if !lease.held() {
                tracing::warn!("capture lease lost: stopping the stream (a standby takes over)");
                return Ok(());
            }
            // Operators' `failed retry|discard` and earlier owners' records
            // reach this partition's view of the parked queues.
            if last_parked.elapsed() >= PARKED_EVERY {
                w.held = part.own(
                    pg.bounded("reading held aggregates", pg.held_aggregates())
                        .await?,
                );
                last_parked = Instant::now();
                parked_due |= !w.held.is_empty();
            }
            // Parked events whose turn came, before the stream's later ones;
            // with no batch out, so a queue released here goes before its
            // aggregate's later events.
            if parked_due || parked_moving {
                if !w.out.is_empty() {
                    if !self.finish_oldest(pg, &mut w).await? {
                        return Ok(());
                    }
                    continue;
                }
                parked_due = false;
                let moved = if w.held.is_empty() {
                    0
                } else {
                    self.retry_parked(pg, &w.held, &mut lease).await?
                };
                parked_moving = moved > 0;
                if parked_moving {
                    w.held = part.own(
                        pg.bounded("reading held aggregates", pg.held_aggregates())
                            .await?,
                    );
                }
            }
            let wait = if parked_moving {
                Duration::ZERO
            } else {
                PARKED_EVERY
            };
            // Collect the next batch unless enough are out, or the next
            // event is of an aggregate a batch still out holds.
            // A full batch out means a backlog: a second one would not
            // shorten anyone's wait (measured: it cost the drain ~10 %), so
            // the pipeline is for arrivals at a steady rate.
            let busy: HashSet<u64> = w
                .out
                .iter()
                .flat_map(|b| b.aggregates.iter().copied())
                .collect();
            let blocked = w.out.len() >= BATCHES_IN_FLIGHT
                || w.out.back().is_some_and(|b| b.full)
                || matches!(&carry, Some(Feed::Event(c, _))
                    if busy.contains(&aggregate_hash(&aggregate_key(c))));
            if blocked {
                if !self.finish_oldest(pg, &mut w).await? {
                    return Ok(());
                }
                continue;
            }
            // Both branches are cancel-safe: waiting for a task, or for the
            // feed's first item.
            let batch = tokio::select! {
                biased;
                done = oldest(&mut w.out), if !w.out.is_empty() => {
                    if !self.take_in(pg, &mut w, done).await? {
                        return Ok(());
                    }
                    continue;
                }
                batch = self.collect(&mut feed, &mut carry, &busy, wait, &stop) => batch?,
            };
            if batch.claims.is_empty() {
                if let Some(mark) = batch.mark {
                    // It comes after every event of the batches out: the
                    // youngest reports it when it ends (a slot of its own
                    // would keep the next batch from going out).
                    match w.out.back_mut() {
                        Some(last) => {
                            last.mark = Some(mark);
                            if batch.last_commit.is_some() {
                                last.last_commit = batch.last_commit;
                            }
                        }
                        None => {
                            w.out.push_back(Out {
                                task: None,
                                full: false,
                                aggregates: Vec::new(),
                                mark: Some(mark),
                                last_commit: batch.last_commit,
                            });
                            self.finish_oldest(pg, &mut w).await?;
                        }
                    }
                }
                continue;
            }
            failpoint::hit("after-claim");
            let now = Utc::now();
            let pickup = metrics::histogram!(m::PICKUP, "source" => self.source.clone());
            for at in batch.claims.iter().filter_map(Claim::committed_at) {
                pickup.record(crate::relay::seconds_since(at, now));
            }
            let aggregates = batch
                .claims
                .iter()
                .map(|c| aggregate_hash(&aggregate_key(c)))
                .collect();
            let (me, held, mut guard, stop) =
                (self.clone(), w.held.clone(), lease.clone(), stop.clone());
            let mut backoff = w.outage_backoff;
            let (claims, room) = (batch.claims, batch.room);
            let full = claims.len() >= self.config.batch_size as usize;
            let task = tokio::spawn(
                async move {
                    let r = me
                        .hand_on(claims, &held, &mut guard, &stop, &mut backoff)
                        .await;
                    drop(room);
                    (r, backoff)
                }
                .in_current_span(),
            );
            w.out.push_back(Out {
                task: Some(AbortOnDrop(task)),
                full,
                aggregates,
                mark: batch.mark,
                last_commit: batch.last_commit,
            });
        }
        // Graceful stop: the batches out finish and report their marks; once
        // one stopped short, the younger ones still finish sending (their
        // marks are not reported: the next reader starts before them).
        let mut reporting = true;
        while !w.out.is_empty() {
            if reporting {
                reporting = self.finish_oldest(pg, &mut w).await?;
            } else {
                let _ = oldest(&mut w.out).await;
                w.out.pop_front();
            }
        }
        Ok(())
    }

    /// Wait for the oldest batch out and take in what became of it. False:
    /// it stopped without finishing (shutdown or lease lost).
    async fn finish_oldest(&self, pg: &PgStore, w: &mut Worker) -> Result<bool> {
        let done = oldest(&mut w.out).await;
        self.take_in(pg, w, done).await
    }

    /// Take in what became of the oldest batch out (`done`, from
    /// [`oldest`]): the parked queues it added to, then its mark.
    async fn take_in(&self, pg: &PgStore, w: &mut Worker, done: Option<HandedOn>) -> Result<bool> {
        if let Some((r, backoff)) = done {
            w.outage_backoff = backoff;
            let Some((report, queued)) = r? else {
                return Ok(false);
            };
            if report.failed + report.retried + report.held + report.deferred > 0 {
                w.held = w.part.own(
                    pg.bounded("reading held aggregates", pg.held_aggregates())
                        .await?,
                );
            }
            for aggregate in queued {
                w.held.insert(aggregate, vec!["*".to_string()]);
            }
        }
        let Some(out) = w.out.pop_front() else {
            return Ok(true);
        };
        // Handled (published or parked): the marks before these events
        // may be confirmed (and their rows deleted) once every worker got
        // there.
        if let Some(mark) = out.mark {
            let _ = w.reached.send((w.part.index, mark));
        }
        if let Some(at) = out.last_commit {
            metrics::gauge!(m::SLOT_LAG_SECONDS, "source" => self.source.clone())
                .set(((Utc::now() - at).num_milliseconds().max(0) as f64) / 1e3);
        }
        self.health.set_store_ok();
        Ok(true)
    }

    /// The cleaner: per confirmable mark, in stream order, delete the rows
    /// of the events before it, then confirm the slot up to it. It stops (and
    /// so the stream restarts from the confirmed position) on a failed
    /// delete or a lost lease.
    async fn clean(
        self: Arc<Self>,
        mut work: mpsc::Receiver<CleanupJob>,
        confirm: watch::Sender<Lsn>,
        mut lease: LeaseGuard,
    ) {
        let Some(pg) = self.store.logical() else {
            return;
        };
        let table = self
            .capture
            .as_ref()
            .is_some_and(|l| l.input == LogicalInput::Table);
        let mut noted: Option<Instant> = None;
        while let Some(job) = work.recv().await {
            if table && !job.rows.is_empty() {
                match pg.delete_captured(&job.rows).await {
                    Ok(n) if n > 0 => {
                        metrics::counter!(m::PURGED, "source" => self.source.clone()).increment(n)
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!("deleting captured rows failed: {e:#}");
                        return;
                    }
                }
            }
            failpoint::hit("mid-mark");
            if !lease.held() {
                tracing::warn!(
                    "capture lease lost before confirming; the next owner re-reads from the confirmed position"
                );
                return;
            }
            if let Some(to) = job.confirm {
                let _ = confirm.send(to);
                // Now and then on record: after a promotion it says where
                // what may have been missed begins.
                if noted.is_none_or(|at| at.elapsed() >= CONFIRMED_NOTE_INTERVAL) {
                    if let Err(e) = pg.note_confirmed(&to.to_string()).await {
                        tracing::debug!("recording the confirmed position: {e:#}");
                    }
                    noted = Some(Instant::now());
                }
            }
        }
    }

    /// Connect to the slot, ending a previous owner's session that still
    /// holds it (this relay has the lease, so that owner is fenced).
    async fn connect_slot(&self, pg: &PgStore, l: &Logical) -> Result<ReplicationClient> {
        let cfg = replication_config(&self.store_key, &self.store_config, l, &self.relay_id)?;
        let mut last = None;
        for attempt in 0..20 {
            let mut client = ReplicationClient::connect(cfg.clone()).await.map_err(|e| {
                anyhow!(
                    "{}.logical.slot `{}`: connecting: {e}",
                    self.store_key,
                    l.slot
                )
            })?;
            match client.wait_started().await {
                Ok(()) => return Ok(client),
                Err(e) => {
                    let text = e.to_string();
                    if text.contains("is active for PID") || text.contains("55006") {
                        if attempt == 0 || attempt % 5 == 4 {
                            tracing::info!(slot = %l.slot, "the slot is still held by a previous owner's session: ending it");
                        }
                        let _ = pg
                            .bounded("taking over the slot", pg.take_over_slot())
                            .await;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        last = Some(text);
                        continue;
                    }
                    return Err(anyhow!(
                        "{}.logical.slot `{}`: starting replication: {text}",
                        self.store_key,
                        l.slot
                    ));
                }
            }
        }
        Err(anyhow!(
            "{}.logical.slot `{}`: still held by another session: {}",
            self.store_key,
            l.slot,
            last.unwrap_or_default()
        ))
    }

    /// Gather a batch from a partition's feed: wait up to `wait` for the
    /// first item, then take what is already there, up to
    /// `relay.batch_size` events or `relay.max_batch_bytes` of payload
    /// (the event that reaches it is the batch's last). Stops before an event whose aggregate is
    /// in `busy` (a batch still out holds it), leaving it in `carry`, where
    /// the next call starts.
    async fn collect(
        &self,
        feed: &mut mpsc::Receiver<Feed>,
        carry: &mut Option<Feed>,
        busy: &HashSet<u64>,
        wait: Duration,
        stop: &CancellationToken,
    ) -> Result<Batch> {
        let mut batch = Batch::default();
        let mut bytes = 0u64;
        let mut next = match carry.take() {
            Some(item) => Some(item),
            None => tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(batch),
                item = feed.recv() => item,
                _ = tokio::time::sleep(wait) => return Ok(batch),
            },
        };
        loop {
            match next {
                None => bail!("the stream dispatcher stopped"),
                Some(Feed::Event(c, room)) => {
                    if !busy.is_empty() && busy.contains(&aggregate_hash(&aggregate_key(&c))) {
                        *carry = Some(Feed::Event(c, room));
                        break;
                    }
                    bytes += c.bytes();
                    batch.claims.push(*c);
                    match (&mut batch.room, room) {
                        (Some(all), Some(room)) => all.merge(room),
                        (all, room) => *all = all.take().or(room),
                    }
                }
                Some(Feed::Mark(n, at)) => {
                    batch.mark = Some(n);
                    if at.is_some() {
                        batch.last_commit = at;
                    }
                }
            }
            if batch.claims.len() >= self.config.batch_size as usize
                || bytes >= self.config.max_batch_bytes
            {
                break;
            }
            match feed.try_recv() {
                Ok(item) => next = Some(item),
                Err(_) => break,
            }
        }
        Ok(batch)
    }

    /// Publish the parked events whose turn came: the due head of each
    /// aggregate's queue and the due events behind it, in order. Returns how
    /// many left the queue.
    pub(crate) async fn retry_parked(
        &self,
        pg: &PgStore,
        aggregates: &HeldAggregates,
        lease: &mut LeaseGuard,
    ) -> Result<u64> {
        let mut claims = pg
            .bounded(
                "reading parked events",
                pg.parked_heads(aggregates, self.config.batch_size),
            )
            .await?;
        if claims.is_empty() {
            return Ok(0);
        }
        lease.stamp(&mut claims);
        let n = claims.len();
        let report = self.process(claims, Some(lease)).await?;
        tracing::debug!(
            events = n,
            published = report.published,
            "parked events retried"
        );
        Ok(report.published as u64)
    }

    /// The record of a captured event that waits behind an earlier event of
    /// its aggregate: parked with its attempts unchanged.
    pub(crate) fn waiting(&self, claim: &Claim) -> Failure {
        let attempts = crate::pipeline::attempts_so_far(claim);
        self.record(
            claim,
            None,
            attempts,
            "waiting behind an earlier event of its aggregate".into(),
            FailureKind::Retry {
                delay: Duration::ZERO,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aggregate_lands_in_one_partition_whether_owned_or_borrowed() {
        // The dispatcher hashes borrowed keys, `Partition::own` the parked
        // queues' owned ones: both must pick the same worker.
        for (t, id) in [("order", "o-1"), ("", ""), ("a", "bc"), ("ab", "c")] {
            let owned = (t.to_string(), id.to_string());
            assert_eq!(aggregate_hash(&owned), aggregate_hash(&(t, id)));
            assert_eq!(
                Partition::of_aggregate(&owned, 7),
                Partition::of_aggregate(&(t, id), 7)
            );
        }
        // ("a", "bc") and ("ab", "c") are different aggregates.
        assert_ne!(aggregate_hash(&("a", "bc")), aggregate_hash(&("ab", "c")));
    }

    #[test]
    fn timestamps_in_iso_text() {
        let t = parse_timestamp("2026-12-01 19:56:00.123456+00").unwrap();
        assert_eq!(t.timestamp_micros() % 1_000_000, 123_456);
        let z = parse_timestamp("2026-12-01 21:56:00+02").unwrap();
        assert_eq!(z, parse_timestamp("2026-12-01 19:56:00+00").unwrap());
        assert!(parse_timestamp("2026-12-01 19:56:00").is_some());
        assert!(parse_timestamp("yesterday").is_none());
    }

    #[test]
    fn a_column_two_keys_map_reaches_both() {
        // `t_outbox`-like: the aggregate id doubles as the event id here.
        let mut t = TableConfig::canonical();
        t.id = "aggregate_id".into();
        t.sequence = None;
        t.event_version = None;
        t.headers = None;
        let cols = [
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "payload",
            "created_at",
        ];
        let rel = pgoutput::Relation {
            namespace: "public".into(),
            name: "outbox".into(),
            columns: cols.iter().map(|c| c.to_string()).collect(),
            types: vec![25, 25, 25, 3802, 1184],
        };
        let shape = RowShape::of(&rel, &t);
        let text = |s: &str| pgoutput::Value::Text(s.into());
        let values = vec![
            text("order"),
            text("o-1"),
            text("order-paid"),
            text(r#"{"total":1}"#),
            text("2026-12-01 19:56:00.5+00"),
        ];
        let e = shape.row(&t, values).validate().unwrap();
        assert_eq!((e.id.as_str(), e.aggregate_id.as_str()), ("o-1", "o-1"));
        assert_eq!(
            (e.aggregate_type.as_str(), e.event_type.as_str()),
            ("order", "order-paid")
        );
        assert_eq!(e.payload, br#"{"total":1}"#.to_vec());
        // Without a sequence column the commit-time order stands in.
        assert_eq!(e.sequence, e.created_at.timestamp_micros());
    }

    #[test]
    fn envelopes_become_rows_or_reasons() {
        let at = Utc::now();
        let ok = envelope_event(
            br#"{"id":"e1","aggregate_type":"order","aggregate_id":"42","event_type":"order-paid","payload":{"total": 10},"headers":{"traceparent":"00-x"}}"#,
            Lsn(100),
            at,
        )
        .unwrap();
        assert_eq!(ok.id, "e1");
        assert_eq!(ok.sequence, 100);
        assert_eq!(ok.payload, br#"{"total": 10}"#.to_vec());
        assert_eq!(ok.traceparent(), Some("00-x"));
        let bad = envelope_event(b"{not json", Lsn(200), at).unwrap_err();
        assert!(
            bad.reason.contains("not an outroute envelope"),
            "{}",
            bad.reason
        );
        let no_payload = envelope_event(
            br#"{"id":"e2","aggregate_id":"1","event_type":"x"}"#,
            Lsn(300),
            at,
        )
        .unwrap_err();
        assert_eq!(no_payload.reason, "payload is NULL");
        let no_id = envelope_event(
            br#"{"id":" ","aggregate_id":"1","event_type":"x","payload":{}}"#,
            Lsn(400),
            at,
        )
        .unwrap_err();
        assert_eq!(no_id.reason, "the envelope's `id` is empty");
        assert_eq!(no_id.id, format!("lsn-{}", Lsn(400).to_pg_string()));
    }
}
