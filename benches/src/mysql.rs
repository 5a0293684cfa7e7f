//! `--only mysql`: a MySQL/MariaDB outbox (issue 44). outroute draining
//! the same pre-filled 1 KB events as the PostgreSQL drain, from the
//! canonical table on an own MariaDB server (`scripts/mariadb-own`: binlog
//! on, as production servers run, and a buffer pool that holds the table;
//! the shared server's 128 MiB pool reads a 100 MB outbox from disk),
//! timed from the relay's start to the last event an independent consumer
//! read and to the last row marked; the relay's and that server's CPU per
//! event beside it.

use super::*;
use outroute_e2e::MyDb;
use sqlx::mysql::MySqlPool;

/// Insert `n` 1 KB events (multi-row INSERTs from 4 connections), one
/// aggregate per event.
async fn fill_mysql(pool: &MySqlPool, n: usize) -> Result<()> {
    let per = n.div_ceil(4);
    let mut tasks = Vec::new();
    for w in 0..4 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let (lo, hi) = (w * per, ((w + 1) * per).min(n));
            let mut i = lo;
            while i < hi {
                let end = (i + 500).min(hi);
                let mut qb = sqlx::QueryBuilder::new(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) ",
                );
                qb.push_values(i..end, |mut b, k| {
                    b.push_bind(uuid::Uuid::new_v4().to_string())
                        .push_bind("order")
                        .push_bind(format!("o-{k}"))
                        .push_bind("order-created")
                        .push_bind(payload(k).to_string());
                });
                qb.build().execute(&pool).await?;
                i = end;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// The own server's processes (`group_cpu` pattern).
const OWN_SERVER: &str = "mariadb-3307/data";

/// How the drained relay reads the outbox.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Capture {
    /// Claims of leased lanes.
    Lease,
    /// The binlog (`capture = "binlog"`): a first run records a position
    /// and stops; the events are written after it, so the timed run reads
    /// every one of them from the binlog.
    Binlog,
}

pub(crate) async fn mysql_drain(
    n: usize,
    sink: &str,
    concurrency: u32,
    capture: Capture,
) -> Result<Value> {
    let db = MyDb::new_at(&outroute_e2e::mariadb_own_admin_url()?).await?;
    let t = tag();
    if sink == "kafka" {
        create_topics(&t).await?;
    } else {
        nats_stream(&format!("B{t}"), vec![format!("b{t}.>")]).await?;
    }
    let dir = test_dir("mysql-drain");
    let http = outroute_e2e::free_addr();
    let config = outroute_e2e::write_config_with(
        &dir,
        &db.url,
        match capture {
            Capture::Lease => "",
            Capture::Binlog => "capture = \"binlog\"",
        },
        &format!("batch_size = 1000\nconcurrency = {concurrency}\nlanes = 64"),
        &relay_body(sink, &t, &http),
    )?;
    db.migrate(&config)?;
    if capture == Capture::Binlog {
        let mut first = Relay::start(&config, &[("RUST_LOG", "warn")])?;
        let recorded = "SELECT count(*) FROM outroute_binlog WHERE backfilled = 1";
        let deadline = Instant::now() + Duration::from_secs(60);
        while db.count(recorded).await != 1 {
            if Instant::now() > deadline {
                anyhow::bail!("binlog drain: no position recorded\n{}", first.log_text());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        first.terminate(Duration::from_secs(15));
    }
    fill_mysql(&db.pool, n).await?;
    let pending = "SELECT count(*) FROM outbox WHERE published_at = '1000-01-01 00:00:00'";
    let deadline = Instant::now() + Duration::from_secs(600);
    let consumer = consumer::start(sink, &t, n, deadline);
    let db_cpu0 = group_cpu(OWN_SERVER);
    let spawned = Instant::now();
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    let pid = relay.child.id();
    let confirmed = loop {
        let (_, m) = outroute_e2e::http_get(&http, "/metrics")
            .await
            .unwrap_or_default();
        let published =
            outroute_e2e::metric(&m, "outroute_events_published_total{route=\"orders\"}")
                .unwrap_or(0.0) as usize;
        if published >= n && db.count(pending).await == 0 {
            break Some(Instant::now());
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let received = consumer.await;
    let (cpu, rss) = proc_stats(pid);
    let db_cpu = group_cpu(OWN_SERVER) - db_cpu0;
    relay.terminate(Duration::from_secs(15));
    let log = relay.log_text();
    db.drop_db().await;
    if sink == "nats" {
        outroute_e2e::drop_nats_stream(&format!("B{t}")).await;
    }
    let (confirmed, received) = match (confirmed, received) {
        (Some(c), Ok(Ok(r))) => (c, r),
        (None, _) => anyhow::bail!("mysql drain: not every event was marked within 600 s\n{log}"),
        (_, Ok(Err(e))) => anyhow::bail!("mysql drain: {e:#}"),
        (_, Err(e)) => anyhow::bail!("mysql drain: the consumer task failed: {e}"),
    };
    let secs = (received - spawned).as_secs_f64().max(1e-3);
    let secs_confirmed = (confirmed - spawned).as_secs_f64().max(1e-3);
    let window = secs.max(secs_confirmed);
    Ok(json!({
        "events": n,
        "clock": "relay start → last event at an independent consumer (events_per_s); → the last row marked (events_per_s_confirmed)",
        "seconds": secs,
        "events_per_s": n as f64 / secs,
        "seconds_confirmed": secs_confirmed,
        "events_per_s_confirmed": n as f64 / secs_confirmed,
        "cores": cpu / window,
        "mariadb_cores": db_cpu / window,
        "relay_us_per_event": cpu * 1e6 / n.max(1) as f64,
        "mariadb_us_per_event": db_cpu * 1e6 / n.max(1) as f64,
        "peak_rss_mib": rss,
    }))
}

/// 8 writer connections on MySQL, one outbox insert per transaction, for
/// `secs`: as fast as they can (`pace` `None`) or `pace` commits/s in all.
/// Returns commits/s and each commit's latency (ms, sorted).
async fn mysql_writers(pool: &MySqlPool, secs: u64, pace: Option<u64>) -> Result<(f64, Vec<f64>)> {
    let end = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for w in 0..8u64 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let (mut n, mut latency) = (0u64, Vec::new());
            let mut tick = pace.map(|p| {
                let mut t = tokio::time::interval(Duration::from_secs_f64(8.0 / p.max(1) as f64));
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                t
            });
            while Instant::now() < end {
                if let Some(t) = tick.as_mut() {
                    t.tick().await;
                }
                let began = Instant::now();
                let mut tx = pool.begin().await?;
                sqlx::query(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                     VALUES (?, 'order', ?, 'order-created', '{}')",
                )
                .bind(uuid::Uuid::new_v4().to_string())
                .bind(format!("w{w}-{}", n % 50))
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                latency.push(began.elapsed().as_secs_f64() * 1000.0);
                n += 1;
            }
            anyhow::Ok((n, latency))
        }));
    }
    let (mut total, mut latency_ms) = (0, Vec::new());
    for t in tasks {
        let (n, l) = t.await??;
        total += n;
        latency_ms.extend(l);
    }
    latency_ms.sort_by(f64::total_cmp);
    Ok((total as f64 / secs as f64, latency_ms))
}

/// What a relay draining a MySQL outbox costs its producers: 8 writers'
/// commits/s with no relay and with one draining what they write (to a
/// file sink: the database's side only), flat out and paced at `paced`/s
/// in lease mode, flat out with binlog capture; `reps` interleaved runs of
/// 8 s each; medians.
pub(crate) async fn mysql_producers(reps: usize, paced: u64) -> Result<Value> {
    let secs = 8;
    let mut out = serde_json::Map::new();
    for (pace, capture) in [
        (None, Capture::Lease),
        (Some(paced), Capture::Lease),
        (None, Capture::Binlog),
    ] {
        let mut rates = [Vec::new(), Vec::new()];
        let mut lat = [Vec::new(), Vec::new()];
        // Cores used while the writers ran: [writers (this process), MariaDB, relay].
        let mut cores: [[Vec<f64>; 3]; 2] = Default::default();
        for _ in 0..reps.max(1) {
            for (i, with_relay) in [false, true].into_iter().enumerate() {
                let db = MyDb::new_at(&outroute_e2e::mariadb_own_admin_url()?).await?;
                let dir = test_dir("mysql-producers");
                let config = outroute_e2e::write_config_with(
                    &dir,
                    &db.url,
                    match capture {
                        Capture::Lease => "",
                        Capture::Binlog => "capture = \"binlog\"",
                    },
                    "",
                    &file_sink_body(&dir),
                )?;
                db.migrate(&config)?;
                let relay = match with_relay {
                    true => Some(Relay::start(&config, &[("RUST_LOG", "warn")])?),
                    false => None,
                };
                tokio::time::sleep(Duration::from_millis(500)).await;
                let relay_pid = relay.as_ref().map(|r| r.child.id());
                let cpu0 = [
                    proc_stats(std::process::id()).0,
                    group_cpu(OWN_SERVER),
                    relay_pid.map_or(0.0, |p| proc_stats(p).0),
                ];
                let (r, l) = mysql_writers(&db.pool, secs, pace).await?;
                let cpu1 = [
                    proc_stats(std::process::id()).0,
                    group_cpu(OWN_SERVER),
                    relay_pid.map_or(0.0, |p| proc_stats(p).0),
                ];
                for k in 0..3 {
                    cores[i][k].push((cpu1[k] - cpu0[k]) / secs as f64);
                }
                if let Some(mut relay) = relay {
                    relay.terminate(Duration::from_secs(15));
                    anyhow::ensure!(
                        file_sink_messages(&dir) > 0,
                        "producers bench: the relay published nothing\n{}",
                        relay.log_text()
                    );
                }
                db.drop_db().await;
                rates[i].push(r);
                lat[i].extend(l);
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            percentile(v, 0.5)
        };
        let (without, with) = (median(&mut rates[0]), median(&mut rates[1]));
        for l in lat.iter_mut() {
            l.sort_by(f64::total_cmp);
        }
        let mode = match capture {
            Capture::Lease => "",
            Capture::Binlog => "binlog_",
        };
        out.insert(
            match pace {
                None => format!("{mode}saturated"),
                Some(p) => format!("{mode}paced_{p}"),
            },
            json!({
                "commits_per_s_without_relay": without,
                "commits_per_s_with_relay": with,
                "ratio": with / without.max(f64::MIN_POSITIVE),
                "commit_ms_p99_without": percentile(&lat[0], 0.99),
                "commit_ms_p99_with": percentile(&lat[1], 0.99),
                "cores_without": cores[0].iter_mut().map(median).collect::<Vec<_>>(),
                "cores_with": cores[1].iter_mut().map(median).collect::<Vec<_>>(),
                "cores_are": "writers (the bench process), MariaDB, relay",
                "runs": rates,
            }),
        );
    }
    Ok(Value::Object(out))
}

/// Steady load on MySQL: `rate` events/s from 4 writers (one transaction
/// each) for `secs`, relayed to JetStream; commit → consumer latency per
/// event (a core subscription on the stream's subjects sees each message
/// as the server stores it), and the relay's pickup (row's `created_at` →
/// claimed) and claim histograms.
pub(crate) async fn mysql_latency(secs: u64, rate: u64) -> Result<Value> {
    use futures::StreamExt;
    let db = MyDb::new_at(&outroute_e2e::mariadb_own_admin_url()?).await?;
    let t = tag();
    nats_stream(&format!("B{t}"), vec![format!("b{t}.>")]).await?;
    let dir = test_dir("mysql-latency");
    let http = outroute_e2e::free_addr();
    let config = write_config(&dir, &db.url, "", &relay_body("nats", &t, &http))?;
    db.migrate(&config)?;
    let mut sub = async_nats::connect(NATS)
        .await?
        .subscribe(format!("b{t}.>"))
        .await?;
    let (tx, rx) = std::sync::mpsc::channel::<(String, Instant)>();
    let consumer = tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            let now = Instant::now();
            if let Some(id) = m.headers.as_ref().and_then(|h| h.get("ce_id")) {
                let _ = tx.send((id.to_string(), now));
            }
        }
    });
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    // Warm up (the relay's first claims, the subscription) before measuring.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, before) = outroute_e2e::http_get(&http, "/metrics")
        .await
        .unwrap_or_default();
    let per_writer = Duration::from_secs_f64(4.0 / rate.max(1) as f64);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut writers = Vec::new();
    for w in 0..4 {
        let pool = db.pool.clone();
        writers.push(tokio::spawn(async move {
            let mut committed: Vec<(String, Instant)> = Vec::new();
            let mut next = Instant::now();
            let mut i = 0usize;
            while Instant::now() < end {
                let id = uuid::Uuid::new_v4().to_string();
                let mut tx = pool.begin().await?;
                sqlx::query(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                     VALUES (?, 'order', ?, 'order-created', ?)",
                )
                .bind(&id)
                .bind(format!("w{w}-{}", i % 100))
                .bind(payload(i).to_string())
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                committed.push((id, Instant::now()));
                i += 1;
                next += per_writer;
                tokio::time::sleep_until(next.into()).await;
            }
            anyhow::Ok(committed)
        }));
    }
    let mut committed: HashMap<String, Instant> = HashMap::new();
    for w in writers {
        committed.extend(w.await??);
    }
    let mut first: HashMap<String, Instant> = HashMap::with_capacity(committed.len());
    let tail = Instant::now() + Duration::from_secs(60);
    while first.len() < committed.len() && Instant::now() < tail {
        for (id, at) in rx.try_iter() {
            if committed.contains_key(&id) {
                first.entry(id).or_insert(at);
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    consumer.abort();
    let (_, metrics) = outroute_e2e::http_get(&http, "/metrics")
        .await
        .unwrap_or_default();
    let metrics = buckets_since(&before, &metrics);
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    outroute_e2e::drop_nats_stream(&format!("B{t}")).await;
    anyhow::ensure!(
        first.len() == committed.len(),
        "mysql latency: {} of {} committed events never reached the consumer",
        committed.len() - first.len(),
        committed.len()
    );
    let mut lat: Vec<f64> = first
        .iter()
        .filter_map(|(id, at)| {
            let c = committed.get(id)?;
            Some(at.saturating_duration_since(*c).as_secs_f64() * 1000.0)
        })
        .collect();
    lat.sort_by(f64::total_cmp);
    Ok(json!({
        "committed": committed.len(),
        "achieved_rate": committed.len() as f64 / secs.max(1) as f64,
        "commit_to_consumer_ms": {"p50": percentile(&lat, 0.5), "p99": percentile(&lat, 0.99), "max": lat.last().copied().unwrap_or(0.0)},
        "pickup_ms_bucket": {
            "p50": bucket_quantile(&metrics, "outroute_pickup_seconds", 0.5),
            "p99": bucket_quantile(&metrics, "outroute_pickup_seconds", 0.99),
        },
        "claim_ms_bucket": {
            "p50": bucket_quantile(&metrics, "outroute_claim_seconds", 0.5),
            "p99": bucket_quantile(&metrics, "outroute_claim_seconds", 0.99),
        },
    }))
}

/// Claim cost against backlog depth on MySQL: `n` 1 KB events pre-filled
/// (one aggregate each), drained to JetStream; the relay's claim histogram
/// and the drain rate over the first and the last tenth of the events
/// (`outroute_claim_seconds` deltas between published counts).
///
/// `reader`: a `REPEATABLE READ` snapshot is held open on the database for
/// the whole drain (a report, a backup): InnoDB's purge can remove no
/// marked row's old index entry meanwhile, the case claim floors exist for.
pub(crate) async fn mysql_deep_backlog(n: usize, reader: bool) -> Result<Value> {
    let db = MyDb::new_at(&outroute_e2e::mariadb_own_admin_url()?).await?;
    let t = tag();
    nats_stream(&format!("B{t}"), vec![format!("b{t}.>")]).await?;
    let dir = test_dir("mysql-deep");
    let http = outroute_e2e::free_addr();
    let config = write_config(
        &dir,
        &db.url,
        "batch_size = 1000\nlanes = 64",
        &relay_body("nats", &t, &http),
    )?;
    db.migrate(&config)?;
    let filled = Instant::now();
    fill_mysql(&db.pool, n).await?;
    eprintln!(
        "   {n} events written in {:.0} s",
        filled.elapsed().as_secs_f64()
    );
    let mut snapshot = None;
    if reader {
        let mut conn = db.pool.acquire().await?;
        sqlx::raw_sql(
            "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ; \
             START TRANSACTION WITH CONSISTENT SNAPSHOT",
        )
        .execute(&mut *conn)
        .await?;
        sqlx::query("SELECT count(*) FROM outbox WHERE seq < 10")
            .execute(&mut *conn)
            .await?;
        snapshot = Some(conn);
    }
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    let tenth = (n / 10).max(1);
    // (published at least, metrics text, instant) at 0, n/10, 8n/10,
    // 9n/10, n: the ninth tenth is deep into the drain, the last one also
    // holds its tail (lanes running dry one after the other).
    let marks = [0, tenth, n - 2 * tenth, n - tenth, n];
    let mut seen: Vec<(String, Instant)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(3600);
    let published = |m: &str| {
        outroute_e2e::metric(m, "outroute_events_published_total{route=\"orders\"}").unwrap_or(0.0)
            as usize
    };
    for mark in marks {
        loop {
            let (_, m) = outroute_e2e::http_get(&http, "/metrics")
                .await
                .unwrap_or_default();
            if published(&m) >= mark {
                seen.push((m, Instant::now()));
                break;
            }
            if Instant::now() > deadline {
                relay.terminate(Duration::from_secs(15));
                anyhow::bail!(
                    "deep backlog: {} of {n} published within an hour",
                    published(&m)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    relay.terminate(Duration::from_secs(15));
    if let Some(mut conn) = snapshot {
        sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
    }
    db.drop_db().await;
    outroute_e2e::drop_nats_stream(&format!("B{t}")).await;
    let window = |a: usize, b: usize| {
        let (ma, ta) = &seen[a];
        let (mb, tb) = &seen[b];
        let d = buckets_since(ma, mb);
        let events = published(mb).saturating_sub(published(ma));
        let claims = |m: &str| {
            outroute_e2e::metric(m, "outroute_claim_seconds_count{source=\"default\"}")
                .unwrap_or(0.0)
        };
        json!({
            "events": events,
            "events_per_s": events as f64 / tb.duration_since(*ta).as_secs_f64().max(1e-3),
            "claim_statements_per_1000_events": (claims(mb) - claims(ma)) * 1000.0 / events.max(1) as f64,
            "claim_ms_p50": bucket_quantile(&d, "outroute_claim_seconds", 0.5),
            "claim_ms_p99": bucket_quantile(&d, "outroute_claim_seconds", 0.99),
        })
    };
    Ok(json!({
        "backlog": n,
        "first_tenth": window(0, 1),
        "ninth_tenth": window(2, 3),
        "last_tenth": window(3, 4),
    }))
}

/// The section: drains to Kafka and JetStream, then (unless `reps` is 0)
/// the producers; the table's rows and the figures by name.
pub(crate) async fn mysql_section(
    events: usize,
    concurrency: u32,
    (reps, paced): (usize, u64),
    (latency_secs, rate): (u64, u64),
    backlog: usize,
) -> Result<(Vec<(String, String)>, Vec<(String, Value)>)> {
    let (mut table, mut results) = (Vec::new(), Vec::new());
    if latency_secs > 0 {
        eprintln!("== steady load on MariaDB: {rate}/s for {latency_secs} s → nats");
        let l = mysql_latency(latency_secs, rate).await?;
        let ms = |k: &str, q: &str| l[k][q].as_f64().unwrap_or(f64::NAN);
        table.push((
            format!("MariaDB latency @{rate}/s → nats: commit→consumer p50 / p99"),
            format!(
                "{:.1} / {:.1} ms",
                ms("commit_to_consumer_ms", "p50"),
                ms("commit_to_consumer_ms", "p99")
            ),
        ));
        table.push((
            "  pickup (created_at → claimed) p50 / p99, claim p50 / p99".into(),
            format!(
                "{:.1} / {:.1} ms, {:.2} / {:.2} ms",
                ms("pickup_ms_bucket", "p50"),
                ms("pickup_ms_bucket", "p99"),
                ms("claim_ms_bucket", "p50"),
                ms("claim_ms_bucket", "p99")
            ),
        ));
        results.push(("mysql_latency".into(), l));
    }
    for reader in [false, true].into_iter().filter(|_| backlog > 0) {
        let (with, key) = match reader {
            false => ("", "mysql_deep_backlog"),
            true => (
                ", a reader holding purge back",
                "mysql_deep_backlog_purge_held",
            ),
        };
        eprintln!("== claim cost against a {backlog}-event MariaDB backlog{with}");
        let b = mysql_deep_backlog(backlog, reader).await?;
        for (k, label) in [
            ("first_tenth", "first"),
            ("ninth_tenth", "ninth"),
            ("last_tenth", "last"),
        ] {
            table.push((
                format!(
                    "MariaDB {backlog} backlog{with}, {label} tenth: drain, claim p50 / p99, claims per 1000 events"
                ),
                format!(
                    "{:.0} events/s, {:.2} / {:.2} ms, {:.1}",
                    b[k]["events_per_s"].as_f64().unwrap_or(0.0),
                    b[k]["claim_ms_p50"].as_f64().unwrap_or(f64::NAN),
                    b[k]["claim_ms_p99"].as_f64().unwrap_or(f64::NAN),
                    b[k]["claim_statements_per_1000_events"].as_f64().unwrap_or(f64::NAN)
                ),
            ));
        }
        results.push((key.into(), b));
    }
    // `--events 0` skips the drains.
    let drains = [
        ("kafka", Capture::Lease, ""),
        ("nats", Capture::Lease, ""),
        ("kafka", Capture::Binlog, "binlog "),
        ("nats", Capture::Binlog, "binlog "),
    ];
    for (sink, capture, mode) in drains.into_iter().filter(|_| events > 0) {
        eprintln!("== outroute {mode}drain from MariaDB → {sink}");
        let d = mysql_drain(events, sink, concurrency, capture).await?;
        table.push((
            format!("outroute {mode}drain, MariaDB → {sink}"),
            rate_line(&d),
        ));
        table.push((
            format!("  CPU per event, MariaDB {mode}→ {sink}: relay + mariadbd"),
            format!(
                "{:.1} + {:.1} µs",
                d["relay_us_per_event"].as_f64().unwrap_or(0.0),
                d["mariadb_us_per_event"].as_f64().unwrap_or(0.0)
            ),
        ));
        let key = match capture {
            Capture::Lease => format!("mysql_drain_{sink}"),
            Capture::Binlog => format!("mysql_binlog_drain_{sink}"),
        };
        results.push((key, d));
    }
    // `--wakeup-reps 0` skips the producers (the drains alone).
    if reps == 0 {
        return Ok((table, results));
    }
    eprintln!("== MariaDB producers with and without a relay draining");
    let p = mysql_producers(reps, paced).await?;
    for (case, v) in p.as_object().into_iter().flatten() {
        table.push((
            format!("MariaDB producers, 8 writers, {case}: with relay / without"),
            format!(
                "{:.0} / {:.0} commits/s ({:.2}), commit p99 {:.1} / {:.1} ms",
                v["commits_per_s_with_relay"].as_f64().unwrap_or(0.0),
                v["commits_per_s_without_relay"].as_f64().unwrap_or(0.0),
                v["ratio"].as_f64().unwrap_or(0.0),
                v["commit_ms_p99_with"].as_f64().unwrap_or(0.0),
                v["commit_ms_p99_without"].as_f64().unwrap_or(0.0),
            ),
        ));
        let c = |k: &str, i: usize| v[k][i].as_f64().unwrap_or(0.0);
        table.push((
            format!("MariaDB producers, 8 writers, {case}: cores with relay / without"),
            format!(
                "writers {:.2} / {:.2}, MariaDB {:.2} / {:.2}, relay {:.2}",
                c("cores_with", 0),
                c("cores_without", 0),
                c("cores_with", 1),
                c("cores_without", 1),
                c("cores_with", 2),
            ),
        ));
    }
    results.push(("mysql_producers".into(), p));
    Ok((table, results))
}
