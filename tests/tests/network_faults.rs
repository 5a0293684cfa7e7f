//! Randomized network faults between the relay and a real broker (tansu,
//! NATS JetStream), through the TCP fault proxy in `tests/src/proxy.rs`:
//! connections cut after a random number of bytes, delays, black holes and
//! refusals, one after another while producers keep committing. Afterwards
//! every committed event has arrived, no first delivery of an aggregate is
//! out of outbox order, and duplicates carry their original ids.
//!
//! Beside them, single faults held on purpose: store and LISTEN connections
//! that go silent, a reload while batches are out, and a broker whose acks
//! take longer than the lease has left (awaited while the lease is renewed).
//!
//! `OUTROUTE_NETWORK_FAULTS` sets the faults per sink (default 200;
//! `scripts/stress` runs more). The seed is printed; `OUTROUTE_FAULT_SEED`
//! replays a run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outroute_e2e::proxy::{Fault, FaultProxy, Rng, inject};
use outroute_e2e::*;

fn faults_per_sink() -> usize {
    std::env::var("OUTROUTE_NETWORK_FAULTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

/// Keep committing business transactions (20 aggregates, 2 events each per
/// round, every 7th rolled back) until `stop`.
fn keep_producing(
    pool: sqlx::PgPool,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<anyhow::Result<Workload>> {
    tokio::spawn(async move {
        let mut all = Workload::default();
        while !stop.load(Ordering::SeqCst) {
            let w = produce(&pool, "net", 20, 2, 7).await?;
            all.committed.extend(w.committed);
            all.rolled_back.extend(w.rolled_back);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        all.committed.sort_by_key(|e| e.seq);
        Ok(all)
    })
}

/// Producers commit while `inject` runs its faults; then wait (bounded)
/// until the relay has marked everything. Returns what was committed, the
/// faults by kind, and whether the outbox drained.
async fn faults_while_producing(
    db: &TestDb,
    proxy: &FaultProxy,
    rng: &mut Rng,
) -> anyhow::Result<(Workload, [usize; 4], bool)> {
    let stop = Arc::new(AtomicBool::new(false));
    let producing = keep_producing(db.pool.clone(), stop.clone());
    let kinds = inject(proxy, rng, faults_per_sink()).await;
    stop.store(true, Ordering::SeqCst);
    let w = producing.await??;
    let drained = eventually(Duration::from_secs(120), || async {
        db.unpublished("").await == 0
    })
    .await;
    Ok((w, kinds, drained))
}

/// Print the figures; nothing pending, nothing lost, no order violation,
/// and the relay met the faults: its sink `sink_name` counted publish
/// errors (read from `/metrics` at `http`).
async fn conclude(
    sink: &str,
    kinds: [usize; 4],
    drained: bool,
    report: &Report,
    relay: &Relay,
    (http, sink_name): (&str, &str),
) {
    let metrics = http_get(http, "/metrics")
        .await
        .map(|(_, m)| m)
        .unwrap_or_default();
    let errors: f64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with(&format!(
                "outroute_publish_errors_total{{sink=\"{sink_name}\""
            ))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        errors >= 1.0,
        "{sink}: the relay met none of the faults (no publish error counted):\n{metrics}"
    );
    println!(
        "{sink}: {} faults (cut {}, delay {}, black hole {}, refuse {}): {report}",
        kinds.iter().sum::<usize>(),
        kinds[0],
        kinds[1],
        kinds[2],
        kinds[3]
    );
    assert!(drained, "rows left pending:\n{}", relay.log_text());
    report.assert_clean();
}

fn relay_settings() -> &'static str {
    // Short publish deadline so black-holed messages are retried quickly.
    "lanes = 16\nbatch_size = 100\npublish_timeout = \"3s\"\npoll_max = \"20ms\""
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_through_random_network_faults_loses_nothing_and_keeps_order() -> anyhow::Result<()> {
    let mut rng = Rng::from_env();
    let broker = free_addr();
    let proxy = FaultProxy::start("127.0.0.1:0", &broker).await?;
    // The broker advertises the proxy, so every connection goes through it.
    let _tansu = Tansu::start(&broker, &proxy.addr).await?;
    let t = tag();
    let topic = format!("net{t}.order-updated");
    create_topic_at(&proxy.addr, &topic, 3).await?;

    let db = TestDb::new().await?;
    let dir = test_dir("net-kafka");
    let route = format!(
        "config = {{ sink = \"kafka\", topic = \"net{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"net{t}.*\"] }}"
    );
    let http = free_addr();
    let body = relay_body(&http, &[TestSink::Kafka], "order-router", "orders", &route)
        .replace(KAFKA, &proxy.addr);
    let config = write_config(&dir, &db.url, relay_settings(), &body)?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;

    let (w, kinds, drained) = faults_while_producing(&db, &proxy, &mut rng).await?;
    let delivered = consume_kafka_at(
        &proxy.addr,
        &topic,
        3,
        w.committed.len(),
        Duration::from_secs(60),
    )?;
    let report = check(&w, &delivered);
    conclude("kafka", kinds, drained, &report, &relay, (&http, "kafka")).await;
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn jetstream_through_random_network_faults_loses_nothing_and_keeps_order()
-> anyhow::Result<()> {
    let mut rng = Rng::from_env();
    let proxy = FaultProxy::start("127.0.0.1:0", "127.0.0.1:4222").await?;
    let t = tag();
    let stream = format!("NET{t}");
    let js = nats_stream(&stream, vec![format!("net{t}.>")]).await?;

    let db = TestDb::new().await?;
    let dir = test_dir("net-nats");
    let route = format!(
        "config = {{ sink = \"nats\", topic = \"net{t}.{{event_type}}\" }}\nallow = {{ nats = [\"net{t}.*\"] }}"
    );
    let http = free_addr();
    let body = relay_body(&http, &[TestSink::Nats], "order-router", "orders", &route)
        .replace(NATS, &format!("nats://{}", proxy.addr));
    let config = write_config(&dir, &db.url, relay_settings(), &body)?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;

    let (w, kinds, drained) = faults_while_producing(&db, &proxy, &mut rng).await?;
    let delivered = consume_nats(&js, &stream, w.committed.len(), Duration::from_secs(30)).await?;
    let report = check(&w, &delivered);
    conclude(
        "jetstream",
        kinds,
        drained,
        &report,
        &relay,
        (&http, "nats"),
    )
    .await;
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

/// The fault proxy in front of `db`'s server, and `db`'s URL through it.
async fn behind_proxy(db: &TestDb) -> anyhow::Result<(FaultProxy, String)> {
    let server = db
        .url
        .split_once('@')
        .and_then(|(_, rest)| rest.split('/').next())
        .ok_or_else(|| anyhow::anyhow!("no host in {}", db.url))?
        .to_string();
    let proxy = FaultProxy::start("127.0.0.1:0", &server).await?;
    let url = db.url.replacen(&server, &proxy.addr, 1);
    Ok((proxy, url))
}

/// The relay's database connections go silent for good (stranded: open, no
/// answer, no FIN or RST; new connections work, as after a partition that
/// dropped one path or a failover that left the old address dark), three
/// times while producers commit. The relay gives its statements up after
/// `store.statement_timeout`, drops those connections, carries on over
/// fresh ones and delivers everything once, in order.
#[tokio::test(flavor = "multi_thread")]
async fn store_connections_that_go_silent_are_given_up_and_replaced() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (proxy, url) = behind_proxy(&db).await?;
    let t = tag();
    let stream = format!("SIL{t}");
    let js = nats_stream(&stream, vec![format!("sil{t}.>")]).await?;
    let dir = test_dir("silent-store");
    let route = format!(
        "config = {{ sink = \"nats\", topic = \"sil{t}.{{event_type}}\" }}\nallow = {{ nats = [\"sil{t}.*\"] }}"
    );
    let http = free_addr();
    let body = relay_body(&http, &[TestSink::Nats], "order-router", "orders", &route);
    let config = write_config_with(
        &dir,
        &url,
        "statement_timeout = \"2s\"",
        "lanes = 16\nbatch_size = 100\npoll_max = \"20ms\"",
        &body,
    )?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;

    let stop = Arc::new(AtomicBool::new(false));
    let producing = keep_producing(db.pool.clone(), stop.clone());
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        proxy.strand();
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::SeqCst);
    let w = producing.await??;
    let drained = eventually(Duration::from_secs(60), || async {
        db.unpublished("").await == 0
    })
    .await;
    let log = relay.log_text();
    assert!(drained, "rows left pending:\n{log}");
    // The relay really met silent connections and gave statements up.
    assert!(
        log.contains("store.statement_timeout"),
        "no statement was given up:\n{log}"
    );
    // And says so where operators are told to alert.
    let (_, metrics) = http_get(&http, "/metrics").await?;
    let abandoned = metric(
        &metrics,
        "outroute_statements_abandoned_total{source=\"default\"}",
    );
    assert!(
        abandoned.is_some_and(|n| n >= 1.0),
        "outroute_statements_abandoned_total: {abandoned:?}\n{metrics}"
    );
    let delivered = consume_nats(&js, &stream, w.committed.len(), Duration::from_secs(30)).await?;
    let report = check(&w, &delivered);
    println!("silent store connections: {report}");
    report.assert_clean();
    relay.terminate(Duration::from_secs(15));
    drop(proxy);
    db.drop_db().await;
    Ok(())
}

/// `relay.notify_channel`: a LISTEN connection that goes silent is given up
/// and replaced, so wake-ups resume. Each event must go out within 3 s of
/// its NOTIFY, after 20 s of quiet: an idle worker's pause starts at
/// `relay.poll_min` (1 ms) whenever it gains lanes or a LISTEN connection
/// opens, and doubles up to `relay.poll_max` (60 s here), so its polls
/// fall 16.4 s and 32.8 s after such a start and polling alone would find
/// the event 12 s or more late. (With a 1 s quiet, as before, polling
/// found it in time: the test passed with NOTIFY broken.)
#[tokio::test(flavor = "multi_thread")]
async fn a_listen_connection_that_goes_silent_is_replaced() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (proxy, url) = behind_proxy(&db).await?;
    let t = tag();
    let channel = format!("wake_{t}");
    let dir = test_dir("silent-listen");
    let out = dir.join("out.jsonl");
    let route = format!(
        "config = {{ sink = \"file\", topic = \"w{t}.{{event_type}}\" }}\nallow = {{ file = [\"w{t}.*\"] }}"
    );
    let body = relay_body(
        "",
        &[TestSink::File(&out)],
        "order-router",
        "orders",
        &route,
    );
    let config = write_config_with(
        &dir,
        &url,
        "statement_timeout = \"1s\"",
        &format!("poll_max = \"60s\"\nnotify_channel = \"{channel}\""),
        &body,
    )?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    let produce_and_notify = |n: i64| {
        let (pool, channel) = (db.pool.clone(), channel.clone());
        async move {
            let mut tx = pool.begin().await?;
            sqlx::query(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES (gen_random_uuid(), 'order', $1, 'order-created', '{}')",
            )
            .bind(format!("o-{n}"))
            .execute(&mut *tx)
            .await?;
            sqlx::query(&format!("NOTIFY {channel}"))
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            anyhow::Ok(())
        }
    };
    // Leases first: a NOTIFY before the relay owns lanes wakes nobody.
    let leased = eventually(Duration::from_secs(30), || async {
        db.count("SELECT count(*) FROM outroute_lanes WHERE lease_until > now()")
            .await
            > 0
    })
    .await;
    assert!(leased, "no lane leased:\n{}", relay.log_text());
    tokio::time::sleep(Duration::from_secs(20)).await;
    // A NOTIFY wakes the relay (polling would take 12 s or more).
    produce_and_notify(1).await?;
    let woken = eventually(Duration::from_secs(3), || async {
        db.unpublished("").await == 0
    })
    .await;
    assert!(
        woken,
        "NOTIFY did not wake the relay:\n{}",
        relay.log_text()
    );

    // Quiet long enough for the workers' pause to grow, then cut.
    tokio::time::sleep(Duration::from_secs(16)).await;
    proxy.strand();
    let replaced = eventually(Duration::from_secs(20), || async {
        relay.log_text().contains("opening a new LISTEN connection")
    })
    .await;
    let log = relay.log_text();
    assert!(replaced, "the silent LISTEN connection was kept:\n{log}");
    assert!(log.contains("store.statement_timeout"), "{log}");
    // The new connection restarted the pause: quiet again, then a NOTIFY.
    tokio::time::sleep(Duration::from_secs(20)).await;
    produce_and_notify(2).await?;
    let woken = eventually(Duration::from_secs(3), || async {
        db.unpublished("").await == 0
    })
    .await;
    assert!(
        woken,
        "no wake-up after the LISTEN connection was replaced:\n{}",
        relay.log_text()
    );
    assert_eq!(file_sink_deliveries(&out).len(), 2);
    relay.terminate(Duration::from_secs(15));
    drop(proxy);
    db.drop_db().await;
    Ok(())
}

/// A reload hands over while a batch still waits for its broker (issue 41,
/// item 9): the broker's answers stop (a black hole) with one event out;
/// meanwhile its stream starts refusing the message (`max_msg_size`), and
/// the reload points the route at another stream, directly. The successor
/// publishes the event. Then the black hole lifts: the old publish reaches
/// the server and is refused. The old batch, past `shutdown_timeout`, must be
/// stopped by then: left running (the bug), it records that refusal as a
/// retry of an event its successor already published, under the same relay
/// id and epoch, and the aggregate's next event waits behind it.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_stops_the_batches_its_predecessor_still_had_out() -> anyhow::Result<()> {
    let proxy = FaultProxy::start("127.0.0.1:0", "127.0.0.1:4222").await?;
    let t = tag();
    let (old_stream, new_stream) = (format!("RLDA{t}"), format!("RLDB{t}"));
    let js = nats_stream(&old_stream, vec![format!("rlda{t}.>")]).await?;
    nats_stream(&new_stream, vec![format!("rldb{t}.>")]).await?;
    let db = TestDb::new().await?;
    let dir = test_dir("net-reload");
    let route = |s: &str| {
        format!(
            "config = {{ sink = \"nats\", topic = \"{s}{t}.{{event_type}}\" }}\nallow = {{ nats = [\"{s}{t}.*\"] }}\n\
             backoff_min = \"60s\"\nbackoff_max = \"120s\""
        )
    };
    let proxied = relay_body(
        "",
        &[TestSink::Nats],
        "order-router",
        "orders",
        &route("rlda"),
    )
    .replace(NATS, &format!("nats://{}", proxy.addr));
    let direct = relay_body(
        "",
        &[TestSink::Nats],
        "order-router",
        "orders",
        &route("rldb"),
    );
    let relay_settings = "lanes = 4\nbatch_size = 10\npublish_timeout = \"10s\"\nshutdown_timeout = \"1s\"\npoll_max = \"20ms\"";
    let config = write_config(&dir, &db.url, relay_settings, &proxied)?;
    db.migrate(&config)?;
    let mut relay = Relay::start(&config, &[])?;
    let warm = insert_events(&db.pool, "warm", 1, 1).await?;
    consume_nats(&js, &old_stream, 1, Duration::from_secs(30)).await?;

    proxy.set(Fault::BlackHole);
    let stuck = insert_events(&db.pool, "x", 1, 1).await?;
    let id = stuck.committed[0].id.clone();
    // The batch is out and waits for its acknowledgement.
    tokio::time::sleep(Duration::from_millis(800)).await;
    // The old stream will refuse the message when it arrives.
    let mut refusing = js
        .get_stream(&old_stream)
        .await?
        .info()
        .await?
        .config
        .clone();
    refusing.max_message_size = 16;
    js.update_stream(&refusing).await?;
    write_config(&dir, &db.url, relay_settings, &direct)?;
    relay.reload();
    // (The warm-up event may come again first: its acknowledgement can be
    // caught in the black hole too, and the successor re-sends it.)
    let reached = |wanted: String| {
        let js = js.clone();
        let stream = new_stream.clone();
        async move {
            consume_nats(&js, &stream, 3, Duration::from_millis(500))
                .await
                .is_ok_and(|d| d.iter().any(|d| d.id() == wanted))
        }
    };
    eventually(Duration::from_secs(30), || reached(id.clone())).await;
    let delivered = consume_nats(&js, &new_stream, 3, Duration::from_millis(500)).await?;
    assert!(
        delivered.iter().any(|d| d.id() == id),
        "the successor did not publish the event ({} pending)\n{}",
        db.unpublished("").await,
        relay.log_text()
    );
    // The old publish reaches the server now, and is refused.
    proxy.set(Fault::None);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let state = db
        .count(&format!(
            "SELECT count(*) FROM outroute_event_state WHERE event_id = '{id}'"
        ))
        .await;
    assert_eq!(
        state,
        0,
        "the predecessor's batch recorded a retry of an event its successor published\n{}",
        relay.log_text()
    );
    // And the aggregate's next event goes out, well before a stale retry
    // (60 s) would release it.
    let next = insert_events(&db.pool, "x", 1, 1).await?;
    eventually(Duration::from_secs(20), || {
        reached(next.committed[0].id.clone())
    })
    .await;
    let delivered = consume_nats(&js, &new_stream, 3, Duration::from_millis(500)).await?;
    assert!(
        delivered.iter().any(|d| d.id() == next.committed[0].id),
        "the aggregate's next event {} was held up; the stream has {:?} (the stuck one: {id})\n{}",
        next.committed[0].id,
        delivered.iter().map(|d| d.id()).collect::<Vec<_>>(),
        relay.log_text()
    );
    assert_eq!(warm.committed.len(), 1);
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    drop_nats_stream(&old_stream).await;
    drop_nats_stream(&new_stream).await;
    Ok(())
}

/// A broker slower to acknowledge than the lease has left when a batch
/// begins waiting: the lease rounds renew it meanwhile, so the batch waits
/// on to the renewed end instead of giving its acks up at the old one (and
/// sending the whole batch again, and again: under load that livelocked a
/// backlog). `lease_ttl = 3s` keeps a lease valid 1–2 s ahead; every byte
/// to and from NATS is held 2.5 s, so an ack takes at least 5 s.
#[tokio::test(flavor = "multi_thread")]
async fn acks_slower_than_the_lease_has_left_are_awaited_while_it_is_renewed() -> anyhow::Result<()>
{
    let proxy = FaultProxy::start("127.0.0.1:0", "127.0.0.1:4222").await?;
    let t = tag();
    let stream = format!("SLOW{t}");
    let js = nats_stream(&stream, vec![format!("slow{t}.>")]).await?;
    let db = TestDb::new().await?;
    let dir = test_dir("net-slow-acks");
    let route = format!(
        "config = {{ sink = \"nats\", topic = \"slow{t}.{{event_type}}\" }}\nallow = {{ nats = [\"slow{t}.*\"] }}"
    );
    let http = free_addr();
    let body = relay_body(&http, &[TestSink::Nats], "order-router", "orders", &route)
        .replace(NATS, &format!("nats://{}", proxy.addr));
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 4\nlease_ttl = \"3s\"\npublish_timeout = \"30s\"",
        &body,
    )?;
    db.migrate(&config)?;
    let relay = Relay::start(&config, &[])?;
    // Connected and publishing before the network slows down.
    let first = insert_events(&db.pool, "slow-first", 1, 1).await?;
    consume_nats(&js, &stream, 1, Duration::from_secs(30)).await?;
    proxy.set(Fault::Delay(Duration::from_millis(2500)));
    let w = insert_events(&db.pool, "slow", 5, 4).await?;
    let drained = eventually(Duration::from_secs(60), || async {
        db.unpublished("").await == 0
    })
    .await;
    let metrics = http_get(&http, "/metrics")
        .await
        .map(|(_, m)| m)
        .unwrap_or_default();
    let retries: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("outroute_retries_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        drained,
        "{} events still pending after 60 s with 5 s acks: {}",
        db.unpublished("").await,
        relay.log_text()
    );
    assert_eq!(
        retries,
        0.0,
        "acks were given up at a lease end that was renewed meanwhile: {}",
        relay.log_text()
    );
    proxy.set(Fault::None);
    let delivered = consume_nats(
        &js,
        &stream,
        first.committed.len() + w.committed.len(),
        Duration::from_secs(30),
    )
    .await?;
    let ids: std::collections::HashSet<&str> = delivered.iter().map(|d| d.id()).collect();
    let committed: std::collections::HashSet<&str> = first
        .committed
        .iter()
        .chain(&w.committed)
        .map(|e| e.id.as_str())
        .collect();
    assert_eq!(
        ids, committed,
        "the events delivered are not the ones committed"
    );
    assert_eq!(
        delivered.len(),
        committed.len(),
        "an event was delivered twice"
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}
