//! Test harness for outroute's end-to-end suite: fresh PostgreSQL databases,
//! business transactions that write outbox rows (some rolled back on
//! purpose), the real `outroute` binary as a child process, consumers that
//! read what reached tansu (Kafka protocol) and NATS JetStream, and the
//! invariant checker every end-to-end test ends with.
//!
//! Files: `db.rs` (databases), `logical.rs` (the log-capture suites'
//! tables and configs), `mysql.rs` (MySQL/MariaDB databases and
//! producers), `workload.rs` (producers and the invariant
//! checker), `process.rs` (the relay as a process), `brokers.rs` (topics,
//! streams, consumers), `proxy.rs` (the TCP fault proxy), `secure.rs` (TLS
//! material and secured services); this one the paths and `eventually`.
//!
//! Services: PostgreSQL 127.0.0.1:5432, MariaDB 127.0.0.1:3306, NATS 127.0.0.1:4222, tansu
//! 127.0.0.1:9092 (`scripts/services` starts whatever is down).

pub mod secure;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::postgres::{PgPool, PgPoolOptions};

pub const KAFKA: &str = "127.0.0.1:9092";
pub const NATS: &str = "nats://127.0.0.1:4222";

pub mod brokers;
pub mod db;
pub mod logical;
pub mod mysql;
pub mod process;
pub mod proxy;
pub mod workload;
pub use brokers::*;
pub use db::*;
pub use mysql::*;
pub use process::*;
pub use workload::*;

pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The `outroute` binary built alongside this test.
pub fn bin() -> PathBuf {
    if let Ok(p) = std::env::var("OUTROUTE_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    // target/debug/deps/<test> or target/debug/<bench> → target/debug/outroute
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join("outroute")
}

/// A built example plugin (`scripts/build-plugins` puts them there).
pub fn plugin(name: &str) -> PathBuf {
    let p = workspace()
        .join("plugins/dist")
        .join(format!("{}.wasm", name.replace('-', "_")));
    assert!(
        p.is_file(),
        "{} missing: run scripts/build-plugins",
        p.display()
    );
    p
}

/// A short unique tag for names (databases, topics, subjects).
pub fn tag() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_string()
}

/// Wait until `f` is true or the timeout passes; returns whether it became true.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The two existing outbox shapes from the seed articles, exactly as they
/// define them, and the `[store.table]` mappings that relay them unchanged.
pub mod seed {
    /// Article 000: `outbox_events`, marked by `published_at`, ordered by
    /// `created_at`, no aggregate type column.
    pub const OUTBOX_EVENTS_DDL: &str = "CREATE TABLE outbox_events (id uuid PRIMARY KEY, event_type text NOT NULL, \
         aggregate_id uuid NOT NULL, payload json NOT NULL, created_at timestamptz NOT NULL DEFAULT clock_timestamp(), \
         published_at timestamptz, attempts int NOT NULL DEFAULT 0, lease_owner text, lease_until timestamptz)";

    /// Article 004: Spring-style `t_outbox`, marked by `status`.
    pub const T_OUTBOX_DDL: &str = "CREATE TABLE t_outbox (event_id varchar(64) PRIMARY KEY, aggregate_type varchar(64), \
         aggregate_id varchar(64), event_type varchar(128) NOT NULL, payload text, \
         status varchar(16) NOT NULL DEFAULT 'PENDING', retry_count int NOT NULL DEFAULT 0, \
         create_time timestamp NOT NULL DEFAULT clock_timestamp())";

    pub const OUTBOX_EVENTS_MAPPING: &str = r#"
[store.table]
name = "outbox_events"
id = "id"
aggregate_type_value = "order"
aggregate_id = "aggregate_id"
event_type = "event_type"
payload = "payload"
created_at = "created_at"
attempts = "attempts"
marking = { style = "published_at", column = "published_at" }
"#;

    pub const T_OUTBOX_MAPPING: &str = r#"
[store.table]
name = "t_outbox"
id = "event_id"
aggregate_type = "aggregate_type"
aggregate_id = "aggregate_id"
event_type = "event_type"
payload = "payload"
created_at = "create_time"
attempts = "retry_count"
marking = { style = "status", column = "status", pending = "PENDING", sent = "SENT" }
"#;
}
