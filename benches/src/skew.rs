//! Fairness under skew (issue 43): one source with a deep backlog beside
//! many quiet ones in one relay. The quiet sources' pickup (commit → a
//! subscriber) with and without the backlog beside them, and the backlog's
//! drain rate with and without the quiet sources. Runs on the scale
//! benchmark's cluster (`scale.rs`), one database per source, every route
//! to core NATS (no stream fills up; the relay's work per event is the
//! same).

use std::sync::Mutex;

use super::scale::{cluster, url};
use super::*;

/// Which sources a run's relay serves.
#[derive(Clone, Copy, PartialEq)]
enum Serves {
    Quiet,
    Backlog,
    Both,
}

/// The config of one run: the backlog source `bulk` (database `dbs[0]`)
/// and the quiet sources `q1`…, each routed to its own subject tree.
fn config(dir: &Path, http: &str, t: &str, dbs: &[String], serves: Serves) -> Result<PathBuf> {
    let mut body = String::new();
    let quiet: Vec<String> = (1..dbs.len()).map(|i| format!("q{i}")).collect();
    if serves != Serves::Quiet {
        body.push_str(&format!("[sources.bulk]\nurl = \"{}\"\n", url(&dbs[0])));
    }
    if serves != Serves::Backlog {
        for (i, db) in dbs.iter().enumerate().skip(1) {
            body.push_str(&format!("[sources.q{i}]\nurl = \"{}\"\n", url(db)));
        }
    }
    body.push_str(&format!(
        "[http]\nlisten = \"{http}\"\n[sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\nmode = \"core\"\n\
         [plugins.p]\npath = \"{}\"\n",
        plugin("order-router").display()
    ));
    if serves != Serves::Quiet {
        body.push_str(&format!(
            "[[routes]]\nname = \"bulk\"\nplugin = \"p\"\nsources = [\"bulk\"]\n\
             config = {{ sink = \"nats\", topic = \"sk{t}.bulk.{{event_type}}\" }}\nallow = {{ nats = [\"sk{t}.bulk.*\"] }}\n"
        ));
    }
    if serves != Serves::Backlog {
        body.push_str(&format!(
            "[[routes]]\nname = \"quiet\"\nplugin = \"p\"\nsources = {quiet:?}\n\
             config = {{ sink = \"nats\", topic = \"sk{t}.quiet.{{event_type}}\" }}\nallow = {{ nats = [\"sk{t}.quiet.*\"] }}\n"
        ));
    }
    let path = dir.join(format!(
        "outroute-{}.toml",
        match serves {
            Serves::Quiet => "quiet",
            Serves::Backlog => "backlog",
            Serves::Both => "both",
        }
    ));
    std::fs::write(&path, body)?;
    Ok(path)
}

/// `n` pending events of 1 KiB in the backlog database.
async fn fill(db: &str, n: usize) -> Result<()> {
    let pool = PgPool::connect(&url(db)).await?;
    let mut done = 0;
    while done < n {
        let end = (done + 250_000).min(n);
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'order', 'b-' || g, 'order-created', \
               jsonb_build_object('pad', repeat('x', 1000)) \
             FROM generate_series($1::bigint, $2::bigint) g",
        )
        .bind(done as i64)
        .bind(end as i64 - 1)
        .execute(&pool)
        .await?;
        done = end;
    }
    pool.close().await;
    Ok(())
}

/// The relay's count of events published by route `route`.
async fn published(http: &str, route: &str) -> f64 {
    outroute_e2e::http_get(http, "/metrics")
        .await
        .ok()
        .and_then(|(_, m)| {
            outroute_e2e::metric(
                &m,
                &format!("outroute_events_published_total{{route=\"{route}\"}}"),
            )
        })
        .unwrap_or(0.0)
}

/// One quiet event: when its commit returned, its source (index in the
/// databases) and its place among that source's events.
#[derive(Clone, Copy)]
struct Sent {
    at: Instant,
    source: usize,
    n: usize,
}

/// Quiet writers: each quiet database gets `rate` events/s (one per
/// transaction) until `stop`; every id with the instant its commit
/// returned.
fn quiet_writers(
    dbs: &[String],
    rate: u64,
    stop: Arc<AtomicBool>,
    sent: Arc<Mutex<HashMap<String, Sent>>>,
) -> Vec<tokio::task::JoinHandle<Result<()>>> {
    let every = Duration::from_secs_f64(1.0 / rate as f64);
    dbs.iter()
        .enumerate()
        .skip(1)
        .map(|(i, db)| {
            let (url, stop, sent) = (url(db), stop.clone(), sent.clone());
            tokio::spawn(async move {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await?;
                // Spread the writers over the interval.
                tokio::time::sleep(every.mul_f64(i as f64 / 100.0 % 1.0)).await;
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let id = uuid::Uuid::new_v4();
                    sqlx::query(
                        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                         VALUES ($1, 'order', 'quiet', 'order-created', '{}')",
                    )
                    .bind(id)
                    .execute(&pool)
                    .await?;
                    if let Ok(mut s) = sent.lock() {
                        s.insert(
                            id.to_string(),
                            Sent {
                                at: Instant::now(),
                                source: i,
                                n,
                            },
                        );
                    }
                    n += 1;
                }
                pool.close().await;
                Ok(())
            })
        })
        .collect()
}

/// One run: what the relay serving `serves` shows — the quiet sources'
/// pickups (ms, sorted) over `secs` or until the backlog drained, and the
/// backlog's drain rate (events/s from its first published event).
async fn run(
    t: &str,
    dbs: &[String],
    serves: Serves,
    backlog: usize,
    rate: u64,
    secs: u64,
) -> Result<(Vec<f64>, f64)> {
    let dir = test_dir("skew");
    let http = outroute_e2e::free_addr();
    let config = config(&dir, &http, t, dbs, serves)?;
    if serves != Serves::Quiet {
        fill(&dbs[0], backlog).await?;
    }
    // The quiet events' arrivals.
    let arrived: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let sub = async_nats::connect(NATS)
        .await?
        .subscribe(format!("sk{t}.quiet.>"))
        .await?;
    let consumer = {
        let arrived = arrived.clone();
        tokio::spawn(async move {
            use futures::StreamExt;
            let mut sub = sub;
            while let Some(m) = sub.next().await {
                let now = Instant::now();
                if let Some(id) = m.headers.as_ref().and_then(|h| h.get("ce_id"))
                    && let Ok(mut a) = arrived.lock()
                {
                    a.insert(id.to_string(), now);
                }
            }
        })
    };
    let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
    // Wait until the relay serves every source (a source holds lanes once
    // it is up), then a few seconds more (idle quiet sources fall asleep):
    // the figures are the steady state beside each other, not the start-up
    // of a hundred sources while a backlog drains (that start-up made the
    // quiet p99 once; it is `scale`'s subject).
    let sources: Vec<String> = match serves {
        Serves::Quiet => (1..dbs.len()).map(|i| format!("q{i}")).collect(),
        Serves::Backlog => vec!["bulk".into()],
        Serves::Both => std::iter::once("bulk".to_string())
            .chain((1..dbs.len()).map(|i| format!("q{i}")))
            .collect(),
    };
    let started = Instant::now();
    loop {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(180),
            "the relay did not serve every source within 3 minutes"
        );
        if let Ok((_, m)) = outroute_e2e::http_get(&http, "/metrics").await
            && sources.iter().all(|s| {
                outroute_e2e::metric(&m, &format!("outroute_lanes_owned{{source=\"{s}\"}}"))
                    .is_some_and(|n| n > 0.0)
            })
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    // The backlog's drain is timed from here, where the quiet writers
    // start (or would), to its last event.
    let from = (Instant::now(), published(&http, "bulk").await);
    if serves != Serves::Quiet {
        anyhow::ensure!(
            from.1 < backlog as f64 * 0.7,
            "the backlog was {:.0} % drained before the run began: make it larger",
            from.1 * 100.0 / backlog as f64
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let sent: Arc<Mutex<HashMap<String, Sent>>> = Arc::default();
    let writers = if serves != Serves::Backlog {
        quiet_writers(dbs, rate, stop.clone(), sent.clone())
    } else {
        Vec::new()
    };
    // Until the backlog drained (or `secs` with no backlog).
    let mut drained = None;
    let until =
        Instant::now() + Duration::from_secs(if serves == Serves::Quiet { secs } else { 3600 });
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if serves != Serves::Quiet {
            let n = published(&http, "bulk").await;
            if n >= backlog as f64 {
                drained = Some((n - from.1) / from.0.elapsed().as_secs_f64());
                break;
            }
        }
    }
    let writing_ended = Instant::now();
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await??;
    }
    // The last quiet events arrive.
    tokio::time::sleep(Duration::from_secs(2)).await;
    relay.terminate(Duration::from_secs(30));
    consumer.abort();
    let sent = sent.lock().map(|s| s.clone()).unwrap_or_default();
    let arrived = arrived.lock().map(|a| a.clone()).unwrap_or_default();
    // The events committed before the writers were told to stop (each
    // writer may commit one more after: not measured, and not missing).
    let measured: Vec<(&String, &Sent)> =
        sent.iter().filter(|(_, s)| s.at < writing_ended).collect();
    let mut pickups: Vec<f64> = measured
        .iter()
        .filter_map(|(id, s)| Some(arrived.get(*id)?.duration_since(s.at).as_secs_f64() * 1000.0))
        .collect();
    let missing: Vec<&Sent> = measured
        .iter()
        .filter(|(id, _)| !arrived.contains_key(*id))
        .map(|(_, s)| *s)
        .collect();
    // Core NATS is at-most-once towards a subscriber: allow 1 %, and say
    // which events they were.
    anyhow::ensure!(
        missing.len() * 100 <= measured.len().max(1),
        "{} of {} quiet events never reached the subscriber (sources {:?}, places {:?})",
        missing.len(),
        measured.len(),
        missing
            .iter()
            .map(|s| s.source)
            .take(10)
            .collect::<Vec<_>>(),
        missing.iter().map(|s| s.n).take(10).collect::<Vec<_>>(),
    );
    pickups.sort_by(f64::total_cmp);
    Ok((pickups, drained.unwrap_or(0.0)))
}

/// The skew case: `quiet` sources at `rate` events/s each and one with a
/// `backlog`-event backlog, alone and together.
pub(crate) async fn skew(quiet: usize, backlog: usize, rate: u64, secs: u64) -> Result<Value> {
    cluster()?;
    let admin = PgPool::connect(&url("postgres")).await?;
    let t = tag();
    let dbs: Vec<String> = (0..=quiet).map(|i| format!("skew_{t}_{i}")).collect();
    for db in &dbs {
        sqlx::query(&format!("CREATE DATABASE {db}"))
            .execute(&admin)
            .await?;
    }
    let result = async {
        let dir = test_dir("skew-migrate");
        let all = config(&dir, &outroute_e2e::free_addr(), &t, &dbs, Serves::Both)?;
        let migrated = std::process::Command::new(outroute_e2e::bin())
            .args(["migrate", "-c"])
            .arg(&all)
            .output()?;
        anyhow::ensure!(
            migrated.status.success(),
            "migrate failed: {}",
            String::from_utf8_lossy(&migrated.stderr)
        );
        eprintln!("   skew: {quiet} quiet sources at {rate}/s, alone");
        let (alone, _) = run(&t, &dbs, Serves::Quiet, backlog, rate, secs).await?;
        eprintln!("   skew: a {backlog}-event backlog, alone");
        let (_, single) = run(&t, &dbs, Serves::Backlog, backlog, rate, secs).await?;
        eprintln!("   skew: both");
        let (beside, shared) = run(&t, &dbs, Serves::Both, backlog, rate, secs).await?;
        let p = |v: &[f64], q| percentile(v, q);
        anyhow::Ok(json!({
            "quiet_sources": quiet,
            "rate_per_quiet_source": rate,
            "backlog": backlog,
            "quiet_pickup_ms_alone": {"p50": p(&alone, 0.5), "p99": p(&alone, 0.99), "samples": alone.len()},
            "quiet_pickup_ms_beside_backlog": {"p50": p(&beside, 0.5), "p99": p(&beside, 0.99), "samples": beside.len()},
            "quiet_p99_ratio": p(&beside, 0.99) / p(&alone, 0.99).max(f64::MIN_POSITIVE),
            "backlog_drain_alone": single,
            "backlog_drain_beside_quiet": shared,
            "backlog_drain_ratio": shared / single.max(f64::MIN_POSITIVE),
        }))
    }
    .await;
    for db in &dbs {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .execute(&admin)
            .await;
    }
    result
}

/// The table rows of a [`skew`] run.
pub(crate) fn skew_rows(s: &Value) -> Vec<(String, String)> {
    let ms = |k: &str, q: &str| s[k][q].as_f64().unwrap_or(0.0);
    vec![
        (
            format!(
                "skew: {} quiet sources at {}/s, pickup commit→subscriber",
                s["quiet_sources"], s["rate_per_quiet_source"]
            ),
            format!(
                "alone p50 {:.1} / p99 {:.1} ms; beside the backlog p50 {:.1} / p99 {:.1} ms ({:.2}×)",
                ms("quiet_pickup_ms_alone", "p50"),
                ms("quiet_pickup_ms_alone", "p99"),
                ms("quiet_pickup_ms_beside_backlog", "p50"),
                ms("quiet_pickup_ms_beside_backlog", "p99"),
                s["quiet_p99_ratio"].as_f64().unwrap_or(0.0),
            ),
        ),
        (
            format!("skew: {}-event backlog drain", s["backlog"]),
            format!(
                "alone {:.0} events/s; beside the quiet sources {:.0} events/s ({:.2}×)",
                s["backlog_drain_alone"].as_f64().unwrap_or(0.0),
                s["backlog_drain_beside_quiet"].as_f64().unwrap_or(0.0),
                s["backlog_drain_ratio"].as_f64().unwrap_or(0.0),
            ),
        ),
    ]
}
