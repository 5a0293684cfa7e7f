//! Helpers of the log-capture suites (`logical.rs`, `logical_slot.rs`):
//! a test's own outbox table `ev` mapped onto log capture, a file-sink
//! config, a Kafka one, the capture lease's owner, and what the file sink
//! got.

use crate::*;

pub const LOGICAL: &str = "capture = \"logical\"";

/// A log-capture config (in a test folder named after `name`) for table
/// `ev` ordered by `pos`, with `table_keys` added to its mapping, publishing
/// to a file sink through `plugin`; `lease_ttl` 2 s. Returns the config and
/// the file the sink writes.
pub fn file_config(
    name: &str,
    db: &TestDb,
    table_keys: &str,
    plugin: &str,
) -> anyhow::Result<(std::path::PathBuf, std::path::PathBuf)> {
    let dir = test_dir(name);
    let out = dir.join("out.jsonl");
    let body = format!(
        "{}{table_keys}\n{}",
        own_table("ev", "pos"),
        relay_body("", &[TestSink::File(&out)], plugin, "orders", FILE_ROUTE)
    );
    let config = write_config_with(&dir, &db.url, LOGICAL, "lease_ttl = \"2s\"", &body)?;
    Ok((config, out))
}

/// Table `ev` as [`file_config`] maps it, with a nullable text id.
pub async fn create_ev(db: &TestDb) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TABLE ev (id text, pos bigserial, aggregate_id text NOT NULL, \
         event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&db.pool)
    .await?;
    Ok(())
}

/// A `[store.table]` mapping of a test's own table `name`: columns `id`,
/// `aggregate_id`, `event_type`, `payload`, `created_at`, and the order
/// column `seq`.
pub fn own_table(name: &str, seq: &str) -> String {
    format!(
        "[store.table]\nname = \"{name}\"\nid = \"id\"\nsequence = \"{seq}\"\naggregate_type_value = \"order\"\n\
         aggregate_id = \"aggregate_id\"\nevent_type = \"event_type\"\npayload = \"payload\"\n\
         created_at = \"created_at\"\nmarking = {{ style = \"delete\" }}\n"
    )
}

/// The first deliveries the file sink got, in order (a crash may repeat an
/// event already delivered: at-least-once; the repeat is not a first).
pub fn delivered_ids(path: &std::path::Path) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    file_sink_deliveries(path)
        .iter()
        .map(|d| d.id().to_string())
        .filter(|id| seen.insert(id.clone()))
        .collect()
}

pub fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// A log-capture config publishing to Kafka topic `t<t>.<event type>`.
pub fn kafka_config(
    dir: &std::path::Path,
    db: &TestDb,
    t: &str,
    relay: &str,
) -> anyhow::Result<std::path::PathBuf> {
    kafka_topic_config(dir, &db.url, LOGICAL, t, relay)
}

/// The relay id holding the capture lease, if any.
pub async fn capture_owner(db: &TestDb) -> Option<String> {
    sqlx::query_scalar::<_, Option<String>>(
        "SELECT owner FROM outroute_lanes WHERE lane = -1 AND lease_until > now()",
    )
    .fetch_optional(&db.pool)
    .await
    .ok()
    .flatten()
    .flatten()
}
