//! Section 4: outroute draining a pre-filled outbox (canonical and existing
//! table shapes, several sources, a 1,000,000-event backlog, one huge
//! transaction), timed from the relay's start to the last event an
//! independent consumer read and to the database's confirmation.

use super::*;

/// Rows the database has not yet confirmed as handled: the shape's
/// pending rows in lease mode; under log capture (which deletes what it
/// handled) the rows still in the table.
pub(crate) fn confirmation_pending(shape: Shape) -> &'static str {
    if MODE.load(Ordering::Relaxed) == 2 {
        "SELECT count(*) FROM outbox"
    } else {
        shape.pending()
    }
}

pub(crate) async fn drain(n: usize, sink: &str, concurrency: u32) -> Result<Value> {
    drain_table(n, sink, concurrency, canonical()).await
}

pub(crate) async fn drain_table(
    n: usize,
    sink: &str,
    concurrency: u32,
    shape: Shape,
) -> Result<Value> {
    let db = bench_db().await?;
    let t = tag();
    if sink == "kafka" {
        create_topics(&t).await?;
    } else {
        nats_stream(&format!("B{t}"), vec![format!("b{t}.>")]).await?;
    }
    let dir = test_dir("drain");
    let http = outroute_e2e::free_addr();
    let config = write_config_with(
        &dir,
        store_keys(),
        &relay_url(&db.url),
        &format!(
            "batch_size = 1000\nconcurrency = {concurrency}\nlanes = 64\nordering = \"{}\"",
            FILL.get().map(|f| f.ordering).unwrap_or("aggregate")
        ),
        &format!("{}{}", shape.mapping(), relay_body(sink, &t, &http)),
    )?;
    db.migrate(&config)?;
    shape.create_and_fill(&db.pool, n).await?;
    migrate_table(shape, &config)?;
    // One clock for every mode: from the relay's start to the last event
    // at an independent consumer, and to the database's confirmation of
    // the last (its mark, or under log capture its cleanup).
    let deadline = Instant::now() + Duration::from_secs(600);
    let consumer = consumer::start(sink, &t, n, deadline);
    let group0: Vec<f64> = GROUPS.iter().map(|(_, p)| group_cpu(p)).collect();
    let broker_port = if sink == "kafka" { 9092 } else { 4222 };
    let traffic0 = broker_traffic(broker_port);
    let pg0 = pg_cpu(&db.pool).await;
    let spawned = Instant::now();
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    let pid = relay.child.id();
    let mut first_publish: Option<Instant> = None;
    let confirmed = loop {
        // Watch the relay's own counter (no load on the database) until
        // it says all were sent, then the database until it confirms.
        let (_, m) = outroute_e2e::http_get(&http, "/metrics")
            .await
            .unwrap_or_default();
        let published =
            outroute_e2e::metric(&m, "outroute_events_published_total{route=\"orders\"}")
                .unwrap_or(0.0) as usize;
        if first_publish.is_none() && published > 0 {
            first_publish = Some(Instant::now());
        }
        if published >= n && db.count(confirmation_pending(shape)).await == 0 {
            break Some(Instant::now());
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // A run that misses its deadline is a failure, not a figure.
    let received = consumer.await;
    let (confirmed, received) = match (confirmed, received) {
        (Some(c), Ok(Ok(r))) => (c, r),
        (None, _) => {
            relay.terminate(Duration::from_secs(15));
            anyhow::bail!("drain: the database did not confirm all {n} events within 600 s");
        }
        (_, Ok(Err(e))) => {
            relay.terminate(Duration::from_secs(15));
            anyhow::bail!("drain: {e:#}");
        }
        (_, Err(e)) => {
            relay.terminate(Duration::from_secs(15));
            anyhow::bail!("drain: the consumer task failed: {e}");
        }
    };
    let secs = (received - spawned).as_secs_f64().max(1e-3);
    let secs_confirmed = (confirmed - spawned).as_secs_f64().max(1e-3);
    let window = secs.max(secs_confirmed);
    let (cpu, rss) = proc_stats(pid);
    let pg = pg_cpu(&db.pool).await - pg0;
    let traffic = traffic_per_event(&traffic0, &broker_traffic(broker_port), n);
    // CPU seconds each broker process spent during the run.
    let spent: Vec<(&str, f64)> = GROUPS
        .iter()
        .zip(group0.iter().chain(std::iter::repeat(&0.0)))
        .map(|((name, p), c0)| (*name, group_cpu(p) - c0))
        .collect();
    let others: serde_json::Map<String, Value> = spent
        .iter()
        .map(|(name, s)| (name.to_string(), json!(s / window)))
        .collect();
    let broker = spent
        .iter()
        .find(|(name, _)| {
            *name
                == if sink == "kafka" {
                    "tansu"
                } else {
                    "nats-server"
                }
        })
        .map_or(0.0, |(_, s)| *s);
    let done = n;
    let (_, metrics) = outroute_e2e::http_get(&http, "/metrics")
        .await
        .unwrap_or_default();
    relay.terminate(Duration::from_secs(15));
    // `outroute reconcile` over the whole drained window: how long an
    // operator waits for the answer (issue 45: a clean 100,000-event window
    // in under 10 s), and that the answer is "clean".
    let reconcile = if sink == "kafka" && MODE.load(Ordering::Relaxed) == 0 {
        let cfg = config.display().to_string();
        let t0 = Instant::now();
        let (code, out, err) = outroute_e2e::cli(&[
            "reconcile",
            "-c",
            &cfg,
            "--since",
            "2000-01-01T00:00:00Z",
            "--json",
        ])?;
        let secs = t0.elapsed().as_secs_f64();
        let report: Value = serde_json::from_str(&out).unwrap_or_else(|_| json!({ "error": err }));
        // Per topic: its counts, so a run that is not clean says why.
        let topics: Vec<Value> = report["topics"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                let n = |k: &str| t[k].as_array().map_or(0, Vec::len);
                json!({
                    "topic": t["topic"], "expected": t["expected"], "found": t["found"],
                    "missing": n("missing"), "duplicated": n("duplicated"),
                    "out_of_order": n("out_of_order"), "unexpected": n("unexpected"),
                    "not_checked": t["not_checked"],
                    "first_out_of_order": t["out_of_order"].get(0),
                })
            })
            .collect();
        json!({ "seconds": secs, "exit": code, "clean": report["clean"], "published": report["published"], "topics": topics })
    } else {
        Value::Null
    };
    db.drop_db().await;
    if sink == "nats" {
        outroute_e2e::drop_nats_stream(&format!("B{t}")).await;
    }
    let mut d = cost_figures(done, window, [cpu, pg, broker], traffic, rss);
    let rest = json!({
        "reconcile": reconcile,
        "other_cores": others,
        "batch_seconds_sum": outroute_e2e::metric(&metrics, "outroute_batch_seconds_sum"),
        "batch_count": outroute_e2e::metric(&metrics, "outroute_batch_seconds_count"),
        "events": done,
        "clock": "relay start → last event at an independent consumer (events_per_s); → the database's confirmation of the last (events_per_s_confirmed)",
        "seconds": secs,
        "events_per_s": done as f64 / secs,
        "seconds_confirmed": secs_confirmed,
        "events_per_s_confirmed": done as f64 / secs_confirmed,
        "first_publish_ms": first_publish.map(|f| (f - spawned).as_secs_f64() * 1e3),
        "plugin_call_seconds_sum": outroute_e2e::metric(&metrics, "outroute_plugin_call_seconds_sum{route=\"orders\"}"),
    });
    if let Value::Object(rest) = rest {
        d.extend(rest);
    }
    Ok(Value::Object(d))
}

/// Log-based capture of one producer transaction of `rows` rows of
/// `mib` MiB payload each (the "300 × 20 MB"): first with a sink
/// that fails every write (`/dev/full`; the relay backs off and holds what
/// it read), the relay's peak RSS after `stall_secs`; then a fresh relay
/// drains it to a file: its peak RSS and the time until the table is empty.
pub(crate) async fn huge_txn(rows: usize, mib: usize, stall_secs: u64) -> Result<Value> {
    MODE.store(2, Ordering::Relaxed);
    let db = bench_db().await?;
    let dir = test_dir("huge-txn");
    let config = |path: &str| {
        write_config_with(
            &dir,
            store_keys(),
            &db.url,
            "concurrency = 2",
            &format!(
                "[http]\nlisten = \"\"\n[sinks.file]\nkind = \"file\"\npath = \"{path}\"\nmax_message_bytes = {}\n\
                 [plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"orders\"\nplugin = \"p\"\n\
                 config = {{ sink = \"file\", topic = \"orders.{{event_type}}\" }}\n\
                 allow = {{ file = [\"orders.*\"] }}\nmemory_mib = 512\nmax_bytes_per_event = {}\n",
                (mib as u64 + 1) << 20,
                plugin("order-router").display(),
                (mib as u64 + 1) << 20,
            ),
        )
    };
    let stalled = config("/dev/full")?;
    db.migrate(&stalled)?;
    let mut relay = Relay::start(&stalled, &[("RUST_LOG", "warn")])?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let base = proc_stats(relay.child.id()).1;
    // Highly compressible: cheap for the database to store, full size on
    // the replication stream and in the relay.
    sqlx::query(&format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || g, 'order-created', \
                json_build_object('pad', repeat(md5(g::text), {} / 32)) \
         FROM generate_series(1, {rows}) g",
        mib << 20
    ))
    .execute(&db.pool)
    .await?;
    eprintln!("   committed; sink failing for {stall_secs} s");
    tokio::time::sleep(Duration::from_secs(stall_secs)).await;
    let stalled_rss = proc_stats(relay.child.id()).1;
    relay.terminate(Duration::from_secs(15));
    let file = dir.join("out.jsonl");
    let flowing = config(&file.display().to_string())?;
    let mut relay = Relay::start(&flowing, &[("RUST_LOG", "warn")])?;
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(1800);
    while db.count("SELECT count(*) FROM outbox").await > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    let drain_rss = proc_stats(relay.child.id()).1;
    let left = db.count("SELECT count(*) FROM outbox").await;
    relay.terminate(Duration::from_secs(15));
    let written = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    let _ = std::fs::remove_file(&file);
    db.drop_db().await;
    MODE.store(0, Ordering::Relaxed);
    anyhow::ensure!(
        left == 0,
        "{left} rows were still in the table after 30 min"
    );
    Ok(json!({
        "rows": rows,
        "row_mib": mib,
        "idle_rss_mib": base,
        "stalled_peak_rss_mib": stalled_rss,
        "drain_peak_rss_mib": drain_rss,
        "drain_seconds": secs,
        "drain_mib_per_s": (rows * mib) as f64 / secs.max(1e-3),
        "file_bytes": written,
    }))
}

/// `n` events split over `k` sources (databases with the canonical table)
/// drained by one relay process to Kafka: total rate, CPU per event, and
/// how far apart the sources finished (fair scheduling keeps it small).
pub(crate) async fn drain_sources(n: usize, k: usize, concurrency: u32) -> Result<Value> {
    let t = tag();
    create_topics(&t).await?;
    let mut dbs = Vec::new();
    for _ in 0..k {
        dbs.push(TestDb::new().await?);
    }
    let dir = test_dir("drain-sources");
    let http = outroute_e2e::free_addr();
    let mut body = format!(
        "[relay]\ncache_dir = \"{}\"\nbatch_size = 1000\nconcurrency = {concurrency}\nlanes = 64\n",
        std::env::temp_dir().join("outroute-test-cache").display()
    );
    for (i, db) in dbs.iter().enumerate() {
        body.push_str(&format!("[sources.s{i}]\nurl = \"{}\"\n", db.url));
    }
    body.push_str(&relay_body("kafka", &t, &http));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("outroute.toml");
    std::fs::write(&config, body)?;
    dbs[0].migrate(&config)?;
    let per = n / k;
    for db in &dbs {
        fill(&db.pool, per).await?;
    }
    let total = per * k;
    // The drain's clock (see `drain_table`): relay start → last event at
    // an independent consumer, and → every database's confirmation.
    let deadline = Instant::now() + Duration::from_secs(600);
    let consumer = consumer::start("kafka", &t, total, deadline);
    let pg0 = pg_cpu(&dbs[0].pool).await;
    let spawned = Instant::now();
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    let pid = relay.child.id();
    let mut finished: Vec<Option<Instant>> = vec![None; k];
    let confirmed = loop {
        let (_, m) = outroute_e2e::http_get(&http, "/metrics")
            .await
            .unwrap_or_default();
        let mut published = 0usize;
        for (i, f) in finished.iter_mut().enumerate() {
            let p = outroute_e2e::metric(
                &m,
                &format!("outroute_events_published_total{{route=\"orders\",source=\"s{i}\"}}"),
            )
            .unwrap_or(0.0) as usize;
            if p >= per && f.is_none() {
                *f = Some(Instant::now());
            }
            published += p;
        }
        if published >= total {
            let mut pending = 0;
            for db in &dbs {
                pending += db.count(Shape::Canonical.pending()).await;
            }
            if pending == 0 {
                break Some(Instant::now());
            }
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let received = consumer.await;
    let (confirmed, received) = match (confirmed, received) {
        (Some(c), Ok(Ok(r))) => (c, r),
        (c, r) => {
            relay.terminate(Duration::from_secs(15));
            anyhow::bail!(
                "drain of {k} sources: not done within 600 s (confirmed: {}, consumer: {})",
                c.is_some(),
                match r {
                    Ok(Ok(_)) => "all received".to_string(),
                    Ok(Err(e)) => format!("{e:#}"),
                    Err(e) => e.to_string(),
                }
            );
        }
    };
    let secs = (received - spawned).as_secs_f64().max(1e-3);
    let secs_confirmed = (confirmed - spawned).as_secs_f64().max(1e-3);
    let window = secs.max(secs_confirmed);
    let (cpu, rss) = proc_stats(pid);
    let pg = pg_cpu(&dbs[0].pool).await - pg0;
    let done = total;
    let ends: Vec<Instant> = finished.iter().flatten().copied().collect();
    let spread = match (ends.iter().min(), ends.iter().max()) {
        (Some(a), Some(b)) => (*b - *a).as_secs_f64(),
        _ => f64::NAN,
    };
    relay.terminate(Duration::from_secs(15));
    for db in dbs {
        db.drop_db().await;
    }
    Ok(json!({
        "sources": k,
        "events": done,
        "seconds": secs,
        "events_per_s": done as f64 / secs,
        "seconds_confirmed": secs_confirmed,
        "events_per_s_confirmed": done as f64 / secs_confirmed,
        "cores": cpu / window,
        "postgres_cores": pg / window,
        "relay_us_per_event": cpu * 1e6 / done.max(1) as f64,
        "postgres_us_per_event": pg * 1e6 / done.max(1) as f64,
        "peak_rss_mib": rss,
        "finish_spread_s": spread,
    }))
}

/// A deep backlog drained to Kafka: is the last 100k as fast as the
/// first, and how soon after start does the first batch go out?
pub(crate) async fn drain_backlog(n: usize, concurrency: u32) -> Result<Value> {
    let db = TestDb::new().await?;
    let t = tag();
    create_topics(&t).await?;
    let dir = test_dir("backlog");
    let http = outroute_e2e::free_addr();
    let config = write_config(
        &dir,
        &db.url,
        &format!("batch_size = 1000\nconcurrency = {concurrency}\nlanes = 64"),
        &format!(
            "{}{}",
            canonical().mapping(),
            relay_body("kafka", &t, &http)
        ),
    )?;
    db.migrate(&config)?;
    migrate_table(canonical(), &config)?;
    let mut done = 0;
    while done < n {
        let step = (n - done).min(100_000);
        fill(&db.pool, step).await?;
        done += step;
        eprintln!("   backlog: {done} events");
    }
    let spawned = Instant::now();
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    let mut samples: Vec<(f64, f64)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        let (_, m) = outroute_e2e::http_get(&http, "/metrics")
            .await
            .unwrap_or_default();
        let published =
            outroute_e2e::metric(&m, "outroute_events_published_total{route=\"orders\"}")
                .unwrap_or(0.0);
        samples.push((spawned.elapsed().as_secs_f64(), published));
        if published as usize >= n || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Then the database's confirmation of the last.
    let confirmed = loop {
        if db.count(Shape::Canonical.pending()).await == 0 {
            break Some(spawned.elapsed().as_secs_f64());
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    relay.terminate(Duration::from_secs(15));
    // Time at which the published count first reached `k`.
    let at = |k: f64| samples.iter().find(|(_, p)| *p >= k).map(|(t, _)| *t);
    let Some(confirmed) = confirmed.filter(|_| at(n as f64).is_some()) else {
        db.drop_db().await;
        anyhow::bail!("backlog: not all {n} events published and confirmed within 1800 s");
    };
    let first = at(1.0).unwrap_or(0.0);
    let end = at(n as f64).unwrap_or(0.0);
    let span = 100_000f64.min(n as f64);
    let rate = |a: f64, b: f64| match (at(a), at(b)) {
        (Some(x), Some(y)) if y > x => (b - a) / (y - x),
        _ => 0.0,
    };
    db.drop_db().await;
    Ok(json!({
        "events": n,
        "first_publish_ms": first * 1000.0,
        "first_100k_per_s": rate(1.0, span),
        "last_100k_per_s": rate(n as f64 - span, n as f64),
        "last_ack_s": end,
        "confirmed_s": confirmed,
        "clock": "relay start → the database's confirmation of the last event",
        "events_per_s": n as f64 / confirmed.max(1e-3),
    }))
}
