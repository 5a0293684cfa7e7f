//! Sections 2 and 3: the ceilings outroute is measured against — the
//! database's own claim + mark SQL in a tight loop, and raw produce to
//! Kafka and JetStream with acks.

use super::*;

/// The relay's own claim + mark SQL in a tight loop: the most the database
/// allows for this table, with no routing or publishing.
pub(crate) async fn db_ceiling(n: usize, marking: &str, batch: u32, workers: u32) -> Result<f64> {
    let db = TestDb::new().await?;
    let dir = test_dir("ceiling");
    let table = match marking {
        "delete" => Shape::CanonicalDelete,
        "published_at" => Shape::CanonicalStamp,
        _ => Shape::Canonical,
    }
    .mapping();
    let config = write_config(
        &dir,
        &db.url,
        &format!("batch_size = {batch}"),
        &format!("{table}{}", file_sink_body(&dir)),
    )?;
    db.migrate(&config)?;
    fill(&db.pool, n).await?;
    // A mapped table: its lane index (`migrate` set up the default's queue).
    let c = config.to_string_lossy().to_string();
    let (code, out, err) = outroute_e2e::cli(&["migrate", "--table", "-c", &c])?;
    anyhow::ensure!(code == 0, "migrate --table: {out}{err}");
    let loaded = outroute::config::load(&config).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut store = outroute::store::Store::connect(
        &loaded.config,
        outroute::config::DEFAULT_SOURCE,
        "ceiling",
    )
    .await?;
    store.check_table().await?;
    let lanes = store.lease_round().await?.lanes;
    let store = Arc::new(store);
    // As many loops over disjoint lanes as the relay has workers.
    let workers = workers as i32;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let store = store.clone();
        let mine: Vec<i32> = lanes.iter().copied().filter(|l| l % workers == w).collect();
        tasks.push(tokio::spawn(async move {
            let mut done = 0usize;
            loop {
                let claims = store.claim(&mine, batch).await?.claims;
                if claims.is_empty() {
                    break;
                }
                let refs: Vec<&outroute::store::Claim> = claims.iter().collect();
                done += store.mark_published(&refs).await? as usize;
            }
            anyhow::Ok(done)
        }));
    }
    let mut done = 0;
    for task in tasks {
        done += task.await??;
    }
    let rate = done as f64 / t.elapsed().as_secs_f64();
    anyhow::ensure!(done == n, "ceiling drained {done} of {n}");
    db.drop_db().await;
    Ok(rate)
}

pub(crate) fn headers(i: usize) -> Vec<outroute::sink::Header<'static>> {
    vec![
        ("ce_id", format!("bench-{i}").into()),
        ("ce_type", "order-created".into()),
        ("ce_source", "/outroute/outbox".into()),
        ("ce_specversion", "1.0".into()),
    ]
}

/// Raw produce with acks through the relay's own Kafka sink, no database.
pub(crate) async fn kafka_ceiling(n: usize) -> Result<f64> {
    let topic = format!("bench{}.raw", tag());
    create_topic(&topic, 3).await?;
    let cfg = KafkaSinkConfig {
        brokers: KAFKA.into(),
        max_message_bytes: 1 << 20,
        compression: "none".into(),
        linger_ms: 5,
        max_in_flight: 10_000,
        options: Default::default(),
        tls: None,
        sasl: None,
    };
    let sink = Arc::new(KafkaSink::build("kafka", &cfg, Duration::from_secs(30))?);
    let body = payload(0).to_string().into_bytes();
    // Warm up: metadata and producer id before the clock starts.
    let h = headers(0);
    let warm = Outgoing {
        topic: &topic,
        key: None,
        partition: None,
        headers: &h,
        payload: &body,
        dedup_id: "warm",
    };
    sink.send(warm, None).await?.wait().await?;
    let t = Instant::now();
    let mut acks = Vec::with_capacity(n);
    for i in 0..n {
        let h = headers(i);
        let key = format!("o-{}", i % 500);
        let id = format!("bench-{i}");
        let out = Outgoing {
            topic: &topic,
            key: Some(key.as_bytes()),
            partition: None,
            headers: &h,
            payload: &body,
            dedup_id: &id,
        };
        acks.push(sink.send(out, None).await?);
        if acks.len() >= 5_000 {
            for a in acks.drain(..) {
                a.wait().await?;
            }
        }
    }
    for a in acks {
        a.wait().await?;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

pub(crate) async fn nats_ceiling(n: usize) -> Result<f64> {
    let t0 = tag();
    nats_stream(&format!("BENCH{t0}"), vec![format!("bench{t0}.>")]).await?;
    let cfg = NatsSinkConfig {
        url: NATS.into(),
        mode: NatsMode::Jetstream,
        max_message_bytes: 1 << 20,
        max_in_flight: 10_000,
        create_stream: None,
        tls: None,
        auth: None,
    };
    let sink = NatsSink::build("nats", &cfg, &[], Duration::from_secs(30)).await?;
    let subject = format!("bench{t0}.raw");
    let body = payload(0).to_string().into_bytes();
    let h = headers(0);
    let warm = Outgoing {
        topic: &subject,
        key: None,
        partition: None,
        headers: &h,
        payload: &body,
        dedup_id: "warm",
    };
    sink.send(warm, None).await?.wait().await?;
    let t = Instant::now();
    let mut acks = Vec::new();
    for i in 0..n {
        let h = headers(i);
        let id = format!("bench-{i}");
        let out = Outgoing {
            topic: &subject,
            key: None,
            partition: None,
            headers: &h,
            payload: &body,
            dedup_id: &id,
        };
        acks.push(sink.send(out, None).await?);
        if acks.len() >= 5_000 {
            futures::future::try_join_all(acks.drain(..).map(|a| a.wait())).await?;
        }
    }
    futures::future::try_join_all(acks.into_iter().map(|a| a.wait())).await?;
    let rate = n as f64 / t.elapsed().as_secs_f64();
    outroute_e2e::drop_nats_stream(&format!("BENCH{t0}")).await;
    Ok(rate)
}
