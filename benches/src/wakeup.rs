//! What the relay costs producers: commits/s of 8 writers with no relay, a
//! relay draining what they write (busy), and a relay asleep beside writers
//! that commit business rows only (idle: what a sleeping source costs its
//! database's other work). Each case runs `reps` times, the cases
//! interleaved, so drift on the machine falls on all of them alike; the
//! figures are medians with their spread.
//!
//! Writers that commit as fast as they can saturate this machine: there a
//! draining relay's own work (its process, and the claims and marks it
//! asks of PostgreSQL) takes cores the writers would use. The paced cases
//! show what a producer below saturation — as producers run — pays: the
//! same offered load with and without a relay draining it, commit latency
//! and commits/s achieved.

use super::*;

/// One case: which relay runs beside the writers, and what they write.
struct Case {
    label: &'static str,
    /// `None`: no relay; `Some(notify)`: a relay, with a NOTIFY in every
    /// producer transaction (relay listening on it) if `notify`.
    relay: Option<bool>,
    /// Writers insert outbox rows (else business rows only: the relay sleeps).
    outbox: bool,
}

const SATURATED: [Case; 5] = [
    Case {
        label: "no relay",
        relay: None,
        outbox: true,
    },
    Case {
        label: "relay polling",
        relay: Some(false),
        outbox: true,
    },
    Case {
        label: "NOTIFY per commit + LISTEN",
        relay: Some(true),
        outbox: true,
    },
    Case {
        label: "idle: business rows, no relay",
        relay: None,
        outbox: false,
    },
    Case {
        label: "idle: business rows, relay asleep",
        relay: Some(false),
        outbox: false,
    },
];

const PACED: [Case; 2] = [
    Case {
        label: "no relay",
        relay: None,
        outbox: true,
    },
    Case {
        label: "relay draining",
        relay: Some(false),
        outbox: true,
    },
];

/// What 8 writers achieved: commits/s and each commit's latency (ms,
/// sorted; begin → commit returned).
struct Written {
    per_s: f64,
    latency_ms: Vec<f64>,
}

/// 8 writer connections, one insert per transaction, for `secs`: as fast
/// as they can (`pace` `None`) or `pace` commits/s in all.
async fn writers(
    pool: &PgPool,
    notify: bool,
    outbox: bool,
    secs: u64,
    pace: Option<u64>,
) -> Result<Written> {
    let end = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for w in 0..8u64 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            let mut latency = Vec::new();
            let mut tick = pace.map(|p| {
                let mut t = tokio::time::interval(Duration::from_secs_f64(8.0 / p.max(1) as f64));
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                t
            });
            if let Some(p) = pace {
                // Spread the writers over the interval.
                tokio::time::sleep(Duration::from_secs_f64(w as f64 / p.max(1) as f64)).await;
            }
            while Instant::now() < end {
                if let Some(t) = tick.as_mut() {
                    t.tick().await;
                }
                let began = Instant::now();
                let mut tx = pool.begin().await?;
                sqlx::query(if outbox {
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'order-created', '{}')"
                } else {
                    "INSERT INTO business (id, note) VALUES ($1, $2)"
                })
                .bind(uuid::Uuid::new_v4())
                .bind(format!("w{w}-{}", n % 50))
                .execute(&mut *tx)
                .await?;
                if notify {
                    sqlx::query("NOTIFY outbox_new").execute(&mut *tx).await?;
                }
                tx.commit().await?;
                latency.push(began.elapsed().as_secs_f64() * 1000.0);
                n += 1;
            }
            anyhow::Ok((n, latency))
        }));
    }
    let mut total = 0;
    let mut latency_ms = Vec::new();
    for t in tasks {
        let (n, l) = t.await??;
        total += n;
        latency_ms.extend(l);
    }
    latency_ms.sort_by(f64::total_cmp);
    Ok(Written {
        per_s: total as f64 / secs as f64,
        latency_ms,
    })
}

/// One run of `case`: a fresh database, the relay (if any) started and —
/// for business rows — asleep, then the writers.
async fn run(case: &Case, secs: u64, pace: Option<u64>) -> Result<Written> {
    let db = bench_db().await?;
    let dir = test_dir("wakeup");
    let relay_cfg = if case.relay == Some(true) {
        "notify_channel = \"outbox_new\""
    } else {
        ""
    };
    let config = write_config_with(
        &dir,
        store_keys(),
        &db.url,
        relay_cfg,
        &format!("{}{}", canonical().mapping(), file_sink_body(&dir)),
    )?;
    db.migrate(&config)?;
    migrate_table(canonical(), &config)?;
    let relay = match case.relay {
        Some(_) => Some(Relay::start(&config, &[("RUST_LOG", "warn")])?),
        None => None,
    };
    sqlx::query("CREATE TABLE business (id uuid PRIMARY KEY, note text)")
        .execute(&db.pool)
        .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    if relay.is_some() && !case.outbox {
        // Asleep: the relay's record in the wake table, and a moment
        // more for its last claims.
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            let asleep: i64 = sqlx::query_scalar("SELECT count(*) FROM outroute_wake WHERE asleep")
                .fetch_one(&db.pool)
                .await
                .unwrap_or(0);
            if asleep > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let written = writers(&db.pool, case.relay == Some(true), case.outbox, secs, pace).await;
    if let Some(mut r) = relay {
        r.terminate(Duration::from_secs(15));
        anyhow::ensure!(
            !case.outbox || file_sink_messages(&dir) > 0,
            "wake-up bench: the relay published nothing\n{}",
            r.log_text()
        );
    }
    db.drop_db().await;
    written
}

/// Median, min and max of `runs`, with the runs.
fn spread(mut runs: Vec<f64>) -> Value {
    runs.sort_by(f64::total_cmp);
    json!({
        "median": percentile(&runs, 0.5),
        "min": runs.first().copied().unwrap_or(0.0),
        "max": runs.last().copied().unwrap_or(0.0),
        "runs": runs,
    })
}

/// The wake-up cost: every saturated case `reps` times, interleaved, 8 s
/// each; then, if `paced` > 0, the paced cases at `paced` commits/s.
pub(crate) async fn wakeup_cost(reps: usize, paced: u64) -> Result<Value> {
    let secs = 8;
    let mut saturated: Vec<Vec<f64>> = vec![Vec::new(); SATURATED.len()];
    for rep in 0..reps.max(1) {
        eprintln!("   wakeup: saturated writers, round {}", rep + 1);
        for (i, case) in SATURATED.iter().enumerate() {
            saturated[i].push(run(case, secs, None).await?.per_s);
        }
    }
    let saturated: serde_json::Map<String, Value> = SATURATED
        .iter()
        .zip(saturated)
        .map(|(c, runs)| (c.label.to_string(), spread(runs)))
        .collect();
    let median = |k: &str| saturated[k]["median"].as_f64().unwrap_or(0.0);
    let mut out = json!({
        "reps": reps,
        "secs_each": secs,
        "busy_ratio": median("relay polling") / median("no relay").max(f64::MIN_POSITIVE),
        "idle_ratio": median("idle: business rows, relay asleep")
            / median("idle: business rows, no relay").max(f64::MIN_POSITIVE),
    });
    if paced > 0 {
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); PACED.len()];
        let mut latency: Vec<Vec<f64>> = vec![Vec::new(); PACED.len()];
        for rep in 0..reps.max(1) {
            eprintln!("   wakeup: writers paced at {paced}/s, round {}", rep + 1);
            for (i, case) in PACED.iter().enumerate() {
                let w = run(case, secs, Some(paced)).await?;
                rates[i].push(w.per_s);
                latency[i].extend(w.latency_ms);
            }
        }
        let paced_cases: serde_json::Map<String, Value> = PACED
            .iter()
            .zip(rates.into_iter().zip(latency))
            .map(|(c, (r, mut l))| {
                l.sort_by(f64::total_cmp);
                (
                    c.label.to_string(),
                    json!({
                        "commits_per_s": spread(r),
                        "commit_ms": {"p50": percentile(&l, 0.5), "p99": percentile(&l, 0.99), "samples": l.len()},
                    }),
                )
            })
            .collect();
        out["paced"] = json!({"offered_per_s": paced, "cases": paced_cases});
    }
    out["saturated"] = Value::Object(saturated);
    Ok(out)
}

/// The table rows of a [`wakeup_cost`] run, each figure labelled by
/// `prefix` (the capture, in the logical section).
pub(crate) fn wakeup_rows(prefix: &str, w: &Value) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    let reps = w["reps"].as_u64().unwrap_or(0);
    for (k, v) in w["saturated"].as_object().into_iter().flatten() {
        rows.push((
            format!("{prefix}producer commits/s, 8 writers flat out, {k}"),
            format!(
                "{:.0} (min {:.0}, max {:.0}; {reps} runs)",
                v["median"].as_f64().unwrap_or(0.0),
                v["min"].as_f64().unwrap_or(0.0),
                v["max"].as_f64().unwrap_or(0.0),
            ),
        ));
    }
    rows.push((
        format!("{prefix}  flat out, relay ÷ no relay: busy, idle"),
        format!(
            "{:.3}, {:.3}",
            w["busy_ratio"].as_f64().unwrap_or(0.0),
            w["idle_ratio"].as_f64().unwrap_or(0.0)
        ),
    ));
    if let Some(cases) = w["paced"]["cases"].as_object() {
        for (k, v) in cases {
            rows.push((
                format!(
                    "{prefix}producer, 8 writers paced at {}/s, {k}",
                    w["paced"]["offered_per_s"]
                ),
                format!(
                    "{:.0} commits/s (min {:.0}); commit p50 {:.2} ms, p99 {:.2} ms",
                    v["commits_per_s"]["median"].as_f64().unwrap_or(0.0),
                    v["commits_per_s"]["min"].as_f64().unwrap_or(0.0),
                    v["commit_ms"]["p50"].as_f64().unwrap_or(0.0),
                    v["commit_ms"]["p99"].as_f64().unwrap_or(0.0),
                ),
            ));
        }
    }
    rows
}
