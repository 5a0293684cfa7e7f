//! Faults between the relay and MariaDB, and behind it (issue 44): random
//! network faults on the relay's database connections (cuts, delays, black
//! holes, refusals) and on the broker's, while producers keep committing;
//! and the database server crashing (`kill -9`) under a running relay. Each
//! in lease mode and in binlog mode (on the own server, which has a binlog).
//! Afterwards every committed event has arrived, none out of per-aggregate
//! order, and the relay is still running.
//!
//! `OUTROUTE_NETWORK_FAULTS` sets the faults per run (default 100 here);
//! the seed is printed and `OUTROUTE_FAULT_SEED` replays a run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outroute_e2e::proxy::{FaultProxy, Rng, inject};
use outroute_e2e::*;

/// Tests on the own server (`scripts/mariadb-own`, the one with a binlog)
/// run beside each other; the one that crashes it runs alone.
static OWN_SERVER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// How the relay reads the outbox, and the server that allows it.
#[derive(Clone, Copy)]
enum Capture {
    /// Claims, on the machine's shared MariaDB.
    Lease,
    /// The binlog, on the own server.
    Binlog,
}

impl Capture {
    async fn db(self) -> anyhow::Result<MyDb> {
        match self {
            Capture::Lease => MyDb::new().await,
            Capture::Binlog => MyDb::new_at(&mariadb_own_admin_url()?).await,
        }
    }

    /// The server's `host:port`.
    fn server(self) -> anyhow::Result<String> {
        Ok(match self {
            Capture::Lease => "127.0.0.1:3306".to_string(),
            Capture::Binlog => {
                let url = mariadb_own_admin_url()?;
                let host = url.rsplit('@').next().unwrap_or_default();
                host.split('/').next().unwrap_or_default().to_string()
            }
        })
    }

    fn store(self) -> &'static str {
        match self {
            Capture::Lease => "",
            Capture::Binlog => "capture = \"binlog\"",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Capture::Lease => "",
            Capture::Binlog => " (binlog)",
        }
    }
}

const PENDING: &str = "SELECT count(*) FROM outbox WHERE published_at = '1000-01-01 00:00:00'";

fn faults() -> usize {
    std::env::var("OUTROUTE_NETWORK_FAULTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

/// Keep committing business transactions on `pool` until `stop`.
fn keep_producing(
    pool: sqlx::MySqlPool,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<anyhow::Result<Workload>> {
    tokio::spawn(async move {
        let mut all = Workload::default();
        let mut round = 0;
        while !stop.load(Ordering::SeqCst) {
            round += 1;
            let w = produce_mysql(&pool, &format!("net{round}"), 20, 2, 7).await?;
            all.committed.extend(w.committed);
            all.rolled_back.extend(w.rolled_back);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        all.committed.sort_by_key(|e| e.seq);
        Ok(all)
    })
}

/// Producers commit while `inject` runs its faults through `proxy`; then
/// wait (bounded) until the relay has marked everything. Returns what was
/// committed and the faults by kind.
async fn faults_while_producing(
    db: &MyDb,
    proxy: &FaultProxy,
    rng: &mut Rng,
    relay: &Relay,
) -> anyhow::Result<(Workload, [usize; 4])> {
    let stop = Arc::new(AtomicBool::new(false));
    let producing = keep_producing(db.pool.clone(), stop.clone());
    let kinds = inject(proxy, rng, faults()).await;
    stop.store(true, Ordering::SeqCst);
    let w = producing.await??;
    let drained = eventually(Duration::from_secs(120), || async {
        db.count(PENDING).await == 0
    })
    .await;
    assert!(drained, "rows left pending:\n{}", relay.log_text());
    Ok((w, kinds))
}

/// `100 faults (cut 28, delay 21, black hole 23, refuse 28)`.
fn describe(kinds: [usize; 4]) -> String {
    format!(
        "{} faults (cut {}, delay {}, black hole {}, refuse {})",
        kinds.iter().sum::<usize>(),
        kinds[0],
        kinds[1],
        kinds[2],
        kinds[3]
    )
}

/// A JetStream stream for `t`'s subjects, and the route publishing to it.
async fn nats_route(t: &str) -> anyhow::Result<(async_nats::jetstream::Context, String, String)> {
    let stream = format!("MYF{t}");
    let js = nats_stream(&stream, vec![format!("myf{t}.>")]).await?;
    let route = format!(
        "config = {{ sink = \"nats\", topic = \"myf{t}.{{event_type}}\" }}\nallow = {{ nats = [\"myf{t}.*\"] }}"
    );
    Ok((js, stream, route))
}

/// The relay's MariaDB connections go through a fault proxy that cuts,
/// delays, black-holes and refuses them at random while producers commit
/// (directly, not through the proxy). Statements lost or hung are given up
/// after `store.statement_timeout` and retried on fresh connections; a mark
/// whose answer was lost may re-send (same id), never lose.
#[tokio::test(flavor = "multi_thread")]
async fn mariadb_connections_through_random_network_faults_lose_nothing() -> anyhow::Result<()> {
    db_faults(Capture::Lease).await
}

/// [`mariadb_connections_through_random_network_faults_lose_nothing`] in
/// binlog mode: the replication connection goes through the proxy too; a
/// stream cut or hung resumes from the recorded position.
#[tokio::test(flavor = "multi_thread")]
async fn mariadb_connections_through_random_network_faults_lose_nothing_in_binlog_mode()
-> anyhow::Result<()> {
    let _beside = OWN_SERVER.read().await;
    db_faults(Capture::Binlog).await
}

async fn db_faults(capture: Capture) -> anyhow::Result<()> {
    let mut rng = Rng::from_env();
    let db = capture.db().await?;
    let server = capture.server()?;
    let proxy = FaultProxy::start("127.0.0.1:0", &server).await?;
    let url = db.url.replacen(&server, &proxy.addr, 1);
    let t = tag();
    let (js, stream, route) = nats_route(&t).await?;
    let dir = test_dir("mysql-net-db");
    let http = free_addr();
    let config = write_config_with(
        &dir,
        &url,
        &format!("statement_timeout = \"2s\"\n{}", capture.store()),
        "lanes = 8\nbatch_size = 100\npoll_max = \"20ms\"\nlease_ttl = \"6s\"",
        &relay_body(&http, &[TestSink::Nats], "order-router", "orders", &route),
    )?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;

    let (w, kinds) = faults_while_producing(&db, &proxy, &mut rng, &relay).await?;
    let delivered = consume_nats(&js, &stream, w.committed.len(), Duration::from_secs(30)).await?;
    let report = check(&w, &delivered);
    println!(
        "mariadb connections{}: {}: {report}",
        capture.label(),
        describe(kinds)
    );
    report.assert_clean();
    // The relay met the faults (its store statements failed or were given
    // up, its stream stopped) and rode them out.
    let log = relay.log_text();
    assert!(
        log.contains("claim failed")
            || log.contains("statement_timeout")
            || log.contains("capture stopped"),
        "the relay met none of the faults:\n{log}"
    );
    assert!(
        relay.child.try_wait()?.is_none(),
        "the relay died:\n{}",
        relay.log_text()
    );
    relay.terminate(Duration::from_secs(15));
    drop(proxy);
    db.drop_db().await;
    Ok(())
}

/// The broker's connections fail at random (Kafka through the fault proxy,
/// tansu advertising it) while a MariaDB outbox is relayed: marks wait for
/// acks, so nothing unacknowledged is marked and nothing is lost.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_through_random_network_faults_from_mariadb_loses_nothing() -> anyhow::Result<()> {
    kafka_faults(Capture::Lease).await
}

/// [`kafka_through_random_network_faults_from_mariadb_loses_nothing`] in
/// binlog mode: the recorded position waits for the acks as marks do.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_through_random_network_faults_from_mariadb_loses_nothing_in_binlog_mode()
-> anyhow::Result<()> {
    let _beside = OWN_SERVER.read().await;
    kafka_faults(Capture::Binlog).await
}

async fn kafka_faults(capture: Capture) -> anyhow::Result<()> {
    let mut rng = Rng::from_env();
    let broker = free_addr();
    let proxy = FaultProxy::start("127.0.0.1:0", &broker).await?;
    let _tansu = Tansu::start(&broker, &proxy.addr).await?;
    let t = tag();
    let topic = format!("myk{t}.order-updated");
    create_topic_at(&proxy.addr, &topic, 3).await?;
    let db = capture.db().await?;
    let dir = test_dir("mysql-net-kafka");
    let route = format!(
        "config = {{ sink = \"kafka\", topic = \"myk{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"myk{t}.*\"] }}"
    );
    let http = free_addr();
    let body = relay_body(&http, &[TestSink::Kafka], "order-router", "orders", &route)
        .replace(KAFKA, &proxy.addr);
    let config = write_config_with(
        &dir,
        &db.url,
        capture.store(),
        "lanes = 8\nbatch_size = 100\npublish_timeout = \"3s\"\npoll_max = \"20ms\"",
        &body,
    )?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    let (w, kinds) = faults_while_producing(&db, &proxy, &mut rng, &relay).await?;
    let delivered = consume_kafka_at(
        &proxy.addr,
        &topic,
        3,
        w.committed.len(),
        Duration::from_secs(60),
    )?;
    let report = check(&w, &delivered);
    println!(
        "kafka from mariadb{}: {}: {report}",
        capture.label(),
        describe(kinds)
    );
    report.assert_clean();
    let (_, metrics) = http_get(&http, "/metrics").await?;
    let errors: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("outroute_publish_errors_total{sink=\"kafka\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        errors >= 1.0,
        "the relay met none of the faults:\n{metrics}"
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// The database server dies (`kill -9` of the own MariaDB of
/// `scripts/mariadb-own`) while the relay drains a backlog, and comes back
/// after InnoDB's crash recovery: the relay rides it out without a restart
/// and every committed event — before the crash and after — arrives once
/// acknowledged rows are marked, in per-aggregate order.
#[tokio::test(flavor = "multi_thread")]
async fn a_mariadb_crash_under_a_running_relay_loses_nothing() -> anyhow::Result<()> {
    let _alone = OWN_SERVER.write().await;
    server_crash(Capture::Lease).await
}

/// [`a_mariadb_crash_under_a_running_relay_loses_nothing`] in binlog mode:
/// the stream breaks with the server and resumes from the recorded position
/// once InnoDB recovered (the binlog and the table agree after recovery).
#[tokio::test(flavor = "multi_thread")]
async fn a_mariadb_crash_under_a_running_relay_loses_nothing_in_binlog_mode() -> anyhow::Result<()>
{
    let _alone = OWN_SERVER.write().await;
    server_crash(Capture::Binlog).await
}

async fn server_crash(capture: Capture) -> anyhow::Result<()> {
    let admin = mariadb_own_admin_url()?;
    let db = MyDb::new_at(&admin).await?;
    let t = tag();
    let (js, stream, route) = nats_route(&t).await?;
    let dir = test_dir("mysql-crash");
    let config = write_config_with(
        &dir,
        &db.url,
        &format!("statement_timeout = \"2s\"\n{}", capture.store()),
        "lanes = 8\nbatch_size = 50\npoll_max = \"50ms\"\nlease_ttl = \"3s\"",
        &relay_body("", &[TestSink::Nats], "order-router", "orders", &route),
    )?;
    db.migrate(&config)?;
    let mut work = produce_mysql(&db.pool, "a", 100, 30, 0).await?;
    let mut relay = Relay::start(&config, &[])?;
    let published = "SELECT count(*) FROM outbox WHERE published_at > '1000-01-01 00:00:00'";
    assert!(
        eventually(Duration::from_secs(30), || async {
            db.count(published).await > 0
        })
        .await,
        "nothing published:\n{}",
        relay.log_text()
    );
    let before = db.count(PENDING).await;
    mariadb_own_crash(&admin)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    mariadb_own_admin_url()?;
    println!("crashed with {before} of {} pending", work.committed.len());
    assert!(before > 0, "the backlog drained before the crash");
    let more = produce_mysql(&db.pool, "b", 40, 5, 0).await?;
    work.committed.extend(more.committed);
    work.committed.sort_by_key(|e| e.seq);
    let drained = eventually(Duration::from_secs(120), || async {
        db.count(PENDING).await == 0
    })
    .await;
    assert!(drained, "rows left pending:\n{}", relay.log_text());
    let delivered =
        consume_nats(&js, &stream, work.committed.len(), Duration::from_secs(30)).await?;
    let report = check(&work, &delivered);
    println!(
        "mariadb kill -9 under a running relay{}: {report}",
        capture.label()
    );
    report.assert_clean();
    assert!(
        relay.child.try_wait()?.is_none(),
        "the relay died with the database:\n{}",
        relay.log_text()
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}
