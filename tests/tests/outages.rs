//! Outages mid-stream: NATS stopped for 10 s, the Kafka broker frozen for
//! 10 s (SIGSTOP: a network cut), PostgreSQL restarted, and the relay itself
//! told to stop mid-batch. Nothing is lost, order holds, memory stays
//! bounded, and the relay recovers without a restart. These tests stop
//! shared services, so they run one at a time.

use std::process::Command;
use std::time::{Duration, Instant};

use outroute_e2e::*;
use tokio::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::const_new(());

fn pids(pattern: &str) -> Vec<i32> {
    Command::new("pgrep")
        .args(["-f", pattern])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn signal_all(pattern: &str, sig: i32) -> usize {
    let p = pids(pattern);
    for pid in &p {
        // SAFETY: kill(2) on a broker process of this machine.
        unsafe {
            libc::kill(*pid, sig);
        }
    }
    p.len()
}

fn services() {
    let status = Command::new(workspace().join("scripts/services")).status();
    assert!(status.is_ok_and(|s| s.success()), "scripts/services failed");
}

fn rss_mib(pid: u32) -> f64 {
    proc_memory_kib(pid, "VmRSS") as f64 / 1024.0
}

fn body(
    t: &str,
    http: &str,
    sinks: &[TestSink],
    plugin_name: &str,
    route_config: &str,
    allow: &str,
) -> String {
    // max_attempts = 1: an unavailable broker must still never dead-letter an event.
    let route = format!(
        "config = {route_config}\nallow = {allow}\nbackoff_min = \"100ms\"\nbackoff_max = \"1s\"\nmax_attempts = 1"
    );
    relay_body(http, sinks, plugin_name, "r", &route).replace("{t}", t)
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_down_for_10s_loses_nothing_and_fanout_waits_for_both_acks() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    services();
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("o{t}.order-updated");
    create_topic(&topic, 2).await?;
    let stream = format!("O{t}");
    nats_stream(&stream, vec![format!("o{t}.>")]).await?;
    let http = free_addr();
    let dir = test_dir("natsdown");
    let config = write_config(
        &dir,
        &db.url,
        "lease_ttl = \"3s\"\npublish_timeout = \"2s\"",
        &body(
            &t,
            &http,
            &[TestSink::Kafka, TestSink::Nats],
            "fanout",
            "{ targets = [ { sink = \"kafka\", topic = \"o{t}.{event_type}\" }, { sink = \"nats\", topic = \"o{t}.{event_type}\" } ] }",
            "{ kafka = [\"o{t}.*\"], nats = [\"o{t}.*\"] }",
        ),
    )?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    let first = produce(&db.pool, "a", 20, 5, 0).await?;
    assert!(
        eventually(Duration::from_secs(30), || async {
            db.unpublished("").await == 0
        })
        .await
    );

    assert!(
        signal_all("nats-server", libc::SIGTERM) > 0,
        "no nats-server to stop"
    );
    // Wait until the server is really gone (it drains for a moment after
    // SIGTERM) before writing the events that must wait for it.
    let gone = eventually(Duration::from_secs(10), || async {
        pids("nats-server").is_empty()
    })
    .await;
    assert!(gone, "nats-server did not stop");
    let down = Instant::now();
    let second = produce(&db.pool, "b", 20, 5, 0).await?;
    // While NATS is down: nothing of the new work is marked (Kafka may have
    // acked its half of the fan-out). The relay is degraded, not down: its
    // source is live, so /readyz answers ready and lists the sink; strict
    // readiness fails.
    let not_ready = eventually(Duration::from_secs(8), || async {
        http_get(&http, "/readyz?strict")
            .await
            .is_ok_and(|(s, b)| s == 503 && b.contains("sink `nats` not connected"))
    })
    .await;
    assert!(not_ready, "{:?}", http_get(&http, "/readyz?strict").await);
    let (code, body) = http_get(&http, "/readyz").await?;
    assert!(
        code == 200
            && body.contains("ready (degraded")
            && body.contains("sink `nats` not connected since "),
        "{code}: {body}"
    );
    assert_eq!(db.unpublished("").await, 100);
    let rss_down = rss_mib(relay.child.id());
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(down.elapsed())).await;
    assert_eq!(db.unpublished("").await, 100, "marked while NATS was down");
    services(); // NATS back
    let mut all = first;
    all.committed.extend(second.committed);
    all.committed.sort_by_key(|e| e.seq);
    let js = async_nats::jetstream::new(async_nats::connect(NATS).await?);
    let nats = consume_nats(&js, &stream, all.committed.len(), Duration::from_secs(60)).await?;
    let kafka = consume_kafka(&topic, 2, all.committed.len(), Duration::from_secs(30))?;
    let (rn, rk) = (check(&all, &nats), check(&all, &kafka));
    println!("nats outage: nats {rn}; kafka {rk}; relay RSS while down {rss_down:.0} MiB");
    rn.assert_clean();
    rk.assert_clean();
    assert!(
        rss_down < 200.0,
        "relay RSS {rss_down} MiB while NATS was down"
    );
    assert!(relay.child.try_wait()?.is_none(), "relay exited");
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// A fresh database, a Kafka topic with `partitions` and a migrated relay
/// config routing order events to it through order-router.
async fn kafka_setup(
    name: &str,
    relay: &str,
    partitions: i32,
) -> anyhow::Result<(TestDb, String, std::path::PathBuf)> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("k{t}.order-updated");
    create_topic(&topic, partitions).await?;
    let http = free_addr();
    let route = (
        "{ sink = \"kafka\", topic = \"k{t}.{event_type}\" }",
        "{ kafka = [\"k{t}.*\"] }",
    );
    let config = write_config(
        &test_dir(name),
        &db.url,
        relay,
        &body(
            &t,
            &http,
            &[TestSink::Kafka],
            "order-router",
            route.0,
            route.1,
        ),
    )?;
    db.migrate(&config)?;
    Ok((db, topic, config))
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_broker_frozen_for_10s_then_everything_arrives_in_order() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    services();
    let (db, topic, config) = kafka_setup(
        "kafkafrozen",
        "lease_ttl = \"3s\"\npublish_timeout = \"5s\"",
        3,
    )
    .await?;
    let mut relay = Relay::start(&config, &[])?;
    let first = produce(&db.pool, "a", 50, 4, 0).await?;
    assert!(
        eventually(Duration::from_secs(30), || async {
            db.unpublished("").await == 0
        })
        .await
    );
    assert!(
        signal_all("tansu broker", libc::SIGSTOP) > 0,
        "no tansu to freeze"
    );
    let second = produce(&db.pool, "b", 50, 4, 0).await?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let pending_while_frozen = db.unpublished("").await;
    let rss = rss_mib(relay.child.id());
    signal_all("tansu broker", libc::SIGCONT);
    assert_eq!(
        pending_while_frozen, 200,
        "rows marked while the broker was frozen"
    );
    let mut all = first;
    all.committed.extend(second.committed);
    all.committed.sort_by_key(|e| e.seq);
    let kafka = consume_kafka(&topic, 3, all.committed.len(), Duration::from_secs(90))?;
    let r = check(&all, &kafka);
    println!("kafka frozen 10s: {r}; relay RSS while frozen {rss:.0} MiB");
    if r.lost > 0 {
        let pending = db.unpublished("").await;
        let log = relay.log_text();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        panic!(
            "lost {} (pending rows {pending}); relay log tail:\n{}",
            r.lost,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    // Nothing lost is not enough: no phantom, and every aggregate's first
    // deliveries in outbox order across the freeze (issue 49).
    r.assert_clean();
    assert!(rss < 200.0);
    assert!(
        eventually(Duration::from_secs(30), || async {
            db.unpublished("").await == 0
        })
        .await
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_restart_and_sigterm_mid_batch_lose_nothing() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    services();
    let (db, topic, config) = kafka_setup(
        "pgrestart",
        "lease_ttl = \"3s\"\nbatch_size = 100\nshutdown_timeout = \"5s\"",
        2,
    )
    .await?;
    let mut work = produce(&db.pool, "a", 100, 20, 0).await?;
    let mut relay = Relay::start(&config, &[])?;

    // SIGTERM while batches are in flight: a clean, bounded exit that gives
    // the lanes back.
    assert!(
        eventually(Duration::from_secs(30), || async {
            db.published("").await > 0
        })
        .await
    );
    let stopped = Instant::now();
    let status = relay
        .terminate(Duration::from_secs(15))
        .expect("no exit within 15s of SIGTERM");
    assert!(status.success(), "{status:?}\n{}", relay.log_text());
    assert!(
        stopped.elapsed() < Duration::from_secs(8),
        "shutdown took {:?}",
        stopped.elapsed()
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM outroute_lanes WHERE owner IS NOT NULL AND lease_until > now()"
        )
        .await,
        0
    );

    // PostgreSQL restarts under a running relay (running: it holds lanes;
    // the one before gave all of them back).
    let mut relay = Relay::start(&config, &[])?;
    let running = eventually(Duration::from_secs(30), || async {
        db.count(
            "SELECT count(*) FROM outroute_lanes WHERE owner IS NOT NULL AND lease_until > now()",
        )
        .await
            > 0
    })
    .await;
    assert!(running, "the relay holds no lane:\n{}", relay.log_text());
    let cluster = std::fs::read_dir("/etc/postgresql")?
        .next()
        .and_then(|e| e.ok())
        .map(|e| e.file_name());
    let cluster = cluster
        .and_then(|c| c.into_string().ok())
        .unwrap_or_else(|| "15".into());
    let ok = Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &cluster, "main", "restart"])
        .status()?;
    assert!(ok.success(), "pg_ctlcluster restart failed");
    services();
    let more = produce(&db.pool, "b", 50, 4, 0).await?;
    work.committed.extend(more.committed);
    work.committed.sort_by_key(|e| e.seq);
    let kafka = consume_kafka(&topic, 2, work.committed.len(), Duration::from_secs(90))?;
    let r = check(&work, &kafka);
    println!("sigterm + postgres restart: {r}");
    r.assert_clean();
    // It met the restart (its connections were ended), and rode it out.
    assert!(
        relay
            .log_text()
            .contains("terminating connection due to administrator command"),
        "the relay never noticed the restart:\n{}",
        relay.log_text()
    );
    assert!(
        relay.child.try_wait()?.is_none(),
        "relay died with the database:\n{}",
        relay.log_text()
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_sink_never_dead_letters_events_while_other_sinks_flow() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    services();
    let db = TestDb::new().await?;
    let t = tag();
    create_topic(&format!("m{t}.order-updated"), 1).await?;
    let stream = format!("M{t}");
    nats_stream(&stream, vec![format!("m{t}.>")]).await?;
    // Route 1 (fan-out to Kafka and NATS) and route 2 (Kafka only) share
    // batches, so a batch is never "all failed" while NATS is down.
    let mut cfg = body(
        &t,
        "",
        &[TestSink::Kafka, TestSink::Nats],
        "fanout",
        "{ targets = [ { sink = \"kafka\", topic = \"m{t}.{event_type}\" }, { sink = \"nats\", topic = \"m{t}.{event_type}\" } ] }",
        "{ kafka = [\"m{t}.*\"], nats = [\"m{t}.*\"] }",
    );
    cfg = cfg.replace(
        "name = \"r\"\n",
        "name = \"r\"\naggregate_types = [\"order\"]\n",
    );
    cfg.push_str(&format!(
        "[plugins.k]\npath = \"{}\"\n[[routes]]\nname = \"kafka-only\"\naggregate_types = [\"audit\"]\nplugin = \"k\"\n\
         config = {{ sink = \"kafka\", topic = \"m{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"m{t}.*\"] }}\n",
        plugin("order-router").display()
    ));
    let config = write_config(
        &test_dir("deadsink"),
        &db.url,
        "lease_ttl = \"3s\"\npublish_timeout = \"2s\"",
        &cfg,
    )?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    let started = eventually(Duration::from_secs(20), || async {
        relay.log_text().contains("outroute relay started")
    })
    .await;
    assert!(started, "{}", relay.log_text());
    assert!(signal_all("nats-server", libc::SIGTERM) > 0);
    assert!(
        eventually(Duration::from_secs(10), || async {
            pids("nats-server").is_empty()
        })
        .await
    );
    let work = produce(&db.pool, "a", 10, 3, 0).await?; // 30 fan-out events
    for i in 0..30 {
        sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'audit', $2, 'order-updated', '{}')")
            .bind(uuid::Uuid::new_v4())
            .bind(format!("x{i}"))
            .execute(&db.pool)
            .await?;
    }
    // Kafka-only events flow while NATS is down …
    let flowed = eventually(Duration::from_secs(30), || async {
        db.unpublished("o.aggregate_type = 'audit'").await == 0
    })
    .await;
    assert!(
        flowed,
        "events for the healthy sink were held back:\n{}",
        relay.log_text()
    );
    // … and several retry rounds later (max_attempts = 1) nothing was dead-lettered.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        db.count("SELECT count(*) FROM outroute_event_state WHERE failed_at IS NOT NULL")
            .await,
        0,
        "dead-lettered"
    );
    assert_eq!(
        db.unpublished("o.aggregate_type = 'order'").await,
        30,
        "fan-out events must wait for NATS"
    );
    services(); // NATS back
    let js = async_nats::jetstream::new(async_nats::connect(NATS).await?);
    let nats = consume_nats(&js, &stream, work.committed.len(), Duration::from_secs(60)).await?;
    let r = check(&work, &nats);
    println!("dead sink: {r}");
    r.assert_clean();
    // The Kafka leg of each fan-out event was acknowledged on the first
    // attempt; the retries while NATS was down re-sent only the NATS leg.
    let kafka: Vec<Delivered> = consume_kafka(
        &format!("m{t}.order-updated"),
        1,
        work.committed.len() + 30,
        Duration::from_secs(30),
    )?
    .into_iter()
    .filter(|d| d.headers.get("ce_aggregatetype").map(String::as_str) == Some("order"))
    .collect();
    let r = check(&work, &kafka);
    println!("dead sink, the healthy sink's leg: {r}");
    r.assert_clean();
    assert_eq!(
        r.duplicates, 0,
        "the acknowledged Kafka leg was re-sent while NATS was down: {r}"
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// NATS is down when the relay starts (its JetStream stream cannot even be
/// created): the relay starts anyway, the Kafka route delivers from the
/// start, the NATS route's events wait (nothing marked, nothing failed) and
/// go out once NATS is back, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn nats_down_at_start_holds_only_the_routes_that_publish_to_it() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    services();
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("k{t}.order-updated");
    create_topic(&topic, 2).await?;
    let stream = format!("S{t}");
    let http = free_addr();
    let dir = test_dir("natsdown-start");
    let body = format!(
        "[http]\nlisten = \"{http}\"\n\
         [sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{KAFKA}\"\n\
         [sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\ncreate_stream = {{ name = \"{stream}\", subjects = [\"s{t}.>\"] }}\n\
         [plugins.p]\npath = \"{}\"\n\
         [[routes]]\nname = \"payments\"\nplugin = \"p\"\naggregate_types = [\"payment\"]\n\
         config = {{ sink = \"nats\", topic = \"s{t}.{{event_type}}\" }}\nallow = {{ nats = [\"s{t}.*\"] }}\n\
         backoff_min = \"100ms\"\nbackoff_max = \"1s\"\nmax_attempts = 1\n\
         [[routes]]\nname = \"orders\"\nplugin = \"p\"\naggregate_types = [\"order\"]\n\
         config = {{ sink = \"kafka\", topic = \"k{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"k{t}.*\"] }}\n",
        plugin("order-router").display()
    );
    let config = write_config(&dir, &db.url, "publish_timeout = \"2s\"", &body)?;
    db.migrate(&config)?;
    let payments = insert_events(&db.pool, "payment", 10, 3).await?;
    assert!(
        signal_all("nats-server", libc::SIGTERM) > 0,
        "no nats-server to stop"
    );
    let gone = eventually(Duration::from_secs(10), || async {
        pids("nats-server").is_empty()
    })
    .await;
    assert!(gone, "nats-server did not stop");
    let mut relay = Relay::start(&config, &[])?;
    let orders = produce(&db.pool, "o", 10, 3, 0).await?;
    let kafka = consume_kafka(&topic, 2, orders.committed.len(), Duration::from_secs(30));
    let still_down = pids("nats-server").is_empty();
    let waiting = db.unpublished("o.aggregate_type = 'payment'").await;
    let (code, ready) = http_get(&http, "/readyz").await?;
    let (_, text) = http_get(&http, "/metrics").await?;
    services(); // NATS back before any assertion can fail
    let r = check(&orders, &kafka?);
    println!("kafka while NATS was down at start: {r}");
    r.assert_clean();
    assert!(still_down, "NATS came back too early for the check");
    assert_eq!(
        waiting,
        payments.committed.len() as i64,
        "payments marked while NATS was down"
    );
    assert!(
        code == 200 && ready.contains("sink `nats` not connected"),
        "{code}: {ready}"
    );
    assert_eq!(
        metric(&text, "outroute_sink_up{sink=\"nats\"}"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "outroute_sink_up{sink=\"kafka\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "outroute_route_waiting{route=\"payments\",reason=\"sink\"}"
        ),
        Some(1.0),
        "{text}"
    );
    // NATS back: the stream is created and the waiting events go out.
    let js = async_nats::jetstream::new(async_nats::connect(NATS).await?);
    let created = eventually(Duration::from_secs(30), || async {
        js.get_stream(&stream).await.is_ok()
    })
    .await;
    assert!(
        created,
        "stream {stream} not created once NATS was back: {}",
        relay.log_text()
    );
    let nats = consume_nats(
        &js,
        &stream,
        payments.committed.len(),
        Duration::from_secs(60),
    )
    .await?;
    let r = check(&payments, &nats);
    println!("nats after it came back: {r}");
    r.assert_clean();
    assert!(
        eventually(Duration::from_secs(30), || async {
            db.unpublished("").await == 0
        })
        .await
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL")
            .await,
        0,
        "an event failed for want of a broker"
    );
    assert!(relay.child.try_wait()?.is_none(), "relay exited");
    relay.terminate(Duration::from_secs(15));
    drop_nats_stream(&stream).await;
    db.drop_db().await;
    Ok(())
}
