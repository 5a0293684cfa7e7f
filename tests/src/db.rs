//! Databases: a fresh PostgreSQL database per test (and the `wal_level =
//! logical` cluster's), clusters of a test's own, the store as the relay
//! opens it, and the rows a test reads back (failure records, purges).

use super::*;

pub fn pg_admin_url() -> String {
    std::env::var("OUTROUTE_TEST_PG")
        .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into())
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

/// Insert an `order-updated` event of `aggregate` into the canonical
/// outbox; its new id.
pub async fn insert_order_event(
    db: &TestDb,
    aggregate: &str,
    payload: serde_json::Value,
) -> anyhow::Result<String> {
    let id = uuid::Uuid::new_v4().to_string();
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1::uuid, 'order', $2, 'order-updated', $3)",
    )
    .bind(&id)
    .bind(aggregate)
    .bind(payload)
    .execute(&db.pool)
    .await?;
    Ok(id)
}
