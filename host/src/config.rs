//! Configuration: one TOML file, with `OUTROUTE_`-prefixed environment
//! variables overriding any key (`OUTROUTE_STORE__URL` sets `store.url`), so
//! secrets and per-deployment values stay out of the file.
//!
//! Loading never half-works: [`load`] parses, then [`Config::validate`]
//! checks every cross-reference (routes → plugins and sinks, allow-lists,
//! column names, budgets). Every problem is reported as `file:key: reason`
//! and the relay refuses to start. `outroute config schema` prints the JSON
//! Schema derived from these structs.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod diff;
mod reference;
mod security;
mod teams;
mod validate;
pub use diff::{Changes, Diff, diff};
pub use reference::reference_markdown;
pub use security::{
    KafkaSaslConfig, NatsAuthConfig, PgTlsConfig, PgTlsMode, SaslMechanism, Secret, TlsConfig,
};
pub use teams::Grant;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// How the relay runs: batching, concurrency, leases, wake-up.
    #[serde(default)]
    pub relay: RelayConfig,
    /// Where the outbox lives: the one-source shorthand for
    /// `[sources.default]`. Use either `[store]` or `[sources.<name>]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<StoreConfig>,
    /// The outboxes this relay serves, by name: each its own database
    /// connection pool, table mapping, lanes and leases, and its own workers
    /// (one source's backlog never holds up another's events). Routes name
    /// the sources they read (`routes[].sources`; unset: every source).
    #[serde(default)]
    pub sources: BTreeMap<String, StoreConfig>,
    /// Set when the sources came from the `[store]` shorthand (error keys
    /// then say `store.…`).
    #[serde(skip)]
    #[schemars(skip)]
    pub store_shorthand: bool,
    /// Team files (plugins and routes of one team each), relative to this
    /// file; wildcards in the file name (`teams/*.toml`).
    #[serde(default)]
    pub include: Vec<String>,
    /// Per team: the sources its routes may read and the sink patterns they
    /// may publish to.
    #[serde(default)]
    pub grants: BTreeMap<String, Grant>,
    /// Named destinations (Kafka clusters, NATS servers, files).
    #[serde(default)]
    pub sinks: BTreeMap<String, SinkConfig>,
    /// Named WebAssembly plugins.
    #[serde(default)]
    pub plugins: BTreeMap<String, PluginConfig>,
    /// Which events go to which plugin, and what that plugin may do.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// HTTP endpoint for `/metrics`, `/healthz` and `/readyz`.
    #[serde(default)]
    pub http: HttpConfig,
    /// Log format and level.
    #[serde(default)]
    pub log: LogConfig,
}

/// Per-aggregate ordering mode. What each guarantees, per sink, is in the
/// README ("Ordering"); `pipeline.rs` is the code that keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    /// Events of one aggregate are sent in outbox order, many in flight at
    /// once; a failing event holds back only the later events of its own
    /// aggregate. A broker that loses an earlier message after storing a
    /// later one (ack-time failure) is counted in
    /// `outroute_order_risk_total`; the later event is re-sent after it.
    #[default]
    Aggregate,
    /// At most one unacknowledged event per aggregate: the next event of an
    /// aggregate is sent only after the previous one was acknowledged, so
    /// first deliveries are always in order. Costs a broker round trip per
    /// repeated aggregate within a batch.
    Strict,
    /// No ordering: every event is independent (maximum parallelism).
    None,
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Identity of this relay instance (lease owner). Default: host-pid-random.
    pub id: Option<String>,
    /// Most events claimed per batch. Each worker starts at an eighth of it
    /// and doubles after every full batch (the first events after a start
    /// go out sooner).
    pub batch_size: u32,
    /// Most payload bytes one batch holds and publishes: a claim (and a
    /// captured batch) stops at the event whose payload reaches it, and
    /// the messages after the one that reaches it wait for the next batch
    /// (a batch is split, never failed, so large payloads or a
    /// fan-out-heavy route cannot balloon the relay's memory). Under
    /// `capture = "logical"` the relay holds at most
    /// `(concurrency × 2 + 1) × max_batch_bytes` of captured events, plus
    /// 16 messages read ahead.
    pub max_batch_bytes: u64,
    /// Batches worked on at once (a worker claims from the owned lanes no
    /// other worker has a batch in flight from;
    /// under `capture = "logical"`, a share of the aggregates).
    pub concurrency: u32,
    /// Number of ordering lanes (aggregates are hashed onto lanes; each lane
    /// has one owner at a time). Must be the same for every relay of a table.
    pub lanes: u32,
    /// How long a lane lease lasts without renewal.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub lease_ttl: Duration,
    /// Shortest pause between polls while events keep arriving.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub poll_min: Duration,
    /// Longest pause between polls when the outbox is idle.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub poll_max: Duration,
    /// Also LISTEN on this channel (producers must `NOTIFY` it; this taxes
    /// producer commits, see README). Off by default.
    pub notify_channel: Option<String>,
    /// Ordering mode: `aggregate` (default), `strict` or `none`.
    pub ordering: Ordering,
    /// How long SIGTERM (or a reload that changes a source) waits for
    /// in-flight batches; then they are stopped, their rows left pending.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub shutdown_timeout: Duration,
    /// How long a broker may take to acknowledge before the event is retried.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub publish_timeout: Duration,
    /// The relay reports not-ready when the backlog is non-empty and nothing
    /// was published for this long.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub stall_after: Duration,
    /// Delete published rows after this long (aged by `published_at`, or by
    /// `created_at` under `status` and `queue` marking; nothing to delete
    /// under `delete`). Unset: keep them.
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "Option<String>")]
    pub retention: Option<Duration>,
    /// Directory for compiled plugin artifacts (native code, verified by a
    /// MAC before use; must be private to the relay's user). Default:
    /// `$HOME/.cache/outroute/plugins`.
    pub cache_dir: Option<PathBuf>,
    /// Keep compiled plugins on disk. `false`: compile in memory at every
    /// start (slower starts, nothing on disk).
    pub plugin_cache: bool,
    /// Check the config file and its includes this often and reload when
    /// one changed (as SIGHUP does). Unset: only on SIGHUP.
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "Option<String>")]
    pub config_watch_interval: Option<Duration>,
    /// The most a team file's route may set for each of its limits (CPU
    /// budget, memory, log volume, messages, bytes, quarantine threshold);
    /// a grant may lower them for its team, never raise them. Unset fields:
    /// the built-in maxima.
    pub route_ceilings: teams::Ceilings,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            id: None,
            batch_size: 500,
            max_batch_bytes: 64 << 20,
            concurrency: 2,
            lanes: 64,
            lease_ttl: Duration::from_secs(10),
            poll_min: Duration::from_millis(1),
            poll_max: Duration::from_millis(100),
            notify_channel: None,
            ordering: Ordering::Aggregate,
            shutdown_timeout: Duration::from_secs(10),
            publish_timeout: Duration::from_secs(30),
            stall_after: Duration::from_secs(60),
            retention: None,
            cache_dir: None,
            plugin_cache: true,
            config_watch_interval: None,
            route_ceilings: teams::Ceilings::default(),
        }
    }
}

/// An outbox: a database and the table in it (`[store]` or
/// `[sources.<name>]`).
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `postgres://…` or `sqlite://path` (the embedded default).
    pub url: String,
    /// Lanes of this source (default `relay.lanes`).
    #[serde(default)]
    pub lanes: Option<u32>,
    /// Pool size.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// Longest the relay waits for the database to answer one of its
    /// statements (a claim, a mark, a lease round, a failure record, a
    /// capture step). Past it the relay gives the statement up, drops its
    /// connection and retries on a fresh one: a connection cut silently (a
    /// network partition, a failover that left the old address dark) would
    /// otherwise hang it for good. Raise it if a claim legitimately takes
    /// longer (a deep backlog in a table without its lane index). Enforced
    /// by the relay; the role's own `statement_timeout` is left as it is.
    #[serde(default = "default_statement_timeout", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub statement_timeout: Duration,
    /// The outbox table and how its columns map. Unset: the canonical table
    /// created by `outroute migrate`, marked through the pending queue
    /// (`marking = queue`) on PostgreSQL in lease mode, by `published_at`
    /// elsewhere.
    #[serde(default)]
    pub table: Option<TableConfig>,
    /// The role's password, kept out of the URL (or `password_file`).
    #[serde(default)]
    pub password: Option<Secret>,
    /// File holding the password (e.g. a mounted secret).
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// TLS to PostgreSQL. Unset: the URL's `sslmode` (default `prefer`).
    #[serde(default)]
    pub tls: Option<PgTlsConfig>,
    /// How the relay reads events: `lease` (claim pending rows of the
    /// table under lane leases; any PostgreSQL or SQLite) or `logical`
    /// (stream committed inserts, or `pg_logical_emit_message` envelopes,
    /// from a logical replication slot; PostgreSQL with `wal_level =
    /// logical`). See `capture/mod.rs`.
    #[serde(default)]
    pub capture: CaptureMode,
    /// Settings of `capture = "logical"`.
    #[serde(default)]
    pub logical: Option<LogicalConfig>,
}

/// How a source's events are read.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CaptureMode {
    /// Poll the table's lane index under lane leases; mark rows published.
    #[default]
    Lease,
    /// Stream from a logical replication slot (pgoutput); confirm the
    /// slot's position only past handled events.
    Logical,
}

/// Where a logical source's events come from.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogicalInput {
    /// Inserts into the outbox table (its mapping, `table`).
    #[default]
    Table,
    /// `pg_logical_emit_message(true, <message_prefix>, <envelope>)` calls
    /// in producer transactions: no table at all.
    Messages,
}

/// What becomes of captured rows of the outbox table.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Cleanup {
    /// Delete them in bulk (by ranges of the sequence column) once handled.
    #[default]
    Delete,
    /// Leave them (the table is pruned by other means, e.g. partitions).
    Keep,
}

/// `[sources.<name>.logical]`: the slot and publication a logical source
/// reads, and what is read.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LogicalConfig {
    /// Replication slot (pgoutput). Default `outroute_<database>_<source>`
    /// (slots are per cluster).
    #[serde(default)]
    pub slot: Option<String>,
    /// Publication of the outbox table. Default `outroute_<source>`.
    #[serde(default)]
    pub publication: Option<String>,
    /// `table` (default) or `messages`.
    #[serde(default)]
    pub input: LogicalInput,
    /// Prefix of the logical messages read under `input = "messages"`.
    #[serde(default = "default_message_prefix")]
    pub message_prefix: String,
    /// `delete` (default) or `keep` captured rows.
    #[serde(default)]
    pub cleanup: Cleanup,
}

fn default_message_prefix() -> String {
    "outroute".into()
}

/// A logical source's settings with their defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logical {
    pub slot: String,
    pub publication: String,
    pub input: LogicalInput,
    pub message_prefix: String,
    pub cleanup: Cleanup,
}

impl StoreConfig {
    /// The logical-capture settings of source `source`, if it streams.
    pub fn logical(&self, source: &str) -> Option<Logical> {
        if self.capture != CaptureMode::Logical {
            return None;
        }
        let l = self.logical.clone().unwrap_or_default();
        // Slots are per cluster, publications per database: the default
        // slot name carries the database so two databases never collide.
        let database = url::Url::parse(&self.url)
            .ok()
            .map(|u| u.path().trim_start_matches('/').to_string())
            .unwrap_or_default();
        let slot: String = format!("outroute_{database}_{source}")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .take(63)
            .collect();
        let base: String = format!("outroute_{source}")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .take(63)
            .collect();
        Some(Logical {
            slot: l.slot.unwrap_or(slot),
            publication: l.publication.unwrap_or(base),
            input: l.input,
            message_prefix: if l.message_prefix.is_empty() {
                default_message_prefix()
            } else {
                l.message_prefix
            },
            cleanup: l.cleanup,
        })
    }
}

impl Config {
    /// The source named `name`.
    pub fn source(&self, name: &str) -> anyhow::Result<&StoreConfig> {
        self.sources.get(name).ok_or_else(|| {
            anyhow::anyhow!(
                "no source named `{name}` (sources: {})",
                self.sources.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })
    }

    /// The config key of source `name`: `store` for the shorthand,
    /// `sources.<name>` otherwise.
    pub fn source_key(&self, name: &str) -> String {
        if self.store_shorthand {
            "store".into()
        } else {
            format!("sources.{name}")
        }
    }

    /// Does route `r` read source `name`?
    pub fn route_reads(r: &RouteConfig, source: &str) -> bool {
        r.sources.is_empty() || r.sources.iter().any(|s| s == source)
    }
}

/// The name of the `[store]` shorthand's source.
pub const DEFAULT_SOURCE: &str = "default";

impl StoreConfig {
    /// The table mapping in force. Unset: the canonical table; on
    /// PostgreSQL in lease mode its pending rows are listed in the queue
    /// (measured: about a third less PostgreSQL work per event than
    /// stamping `published_at`, rows kept; see README "Marking: queue, stamp or delete"). Rows
    /// stamped before the switch count as published.
    pub fn table(&self) -> TableConfig {
        match &self.table {
            Some(t) => t.clone(),
            None => {
                let mut t = TableConfig::canonical();
                if self.url.starts_with("postgres") && self.capture == CaptureMode::Lease {
                    t.marking = Marking::Queue {
                        column: Some(default_published_at()),
                    };
                }
                t
            }
        }
    }
}

fn default_max_connections() -> u32 {
    8
}

fn default_statement_timeout() -> Duration {
    Duration::from_secs(30)
}

/// How a row is marked published.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(tag = "style", rename_all = "snake_case", deny_unknown_fields)]
pub enum Marking {
    /// Set a timestamp column; pending rows have it NULL.
    PublishedAt {
        #[serde(default = "default_published_at")]
        column: String,
    },
    /// Set a status column from `pending` to `sent`.
    Status {
        column: String,
        pending: String,
        sent: String,
        /// Value written when an event fails for good. Unset: the row keeps
        /// its `pending` value for ever; the failure is recorded only in
        /// outroute's own `outroute_event_state` table (`outroute failed
        /// list` shows it, the relay skips it), and every claim still walks
        /// past it in the lane index. Set it when the table allows a third
        /// status, so failed rows leave the pending set.
        failed: Option<String>,
    },
    /// Delete the row once published.
    Delete,
    /// List pending rows in outroute's narrow `outroute_queue` (source,
    /// lane, seq), filled by an insert trigger on the table (`outroute
    /// migrate` adds it to the canonical table, whose default this is on
    /// PostgreSQL; `migrate --table` to a mapped one); publishing deletes
    /// the queue entry and leaves the row as it is. Claims walk only
    /// pending entries, and no ~1 KB row is rewritten: about 40 % less
    /// PostgreSQL work per event
    /// than `published_at`, with every row kept for replay and retention.
    /// Needs a unique `sequence` column the database fills. `column`: a
    /// timestamp column whose rows count as published already when the
    /// queue is first filled (`published_at` of a table switched over).
    Queue {
        #[serde(default)]
        column: Option<String>,
    },
}

fn default_published_at() -> String {
    "published_at".into()
}

impl Marking {
    /// The `style` key's value.
    pub fn style(&self) -> &'static str {
        match self {
            Marking::PublishedAt { .. } => "published_at",
            Marking::Status { .. } => "status",
            Marking::Delete => "delete",
            Marking::Queue { .. } => "queue",
        }
    }
}

impl Default for Marking {
    fn default() -> Self {
        Marking::PublishedAt {
            column: default_published_at(),
        }
    }
}

/// Column mapping of an outbox table. Optional columns left unset are
/// absent from the table; constants stand in where noted. Two existing
/// shapes are shown in `examples/`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TableConfig {
    /// Table name, optionally schema-qualified (`app.outbox`).
    pub name: String,
    pub id: String,
    /// Monotonic ordering column, filled by a database sequence or identity
    /// at insert (claim floors rely on later inserts getting higher
    /// numbers; nullable or `CACHE` > 1 turns them off). Unset:
    /// `created_at` orders events.
    #[serde(default)]
    pub sequence: Option<String>,
    /// Aggregate type column; unset: `aggregate_type_value` is used.
    #[serde(default)]
    pub aggregate_type: Option<String>,
    /// Constant aggregate type for tables without the column.
    #[serde(default)]
    pub aggregate_type_value: Option<String>,
    pub aggregate_id: String,
    pub event_type: String,
    /// Schema version column; unset: every event is version 1.
    #[serde(default)]
    pub event_version: Option<String>,
    pub payload: String,
    /// Headers column (JSON object); unset: no producer headers.
    #[serde(default)]
    pub headers: Option<String>,
    pub created_at: String,
    /// Attempts counter kept up to date in the table too (optional).
    #[serde(default)]
    pub attempts: Option<String>,
    /// Last error text kept in the table too (optional).
    #[serde(default)]
    pub last_error: Option<String>,
    /// Timestamp set when an event fails (optional); failed rows are then
    /// excluded from the pending index.
    #[serde(default)]
    pub failed_at: Option<String>,
    #[serde(default)]
    pub marking: Marking,
}

impl TableConfig {
    /// The mapped columns, `(key, column)`: the required ones, then the
    /// optional ones that are set (not the marking column).
    pub fn columns(&self) -> Vec<(&'static str, &String)> {
        let mut cols = vec![
            ("id", &self.id),
            ("aggregate_id", &self.aggregate_id),
            ("event_type", &self.event_type),
            ("payload", &self.payload),
            ("created_at", &self.created_at),
        ];
        for (k, v) in [
            ("sequence", &self.sequence),
            ("aggregate_type", &self.aggregate_type),
            ("event_version", &self.event_version),
            ("headers", &self.headers),
            ("attempts", &self.attempts),
            ("last_error", &self.last_error),
            ("failed_at", &self.failed_at),
        ] {
            if let Some(v) = v {
                cols.push((k, v));
            }
        }
        cols
    }

    /// The table `outroute migrate` creates, marked by `published_at` (as
    /// on SQLite and under log-based capture; `StoreConfig::table` lists
    /// PostgreSQL's pending rows in the queue instead).
    pub fn canonical() -> Self {
        TableConfig {
            name: "outbox".into(),
            id: "id".into(),
            sequence: Some("seq".into()),
            aggregate_type: Some("aggregate_type".into()),
            aggregate_type_value: None,
            aggregate_id: "aggregate_id".into(),
            event_type: "event_type".into(),
            event_version: Some("event_version".into()),
            payload: "payload".into(),
            headers: Some("headers".into()),
            created_at: "created_at".into(),
            attempts: Some("attempts".into()),
            last_error: Some("last_error".into()),
            failed_at: Some("failed_at".into()),
            marking: Marking::default(),
        }
    }
}

/// A destination.
#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum SinkConfig {
    Kafka(KafkaSinkConfig),
    Nats(NatsSinkConfig),
    File(FileSinkConfig),
}

impl SinkConfig {
    pub fn max_message_bytes(&self) -> usize {
        match self {
            SinkConfig::Kafka(k) => k.max_message_bytes,
            SinkConfig::Nats(n) => n.max_message_bytes,
            SinkConfig::File(f) => f.max_message_bytes,
        }
    }
}

/// librdkafka settings `sinks.<name>.options` may not set, with what each
/// protects: they are what makes "acknowledged" mean stored and keeps an
/// aggregate's messages in order. `config check` and start-up refuse them.
pub const KAFKA_PROTECTED_OPTIONS: &[(&str, &str)] = &[
    (
        "enable.idempotence",
        "no duplicates or reordering on producer retries",
    ),
    (
        "enable.gapless.guarantee",
        "a failed message never leaves a silent gap before a later one",
    ),
    (
        "acks",
        "an acknowledgement means every in-sync replica has the message",
    ),
    (
        "request.required.acks",
        "an acknowledgement means every in-sync replica has the message",
    ),
    (
        "max.in.flight.requests.per.connection",
        "order with idempotence needs at most 5 requests in flight",
    ),
    (
        "max.in.flight",
        "order with idempotence needs at most 5 requests in flight",
    ),
    (
        "retries",
        "the producer retries in order instead of failing",
    ),
    (
        "message.send.max.retries",
        "the producer retries in order instead of failing",
    ),
    ("message.timeout.ms", "set from relay.publish_timeout"),
    ("delivery.timeout.ms", "set from relay.publish_timeout"),
    ("bootstrap.servers", "set from sinks.<name>.brokers"),
    ("metadata.broker.list", "set from sinks.<name>.brokers"),
    ("partitioner", "one key always goes to one partition"),
    ("security.protocol", "set from sinks.<name>.tls and .sasl"),
    ("sasl.mechanism", "set from sinks.<name>.sasl"),
    ("sasl.mechanisms", "set from sinks.<name>.sasl"),
    ("sasl.username", "set from sinks.<name>.sasl"),
    (
        "sasl.password",
        "set from sinks.<name>.sasl (password_file keeps it out of the file)",
    ),
    ("ssl.ca.location", "set from sinks.<name>.tls.ca_file"),
    (
        "ssl.certificate.location",
        "set from sinks.<name>.tls.cert_file",
    ),
    ("ssl.key.location", "set from sinks.<name>.tls.key_file"),
    (
        "enable.ssl.certificate.verification",
        "the brokers' certificates are verified; a test cluster may opt out with tls.insecure_skip_verify",
    ),
    (
        "ssl.endpoint.identification.algorithm",
        "a broker's certificate must name its host; a test cluster may opt out with tls.insecure_skip_verify",
    ),
];

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSinkConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Largest payload accepted (bytes); larger messages fail their event.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// `compression.type` (none, gzip, snappy, lz4).
    #[serde(default = "default_compression")]
    pub compression: String,
    /// `linger.ms`: how long the producer waits to fill a batch.
    #[serde(default = "default_linger_ms")]
    pub linger_ms: u32,
    /// Messages awaiting acknowledgement before publishing waits.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// TLS to the brokers (`security.protocol` `ssl`, or `sasl_ssl` with
    /// `sasl`).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// SASL authentication (PLAIN, SCRAM-SHA-256/512). Without `tls` the
    /// credentials cross the network unencrypted (`sasl_plaintext`).
    #[serde(default)]
    pub sasl: Option<KafkaSaslConfig>,
    /// Any other librdkafka producer setting (tuning), passed
    /// through verbatim. Settings that make an acknowledgement mean "stored,
    /// in order" are refused: `enable.idempotence`, `enable.gapless.guarantee`,
    /// `acks`, `max.in.flight*`, `retries`, `message.timeout.ms`,
    /// `bootstrap.servers`, `partitioner` and their aliases; TLS and SASL
    /// are set from `tls` and `sasl`.
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum NatsMode {
    /// JetStream: every publish waits for the stream's PubAck.
    #[default]
    Jetstream,
    /// Core NATS: no acknowledgement. An event is marked once a server
    /// round trip after its messages came back (the server has them); a
    /// subscriber that is not connected then never sees them:
    /// **at-most-once** beyond the server. Only for subjects nobody needs
    /// to see reliably.
    Core,
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    pub url: String,
    #[serde(default)]
    pub mode: NatsMode,
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// Create this stream at start-up if it does not exist. Unset: start-up
    /// fails when no stream captures a subject the routes allow.
    pub create_stream: Option<NatsStreamConfig>,
    /// TLS to the server (required when set; `tls://` URLs need it too).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Credentials: user + password, token, NKey or `.creds` file.
    #[serde(default)]
    pub auth: Option<NatsAuthConfig>,
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NatsStreamConfig {
    pub name: String,
    pub subjects: Vec<String>,
    /// Deduplication window for `Nats-Msg-Id`.
    #[serde(default = "default_dedup_window", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub duplicate_window: Duration,
}

fn default_dedup_window() -> Duration {
    Duration::from_secs(120)
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileSinkConfig {
    /// JSON-lines file to append to; `-` for standard output.
    pub path: String,
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
}

fn default_max_message_bytes() -> usize {
    1024 * 1024
}
fn default_compression() -> String {
    "none".into()
}
fn default_linger_ms() -> u32 {
    5
}
fn default_max_in_flight() -> usize {
    10_000
}

/// A WebAssembly routing plugin.
#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginConfig {
    /// Path to the compiled component (`.wasm`), relative to the config file.
    pub path: PathBuf,
    /// Check the file for changes this often and switch to a new version
    /// without restart. Unset: no hot reload.
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "Option<String>")]
    pub reload_interval: Option<Duration>,
    /// A candidate version (`.wasm`, relative to the config file) run on the
    /// same live events as this one: its answers are compared with the
    /// active version's and never published (`outroute_shadow_events_total`,
    /// `outroute_shadow_differences_total`, `outroute plugin shadow-report`).
    /// `outroute plugin promote <plugin>` makes it the active version.
    #[serde(default)]
    pub shadow: Option<PathBuf>,
    /// The candidate's route config (JSON), when it differs from the
    /// route's `config`.
    #[serde(default)]
    pub shadow_config: Option<serde_json::Value>,
}

/// What a failed event does to the later events of its aggregate.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// Later events of the aggregate wait until an operator retries or
    /// discards the failed one.
    #[default]
    Block,
    /// Later events continue; the failure is recorded.
    Skip,
}

/// Selects events and names the plugin that routes them. Routes are
/// subscriptions: every route whose selection matches an event gets it,
/// with its own plugin call, messages, retries, failures and per-aggregate
/// order; the event is marked once every one of them delivered it.
#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Route name (metrics label, failed-event filter): 1–128 letters,
    /// digits, `-`, `_` or `.`.
    pub name: String,
    /// Glob patterns over the aggregate type (default: all).
    #[serde(default = "match_all")]
    pub aggregate_types: Vec<String>,
    /// Glob patterns over the event type (default: all).
    #[serde(default = "match_all")]
    pub event_types: Vec<String>,
    /// Sources (`[sources.<name>]`) whose events this route selects.
    /// Unset: every source.
    #[serde(default)]
    pub sources: Vec<String>,
    /// This route alone gets the events it selects: routes that are not
    /// exclusive do not get them, though they select them too (every
    /// exclusive route that selects an event gets it). A team route may be
    /// exclusive only over aggregate types its grant `owns`.
    #[serde(default)]
    pub exclusive: bool,
    /// Name of a plugin in `[plugins]`.
    pub plugin: String,
    /// Static configuration handed to the plugin's `init` (any JSON).
    #[serde(default)]
    pub config: serde_json::Value,
    /// Sinks this route may publish to, each with the topic/subject glob
    /// patterns allowed (`*` any run of characters but `.`, `**` anything).
    pub allow: BTreeMap<String, Vec<String>>,
    /// CPU time one event may use in the plugin, measured as the CPU time of
    /// the thread running it (so a busy host does not eat the budget); a
    /// call is also stopped at 10× this in wall time. A batch call gets this
    /// times its size. Plugins cannot block: sleeps and clock waits return
    /// at once.
    #[serde(default = "default_cpu_budget", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub cpu_budget: Duration,
    /// Memory cap per plugin instance, in MiB: all its linear memories and
    /// tables together.
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u32,
    /// Idle plugin instances are kept warm for reuse up to this many MiB of
    /// their memory together; the rest are dropped after use.
    #[serde(default = "default_max_idle_memory_mib")]
    pub max_idle_memory_mib: u32,
    /// Most `host.log` lines one event may write; one more fails the event
    /// (guest stderr is not counted: it is kept as a small ring buffer of
    /// the last bytes and quoted in failure reasons).
    #[serde(default = "default_max_log_lines_per_event")]
    pub max_log_lines_per_event: u32,
    /// Most `host.log` bytes one event may write.
    #[serde(default = "default_max_log_bytes_per_event")]
    pub max_log_bytes_per_event: u64,
    /// After this many events in a row break a limit of the route (CPU
    /// budget, memory, messages, bytes or log lines per event), the route is
    /// quarantined: its plugin is no longer called and its events wait
    /// (no attempt counted) while other routes flow, until a probe event
    /// gets through or `outroute route resume`. 0: never quarantine.
    #[serde(default = "default_quarantine_after")]
    pub quarantine_after: u32,
    /// How often a quarantined route lets one event through as a probe.
    #[serde(
        default = "default_quarantine_probe_interval",
        with = "humantime_serde"
    )]
    #[schemars(with = "String")]
    pub quarantine_probe_interval: Duration,
    /// Attempts before an event goes to the failed state. Counts plugin
    /// rejections, traps and permanent broker refusals; a broker that is
    /// merely unavailable is retried with backoff until it is back.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// First retry delay; doubles each attempt, with jitter.
    #[serde(default = "default_backoff_min", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub backoff_min: Duration,
    /// Largest retry delay.
    #[serde(default = "default_backoff_max", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub backoff_max: Duration,
    /// `block` (default) or `skip`.
    #[serde(default)]
    pub on_failure: OnFailure,
    /// Most messages one event may produce (a fan-out bomb fails its event
    /// with the reason instead of flooding the sinks).
    #[serde(default = "default_max_messages_per_event")]
    pub max_messages_per_event: u32,
    /// Most payload bytes all messages of one event may carry together.
    #[serde(default = "default_max_bytes_per_event")]
    pub max_bytes_per_event: u64,
    /// Kafka key of a message whose plugin set neither key nor partition:
    /// `aggregate-id` (default; one aggregate stays on one partition, so in
    /// order) or `none` (spread over partitions; no per-aggregate order).
    #[serde(default)]
    pub default_key: DefaultKey,
}

/// The Kafka key a route gives messages the plugin left without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema, Default)]
#[serde(rename_all = "kebab-case")]
pub enum DefaultKey {
    /// The event's aggregate id.
    #[default]
    AggregateId,
    /// No key: librdkafka's partitioner spreads the messages.
    None,
}

fn default_max_messages_per_event() -> u32 {
    100
}
fn default_max_idle_memory_mib() -> u32 {
    64
}
fn default_max_log_lines_per_event() -> u32 {
    100
}
fn default_max_log_bytes_per_event() -> u64 {
    64 << 10
}
fn default_quarantine_after() -> u32 {
    5
}
fn default_quarantine_probe_interval() -> Duration {
    Duration::from_secs(30)
}
fn default_max_bytes_per_event() -> u64 {
    16 << 20
}
fn match_all() -> Vec<String> {
    vec!["*".into()]
}
fn default_cpu_budget() -> Duration {
    Duration::from_millis(50)
}
fn default_memory_mib() -> u32 {
    64
}
fn default_max_attempts() -> u32 {
    10
}
fn default_backoff_min() -> Duration {
    Duration::from_millis(500)
}
fn default_backoff_max() -> Duration {
    Duration::from_secs(300)
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Address for `/metrics`, `/healthz`, `/readyz`. Empty: no server.
    pub listen: String,
    /// Bearer token for the endpoints that show event content (`/shadow`):
    /// a request must send `Authorization: Bearer <token>`. Unset: those
    /// endpoints answer 401 to everyone. `/metrics`, `/healthz` and
    /// `/readyz` stay open. Better from `OUTROUTE_HTTP__TOKEN` or
    /// `token_file` than in the file.
    pub token: Option<Secret>,
    /// A file holding `token` (a mounted secret).
    pub token_file: Option<PathBuf>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:9464".into(),
            token: None,
            token_file: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

#[derive(PartialEq, Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// `tracing` filter, e.g. `info,outroute=debug`. `RUST_LOG` wins.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Human,
            level: "info".into(),
        }
    }
}

/// One configuration problem: where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub key: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file, self.key, self.reason)
    }
}

/// All problems found in a configuration file.
#[derive(Debug)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A loaded, validated configuration plus the directory relative paths are
/// resolved against.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub base_dir: PathBuf,
    /// The files read: the config file, then its includes.
    pub files: Vec<PathBuf>,
    /// What `relay.config_watch_interval` watches: the files, and the
    /// directories includes are looked for in (a new team file).
    pub watched: Vec<PathBuf>,
    /// Team files refused: each costs only its team, which runs its last
    /// known good copy or not at all (`config/teams.rs`).
    pub refused: Vec<teams::Refused>,
    /// Team files accepted, `(team, file, text)`: the last known good
    /// copies `outroute run` keeps.
    pub accepted_teams: Vec<(String, PathBuf, String)>,
}

impl Loaded {
    /// A path from the config, resolved relative to the config file.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base_dir.join(p)
        }
    }

    /// Where each team's last known good team file is kept: beside the
    /// compiled plugins, one directory per main file. `None` without a
    /// plugin cache on disk.
    pub fn last_good_dir(&self) -> Option<PathBuf> {
        use sha2::Digest;
        let main = self.files.first()?;
        let main = main.canonicalize().unwrap_or_else(|_| main.clone());
        let hash = sha2::Sha256::digest(main.to_string_lossy().as_bytes());
        let key: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
        Some(self.cache_dir()?.join("last-good").join(key))
    }

    /// Connections that would cross a network unverified, one line each.
    pub fn transport_warnings(&self) -> Vec<String> {
        security::transport_warnings(&self.config)
    }

    /// One line per refused team file: what runs instead and why.
    pub fn refused_lines(&self) -> Vec<String> {
        self.refused
            .iter()
            .map(|r| {
                format!(
                    "team file {} refused ({}): {}",
                    r.file.display(),
                    if r.last_good {
                        "its last known good copy runs"
                    } else {
                        "its routes do not run, their events wait"
                    },
                    r.problems
                        .iter()
                        .map(|p| format!("{}: {}", p.key, p.reason))
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            })
            .collect()
    }

    /// Log the refused team files, count them, and keep the accepted ones
    /// as last known good (`outroute run`, at start and after a reload).
    pub fn report_teams(&self) {
        for line in self.refused_lines() {
            tracing::error!("{line}");
        }
        metrics::gauge!(crate::metrics::TEAM_FILES_REFUSED).set(self.refused.len() as f64);
        self.remember_good_teams();
    }

    /// Keep every accepted team file as its team's last known good copy
    /// (`outroute run`, at start and after each reload).
    pub fn remember_good_teams(&self) {
        let Some(dir) = self.last_good_dir() else {
            return;
        };
        if let Err(e) = teams::remember(&dir, &self.accepted_teams) {
            tracing::warn!(
                "could not keep the team files as last known good under {}: {e}",
                dir.display()
            );
        }
    }

    /// Where compiled plugins are cached; `None`: not on disk (disabled, or
    /// no `HOME` — never a shared temporary directory).
    pub fn cache_dir(&self) -> Option<PathBuf> {
        if !self.config.relay.plugin_cache {
            return None;
        }
        match &self.config.relay.cache_dir {
            Some(d) => Some(self.resolve(d)),
            None => default_plugin_cache(),
        }
    }
}

/// `$HOME/.cache/outroute/plugins`, or `None` without `HOME` (plugins are
/// then compiled in memory; a shared `/tmp` would let others plant code).
pub fn default_plugin_cache() -> Option<PathBuf> {
    let dir = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache/outroute/plugins"));
    if dir.is_none() {
        tracing::warn!("HOME is not set: compiled plugins are not cached on disk");
    }
    dir
}

/// Read `file`, apply `OUTROUTE_*` environment overrides, validate.
pub fn load(file: &Path) -> Result<Loaded, ConfigErrors> {
    let shown = file.display().to_string();
    if !file.exists() {
        return Err(ConfigErrors(vec![ConfigError {
            file: shown,
            key: "-".into(),
            reason: "file not found".into(),
        }]));
    }
    let figment = Figment::new()
        .merge(Toml::file_exact(file))
        // Only `OUTROUTE_<TABLE>__<KEY>` names are config overrides; other
        // OUTROUTE_* variables (OUTROUTE_CONFIG, test hooks) are not.
        .merge(
            Env::prefixed("OUTROUTE_")
                .filter(|k| k.as_str().contains("__"))
                .split("__"),
        );
    let mut config: Config = figment.extract().map_err(|e| {
        ConfigErrors(
            e.into_iter()
                .map(|e| {
                    let from_env = matches!(
                        e.metadata.as_ref().map(|m| m.name.as_ref()),
                        Some(n) if n.contains("environment")
                    );
                    ConfigError {
                        file: if from_env {
                            "environment".into()
                        } else {
                            shown.clone()
                        },
                        key: if e.path.is_empty() {
                            "-".into()
                        } else {
                            key_of(&e.path)
                        },
                        reason: {
                            let reason = e.kind.to_string();
                            // `OUTROUTE_ROUTES__0__…` makes a map, never a list.
                            if from_env && reason.contains("expected a sequence") {
                                format!(
                                    "{reason}: lists (such as `routes`) cannot be set or changed \
                                     from the environment, only in the file"
                                )
                            } else {
                                reason
                            }
                        },
                    }
                })
                .collect(),
        )
    })?;
    let base_dir = file
        .canonicalize()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."));
    let mut problems = Vec::new();
    match (config.store.take(), config.sources.is_empty()) {
        (Some(store), true) => {
            config.sources.insert(DEFAULT_SOURCE.into(), store);
            config.store_shorthand = true;
        }
        (Some(_), false) => problems.push((
            "store".to_string(),
            "use either [store] (one source) or [sources.<name>], not both".to_string(),
        )),
        (None, false) => {}
        (None, true) => problems.push((
            "store".to_string(),
            "no outbox configured: set [store] or [sources.<name>]".to_string(),
        )),
    }
    problems.extend(security::resolve(&mut config, &base_dir));
    // Each team file is merged on its own, checked with the config's own
    // checks; a refused one costs only its team (see `config/teams.rs`).
    let mut loaded = Loaded {
        config,
        files: vec![file.to_path_buf()],
        watched: Vec::new(),
        base_dir,
        refused: Vec::new(),
        accepted_teams: Vec::new(),
    };
    let last_good = loaded.last_good_dir();
    let validate = |c: &Config| {
        Loaded {
            config: c.clone(),
            files: Vec::new(),
            watched: Vec::new(),
            base_dir: loaded.base_dir.clone(),
            refused: Vec::new(),
            accepted_teams: Vec::new(),
        }
        .validate()
    };
    let mut config = loaded.config.clone();
    let merged = teams::merge(
        &mut config,
        &loaded.base_dir,
        &shown,
        last_good.as_deref(),
        &validate,
    );
    loaded.config = config;
    loaded.files.extend(merged.files);
    loaded.watched = loaded.files.clone();
    loaded.watched.extend(merged.origins.dirs.iter().cloned());
    loaded.refused = merged.refused;
    loaded.accepted_teams = merged.accepted;
    problems.extend(loaded.validate());
    let mut errors: Vec<ConfigError> = merged.problems;
    for (key, reason) in problems {
        let (file, key) = merged.origins.locate(&shown, &key);
        // A value an `OUTROUTE_…` variable set is the environment's fault,
        // not the file's.
        let (file, reason) = match env_var_of(&figment, &key) {
            Some(var) if file == shown => (
                "environment".to_string(),
                format!("{reason} (set by {var})"),
            ),
            _ => (file, reason),
        };
        if !errors.iter().any(|e| e.file == file && e.key == key) {
            errors.push(ConfigError { file, key, reason });
        }
    }
    if errors.is_empty() {
        Ok(loaded)
    } else {
        // The main file's problems, and with them every refused team
        // file's, so one run of `config check` shows them all.
        errors.extend(loaded.refused.into_iter().flat_map(|r| r.problems));
        Err(ConfigErrors(errors))
    }
}

/// A SQL identifier from config: letters, digits and `_`, not starting with a
/// digit; at most one `.` for a schema. Anything else is refused (so nothing
/// from config can inject SQL); accepted names are still quoted.
pub fn check_identifier(name: &str, allow_schema: bool) -> Result<(), String> {
    let parts: Vec<&str> = name.split('.').collect();
    if parts.len() > if allow_schema { 2 } else { 1 } {
        return Err(format!("`{name}` has too many `.` parts"));
    }
    for p in parts {
        let ok = !p.is_empty()
            && p.len() <= 63
            && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !p.starts_with(|c: char| c.is_ascii_digit());
        if !ok {
            return Err(format!(
                "`{name}` is not a plain SQL identifier (letters, digits, `_`; not starting with a digit)"
            ));
        }
    }
    Ok(())
}

/// A URL with its secrets replaced by `****`, for every error message, log
/// line and command output that shows one: the password of the userinfo;
/// for brokers (not PostgreSQL, whose user name is no secret) a userinfo
/// without `:` too, which is how a NATS token is given (`nats://TOKEN@host`);
/// and the value of every query parameter named like a secret
/// (`password`, `passwd`, `pwd`, `token`, `secret`, `key`, `sslpassword`…).
pub fn redact_url(url: &str) -> String {
    let Some(s) = url.find("://") else {
        return url.to_string();
    };
    let scheme = &url[..s];
    let rest = &url[s + 3..];
    // The authority ends at the first `/`, `?` or `#`; the userinfo at its
    // last `@`.
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(auth_end);
    let authority = match authority.rfind('@') {
        Some(at) => {
            let (creds, host) = authority.split_at(at);
            match creds.find(':') {
                Some(c) => format!("{}:****{host}", &creds[..c]),
                None if scheme.starts_with("postgres") => authority.to_string(),
                None => format!("****{host}"),
            }
        }
        None => authority.to_string(),
    };
    let tail = match tail.split_once('?') {
        None => tail.to_string(),
        Some((path, query)) => {
            let (query, fragment) = match query.split_once('#') {
                Some((q, f)) => (q, format!("#{f}")),
                None => (query, String::new()),
            };
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if secret_name(k) => format!("{k}=****"),
                    _ => pair.to_string(),
                })
                .collect();
            format!("{path}?{}{fragment}", query.join("&"))
        }
    };
    format!("{scheme}://{authority}{tail}")
}

/// `text` (a client library's error, say) with every secret of `url` —
/// what [`redact_url`] hides — replaced by `****`, wherever it appears.
pub fn scrub(text: &str, url: &str) -> String {
    let mut out = text.replace(url, &redact_url(url));
    for secret in url_secrets(url) {
        // Shorter ones would blank unrelated text; they are in the URL only.
        if secret.len() >= 3 {
            out = out.replace(secret, "****");
        }
    }
    out
}

/// The secrets `url` carries, as [`redact_url`] finds them.
fn url_secrets(url: &str) -> Vec<&str> {
    let Some(s) = url.find("://") else {
        return Vec::new();
    };
    let rest = &url[s + 3..];
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let mut out = Vec::new();
    if let Some(at) = rest[..auth_end].rfind('@') {
        match rest[..at].split_once(':') {
            Some((_, password)) => out.push(password),
            None if !url.starts_with("postgres") => out.push(&rest[..at]),
            None => {}
        }
    }
    if let Some((_, query)) = rest[auth_end..].split_once('?') {
        let query = query.split('#').next().unwrap_or(query);
        for pair in query.split('&') {
            if let Some((k, v)) = pair.split_once('=')
                && secret_name(k)
            {
                out.push(v);
            }
        }
    }
    out
}

/// A query parameter or setting name that holds a secret.
fn secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "pass",
        "pwd",
        "token",
        "secret",
        "key",
        "credential",
        "auth",
    ]
    .iter()
    .any(|w| n.contains(w))
}

/// The JSON Schema of the configuration file.
pub fn schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(Config)).unwrap_or_default()
}

/// The `OUTROUTE_…` variable that set config `key` (`store.url`,
/// `routes[0].x`), if the environment set it.
fn env_var_of(figment: &Figment, key: &str) -> Option<String> {
    let dotted = key.replace('[', ".").replace(']', "");
    // Only a value, not a table: a table the file and a variable both set
    // keys of carries the variable's tag, though the file wrote the table.
    let is_table = matches!(
        figment.find_value(&dotted),
        Ok(figment::value::Value::Dict(..))
    );
    let from_env = !is_table
        && figment
            .find_metadata(&dotted)
            .is_some_and(|m| m.name.contains("environment"));
    from_env.then(|| format!("OUTROUTE_{}", dotted.to_uppercase().replace('.', "__")))
}

/// A key path as the other messages spell it: `routes[0].plugin`, not
/// `routes.0.plugin`.
fn key_of(path: &[String]) -> String {
    let mut key = String::new();
    for part in path {
        if !key.is_empty() && part.parse::<usize>().is_ok() {
            key.push_str(&format!("[{part}]"));
        } else {
            if !key.is_empty() {
                key.push('.');
            }
            key.push_str(part);
        }
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_paths_are_spelled_as_in_the_other_messages() {
        let path = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            super::key_of(&path(&["routes", "0", "aggregate_types"])),
            "routes[0].aggregate_types"
        );
        assert_eq!(super::key_of(&path(&["relay", "lanes"])), "relay.lanes");
    }

    fn write(dir: &Path, body: &str) -> PathBuf {
        let f = dir.join("outroute.toml");
        std::fs::write(&f, body).unwrap();
        std::fs::write(dir.join("p.wasm"), b"\0asm").unwrap();
        f
    }

    fn tmp() -> PathBuf {
        let d = std::env::temp_dir().join(format!("outroute-cfg-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    const GOOD: &str = r#"
[store]
url = "postgres://root@127.0.0.1/test"
[sinks.kafka]
kind = "kafka"
brokers = "127.0.0.1:9092"
[plugins.p]
path = "p.wasm"
[[routes]]
name = "orders"
plugin = "p"
allow = { kafka = ["orders.*"] }
"#;

    const PLATFORM: &str = r#"
include = ["teams/*.toml"]
[sources.orders]
url = "postgres://root@127.0.0.1/orders"
[sources.billing]
url = "postgres://root@127.0.0.1/billing"
[sinks.kafka]
kind = "kafka"
brokers = "127.0.0.1:9092"
[grants.payments]
sources = ["orders"]
allow = { kafka = ["payments.*"] }
plugin_dirs = ["."]
"#;

    fn team_file(dir: &Path, name: &str, body: &str) {
        std::fs::create_dir_all(dir.join("teams")).unwrap();
        std::fs::write(dir.join("teams").join(name), body).unwrap();
    }

    const PAYMENTS: &str = "team = \"payments\"\n[plugins.pay]\npath = \"../p.wasm\"\n\
        [[routes]]\nname = \"pay\"\nplugin = \"pay\"\nallow = { kafka = [\"payments.*\"] }\n";

    /// Every problem: the refused team files' (the load goes on without
    /// them) and the main file's (the load is refused).
    fn problems(f: &Path) -> Vec<ConfigError> {
        match load(f) {
            Ok(l) => l.refused.into_iter().flat_map(|r| r.problems).collect(),
            Err(e) => e.0,
        }
    }

    #[test]
    fn team_files_merge_within_their_grant() {
        let d = tmp();
        let f = write(&d, PLATFORM);
        team_file(&d, "payments.toml", PAYMENTS);
        let l = load(&f).unwrap();
        assert_eq!(l.files.len(), 2);
        let r = &l.config.routes[0];
        assert_eq!(r.sources, vec!["orders".to_string()], "the grant's sources");
        assert!(l.config.plugins["pay"].path.is_absolute());
        assert!(!l.config.store_shorthand);
    }

    #[test]
    fn team_files_cannot_reach_outside_their_grant() {
        let d = tmp();
        let f = write(&d, PLATFORM);
        let team = d.join("teams/payments.toml").display().to_string();
        let cases = [
            (
                PAYMENTS.replace("payments.*\"]", "orders.*\"]"),
                "routes[0].allow.kafka",
                "outside team `payments`'s grant",
            ),
            (
                format!("{PAYMENTS}sources = [\"billing\"]\n"),
                "routes[0].sources",
                "source `billing` is outside",
            ),
            (
                PAYMENTS.replace("payments\"\n[plugins", "ghosts\"\n[plugins"),
                "team",
                "this file says team `ghosts`, but a team file must be named after its team",
            ),
            (
                format!("{PAYMENTS}[sinks.mine]\nkind = \"file\"\npath = \"x\"\n"),
                "sinks",
                "a team file declares `team`, `plugins` and `routes` only",
            ),
            (
                PAYMENTS.replace("plugin = \"pay\"", "plugin = \"other\""),
                "routes[0].plugin",
                "not declared in this file",
            ),
        ];
        for (body, key, reason) in cases {
            team_file(&d, "payments.toml", &body);
            let p = problems(&f);
            assert!(
                p.iter()
                    .any(|e| e.file == team && e.key == key && e.reason.contains(reason)),
                "{key}: {p:?}"
            );
        }
        // A team without a grant.
        team_file(&d, "payments.toml", PAYMENTS);
        team_file(
            &d,
            "ghosts.toml",
            &PAYMENTS.replace("payments\"\n[plugins", "ghosts\"\n[plugins"),
        );
        let p = problems(&f);
        assert!(
            p.iter()
                .any(|e| e.key == "team" && e.reason.contains("team `ghosts` has no grant")),
            "{p:?}"
        );
        std::fs::remove_file(d.join("teams/ghosts.toml")).unwrap();
        // Another file's route name is not a team's to take.
        let f = write(
            &d,
            &format!(
                "{PLATFORM}[grants.billing]\nsources = [\"billing\"]\nallow = {{ kafka = [\"billing.*\"] }}\nplugin_dirs = [\".\"]\n"
            ),
        );
        team_file(
            &d,
            "billing.toml",
            "team = \"billing\"\n[plugins.bill]\npath = \"../p.wasm\"\n\
             [[routes]]\nname = \"pay\"\nplugin = \"bill\"\nallow = { kafka = [\"billing.*\"] }\n",
        );
        let p = problems(&f);
        assert!(
            p.iter()
                .any(|e| e.key == "routes[0].name" && e.reason.contains("already declared by")),
            "{p:?}"
        );
    }

    #[test]
    fn team_plugin_files_stay_in_the_teams_directories() {
        let d = tmp();
        // No `plugin_dirs`: only the team file's own directory.
        let f = write(&d, &PLATFORM.replace("plugin_dirs = [\".\"]\n", ""));
        let team = d.join("teams/payments.toml").display().to_string();
        let outside = std::env::temp_dir().join("outroute-not-the-teams");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::create_dir_all(d.join("teams")).unwrap();
        let link = d.join("teams/linked");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        for path in [
            "../p.wasm".to_string(),
            outside.join("p.wasm").display().to_string(),
            "linked/p.wasm".to_string(),
            "sub/../../p.wasm".to_string(),
        ] {
            team_file(&d, "payments.toml", &PAYMENTS.replace("../p.wasm", &path));
            let p = problems(&f);
            assert!(
                p.iter().any(|e| e.file == team
                    && e.key == "plugins.pay.path"
                    && e.reason.contains("outside team `payments`'s directories")),
                "{path}: {p:?}"
            );
        }
        // The shadow too.
        team_file(
            &d,
            "payments.toml",
            &PAYMENTS.replace(
                "path = \"../p.wasm\"",
                "path = \"p.wasm\"\nshadow = \"../cand.wasm\"",
            ),
        );
        let p = problems(&f);
        assert!(p.iter().any(|e| e.key == "plugins.pay.shadow"), "{p:?}");
        // Inside the team's directory (a file not there yet included), or
        // one its grant names: accepted.
        team_file(
            &d,
            "payments.toml",
            &PAYMENTS.replace("../p.wasm", "plugins/p.wasm"),
        );
        assert!(load(&f).unwrap().refused.is_empty());
        let f = write(&d, PLATFORM);
        team_file(&d, "payments.toml", PAYMENTS);
        assert!(load(&f).unwrap().refused.is_empty());
    }

    #[test]
    fn a_grant_bounds_the_events_a_team_reads() {
        let d = tmp();
        let f = write(
            &d,
            &PLATFORM.replace(
                "sources = [\"orders\"]\n",
                "sources = [\"orders\"]\naggregate_types = [\"payment*\"]\n",
            ),
        );
        // The default selection reads exactly what the grant allows.
        team_file(&d, "payments.toml", PAYMENTS);
        let l = load(&f).unwrap();
        assert!(l.refused.is_empty(), "{:?}", l.refused);
        let route = l.config.routes.iter().find(|r| r.name == "pay").unwrap();
        assert_eq!(route.aggregate_types, ["payment*"]);
        // A narrower selection is the team's to make.
        team_file(
            &d,
            "payments.toml",
            &format!("{PAYMENTS}aggregate_types = [\"payment.refund\"]\n"),
        );
        assert!(load(&f).unwrap().refused.is_empty());
        // Another team's events are not.
        let team = d.join("teams/payments.toml").display().to_string();
        for pats in ["\"order\"", "\"payment\", \"*\""] {
            team_file(
                &d,
                "payments.toml",
                &format!("{PAYMENTS}aggregate_types = [{pats}]\n"),
            );
            let p = problems(&f);
            assert!(
                p.iter().any(|e| e.file == team
                    && e.key == "routes[0].aggregate_types"
                    && e.reason.contains("outside team `payments`'s grant")),
                "{pats}: {p:?}"
            );
        }
    }

    #[test]
    fn a_grant_bounds_the_event_types_a_team_reads() {
        let d = tmp();
        let f = write(
            &d,
            &PLATFORM.replace(
                "sources = [\"orders\"]\n",
                "sources = [\"orders\"]\nevent_types = [\"payment.*\"]\n",
            ),
        );
        team_file(&d, "payments.toml", PAYMENTS);
        let l = load(&f).unwrap();
        assert!(l.refused.is_empty(), "{:?}", l.refused);
        assert_eq!(l.config.routes[0].event_types, ["payment.*"]);
        team_file(
            &d,
            "payments.toml",
            &format!("{PAYMENTS}event_types = [\"payment.refunded\"]\n"),
        );
        assert!(load(&f).unwrap().refused.is_empty());
        // `*`, written out, is the default: it reads the grant's.
        team_file(
            &d,
            "payments.toml",
            &format!("{PAYMENTS}event_types = [\"*\"]\n"),
        );
        let l = load(&f).unwrap();
        assert!(l.refused.is_empty(), "{:?}", l.refused);
        assert_eq!(l.config.routes[0].event_types, ["payment.*"]);
        let team = d.join("teams/payments.toml").display().to_string();
        for pats in ["\"order.created\"", "\"payment.*\", \"order.*\""] {
            team_file(
                &d,
                "payments.toml",
                &format!("{PAYMENTS}event_types = [{pats}]\n"),
            );
            let p = problems(&f);
            assert!(
                p.iter().any(|e| e.file == team
                    && e.key == "routes[0].event_types"
                    && e.reason
                        .contains("outside team `payments`'s grant (event_types: payment.*)")),
                "{pats}: {p:?}"
            );
        }
    }

    #[test]
    fn only_an_owner_keeps_events_from_copies() {
        let d = tmp();
        let owner = PLATFORM.replace(
            "sources = [\"orders\"]\n",
            "sources = [\"orders\"]\nowns = [\"payment*\"]\n",
        );
        let f = write(&d, &owner);
        let team = d.join("teams/payments.toml").display().to_string();
        // Exclusive over what the team owns (its default selection, or a
        // narrower one): accepted.
        for extra in [
            "aggregate_types = [\"payment\"]\n",
            "aggregate_types = [\"payment.*\"]\n",
        ] {
            team_file(
                &d,
                "payments.toml",
                &format!("{PAYMENTS}exclusive = true\n{extra}"),
            );
            let l = load(&f).unwrap();
            assert!(l.refused.is_empty(), "{extra}: {:?}", l.refused);
            assert!(l.config.routes[0].exclusive);
        }
        // Over anything it does not own (here, its default selection: every
        // event of the source): refused, naming the key.
        team_file(
            &d,
            "payments.toml",
            &format!("{PAYMENTS}exclusive = true\n"),
        );
        let p = problems(&f);
        assert!(
            p.iter().any(|e| e.file == team
                && e.key == "routes[0].exclusive"
                && e.reason
                    .contains("pattern `*` is not owned by team `payments`")),
            "{p:?}"
        );
        // A team that owns nothing cannot be exclusive at all.
        let f = write(&d, PLATFORM);
        team_file(
            &d,
            "payments.toml",
            &format!("{PAYMENTS}exclusive = true\naggregate_types = [\"payment\"]\n"),
        );
        let p = problems(&f);
        assert!(
            p.iter().any(|e| e.key == "routes[0].exclusive"
                && e.reason
                    .contains("owns no aggregate types (grants.payments.owns)")),
            "{p:?}"
        );
        // An aggregate type has one owner; and a team owns only what it
        // may read.
        let f = write(
            &d,
            &format!(
                "{owner}[grants.billing]\nsources = [\"orders\"]\nowns = [\"payment\"]\n\
                 [grants.audit]\nsources = [\"orders\"]\naggregate_types = [\"audit\"]\nowns = [\"order\"]\n"
            ),
        );
        let p = load(&f).unwrap_err().0;
        assert!(
            p.iter().any(|e| e.key == "grants.payments.owns"
                && e.reason
                    .contains("`payment*` overlaps `payment`, owned by team `billing`")),
            "{p:?}"
        );
        assert!(
            p.iter().any(|e| e.key == "grants.audit.owns"
                && e.reason
                    .contains("`order` is outside what team `audit` may read")),
            "{p:?}"
        );
    }

    #[test]
    fn team_routes_stay_under_their_grants_ceilings_and_grants_under_the_relays() {
        let d = tmp();
        let f = write(&d, PLATFORM);
        let team = d.join("teams/payments.toml").display().to_string();
        let refused = |body: &str| {
            team_file(&d, "payments.toml", body);
            problems(&f)
        };
        // The issue's example: a minute of CPU per event, never quarantined.
        let p = refused(&format!(
            "{PAYMENTS}cpu_budget = \"60s\"\nquarantine_after = 4000000000\n"
        ));
        for (key, needle) in [
            (
                "routes[0].cpu_budget",
                "\"1m\" is above team `payments`'s ceiling \"1s\"",
            ),
            ("routes[0].quarantine_after", "4000000000 is above"),
        ] {
            assert!(
                p.iter()
                    .any(|e| e.file == team && e.key == key && e.reason.contains(needle)),
                "{key}: {p:?}"
            );
        }
        // Never quarantining is no team's choice.
        let p = refused(&format!("{PAYMENTS}quarantine_after = 0\n"));
        assert!(p.iter().any(|e| e.reason.contains("0 (never)")), "{p:?}");
        // Within the built-in maxima: accepted.
        assert!(
            refused(&format!(
                "{PAYMENTS}cpu_budget = \"500ms\"\nmemory_mib = 256\n"
            ))
            .is_empty()
        );
        // A grant lowers them for its team...
        let f = write(
            &d,
            &PLATFORM.replace(
                "allow = { kafka = [\"payments.*\"] }",
                "allow = { kafka = [\"payments.*\"] }\nceilings = { memory_mib = 128 }",
            ),
        );
        team_file(
            &d,
            "payments.toml",
            &format!("{PAYMENTS}memory_mib = 256\n"),
        );
        let p = problems(&f);
        assert!(
            p.iter().any(|e| e.key == "routes[0].memory_mib"
                && e.reason
                    .contains("256 is above team `payments`'s ceiling 128")),
            "{p:?}"
        );
        // ...and cannot raise them above the relay's: the main file is refused.
        let f = write(
            &d,
            &format!(
                "{}[relay]\nroute_ceilings = {{ memory_mib = 256 }}\n",
                PLATFORM.replace(
                    "allow = { kafka = [\"payments.*\"] }",
                    "allow = { kafka = [\"payments.*\"] }\nceilings = { memory_mib = 1024 }",
                )
            ),
        );
        team_file(&d, "payments.toml", PAYMENTS);
        let e = load(&f).err().map(|e| e.0).unwrap_or_default();
        assert!(
            e.iter()
                .any(|e| e.key == "grants.payments.ceilings.memory_mib"
                    && e.reason.contains("1024 is above the relay's ceiling 256")),
            "{e:?}"
        );
    }

    #[test]
    fn a_refused_team_file_costs_only_its_team_which_runs_its_last_known_good_copy() {
        let d = tmp();
        let main = format!(
            "{PLATFORM}[relay]\ncache_dir = \"{}\"\n\
             [grants.billing]\nsources = [\"billing\"]\nallow = {{ kafka = [\"billing.*\"] }}\nplugin_dirs = [\".\"]\n",
            d.join("cache").display()
        );
        let f = write(&d, &main);
        let billing = "team = \"billing\"\n[plugins.bill]\npath = \"../p.wasm\"\n\
             [[routes]]\nname = \"bill\"\nplugin = \"bill\"\nallow = { kafka = [\"billing.*\"] }\n";
        team_file(&d, "payments.toml", PAYMENTS);
        team_file(&d, "billing.toml", billing);
        let routes = |l: &Loaded| {
            let mut r: Vec<String> = l.config.routes.iter().map(|r| r.name.clone()).collect();
            r.sort();
            r
        };
        let good = load(&f).unwrap();
        assert!(good.refused.is_empty(), "{:?}", good.refused);
        assert_eq!(routes(&good), ["bill", "pay"]);
        // Without a copy kept, a broken file takes its team's routes out
        // (their events wait), never the other team's.
        team_file(
            &d,
            "payments.toml",
            "team = \"payments\"\n[[routes]\nbroken",
        );
        let l = load(&f).unwrap();
        assert_eq!(routes(&l), ["bill"]);
        assert_eq!(l.refused.len(), 1);
        assert!(!l.refused[0].last_good);
        assert!(
            l.refused_lines()[0].contains("teams/payments.toml refused (its routes do not run")
        );
        // Kept once accepted (as `run` does), the copy runs in its place:
        // at the next load, as after a restart.
        good.remember_good_teams();
        let l = load(&f).unwrap();
        assert_eq!(routes(&l), ["bill", "pay"]);
        assert!(l.refused[0].last_good, "{:?}", l.refused);
        assert!(l.config.plugins["pay"].path.ends_with("p.wasm"));
        // A file claiming another team's name is refused; that team is
        // untouched.
        team_file(&d, "payments.toml", PAYMENTS);
        team_file(
            &d,
            "rogue.toml",
            &billing.replace("billing\"\n[plugins", "payments\"\n[plugins"),
        );
        let l = load(&f).unwrap();
        assert_eq!(routes(&l), ["bill", "pay"]);
        assert_eq!(l.refused.len(), 1);
        assert_eq!(l.refused[0].problems[0].key, "team");
        // A granted team whose file went missing runs its copy, and says so.
        std::fs::remove_file(d.join("teams/rogue.toml")).unwrap();
        std::fs::remove_file(d.join("teams/payments.toml")).unwrap();
        let l = load(&f).unwrap();
        assert_eq!(routes(&l), ["bill", "pay"]);
        assert!(
            l.refused[0].problems[0]
                .reason
                .contains("has a grant but no team file")
        );
        // A copy the grant no longer allows does not run.
        let narrower = main.replace(
            "allow = { kafka = [\"payments.*\"] }",
            "allow = { kafka = [\"pay.*\"] }",
        );
        let f = write(&d, &narrower);
        let l = load(&f).unwrap();
        assert_eq!(routes(&l), ["bill"]);
        // The main file's own problems still refuse the whole config.
        let f = write(
            &d,
            &main.replace("[sinks.kafka]", "[sinks.kafka]\nmax_in_flight = 0"),
        );
        assert!(load(&f).is_err());
    }

    #[test]
    fn diff_names_what_changes_and_which_sources() {
        let d = tmp();
        let f = write(&d, PLATFORM);
        team_file(&d, "payments.toml", PAYMENTS);
        let old = load(&f).unwrap();
        let d2 = tmp();
        let f2 = write(
            &d2,
            &format!(
                "{}\n[relay]\nbatch_size = 10\n",
                PLATFORM.replace("billing", "invoices")
            ),
        );
        team_file(
            &d2,
            "payments.toml",
            &PAYMENTS.replace("payments.*\"]", "payments.x\"]"),
        );
        let new = load(&f2).unwrap();
        let diff = super::diff(&old.config, &new.config);
        assert_eq!(diff.sources.added, vec!["invoices".to_string()]);
        assert_eq!(diff.sources.removed, vec!["billing".to_string()]);
        assert_eq!(diff.routes.changed, vec!["pay".to_string()]);
        assert_eq!(diff.restart, vec!["relay.batch_size".to_string()]);
        assert_eq!(
            diff.affected_sources,
            vec!["invoices".to_string(), "orders".to_string()]
        );
        let same = super::diff(&old.config, &old.config);
        assert!(same.is_empty() && same.affected_sources.is_empty());
    }

    #[test]
    fn good_config_loads() {
        let d = tmp();
        let l = load(&write(&d, GOOD)).unwrap();
        assert_eq!(l.config.routes[0].max_attempts, 10);
        // The canonical table, listed in the pending queue on PostgreSQL.
        let table = l.config.sources["default"].table();
        assert_eq!(
            table.marking,
            Marking::Queue {
                column: Some("published_at".into())
            }
        );
        assert_eq!(
            TableConfig {
                marking: Marking::default(),
                ..table
            },
            TableConfig::canonical()
        );
    }

    #[test]
    fn errors_name_file_key_and_reason() {
        let d = tmp();
        let body = GOOD
            .replace("plugin = \"p\"", "plugin = \"nope\"")
            .replace("kafka = [", "kafak = [");
        let errs = load(&write(&d, &body)).unwrap_err();
        let text = errs.to_string();
        assert!(
            text.contains("outroute.toml:routes[0].plugin: no plugin named `nope`"),
            "{text}"
        );
        assert!(
            text.contains("outroute.toml:routes[0].allow.kafak: no sink named `kafak`"),
            "{text}"
        );
    }

    /// Values that load and parse but would start a relay that publishes
    /// nothing, logs nothing, or fails every event: refused by name.
    #[test]
    fn values_that_would_start_a_broken_relay_are_refused() {
        let d = tmp();
        let body = GOOD
            .replace(
                "[store]",
                "[http]\nlisten = \":99999\"\n[log]\nlevel = \"verbose\"\n[relay]\nmax_batch_bytes = 0\npublish_timeout = \"0s\"\n[store]",
            )
            .replace(
                "[plugins.p]",
                "[sinks.nats]\nkind = \"nats\"\nurl = \"nats:/127.0.0.1:4222\"\nmax_in_flight = 0\n\
                 create_stream = { name = \"S\", subjects = [\"orders..x\"] }\n[plugins.p]",
            )
            .replace(
                "allow = { kafka = [\"orders.*\"] }",
                "allow = { kafka = [\"orders/*\", \"orders.{a,b}-?\"], nats = [\"orders.>\"] }\nmax_messages_per_event = 0",
            )
            .replace(
                "url = \"postgres://root@127.0.0.1/test\"",
                "url = \"postgres://root@127.0.0.1/test\"\nmax_connections = 0",
            );
        let text = load(&write(&d, &body)).unwrap_err().to_string();
        for expected in [
            "outroute.toml:relay.max_batch_bytes: must be positive",
            "outroute.toml:relay.publish_timeout: must be positive",
            "outroute.toml:log.level: `verbose`: `verbose` is not a level",
            "outroute.toml:sinks.nats.url: `nats:/127.0.0.1:4222` is not a NATS server address",
            "outroute.toml:routes[0].allow.kafka: pattern `orders/*` can never match: Kafka topics have no `/`",
            "outroute.toml:routes[0].allow.nats: pattern `orders.>`: `>` is a NATS wildcard",
            "outroute.toml:routes[0].max_messages_per_event: must be at least 1",
            "outroute.toml:sinks.nats.max_in_flight: must be at least 1",
            "outroute.toml:store.max_connections: must be at least 1",
            "outroute.toml:http.listen: `:99999` is not host:port",
            "outroute.toml:sinks.nats.create_stream.subjects: `orders..x` is not a NATS subject",
        ] {
            assert!(text.contains(expected), "{expected}\n---\n{text}");
        }
        // Glob syntax in a Kafka pattern is not a bad character.
        assert!(!text.contains("orders.{a,b}-?"), "{text}");
        // Directives and plain levels stay accepted.
        assert_eq!(
            super::validate::check_log_level("info,outroute::plugin=debug"),
            Ok(())
        );
        assert_eq!(super::validate::check_log_level("WARN"), Ok(()));
        assert_eq!(
            super::validate::check_nats_url("nats://a:4222, tls://b:4223,c:4222"),
            Ok(())
        );
    }

    #[test]
    fn type_errors_name_the_key() {
        let d = tmp();
        let body = GOOD.replace("[store]", "[relay]\nbatch_size = \"many\"\n[store]");
        let text = load(&write(&d, &body)).unwrap_err().to_string();
        assert!(text.contains("outroute.toml:relay.batch_size:"), "{text}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let d = tmp();
        let body = GOOD.replace("[store]", "[store]\nurll = \"x\"");
        let text = load(&write(&d, &body)).unwrap_err().to_string();
        assert!(text.contains("urll"), "{text}");
    }

    #[test]
    fn injection_through_identifiers_is_refused() {
        let d = tmp();
        let body = GOOD.replace(
            "[sinks.kafka]",
            "[store.table]\nname = \"outbox; drop table x\"\nid = \"id\"\naggregate_id = \"a\"\nevent_type = \"e\"\npayload = \"p\"\ncreated_at = \"c\"\n[sinks.kafka]",
        );
        let text = load(&write(&d, &body)).unwrap_err().to_string();
        assert!(text.contains("store.table.name"), "{text}");
        assert!(check_identifier("app.outbox", true).is_ok());
        assert!(check_identifier("a\"b", false).is_err());
        assert!(check_identifier("1abc", false).is_err());
    }

    #[test]
    fn the_queue_needs_a_failed_marker() {
        let d = tmp();
        let table = "[store.table]\nname = \"ev\"\nid = \"id\"\nsequence = \"seq\"\naggregate_id = \"a\"\n\
            aggregate_type_value = \"order\"\nevent_type = \"e\"\npayload = \"p\"\ncreated_at = \"c\"\n\
            marking = { style = \"queue\" }\n";
        let body = GOOD.replace("[sinks.kafka]", &format!("{table}[sinks.kafka]"));
        let text = load(&write(&d, &body)).unwrap_err().to_string();
        assert!(
            text.contains("store.table.failed_at") && text.contains("count as published"),
            "{text}"
        );
        let body = GOOD.replace(
            "[sinks.kafka]",
            &format!("{table}failed_at = \"f\"\n[sinks.kafka]"),
        );
        assert!(load(&write(&d, &body)).is_ok());
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://u:secret@h/db"),
            "postgres://u:****@h/db"
        );
        assert_eq!(redact_url("postgres://h/db"), "postgres://h/db");
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
        // A NATS token is a userinfo without `:`.
        assert_eq!(redact_url("nats://s3cr3t@h:4222"), "nats://****@h:4222");
        assert_eq!(redact_url("tls://u:p@h"), "tls://u:****@h");
        // An `@` in the path is not a userinfo; in the password it is.
        assert_eq!(redact_url("nats://h/a@b"), "nats://h/a@b");
        assert_eq!(
            redact_url("postgres://u:p@ss@h/db"),
            "postgres://u:****@h/db"
        );
        assert_eq!(
            redact_url("postgres://h/db?sslmode=require&password=s3cr3t&sslpassword=x#f"),
            "postgres://h/db?sslmode=require&password=****&sslpassword=****#f"
        );
        assert_eq!(
            redact_url("postgresql://u@h/db?application_name=a&Token=t"),
            "postgresql://u@h/db?application_name=a&Token=****"
        );
        assert_eq!(redact_url("not a url"), "not a url");
        // A client library's message naming the URL or its secret.
        assert_eq!(
            scrub(
                "cannot connect to nats://s3cr3t@h:4222 (token s3cr3t refused)",
                "nats://s3cr3t@h:4222"
            ),
            "cannot connect to nats://****@h:4222 (token **** refused)"
        );
        assert_eq!(
            scrub(
                "auth failed for p4ss",
                "postgres://u:p4ss@h/db?password=p4ss"
            ),
            "auth failed for ****"
        );
    }
}
