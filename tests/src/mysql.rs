//! MySQL/MariaDB for the end-to-end suite: a fresh database per test on
//! the machine's MariaDB (127.0.0.1:3306, `scripts/services` starts it),
//! and the business transactions that write its outbox rows — the same
//! workload [`produce`] writes to PostgreSQL, checked by the same [`check`].

use super::*;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

pub fn mysql_admin_url() -> String {
    std::env::var("OUTROUTE_TEST_MYSQL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A fresh MySQL database with a business table `orders`; the outbox
/// comes from `outroute migrate` ([`MyDb::migrate`]).
pub struct MyDb {
    pub name: String,
    pub url: String,
    pub pool: MySqlPool,
}

/// The own MariaDB server of `scripts/mariadb-own` (binlog on, a buffer
/// pool for benchmarks), started if needed: its admin URL.
pub fn mariadb_own_admin_url() -> Result<String> {
    let out = Command::new(workspace().join("scripts/mariadb-own"))
        .stdin(Stdio::null())
        .output()
        .context("scripts/mariadb-own")?;
    if !out.status.success() {
        bail!(
            "scripts/mariadb-own failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let port = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok(format!("mysql://root@127.0.0.1:{port}/test"))
}

impl MyDb {
    /// A fresh database on the shared server (`OUTROUTE_TEST_MYSQL`).
    pub async fn new() -> Result<Self> {
        Self::new_at(&mysql_admin_url()).await
    }

    /// A fresh database on the server behind `admin_url`.
    pub async fn new_at(admin_url: &str) -> Result<Self> {
        let admin_url = admin_url.to_string();
        let admin = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&admin_url)
            .await
            .with_context(|| {
                format!("connecting to {admin_url} (scripts/services starts MariaDB)")
            })?;
        let name = format!("outroute_t_{}", tag());
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await?;
        admin.close().await;
        let base = &admin_url[..admin_url.rfind('/').unwrap_or(admin_url.len())];
        let url = format!("{base}/{name}");
        let pool = MySqlPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await?;
        sqlx::query("CREATE TABLE orders (id VARCHAR(255) PRIMARY KEY, version INT NOT NULL) ENGINE = InnoDB")
            .execute(&pool)
            .await?;
        Ok(MyDb { name, url, pool })
    }

    /// Apply outroute's migrations through the real binary.
    pub fn migrate(&self, config: &Path) -> Result<()> {
        let out = Command::new(bin())
            .args(["migrate", "-c"])
            .arg(config)
            .output()?;
        if !out.status.success() {
            bail!(
                "outroute migrate failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .unwrap_or(-1)
    }

    pub async fn drop_db(self) {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {}", self.name))
            .execute(&self.pool)
            .await;
        self.pool.close().await;
    }
}

/// [`produce`] on MySQL: business transactions that update an order and
/// insert its event in the same transaction, every `rollback_every`-th
/// rolled back; four producers at once, each owning a quarter of the
/// aggregates.
pub async fn produce_mysql(
    pool: &MySqlPool,
    prefix: &str,
    aggregates: usize,
    per_aggregate: usize,
    rollback_every: usize,
) -> Result<Workload> {
    produce_into(
        pool,
        OutboxTable::Outbox,
        prefix,
        (aggregates, per_aggregate),
        rollback_every,
    )
    .await
}

/// [`produce_mysql`] into [`T_OUTBOX`] the way the seed's service writes
/// it: `create_time = NOW()` (whole seconds), so events of one aggregate
/// share a time and their ids order them (`<prefix>-<round>-<aggregate>-…`:
/// a producer that wants order within a second must give it).
pub async fn produce_t_outbox(
    pool: &MySqlPool,
    prefix: &str,
    aggregates: usize,
    per_aggregate: usize,
    rollback_every: usize,
) -> Result<Workload> {
    produce_into(
        pool,
        OutboxTable::TOutbox,
        prefix,
        (aggregates, per_aggregate),
        rollback_every,
    )
    .await
}

/// The table a producer writes.
#[derive(Clone, Copy)]
enum OutboxTable {
    /// The canonical `outbox`: UUID ids, ordered by its AUTO_INCREMENT.
    Outbox,
    /// [`T_OUTBOX`]: ids that sort in write order, `create_time = NOW()`.
    TOutbox,
}

async fn produce_into(
    pool: &MySqlPool,
    into: OutboxTable,
    prefix: &str,
    (aggregates, per_aggregate): (usize, usize),
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
                    let id = match into {
                        OutboxTable::Outbox => uuid::Uuid::new_v4().to_string(),
                        OutboxTable::TOutbox => {
                            format!("{prefix}-{round:06}-{a:06}-{}", uuid::Uuid::new_v4())
                        }
                    };
                    let payload = serde_json::json!({"order_id": agg, "version": round}).to_string();
                    let mut tx = pool.begin().await?;
                    sqlx::query(
                        "INSERT INTO orders (id, version) VALUES (?, ?) ON DUPLICATE KEY UPDATE version = VALUES(version)",
                    )
                    .bind(&agg)
                    .bind(round as i32)
                    .execute(&mut *tx)
                    .await?;
                    let seq = match into {
                        OutboxTable::Outbox => sqlx::query(
                            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) \
                             VALUES (?, 'order', ?, 'order-updated', ?, ?)",
                        )
                        .bind(&id)
                        .bind(&agg)
                        .bind(&payload)
                        .bind(
                            serde_json::json!({"traceparent": format!("00-{:032x}-{:016x}-01", n + 1, round + 1)})
                                .to_string(),
                        )
                        .execute(&mut *tx)
                        .await?
                        .last_insert_id() as i64,
                        OutboxTable::TOutbox => {
                            sqlx::query(
                                "INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                 status, retry_count, create_time) VALUES (?, 'order', ?, 'order-updated', ?, 'PENDING', 0, NOW())",
                            )
                            .bind(&id)
                            .bind(&agg)
                            .bind(&payload)
                            .execute(&mut *tx)
                            .await?;
                            (round * aggregates + a) as i64
                        }
                    };
                    if rollback_every > 0 && n.is_multiple_of(rollback_every) {
                        tx.rollback().await?;
                        w.rolled_back.push(id);
                    } else {
                        tx.commit().await?;
                        w.committed.push(Expected {
                            id,
                            aggregate_id: agg,
                            seq,
                        });
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

/// Seed article 004's `t_outbox` as Hibernate creates it for the JPA
/// entity: varchar id, nullable text columns, `@Lob` payload, status
/// `PENDING`/`SENT`, `retry_count`, `create_time` (the server's default
/// collation, case-insensitive).
pub const T_OUTBOX: &str = "CREATE TABLE t_outbox (
    event_id varchar(255) NOT NULL,
    aggregate_type varchar(255),
    aggregate_id varchar(255),
    event_type varchar(255),
    payload longtext,
    status varchar(255),
    retry_count int NOT NULL,
    create_time datetime(6),
    PRIMARY KEY (event_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4";

/// `[store.table]` mapping [`T_OUTBOX`] as it is (`examples/mysql-t_outbox.toml`).
pub const T_OUTBOX_MAPPING: &str = "[store.table]
name = \"t_outbox\"
id = \"event_id\"
aggregate_type = \"aggregate_type\"
aggregate_id = \"aggregate_id\"
event_type = \"event_type\"
payload = \"payload\"
created_at = \"create_time\"
attempts = \"retry_count\"
marking = { style = \"status\", column = \"status\", pending = \"PENDING\", sent = \"SENT\" }";

/// Crash the own server of `scripts/mariadb-own` (`kill -9`, as a host
/// failure would) and wait until its port is closed; `mariadb_own_admin_url`
/// starts it again (InnoDB recovers what was committed).
pub fn mariadb_own_crash(admin_url: &str) -> Result<()> {
    let port = admin_url
        .rsplit(':')
        .next()
        .and_then(|p| p.split('/').next())
        .unwrap_or("3307")
        .to_string();
    let out = Command::new("pgrep")
        .args(["-f", &format!("mariadbd .*--port={port}")])
        .output()?;
    let pids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect();
    if pids.is_empty() {
        bail!("no mariadbd on port {port} to crash");
    }
    for pid in &pids {
        Command::new("kill").args(["-9", pid]).status()?;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap_or(3307))).is_ok() {
        if Instant::now() > deadline {
            bail!("mariadbd on port {port} still answers after kill -9");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Start a relay on `config` and stop it once it recorded a binlog
/// position (`capture = "binlog"`): what is written after comes from the
/// binlog.
pub async fn record_a_position(db: &MyDb, config: &Path) -> Result<()> {
    let mut first = Relay::start(config, &[])?;
    let recorded = eventually(Duration::from_secs(20), || async {
        db.count("SELECT count(*) FROM outroute_binlog WHERE backfilled = 1")
            .await
            == 1
    })
    .await;
    let log = first.log_text();
    first.terminate(Duration::from_secs(15));
    if !recorded {
        bail!("no binlog position recorded\n{log}");
    }
    Ok(())
}

/// Lease loss mid-batch on MySQL/MariaDB, end to end, for one failpoint:
/// a relay frozen there (SIGSTOP) loses its lease to a second relay, which
/// publishes everything; thawed, the first publishes at most
/// `may_duplicate` events again, says one of `noticed`, keeps running, and
/// after an ack counts its refused mark (`outroute_mark_fenced_total`).
/// `store`: more `[store]` lines (`capture = "binlog"`: a position is
/// recorded first, so the events are streamed).
pub async fn frozen_past_its_lease(
    db: &MyDb,
    point: &str,
    (store, relay): (&str, &str),
    may_duplicate: usize,
    noticed: &[&str],
) -> Result<()> {
    let t = tag();
    let topic = format!("t{t}.order-updated");
    create_topic(&topic, 3).await?;
    let dir = test_dir(&format!("mysql-frozen-{point}"));
    let route = format!(
        "config = {{ sink = \"kafka\", topic = \"t{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"t{t}.*\"] }}"
    );
    let (frozen_http, other_http) = (free_addr(), free_addr());
    let config_at = |dir: &Path, http: &str| {
        write_config_with(
            dir,
            &db.url,
            store,
            relay,
            &relay_body(http, &[TestSink::Kafka], "order-router", "orders", &route),
        )
    };
    let config = config_at(&dir, &frozen_http)?;
    let other_config = config_at(&dir.join("other"), &other_http)?;
    db.migrate(&config)?;
    if store.contains("binlog") {
        record_a_position(db, &config).await?;
    }
    let w = produce_mysql(&db.pool, &format!("frozen-{point}"), 40, 5, 0).await?;
    let mut frozen = Relay::start(
        &config,
        &[
            ("OUTROUTE_FAILPOINT", point),
            ("OUTROUTE_FAILPOINT_ACTION", "stop"),
        ],
    )?;
    let pid = frozen.child.id();
    if !eventually(Duration::from_secs(30), || async { stopped(pid) }).await {
        bail!(
            "{point}: the relay never stopped at the failpoint:\n{}",
            frozen.log_text()
        );
    }
    let pending = "SELECT count(*) FROM outbox WHERE published_at = '1000-01-01 00:00:00'";
    let mut other = Relay::start(&other_config, &[])?;
    if !eventually(Duration::from_secs(60), || async {
        db.count(pending).await == 0
    })
    .await
    {
        bail!(
            "{point}: the second relay did not publish the backlog:\n{}",
            other.log_text()
        );
    }
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(pid as i32, libc::SIGCONT);
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    let delivered = consume_kafka(&topic, 3, usize::MAX, Duration::from_secs(5))?;
    let report = check(&w, &delivered);
    println!("frozen at {point}: {report}");
    let log = frozen.log_text();
    let said = noticed.iter().find(|n| log.contains(**n));
    let running = frozen.child.try_wait()?.is_none();
    let fenced = if said == noticed.first() && point == "after-ack" {
        let (_, metrics) = http_get(&frozen_http, "/metrics").await?;
        metric(&metrics, "outroute_mark_fenced_total{source=\"default\"}")
    } else {
        Some(1.0)
    };
    frozen.terminate(Duration::from_secs(15));
    other.terminate(Duration::from_secs(15));
    if report.lost > 0 || report.order_violations > 0 || report.duplicates > may_duplicate {
        bail!("{point}: {report} (at most {may_duplicate} duplicates)\n{log}");
    }
    if said.is_none() || !running {
        bail!("{point}: the thawed relay should notice its lease lapsed and keep running:\n{log}");
    }
    if !fenced.is_some_and(|n| n >= 1.0) {
        bail!("{point}: outroute_mark_fenced_total: {fenced:?}");
    }
    Ok(())
}
