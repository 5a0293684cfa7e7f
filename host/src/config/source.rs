//! `[sources.<name>]` (and the `[store]` shorthand): where a source's
//! events come from — its database, capture mode (lease or logical) and
//! table mapping (columns, marking style) — and the names it may use in
//! SQL. It never connects: `store/` does.

use super::*;

/// An outbox: a database and the table in it (`[store]` or
/// `[sources.<name>]`).
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `postgres://…`, `mysql://…` / `mariadb://…` (MySQL 8.0.16+,
    /// MariaDB 10.6+; lease mode, canonical table) or `sqlite://path` (the
    /// embedded default).
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
    /// table under lane leases; any database), `logical` (stream committed
    /// inserts, or `pg_logical_emit_message` envelopes, from a logical
    /// replication slot; PostgreSQL with `wal_level = logical`; see
    /// `capture/mod.rs`) or `binlog` (stream the table's committed inserts
    /// from the binary log; MariaDB with `binlog_format = ROW`; see
    /// `capture/binlog.rs`).
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
    /// Stream the table's inserts from the binary log (MariaDB, row
    /// format); record the stream's GTID position only past handled events
    /// and mark rows published as in lease mode.
    Binlog,
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
    /// A PostgreSQL source (not SQLite).
    pub fn is_postgres(&self) -> bool {
        self.url.starts_with("postgres://") || self.url.starts_with("postgresql://")
    }

    /// A MySQL or MariaDB source (`mysql://` or `mariadb://`).
    pub fn is_mysql(&self) -> bool {
        self.url.starts_with("mysql://") || self.url.starts_with("mariadb://")
    }

    /// A source on a database server, whose pool shares
    /// `relay.max_connections` (PostgreSQL or MySQL; not SQLite).
    pub fn is_pooled(&self) -> bool {
        self.is_postgres() || self.is_mysql()
    }

    /// The most connections this source's pool opens: its own
    /// `max_connections` (at least 2), under `relay.max_connections` an
    /// equal share of that less the LISTEN connection.
    pub fn pool_size(&self, relay: &super::RelayConfig, postgres_sources: usize) -> u32 {
        let own = self.max_connections.max(2);
        match relay.max_connections {
            Some(n) => own.min(
                (n / postgres_sources.max(1) as u32)
                    .saturating_sub(1)
                    .max(2),
            ),
            None => own,
        }
    }

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

impl StoreConfig {
    /// The table mapping in force. Unset: the canonical table; on
    /// PostgreSQL in lease mode its pending rows are listed in the queue
    /// (measured: about a third less PostgreSQL work per event than
    /// stamping `published_at`, rows kept; see the guide, "Marking: queue, stamp or delete"). Rows
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
