//! Route isolation against the real relay (issue 12): a route whose plugin
//! loops, blows its memory cap or fans out 10,000 messages per event shares
//! the outbox, the lanes and the batches with a healthy route. Two runs, the
//! same healthy traffic, with and without the hostile route:
//!
//! * every healthy event is delivered, with a commit→consumer latency close
//!   to the run without the hostile route (the table is printed; the bound
//!   asserted is loose on purpose: figures belong to benchmarks);
//! * the hostile route is quarantined after three broken limits in a row,
//!   visibly (`outroute status`, `outroute route list`, `/readyz` stays
//!   ready with a note, `outroute_route_quarantined`), and each hostile event
//!   is failed with its own limit or waits with the quarantine reason;
//! * the relay stays up and small (peak RSS ≤ 128 MiB);
//! * an operator resumes the route with `outroute route resume`.

use std::time::{Duration, Instant};

use outroute_e2e::*;

const HEALTHY: usize = 600;

struct Run {
    latencies: Vec<Duration>,
    peak_rss_kib: u64,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn insert(
    db: &TestDb,
    aggregate_type: &str,
    aggregate: &str,
    payload: serde_json::Value,
) -> anyhow::Result<String> {
    let id = uuid::Uuid::new_v4().to_string();
    sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1::uuid, $2, $3, 'updated', $4)")
        .bind(&id)
        .bind(aggregate_type)
        .bind(aggregate)
        .bind(payload)
        .execute(&db.pool)
        .await?;
    Ok(id)
}

async fn run(with_hostile: bool) -> anyhow::Result<Run> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("iso{t}.updated");
    create_topic(&topic, 2).await?;
    let http = free_addr();
    let dir = test_dir("isolation");
    let body = format!(
        "[http]\nlisten = \"{http}\"\n\
         [sinks.kafka]\nkind = \"kafka\"\nbrokers = \"127.0.0.1:9092\"\n\
         [plugins.p]\npath = \"{plugin}\"\n\
         [[routes]]\nname = \"healthy\"\nplugin = \"p\"\naggregate_types = [\"order\"]\n\
         config = {{ sink = \"kafka\", topic = \"iso{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"iso{t}.*\"] }}\n\
         [[routes]]\nname = \"hostile\"\nplugin = \"p\"\naggregate_types = [\"bad\"]\n\
         config = {{ sink = \"kafka\", topic = \"iso{t}-bad.{{event_type}}\" }}\nallow = {{ kafka = [\"iso{t}-bad.*\"] }}\n\
         cpu_budget = \"20ms\"\nmemory_mib = 32\nquarantine_after = 3\nquarantine_probe_interval = \"2s\"\n",
        plugin = plugin("hostile").display()
    );
    let config = write_config(&dir, &db.url, "lease_ttl = \"3s\"\nbatch_size = 100", &body)?;
    db.migrate(&config)?;
    let cfg = config.to_str().unwrap_or_default().to_string();

    let mut relay = Relay::start(&config, &[])?;
    let consumer = {
        let topic = topic.clone();
        tokio::task::spawn_blocking(move || {
            consume_kafka(&topic, 2, HEALTHY, Duration::from_secs(90))
        })
    };
    // Let the relay start and the consumer attach before the clock starts.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let modes = ["loop", "oom", "fan-out-bomb"];
    let mut healthy = Vec::new();
    let mut hostile: Vec<(&str, String)> = Vec::new();
    let tick = Duration::from_millis(10);
    let started = Instant::now();
    for i in 0..HEALTHY {
        healthy.push(
            insert(
                &db,
                "order",
                &format!("h-{}", i % 40),
                serde_json::json!({"n": i}),
            )
            .await?,
        );
        if with_hostile && i % 5 == 0 {
            let mode = modes[(i / 5) % modes.len()];
            let id = insert(
                &db,
                "bad",
                &format!("bad-{i}"),
                serde_json::json!({"hostile": mode}),
            )
            .await?;
            hostile.push((mode, id));
        }
        let due = started + tick * (i as u32 + 1);
        tokio::time::sleep_until(due.into()).await;
    }
    let delivered = consumer.await??;

    // Every healthy event arrived.
    let mut first: std::collections::HashMap<&str, &Delivered> = std::collections::HashMap::new();
    for d in &delivered {
        first.entry(d.id()).or_insert(d);
    }
    for id in &healthy {
        assert!(
            first.contains_key(id.as_str()),
            "healthy event {id} not delivered (hostile route: {with_hostile})\n{}",
            relay.log_text()
        );
    }
    let mut latencies: Vec<Duration> = healthy
        .iter()
        .filter_map(|id| first.get(id.as_str()).and_then(|d| d.latency()))
        .collect();
    latencies.sort();

    if with_hostile {
        // The hostile route is quarantined, visibly; the relay stays ready.
        let quarantined = eventually(Duration::from_secs(20), || async {
            cli(&["status", "-c", &cfg])
                .is_ok_and(|(_, out, _)| out.contains("quarantined      route `hostile`"))
        })
        .await;
        let (_, status, _) = cli(&["status", "-c", &cfg])?;
        assert!(quarantined, "{status}\n{}", relay.log_text());
        assert!(status.contains("events in a row broke a limit"), "{status}");
        let (_, list, _) = cli(&["route", "list", "-c", &cfg])?;
        assert!(
            list.contains("healthy") && list.contains("flowing"),
            "{list}"
        );
        assert!(
            list.lines()
                .any(|l| l.starts_with("hostile") && l.contains("quarantined since")),
            "{list}"
        );
        let ready_note = eventually(Duration::from_secs(10), || async {
            http_get(&http, "/readyz").await.is_ok_and(|(code, body)| {
                code == 200 && body.contains("route `hostile` quarantined")
            })
        })
        .await;
        let (code, body) = http_get(&http, "/readyz").await?;
        assert!(ready_note, "/readyz {code}: {body}");
        let (_, metrics) = http_get(&http, "/metrics").await?;
        assert_eq!(
            metric(&metrics, "outroute_route_quarantined{route=\"hostile\"}"),
            Some(1.0),
            "{metrics}"
        );
        assert!(
            metric(
                &metrics,
                "outroute_plugin_limit_breaches_total{route=\"hostile\",limit=\"cpu_budget\"}"
            )
            .unwrap_or(0.0)
                >= 1.0,
            "{metrics}"
        );
        assert!(
            metric(
                &metrics,
                "outroute_events_deferred_total{route=\"hostile\"}"
            )
            .unwrap_or(0.0)
                >= 1.0,
            "{metrics}"
        );

        // Each hostile event failed with its own limit, or waits with the
        // quarantine's reason; none was published.
        let recorded = eventually(Duration::from_secs(30), || async {
            db.count("SELECT count(*) FROM outroute_event_state WHERE route = 'hostile'")
                .await
                >= hostile.len() as i64
        })
        .await;
        assert!(recorded, "{}", relay.log_text());
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT event_id, last_error FROM outroute_event_state WHERE route = 'hostile'",
        )
        .fetch_all(&db.pool)
        .await?;
        let reasons: std::collections::HashMap<String, String> = rows.into_iter().collect();
        for (mode, id) in &hostile {
            let r = reasons.get(id).cloned().unwrap_or_default();
            let own = match *mode {
                "loop" => "exceeded its CPU budget (20 ms",
                "oom" => "exceeded its memory cap of 32 MiB",
                _ => "returned 10000 messages for one event",
            };
            assert!(
                r.contains(own) || r.contains("route `hostile` is quarantined"),
                "{mode} event {id}: reason `{r}`"
            );
        }
        assert_eq!(db.published("o.aggregate_type = 'bad'").await, 0);

        // The operator resumes it.
        let (code, out, err) = cli(&["route", "resume", "hostile", "-c", &cfg])?;
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("route `hostile` resumed"), "{out}");
        let (code, _, err) = cli(&["route", "resume", "nosuch", "-c", &cfg])?;
        assert_ne!(code, 0);
        assert!(err.contains("no route named `nosuch`"), "{err}");
    }

    assert!(
        relay.child.try_wait()?.is_none(),
        "relay died:\n{}",
        relay.log_text()
    );
    let peak_rss_kib = proc_memory_kib(relay.child.id(), "VmHWM");
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(Run {
        latencies,
        peak_rss_kib,
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_route_is_quarantined_and_does_not_delay_a_healthy_one() -> anyhow::Result<()> {
    let alone = run(false).await?;
    let beside = run(true).await?;
    let row = |name: &str, r: &Run| {
        eprintln!(
            "{name:<28} healthy commit→consumer p50 {:>6.1} ms  p99 {:>6.1} ms  max {:>6.1} ms  relay peak RSS {:>4} MiB",
            percentile(&r.latencies, 0.5).as_secs_f64() * 1e3,
            percentile(&r.latencies, 0.99).as_secs_f64() * 1e3,
            r.latencies
                .last()
                .copied()
                .unwrap_or_default()
                .as_secs_f64()
                * 1e3,
            r.peak_rss_kib / 1024
        );
    };
    row("healthy route alone", &alone);
    row("beside loop/oom/fan-out-bomb", &beside);
    assert!(
        beside.peak_rss_kib <= 128 * 1024,
        "peak RSS {} KiB",
        beside.peak_rss_kib
    );
    // Not a speed goal (that is the benchmark's job): a guard against the
    // healthy route waiting for the hostile one's budgets, which cost
    // seconds per batch before isolation. Loose enough for a loaded
    // 2-core machine (a build beside it gave 107 ms alone, 423 ms beside).
    let (a, b) = (
        percentile(&alone.latencies, 0.99),
        percentile(&beside.latencies, 0.99),
    );
    assert!(
        b <= a * 3 + Duration::from_millis(1000),
        "healthy p99 {b:?} beside the hostile route, {a:?} alone"
    );
    Ok(())
}

/// The quarantine is the fleet's, and a probe ends it by itself. Relay A
/// quarantines a route whose events loop and records it; relay B, which
/// never saw a breach, follows the record: it defers the route's next
/// event until an operator resumes the route. Then, with a probe every
/// 3 s (applied by reload), B quarantines the route again after two
/// more loops, and the next event, let through as a probe, keeps within
/// its limits: the route resumes with no command and the event goes out.
#[tokio::test(flavor = "multi_thread")]
async fn a_quarantine_is_followed_by_every_relay_and_a_good_probe_resumes_it() -> anyhow::Result<()>
{
    let db = TestDb::new().await?;
    let dir = test_dir("quarantine-fleet");
    let out = dir.join("out.jsonl");
    let body = |http: &str, probe: &str| {
        format!(
            "[http]\nlisten = \"{http}\"\n\
             [sinks.file]\nkind = \"file\"\npath = \"{out}\"\n\
             [plugins.p]\npath = \"{plugin}\"\n\
             [[routes]]\nname = \"hostile\"\nplugin = \"p\"\n\
             config = {{ sink = \"file\", topic = \"q.{{event_type}}\" }}\nallow = {{ file = [\"q.*\"] }}\n\
             cpu_budget = \"20ms\"\nmax_attempts = 1\nquarantine_after = 2\nquarantine_probe_interval = \"{probe}\"\n",
            out = out.display(),
            plugin = plugin("hostile").display()
        )
    };
    let (http_a, http_b) = (free_addr(), free_addr());
    let config_a = write_config(
        &dir.join("a"),
        &db.url,
        "lease_ttl = \"3s\"",
        &body(&http_a, "1h"),
    )?;
    let config_b = write_config(
        &dir.join("b"),
        &db.url,
        "lease_ttl = \"3s\"",
        &body(&http_b, "1h"),
    )?;
    db.migrate(&config_a)?;
    let gauge = |http: String, name: &'static str| async move {
        http_get(&http, "/metrics")
            .await
            .ok()
            .and_then(|(_, m)| metric(&m, name))
            .unwrap_or(0.0)
    };
    const QUARANTINED: &str = "outroute_route_quarantined{route=\"hostile\"}";
    const DEFERRED: &str = "outroute_events_deferred_total{route=\"hostile\"}";
    // Events of the route that loop (each breaks its CPU budget), then
    // whether the relay at `http` quarantined the route within 30 s.
    let loop_until_quarantined = |events: std::ops::Range<i32>, http: &String| {
        let (db, http) = (&db, http.clone());
        async move {
            for i in events {
                insert(
                    db,
                    "bad",
                    &format!("loop-{i}"),
                    serde_json::json!({"hostile": "loop"}),
                )
                .await?;
            }
            anyhow::Ok(
                eventually(Duration::from_secs(30), || async {
                    gauge(http.clone(), QUARANTINED).await == 1.0
                })
                .await,
            )
        }
    };

    let mut a = Relay::start(&config_a, &[])?;
    let quarantined = loop_until_quarantined(0..2, &http_a).await?;
    assert!(
        quarantined,
        "relay A quarantines the route: {}",
        a.log_text()
    );
    a.kill();

    let b = Relay::start(&config_b, &[])?;
    let first = insert(&db, "order", "p-1", serde_json::json!({})).await?;
    let deferred = eventually(Duration::from_secs(30), || async {
        gauge(http_b.clone(), DEFERRED).await >= 1.0
            && gauge(http_b.clone(), QUARANTINED).await == 1.0
    })
    .await;
    assert!(deferred, "relay B follows A's quarantine: {}", b.log_text());
    assert_eq!(db.published("").await, 0, "nothing of the route went out");
    let cfg_b = config_b.display().to_string();
    let (code, o, e) = cli(&["route", "resume", "hostile", "-c", &cfg_b])?;
    assert_eq!(code, 0, "{o}{e}");
    let sent = eventually(Duration::from_secs(30), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == first)
    })
    .await;
    assert!(sent, "resumed for every relay: {}", b.log_text());

    // A probe every 3 s, then two more loops.
    std::fs::write(
        &config_b,
        std::fs::read_to_string(&config_b)?.replace("\"1h\"", "\"3s\""),
    )?;
    b.reload();
    let reloaded = eventually(Duration::from_secs(15), || async {
        b.log_text().contains("config reload applied")
    })
    .await;
    assert!(reloaded, "{}", b.log_text());
    let again = loop_until_quarantined(2..4, &http_b).await?;
    assert!(again, "{}", b.log_text());
    let deferred_before = gauge(http_b.clone(), DEFERRED).await;
    let probe = insert(&db, "order", "p-2", serde_json::json!({})).await?;
    let resumed = eventually(Duration::from_secs(30), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == probe)
            && gauge(http_b.clone(), QUARANTINED).await == 0.0
    })
    .await;
    assert!(
        resumed,
        "the good probe resumed the route: {}",
        b.log_text()
    );
    assert!(
        gauge(http_b.clone(), DEFERRED).await > deferred_before,
        "the event waited for its probe (deferred while quarantined)"
    );
    let (_, status, _) = cli(&["route", "list", "-c", &cfg_b])?;
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("hostile") && l.contains("flowing")),
        "{status}"
    );
    drop(b);
    db.drop_db().await;
    Ok(())
}
