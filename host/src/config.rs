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
    /// Where the outbox lives.
    pub store: StoreConfig,
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

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Identity of this relay instance (lease owner). Default: host-pid-random.
    pub id: Option<String>,
    /// Events claimed per batch.
    pub batch_size: u32,
    /// Most payload bytes one batch publishes; the events after the one
    /// that reaches it wait for the next batch (a batch is split, never
    /// failed, so a fan-out-heavy route cannot balloon the relay's memory).
    pub max_batch_bytes: u64,
    /// Batches worked on at once (each worker owns a share of the lanes).
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
    /// How long SIGTERM waits for in-flight batches before exiting.
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
    /// Delete published rows after this long (only for `published_at` and
    /// `status` marking). Unset: keep them.
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
        }
    }
}

/// The outbox store.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `postgres://…` or `sqlite://path` (the embedded default).
    pub url: String,
    /// Pool size.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// The outbox table and how its columns map. Unset: the canonical table
    /// created by `outroute migrate`.
    #[serde(default)]
    pub table: Option<TableConfig>,
}

impl StoreConfig {
    /// The table mapping in force (the canonical table when unset).
    pub fn table(&self) -> TableConfig {
        self.table.clone().unwrap_or_else(TableConfig::canonical)
    }
}

fn default_max_connections() -> u32 {
    8
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
}

fn default_published_at() -> String {
    "published_at".into()
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
    /// Monotonic ordering column. Unset: `created_at` orders events.
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
    /// The table `outroute migrate` creates.
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
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
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

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
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
    /// Any other librdkafka producer setting (TLS, SASL, tuning), passed
    /// through verbatim. Settings that make an acknowledgement mean "stored,
    /// in order" are refused: `enable.idempotence`, `enable.gapless.guarantee`,
    /// `acks`, `max.in.flight*`, `retries`, `message.timeout.ms`,
    /// `bootstrap.servers`, `partitioner` and their aliases.
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

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
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
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
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

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
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
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginConfig {
    /// Path to the compiled component (`.wasm`), relative to the config file.
    pub path: PathBuf,
    /// Check the file for changes this often and switch to a new version
    /// without restart. Unset: no hot reload.
    #[serde(default, with = "humantime_serde")]
    #[schemars(with = "Option<String>")]
    pub reload_interval: Option<Duration>,
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

/// Selects events and names the plugin that routes them.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Route name (metrics label, failed-event filter).
    pub name: String,
    /// Glob patterns over the aggregate type (default: all).
    #[serde(default = "match_all")]
    pub aggregate_types: Vec<String>,
    /// Glob patterns over the event type (default: all).
    #[serde(default = "match_all")]
    pub event_types: Vec<String>,
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

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Address for `/metrics`, `/healthz`, `/readyz`. Empty: no server.
    pub listen: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:9464".into(),
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

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
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
    let config: Config = figment.extract().map_err(|e| {
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
                            e.path.join(".")
                        },
                        reason: e.kind.to_string(),
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
    let loaded = Loaded { config, base_dir };
    let problems = loaded.validate();
    if problems.is_empty() {
        Ok(loaded)
    } else {
        Err(ConfigErrors(
            problems
                .into_iter()
                .map(|(key, reason)| ConfigError {
                    file: shown.clone(),
                    key,
                    reason,
                })
                .collect(),
        ))
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

impl Loaded {
    /// What `run` needs beyond a valid file: at least one route. (`migrate`,
    /// `status` and `failed` need only the store.)
    pub fn check_runnable(&self) -> Result<(), String> {
        if self.config.routes.is_empty() {
            return Err("routes: no routes: the relay would route nothing".into());
        }
        Ok(())
    }

    /// Every cross-reference and value check; returns `(key, reason)` pairs.
    pub fn validate(&self) -> Vec<(String, String)> {
        let c = &self.config;
        let mut p: Vec<(String, String)> = Vec::new();
        let mut err = |k: String, r: String| p.push((k, r));

        if c.relay.batch_size == 0 || c.relay.batch_size > 10_000 {
            err(
                "relay.batch_size".into(),
                "must be between 1 and 10000".into(),
            );
        }
        if c.relay.concurrency == 0 || c.relay.concurrency > 64 {
            err(
                "relay.concurrency".into(),
                "must be between 1 and 64".into(),
            );
        }
        if c.relay.lanes == 0 || c.relay.lanes > 4096 {
            err("relay.lanes".into(), "must be between 1 and 4096".into());
        }
        if c.relay.lease_ttl < Duration::from_secs(1) {
            err("relay.lease_ttl".into(), "must be at least 1s".into());
        }
        if c.relay.poll_min > c.relay.poll_max {
            err(
                "relay.poll_min".into(),
                "must not exceed relay.poll_max".into(),
            );
        }
        if let Some(ch) = &c.relay.notify_channel
            && let Err(e) = check_identifier(ch, false)
        {
            err("relay.notify_channel".into(), e);
        }

        if !(c.store.url.starts_with("postgres://")
            || c.store.url.starts_with("postgresql://")
            || c.store.url.starts_with("sqlite:"))
        {
            err(
                "store.url".into(),
                format!(
                    "`{}` is neither a postgres:// nor a sqlite: URL",
                    redact_url(&c.store.url)
                ),
            );
        }
        let t = &c.store.table();
        let mut cols: Vec<(&str, &str)> = vec![
            ("id", &t.id),
            ("aggregate_id", &t.aggregate_id),
            ("event_type", &t.event_type),
            ("payload", &t.payload),
            ("created_at", &t.created_at),
        ];
        for (k, v) in [
            ("sequence", &t.sequence),
            ("aggregate_type", &t.aggregate_type),
            ("event_version", &t.event_version),
            ("headers", &t.headers),
            ("attempts", &t.attempts),
            ("last_error", &t.last_error),
            ("failed_at", &t.failed_at),
        ] {
            if let Some(v) = v {
                cols.push((k, v));
            }
        }
        if let Err(e) = check_identifier(&t.name, true) {
            err("store.table.name".into(), e);
        }
        for (k, v) in cols {
            if let Err(e) = check_identifier(v, false) {
                err(format!("store.table.{k}"), e);
            }
        }
        match &t.marking {
            Marking::PublishedAt { column } | Marking::Status { column, .. } => {
                if let Err(e) = check_identifier(column, false) {
                    err("store.table.marking.column".into(), e);
                }
            }
            Marking::Delete => {
                if c.relay.retention.is_some() {
                    err(
                        "relay.retention".into(),
                        "has no effect with marking style `delete` (published rows are already gone)".into(),
                    );
                }
            }
        }
        if t.aggregate_type.is_none() && t.aggregate_type_value.is_none() {
            err(
                "store.table.aggregate_type_value".into(),
                "the table has no aggregate_type column; set a constant aggregate type here".into(),
            );
        }

        for (name, sink) in &c.sinks {
            if name.is_empty()
                || !name
                    .chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_')
            {
                err(
                    format!("sinks.{name}"),
                    "sink names use letters, digits, `-` and `_`".into(),
                );
            }
            if sink.max_message_bytes() == 0 {
                err(
                    format!("sinks.{name}.max_message_bytes"),
                    "must be positive".into(),
                );
            }
            if let SinkConfig::Kafka(k) = sink {
                for key in k.options.keys() {
                    if let Some((_, why)) = crate::sink::kafka::PROTECTED_OPTIONS
                        .iter()
                        .find(|(p, _)| p == key)
                    {
                        err(
                            format!("sinks.{name}.options.\"{key}\""),
                            format!("outroute sets this itself ({why}); remove it"),
                        );
                    }
                }
            }
            if let SinkConfig::Nats(n) = sink
                && !n.url.starts_with("nats://")
                && !n.url.starts_with("tls://")
                && !n.url.contains(':')
            {
                err(
                    format!("sinks.{name}.url"),
                    format!("`{}` is not a NATS URL", n.url),
                );
            }
        }
        for (name, plugin) in &c.plugins {
            let path = self.resolve(&plugin.path);
            if !path.is_file() {
                err(
                    format!("plugins.{name}.path"),
                    format!("{} does not exist", path.display()),
                );
            }
            if plugin
                .reload_interval
                .is_some_and(|d| d < Duration::from_millis(100))
            {
                err(
                    format!("plugins.{name}.reload_interval"),
                    "must be at least 100ms".into(),
                );
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, r) in c.routes.iter().enumerate() {
            let key = |f: &str| format!("routes[{i}].{f}");
            if !seen.insert(r.name.clone()) {
                err(
                    key("name"),
                    format!("route name `{}` is used twice", r.name),
                );
            }
            if !c.plugins.contains_key(&r.plugin) {
                err(
                    key("plugin"),
                    format!("no plugin named `{}` in [plugins]", r.plugin),
                );
            }
            if r.allow.is_empty() {
                err(
                    key("allow"),
                    "allows no sink: every message would be rejected".into(),
                );
            }
            for (sink, patterns) in &r.allow {
                if !c.sinks.contains_key(sink) {
                    err(
                        key(&format!("allow.{sink}")),
                        format!("no sink named `{sink}` in [sinks]"),
                    );
                }
                for pat in patterns {
                    if let Err(e) = crate::routing::topic_matcher(pat) {
                        err(key(&format!("allow.{sink}")), e);
                    }
                }
            }
            for pat in r.aggregate_types.iter().chain(&r.event_types) {
                if let Err(e) = crate::routing::name_matcher(pat) {
                    err(key("event_types"), e);
                }
            }
            if r.max_attempts == 0 {
                err(key("max_attempts"), "must be at least 1".into());
            }
            if r.memory_mib < 1 || r.memory_mib > 4096 {
                err(key("memory_mib"), "must be between 1 and 4096".into());
            }
            if r.cpu_budget.is_zero() {
                err(key("cpu_budget"), "must be positive".into());
            }
            if r.quarantine_probe_interval.is_zero() {
                err(key("quarantine_probe_interval"), "must be positive".into());
            }
            if r.backoff_min > r.backoff_max {
                err(key("backoff_min"), "must not exceed backoff_max".into());
            }
        }
        p
    }
}

/// A URL with any password replaced, for error messages and logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:****{}", &url[..s + 3], &creds[..c], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

/// The JSON Schema of the configuration file.
pub fn schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(Config)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn good_config_loads() {
        let d = tmp();
        let l = load(&write(&d, GOOD)).unwrap();
        assert_eq!(l.config.routes[0].max_attempts, 10);
        assert_eq!(l.config.store.table(), TableConfig::canonical());
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
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://u:secret@h/db"),
            "postgres://u:****@h/db"
        );
        assert_eq!(redact_url("postgres://h/db"), "postgres://h/db");
    }
}

/// The configuration reference in Markdown, generated from the JSON Schema
/// (so the doc comments on the structs above are the single source).
pub fn reference_markdown() -> String {
    let schema = schema();
    let empty = serde_json::Map::new();
    let defs = schema
        .get("definitions")
        .and_then(|d| d.as_object())
        .unwrap_or(&empty);
    let mut out = String::from(
        "# Configuration reference\n\nGenerated by `outroute config schema --markdown` from the same structs that parse the \
         file; do not edit by hand. Every key can be overridden by an environment variable \
         `OUTROUTE_<TABLE>__<KEY>` (e.g. `OUTROUTE_STORE__URL`). Durations are written like `500ms`, `10s`, `7d`.\n\n",
    );
    out.push_str("## Top level\n\n");
    table(&mut out, &schema);
    for (name, def) in defs {
        out.push_str(&format!("\n## {name}\n\n"));
        if let Some(d) = def.get("description").and_then(|d| d.as_str()) {
            out.push_str(&one_line(d));
            out.push_str("\n\n");
        }
        if def.get("properties").is_some() {
            table(&mut out, def);
        }
        for v in def
            .get("oneOf")
            .or_else(|| def.get("anyOf"))
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
        {
            out.push_str(&format!("- {}", variant(v)));
            out.push('\n');
        }
        if let Some(values) = def.get("enum").and_then(|e| e.as_array()) {
            let vs: Vec<String> = values
                .iter()
                .map(|v| format!("`{}`", v.as_str().unwrap_or("")))
                .collect();
            out.push_str(&format!("One of {}.\n", vs.join(", ")));
        }
    }
    out
}

fn one_line(s: &str) -> String {
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

fn type_of(v: &serde_json::Value) -> String {
    let link = |r: &str| {
        let n = r.rsplit('/').next().unwrap_or(r);
        format!("[{n}](#{})", n.to_lowercase())
    };
    if let Some(r) = v.get("$ref").and_then(|r| r.as_str()) {
        return link(r);
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(list) = v.get(key).and_then(|l| l.as_array()) {
            let parts: Vec<String> = list
                .iter()
                .filter(|x| x.get("type").and_then(|t| t.as_str()) != Some("null"))
                .map(type_of)
                .collect();
            return parts.join(" or ");
        }
    }
    let ty = match v.get("type") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_str())
            .filter(|x| *x != "null")
            .collect::<Vec<_>>()
            .join(" or "),
        _ => "any".into(),
    };
    if ty == "array"
        && let Some(items) = v.get("items")
    {
        return format!("list of {}", type_of(items));
    }
    if ty == "object"
        && let Some(ap) = v.get("additionalProperties").filter(|a| a.is_object())
    {
        return format!("map of {}", type_of(ap));
    }
    ty
}

fn table(out: &mut String, obj: &serde_json::Value) {
    let required: Vec<&str> = obj
        .get("required")
        .and_then(|r| r.as_array())
        .map(|r| r.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    out.push_str("| key | type | default | description |\n| --- | --- | --- | --- |\n");
    for (k, v) in obj
        .get("properties")
        .and_then(|p| p.as_object())
        .into_iter()
        .flatten()
    {
        let default = match v.get("default") {
            Some(d) => format!("`{}`", d.to_string().replace('|', "\\|")),
            None if required.contains(&k.as_str()) => "required".into(),
            None => "-".into(),
        };
        let desc = v
            .get("description")
            .and_then(|d| d.as_str())
            .map(one_line)
            .unwrap_or_default();
        out.push_str(&format!(
            "| `{k}` | {} | {default} | {desc} |\n",
            type_of(v)
        ));
    }
}

fn variant(v: &serde_json::Value) -> String {
    let desc = v
        .get("description")
        .and_then(|d| d.as_str())
        .map(one_line)
        .unwrap_or_default();
    if let Some(e) = v
        .get("enum")
        .and_then(|e| e.as_array())
        .and_then(|e| e.first())
    {
        return format!("`{}`: {desc}", e.as_str().unwrap_or(""));
    }
    // Internally tagged: the tag is the property with a single enum value.
    let props = v.get("properties").and_then(|p| p.as_object());
    let tag = props.and_then(|p| {
        p.iter().find_map(|(k, pv)| {
            pv.get("enum")
                .and_then(|e| e.as_array())
                .filter(|e| e.len() == 1)
                .map(|e| format!("{k} = {}", e[0]))
        })
    });
    let fields: Vec<String> = props
        .map(|p| {
            p.iter()
                .filter(|(_, pv)| pv.get("enum").is_none())
                .map(|(k, pv)| format!("`{k}` ({})", type_of(pv)))
                .collect()
        })
        .unwrap_or_default();
    let mut s = format!("`{}`", tag.unwrap_or_else(|| type_of(v)));
    if let Some(all) = v.get("allOf") {
        s.push_str(&format!(
            ": fields of {}",
            type_of(&serde_json::json!({ "allOf": all }))
        ));
    }
    if !fields.is_empty() {
        s.push_str(&format!(" with {}", fields.join(", ")));
    }
    if !desc.is_empty() {
        s.push_str(&format!(" — {desc}"));
    }
    s
}

#[cfg(test)]
mod reference_tests {
    #[test]
    fn docs_config_reference_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/config-reference.md");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == super::reference_markdown(),
            "docs/config-reference.md is stale: run `outroute config schema --markdown > docs/config-reference.md`"
        );
    }
}
