//! `outroute quickstart`: the whole product on the embedded default, no
//! servers needed. It writes a config (SQLite outbox, file sink, the
//! `order-router` example plugin), runs business transactions that write
//! outbox rows (one rolled back on purpose, one with a malformed payload),
//! runs the real relay until the outbox is drained, and prints what went
//! where.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::health::Health;
use crate::relay::Relay;
use crate::store::{Filter, Store};

/// The demo plugin, when the binary was built after the plugins (build.rs).
#[cfg(embedded_demo)]
const DEMO_PLUGIN: Option<&[u8]> = Some(include_bytes!(env!("OUTROUTE_DEMO_PLUGIN")));
#[cfg(not(embedded_demo))]
const DEMO_PLUGIN: Option<&[u8]> = None;

#[derive(Args)]
pub struct QuickstartArgs {
    /// Working directory for the database, config and output.
    #[arg(long, default_value = ".outroute/quickstart")]
    dir: PathBuf,
    /// The routing plugin to use (default: the order-router demo carried in
    /// this binary, or `plugins/dist/order_router.wasm` in a checkout).
    #[arg(long)]
    plugin: Option<PathBuf>,
    /// How many orders to create.
    #[arg(long, default_value_t = 20)]
    orders: u32,
}

pub async fn run(a: QuickstartArgs) -> Result<ExitCode> {
    // The summary below reports failures; keep the log to real errors.
    crate::ops::init_logging(crate::config::LogFormat::Human, "error");
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    let dir = a.dir.canonicalize()?;
    let plugin = match (a.plugin, DEMO_PLUGIN) {
        (Some(p), _) => p,
        (None, Some(bytes)) => {
            let p = dir.join("order_router.wasm");
            std::fs::write(&p, bytes).with_context(|| format!("writing {}", p.display()))?;
            p
        }
        (None, None) => PathBuf::from("plugins/dist/order_router.wasm"),
    };
    if !plugin.is_file() {
        bail!(
            "{} not found: build the example plugins first (scripts/build-plugins), or pass --plugin",
            plugin.display()
        );
    }
    let plugin = plugin.canonicalize()?;
    for f in [
        "outbox.db",
        "outbox.db-wal",
        "outbox.db-shm",
        "messages.jsonl",
    ] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let config_path = dir.join("outroute.toml");
    std::fs::write(
        &config_path,
        format!(
            r#"# Written by `outroute quickstart`.
[relay]
batch_size = 100
poll_max = "50ms"

[store]
url = "sqlite://{db}"

[sinks.file]
kind = "file"
path = "messages.jsonl"

[plugins.order-router]
path = "{plugin}"

[[routes]]
name = "orders"
aggregate_types = ["order"]
plugin = "order-router"
config = {{ sink = "file", topic = "orders.{{event_type}}" }}
allow = {{ file = ["orders.*"] }}
max_attempts = 1

[http]
listen = ""
"#,
            db = dir.join("outbox.db").display(),
            plugin = plugin.display()
        ),
    )?;
    let loaded = crate::ops::load(&config_path)?;
    let mut store =
        Store::connect(&loaded.config, crate::config::DEFAULT_SOURCE, "quickstart").await?;
    store.migrate(true).await?;
    store.check_table().await?;
    let Store::Sqlite(sq) = &store else {
        bail!("quickstart uses the SQLite store")
    };

    // Business transactions: the order row and its event commit together.
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, status TEXT NOT NULL, total_cents INTEGER NOT NULL)")
        .execute(sq.pool())
        .await?;
    let mut written = 0;
    for i in 1..=a.orders {
        let order = format!("order-{i}");
        for (event, status) in [("order-created", "created"), ("order-paid", "paid")] {
            let mut tx = sq.pool().begin().await?;
            sqlx::query("INSERT INTO orders (id, status, total_cents) VALUES (?1, ?2, ?3) ON CONFLICT (id) DO UPDATE SET status = ?2")
                .bind(&order)
                .bind(status)
                .bind(i64::from(i) * 1000)
                .execute(&mut *tx)
                .await?;
            sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES (?1, 'order', ?2, ?3, ?4)")
                .bind(uuid::Uuid::now_v7().to_string())
                .bind(&order)
                .bind(event)
                .bind(serde_json::json!({"order_id": order, "status": status, "total_cents": i * 1000}).to_string())
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            written += 1;
        }
    }
    // A transaction that rolls back: its event must never be published.
    let mut tx = sq.pool().begin().await?;
    sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES (?1, 'order', 'order-rolled-back', 'order-created', '{}')")
        .bind(uuid::Uuid::now_v7().to_string())
        .execute(&mut *tx)
        .await?;
    tx.rollback().await?;
    // A producer bug: payload that is not JSON. It must fail with a reason.
    sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES (?1, 'order', 'order-broken', 'order-created', '{not json')")
        .bind(uuid::Uuid::now_v7().to_string())
        .execute(sq.pool())
        .await?;
    println!("wrote {written} events in business transactions (+1 rolled back, +1 malformed)");

    // Run the real relay until the outbox is drained.
    let store = Arc::new(store);
    let relay = Arc::new(
        Relay::build(
            &loaded,
            crate::config::DEFAULT_SOURCE,
            store.clone(),
            crate::relay::build_sinks(&loaded).await?,
            Health::new(crate::config::DEFAULT_SOURCE, Duration::from_secs(60)),
        )
        .await?,
    );
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(relay.clone().run(shutdown.clone()));
    let started = Instant::now();
    loop {
        let (backlog, _) = store.backlog().await?;
        if backlog == 0 || started.elapsed() > Duration::from_secs(30) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    shutdown.cancel();
    running.await??;

    // What went where.
    let out = dir.join("messages.jsonl");
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let mut by_topic: BTreeMap<String, usize> = BTreeMap::new();
    for line in text.lines() {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
            *by_topic
                .entry(v["topic"].as_str().unwrap_or("?").to_string())
                .or_default() += 1;
        }
    }
    let total: usize = by_topic.values().sum();
    println!(
        "routed {total} messages in {:.0} ms through plugin order-router:",
        elapsed.as_secs_f64() * 1000.0
    );
    for (topic, n) in &by_topic {
        println!("  file sink, topic {topic:<22} {n} messages");
    }
    let failed = store.failed_list(&Filter::default()).await?;
    println!("failed events: {}", failed.len());
    for f in &failed {
        println!(
            "  {} ({}): {}",
            f.id,
            f.aggregate_id,
            f.reason.as_deref().unwrap_or("-")
        );
    }
    if let Some(first) = text.lines().next() {
        println!("first message:\n  {first}");
    }
    println!(
        "messages: {}\nconfig:   {}",
        out.display(),
        config_path.display()
    );
    let rolled_back_published = text.contains("order-rolled-back");
    if total != written || rolled_back_published || failed.len() != 1 {
        eprintln!(
            "quickstart: unexpected result (routed {total} of {written}, failed {})",
            failed.len()
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}
