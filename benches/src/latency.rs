//! Section 6: steady load at a fixed rate from several writers — commit to
//! consumer latency, claim and pickup histograms, producer commits/s —
//! with and without history kept.

use super::*;

/// `rate` events/s committed by 4 writers for `secs` seconds; commit →
/// consumer-received measured per event.
///
/// `history`: that many already-published rows (`history_payload` bytes of
/// payload each) are in the table first, as after months without retention.
pub(crate) async fn latency(
    secs: u64,
    rate: u64,
    history: usize,
    history_payload: usize,
    concurrency: u32,
) -> Result<Value> {
    let db = bench_db().await?;
    let t = tag();
    let topic = format!("b{t}.order-created");
    let sink = LATENCY_SINK.get().map_or("kafka", String::as_str);
    if sink == "nats" {
        nats_stream(&format!("B{t}"), vec![format!("b{t}.>")]).await?;
    } else {
        create_topics(&t).await?;
    }
    let failing = FAILING_ROUTE.get().copied().unwrap_or(false);
    let dir = test_dir("latency");
    let http = outroute_e2e::free_addr();
    let mut body = relay_body(sink, &t, &http);
    if history > 0 {
        // The measured routes read the measured events only.
        for plugin in ["order-router", "hostile"] {
            body = body.replace(
                &format!("plugin = \"{plugin}\"\n"),
                &format!("plugin = \"{plugin}\"\naggregate_types = [\"order\"]\n"),
            );
        }
        body.push_str(&format!(
            "[plugins.quiet]\npath = \"{}\"\n[[routes]]\nname = \"history\"\nplugin = \"quiet\"\n\
             aggregate_types = [\"history\"]\nconfig = {{ mode = \"nothing\" }}\nallow = {{ {sink} = [\"b{t}.history\"] }}\n",
            plugin("hostile").display()
        ));
    }
    let config = write_config_with(
        &dir,
        store_keys(),
        &relay_url(&db.url),
        &format!("concurrency = {concurrency}"),
        &format!("{}{body}", canonical().mapping()),
    )?;
    db.migrate(&config)?;
    migrate_table(canonical(), &config)?;
    // History the way production leaves it: rows the relay itself
    // published (through a route whose plugin sends nothing, so the broker
    // is not filled), then kept. Written before the relay starts, drained
    // before the measured run begins.
    let mut chunk = 0;
    while chunk < history {
        let end = (chunk + 500_000).min(history);
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'history', 'h-' || g, 'order-created', jsonb_build_object('pad', repeat('x', $3)) \
             FROM generate_series($1::bigint, $2::bigint) g",
        )
        .bind(chunk as i64)
        .bind(end as i64 - 1)
        .bind(history_payload as i32)
        .execute(&db.pool)
        .await?;
        chunk = end;
        eprintln!("   history: {chunk} rows written");
    }
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    if history > 0 {
        let built = Instant::now();
        loop {
            let (_, m) = outroute_e2e::http_get(&http, "/metrics")
                .await
                .unwrap_or_default();
            let done =
                outroute_e2e::metric(&m, "outroute_events_published_total{route=\"history\"}")
                    .unwrap_or(0.0) as usize;
            if done >= history && db.count(canonical().pending()).await == 0 {
                break;
            }
            if built.elapsed() > Duration::from_secs(3600) {
                relay.terminate(Duration::from_secs(15));
                anyhow::bail!(
                    "history: the relay published {done} of {history} rows within an hour"
                );
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        eprintln!(
            "   history: {history} rows published by the relay in {:.0} s",
            built.elapsed().as_secs_f64()
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Consumer thread: id → receive instant.
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel::<(String, Instant)>();
    // JetStream: a core subscription on the stream's subjects gets each
    // message as the server routes it to the stream (microseconds apart
    // from the store; the stream's PubAck is what the relay waits for).
    let nats_consumer = if sink == "nats" {
        let sub = async_nats::connect(NATS)
            .await?
            .subscribe(format!("b{t}.>"))
            .await?;
        let tx = tx.clone();
        Some(tokio::spawn(async move {
            use futures::StreamExt;
            let mut sub = sub;
            while let Some(m) = sub.next().await {
                let now = Instant::now();
                if let Some(id) = m.headers.as_ref().and_then(|h| h.get("ce_id")) {
                    let _ = tx.send((id.to_string(), now));
                }
            }
        }))
    } else {
        None
    };
    let consumer = {
        let stop = stop.clone();
        let topic = topic.clone();
        let kafka = sink == "kafka";
        std::thread::spawn(move || -> Result<()> {
            if !kafka {
                return Ok(());
            }
            use rdkafka::consumer::{BaseConsumer, Consumer};
            use rdkafka::message::{Headers, Message};
            let c: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", KAFKA)
                .set("group.id", format!("bench-{}", tag()))
                .set("fetch.min.bytes", "1")
                .set("fetch.wait.max.ms", "5")
                .create()?;
            let mut tpl = rdkafka::TopicPartitionList::new();
            for p in 0..PARTITIONS.load(Ordering::Relaxed) {
                tpl.add_partition_offset(&topic, p, rdkafka::Offset::Beginning)?;
            }
            c.assign(&tpl)?;
            while !stop.load(Ordering::Relaxed) {
                if let Some(Ok(m)) = c.poll(Duration::from_millis(20)) {
                    let now = Instant::now();
                    let id = m.headers().and_then(|h| {
                        h.iter()
                            .find(|x| x.key == "ce_id")
                            .and_then(|x| x.value.map(|v| String::from_utf8_lossy(v).into_owned()))
                    });
                    if let Some(id) = id {
                        let _ = tx.send((id, now));
                    }
                }
            }
            Ok(())
        })
    };

    // One warm-up event, awaited at the consumer before the measured
    // writers start: a Kafka consumer takes 0.3–0.5 s to join its
    // partitions, and the events committed meanwhile made the p99 of
    // commit→consumer (300–460 ms against a p50 of 10–15 ms) a measure of
    // the consumer's start, not of the relay.
    let warm_up = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'warm-up', 'order-created', '{}')")
        .bind(warm_up)
        .execute(&db.pool)
        .await?;
    let warm_up = warm_up.to_string();
    let waited = Instant::now();
    loop {
        match rx.try_recv() {
            Ok((id, _)) if id == warm_up => break,
            Ok(_) => {}
            Err(std::sync::mpsc::TryRecvError::Empty) => {
                anyhow::ensure!(
                    waited.elapsed() < Duration::from_secs(60),
                    "the warm-up event did not reach the consumer within 60 s"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => anyhow::bail!("the consumer stopped before the warm-up event: {e}"),
        }
    }

    // The relay's histograms so far (history drain, warm-up), taken off
    // the figures at the end.
    let (_, before) = outroute_e2e::http_get(&http, "/metrics")
        .await
        .unwrap_or_default();
    // 4 writers, each at rate/4 events/s, each event its own transaction.
    let per_writer = Duration::from_secs_f64(4.0 / rate as f64);
    let pid = relay.child.id();
    let (cpu0, t0) = (proc_stats(pid).0, Instant::now());
    let end = t0 + Duration::from_secs(secs);
    let mut writers = Vec::new();
    for w in 0..4 {
        let pool = db.pool.clone();
        writers.push(tokio::spawn(async move {
            // (id, committed at, of the aggregate the failing route fails)
            let mut committed: Vec<(String, Instant, bool)> = Vec::new();
            let mut tx_ms: Vec<f64> = Vec::new();
            let mut next = Instant::now();
            let mut i = 0usize;
            while Instant::now() < end {
                let id = uuid::Uuid::new_v4();
                let mut conn = pool.acquire().await?;
                // After the pool's acquire (and its ping): from BEGIN on.
                let began = Instant::now();
                let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                let failing_aggregate = w == 0 && i.is_multiple_of(100);
                let mut body = payload(i);
                if failing && failing_aggregate && i == 0 {
                    body["hostile"] = json!("retry");
                }
                sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'order-created', $3)")
                    .bind(id)
                    .bind(format!("w{w}-{}", i % 100))
                    .bind(body)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                let done = Instant::now();
                committed.push((id.to_string(), done, failing_aggregate));
                tx_ms.push(done.duration_since(began).as_secs_f64() * 1000.0);
                i += 1;
                next += per_writer;
                tokio::time::sleep_until(next.into()).await;
            }
            anyhow::Ok((committed, tx_ms))
        }));
    }
    let mut committed: HashMap<String, (Instant, bool)> = HashMap::new();
    // BEGIN to COMMIT acknowledged, per producer transaction: lease mode's
    // pickup starts at `created_at` (the transaction's start), so it
    // includes this.
    let mut tx_ms: Vec<f64> = Vec::new();
    for w in writers {
        let (c, t) = w.await??;
        committed.extend(c.into_iter().map(|(id, at, x)| (id, (at, x))));
        tx_ms.extend(t);
    }
    tx_ms.sort_by(f64::total_cmp);
    // Every committed event must reach the consumer: percentiles are over
    // all of them, and one missing is a failed run, not a dropped sample.
    // The first receipt of each event counts (a re-sent duplicate would
    // count again).
    let mut first: HashMap<String, Instant> = HashMap::with_capacity(committed.len());
    let tail = Instant::now() + Duration::from_secs(60);
    loop {
        for (id, at) in rx.try_iter() {
            if committed.contains_key(&id) {
                first.entry(id).or_insert(at);
            }
        }
        if first.len() == committed.len() {
            break;
        }
        if Instant::now() > tail {
            stop.store(true, Ordering::Relaxed);
            relay.terminate(Duration::from_secs(15));
            anyhow::bail!(
                "latency: {} of {} committed events never reached the consumer within 60 s of the last commit",
                committed.len() - first.len(),
                committed.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The relay's CPU from the first commit to the last receipt.
    let relay_cores = (proc_stats(pid).0 - cpu0) / t0.elapsed().as_secs_f64().max(1e-3);
    stop.store(true, Ordering::Relaxed);
    let _ = consumer.join();
    if let Some(c) = nats_consumer {
        c.abort();
    }
    let mut lat: Vec<f64> = Vec::new();
    // The same, for the events of the aggregate `--failing-route` fails.
    let mut lat_x: Vec<f64> = Vec::new();
    for (id, at) in &first {
        if let Some((c, x)) = committed.get(id) {
            let ms = at.saturating_duration_since(*c).as_secs_f64() * 1000.0;
            lat.push(ms);
            if *x {
                lat_x.push(ms);
            }
        }
    }
    lat.sort_by(f64::total_cmp);
    lat_x.sort_by(f64::total_cmp);
    let of_x = committed.values().filter(|(_, x)| *x).count();
    let (_, metrics) = outroute_e2e::http_get(&http, "/metrics")
        .await
        .unwrap_or_default();
    let metrics = buckets_since(&before, &metrics);
    let rss = proc_stats(pid).1;
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    if sink == "nats" {
        outroute_e2e::drop_nats_stream(&format!("B{t}")).await;
    }
    Ok(json!({
        "sink": sink,
        "producer_tx_ms": {"p50": percentile(&tx_ms, 0.5), "p99": percentile(&tx_ms, 0.99)},
        "relay_cores": relay_cores,
        "committed": committed.len(),
        "received": lat.len(),
        "achieved_rate": committed.len() as f64 / secs as f64,
        "commit_to_consumer_ms": {"p50": percentile(&lat, 0.5), "p99": percentile(&lat, 0.99), "max": lat.last().copied().unwrap_or(0.0)},
        "failing_aggregate": {
            "committed": of_x,
            "received": lat_x.len(),
            "commit_to_consumer_ms": {"p50": percentile(&lat_x, 0.5), "p99": percentile(&lat_x, 0.99), "max": lat_x.last().copied().unwrap_or(0.0)},
            "failed_on_failing_route": outroute_e2e::metric(&metrics, "outroute_events_failed_total{route=\"payments\"}"),
        },
        "commit_to_ack_ms_bucket": {
            "p50": bucket_quantile(&metrics, "outroute_commit_to_ack_seconds", 0.5),
            "p99": bucket_quantile(&metrics, "outroute_commit_to_ack_seconds", 0.99),
        },
        "claim_ms_bucket": {
            "p50": bucket_quantile(&metrics, "outroute_claim_seconds", 0.5),
            "p99": bucket_quantile(&metrics, "outroute_claim_seconds", 0.99),
            "share_over_2ms": bucket_share_above(&metrics, "outroute_claim_seconds", 0.002),
        },
        "pickup_ms_bucket": {
            "p50": bucket_quantile(&metrics, "outroute_pickup_seconds", 0.5),
            "p99": bucket_quantile(&metrics, "outroute_pickup_seconds", 0.99),
        },
        "batch_ms_bucket": {
            "p50": bucket_quantile(&metrics, "outroute_batch_seconds", 0.5),
            "p99": bucket_quantile(&metrics, "outroute_batch_seconds", 0.99),
        },
        "history_rows": history,
        "history_payload_bytes": history_payload,
        "peak_rss_mib": rss,
    }))
}

/// `rate` events/s for `secs` seconds into `pool`'s outbox, from 4 writers,
/// one transaction each; returns how many were committed.
pub(crate) async fn steady_writes(
    pool: &PgPool,
    rate: u64,
    secs: u64,
    prefix: &str,
) -> Result<usize> {
    let per_writer = Duration::from_secs_f64(4.0 / rate.max(1) as f64);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut writers = Vec::new();
    for w in 0..4 {
        let pool = pool.clone();
        let prefix = prefix.to_string();
        writers.push(tokio::spawn(async move {
            let mut next = Instant::now();
            let mut i = 0usize;
            while Instant::now() < end {
                sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'order-created', $3)")
                    .bind(uuid::Uuid::new_v4())
                    .bind(format!("{prefix}{w}-{}", i % 100))
                    .bind(payload(i))
                    .execute(&pool)
                    .await?;
                i += 1;
                next += per_writer;
                tokio::time::sleep_until(next.into()).await;
            }
            anyhow::Ok(i)
        }));
    }
    let mut n = 0;
    for w in writers {
        n += w.await??;
    }
    Ok(n)
}
