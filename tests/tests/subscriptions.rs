//! Routes are subscriptions, on a shared relay (real PostgreSQL, tansu,
//! NATS, file sink): every route that selects an event gets it, and one
//! route can neither take another's events, nor hide them, nor hold them
//! back.
//!
//! * A team whose file sorts first, with a route that selects everything
//!   its grant allows and a plugin that returns no messages, takes nothing
//!   from the team that owns the events: every event reaches the owner's
//!   topic, and the first team sees exactly what its grant allows.
//! * One route failing an event (retryable, then for good) holds back only
//!   that route's later events of the aggregate — those in the batch and
//!   those written after the failure: another route's copies of them are
//!   delivered at once, in order, and never again when the first route's
//!   later deliveries finally go.

use std::time::Duration;

use anyhow::Result;
use outroute_e2e::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_team_that_selects_everything_takes_nothing_from_another() -> Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("own{t}.events");
    create_topic(&topic, 1).await?;
    let dir = test_dir("subscriptions-teams");
    let http = free_addr();
    std::fs::create_dir_all(dir.join("teams"))?;
    let config = dir.join("outroute.toml");
    std::fs::write(
        &config,
        format!(
            "include = [\"teams/*.toml\"]\n[relay]\ncache_dir = \"{cache}\"\nlanes = 8\n\
             [sources.orders]\nurl = \"{url}\"\n\
             [sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{KAFKA}\"\n\
             [sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\n\
             [grants.aaa]\nsources = [\"orders\"]\naggregate_types = [\"order\"]\nallow = {{ nats = [\"aaa{t}.**\"] }}\n\
             plugin_dirs = [\"{dist}\"]\n\
             [grants.payments]\nsources = [\"orders\"]\nallow = {{ kafka = [\"own{t}.*\"] }}\nplugin_dirs = [\"{dist}\"]\n\
             [http]\nlisten = \"{http}\"\n",
            cache = std::env::temp_dir().join("outroute-test-cache").display(),
            url = db.url,
            dist = workspace().join("plugins/dist").display(),
        ),
    )?;
    // `aaa` sorts first and leaves its selection at the default: under
    // first-match routing it took every event, published nothing and the
    // rows were marked.
    std::fs::write(
        dir.join("teams/aaa.toml"),
        format!(
            "team = \"aaa\"\n[plugins.nothing]\npath = \"{}\"\n\
             [[routes]]\nname = \"aaa-all\"\nplugin = \"nothing\"\nconfig = {{ mode = \"nothing\" }}\n\
             allow = {{ nats = [\"aaa{t}.**\"] }}\n",
            plugin("hostile").display()
        ),
    )?;
    std::fs::write(
        dir.join("teams/payments.toml"),
        format!(
            "team = \"payments\"\n[plugins.router]\npath = \"{}\"\n\
             [[routes]]\nname = \"payments-own\"\nplugin = \"router\"\naggregate_types = [\"order\", \"payment\"]\n\
             config = {{ sink = \"kafka\", topic = \"own{t}.events\" }}\nallow = {{ kafka = [\"own{t}.*\"] }}\n",
            plugin("order-router").display()
        ),
    )?;
    let (code, out, err) = cli(&["config", "check", "-c", &config.display().to_string()])?;
    assert_eq!(code, 0, "{out}{err}");
    db.migrate(&config)?;
    let orders = produce(&db.pool, "o", 12, 4, 0).await?;
    let payments = insert_events(&db.pool, "payment", 4, 3).await?;
    let mut all = Workload::default();
    all.committed.extend(orders.committed.iter().cloned());
    all.committed.extend(payments.committed.iter().cloned());
    all.committed.sort_by_key(|e| e.seq);

    let relay = Relay::start(&config, &[])?;
    let delivered = consume_kafka(&topic, 1, all.committed.len(), Duration::from_secs(60))?;
    let report = check(&all, &delivered);
    println!("owner's topic: {report}");
    report.assert_clean();
    assert_eq!(report.delivered_unique, all.committed.len(), "{report}");
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.unpublished("").await == 0
        })
        .await,
        "rows left unmarked:\n{}",
        relay.log_text()
    );
    // `aaa` got exactly its grant: every order event, no payment event.
    let (_, metrics) = http_get(&http, "/metrics").await?;
    let got = |route: &str| {
        metric(
            &metrics,
            &format!("outroute_events_published_total{{route=\"{route}\"}}"),
        )
        .unwrap_or(0.0) as usize
    };
    assert_eq!(got("aaa-all"), orders.committed.len(), "{metrics}");
    assert_eq!(got("payments-own"), all.committed.len(), "{metrics}");
    Ok(())
}

/// One event of aggregate `x` and five more after it, interleaved with six
/// of aggregate `y`; `x`'s first asks the `hostile` plugin for a retry.
async fn write_events(db: &TestDb) -> Result<(Workload, String)> {
    let mut w = Workload::default();
    let mut x1 = String::new();
    for n in 1..=6 {
        for agg in ["x", "y"] {
            let payload = if agg == "x" && n == 1 {
                serde_json::json!({ "n": n, "hostile": "retry" })
            } else {
                serde_json::json!({ "n": n })
            };
            let id = uuid::Uuid::new_v4().to_string();
            let seq: i64 = sqlx::query_scalar(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1::uuid, 'order', $2, 'order-updated', $3) RETURNING seq",
            )
            .bind(&id)
            .bind(agg)
            .bind(payload)
            .fetch_one(&db.pool)
            .await?;
            if agg == "x" && n == 1 {
                x1 = id.clone();
            }
            w.committed.push(Expected {
                id,
                aggregate_id: agg.into(),
                seq,
            });
        }
    }
    Ok((w, x1))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failure_on_one_route_holds_back_only_that_route() -> Result<()> {
    failure_on_one_route(false).await
}

/// The same with log-based capture: what a route did not take waits in the
/// parked queue, for that route only.
#[tokio::test(flavor = "multi_thread")]
async fn a_failure_on_one_route_holds_back_only_that_route_in_logical_mode() -> Result<()> {
    failure_on_one_route(true).await
}

async fn failure_on_one_route(logical: bool) -> Result<()> {
    let db = if logical {
        TestDb::new_logical().await?
    } else {
        TestDb::new().await?
    };
    let t = tag();
    let topic = format!("pay{t}.order-updated");
    create_topic(&topic, 1).await?;
    let dir = test_dir(if logical {
        "subscriptions-failure-logical"
    } else {
        "subscriptions-failure"
    });
    let copies = dir.join("analytics.jsonl");
    let body = format!(
        "[sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{KAFKA}\"\n\
         [sinks.file]\nkind = \"file\"\npath = \"{}\"\n\
         [plugins.pay]\npath = \"{}\"\n[plugins.copy]\npath = \"{}\"\n\
         [[routes]]\nname = \"payments\"\nplugin = \"pay\"\naggregate_types = [\"order\"]\n\
         config = {{ sink = \"kafka\", topic = \"pay{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"pay{t}.*\"] }}\n\
         max_attempts = 3\nbackoff_min = \"3s\"\nbackoff_max = \"3s\"\n\
         [[routes]]\nname = \"analytics\"\nplugin = \"copy\"\naggregate_types = [\"order\"]\n\
         config = {{ sink = \"file\", topic = \"analytics.{{event_type}}\" }}\nallow = {{ file = [\"analytics.*\"] }}\n\
         [http]\nlisten = \"\"\n",
        copies.display(),
        plugin("hostile").display(),
        plugin("order-router").display(),
    );
    let store = if logical { "capture = \"logical\"" } else { "" };
    let config = write_config_with(&dir, &db.url, store, "lanes = 4", &body)?;
    db.migrate(&config)?;
    let (work, x1) = write_events(&db).await?;
    let cfg = config.display().to_string();

    let relay = Relay::start(&config, &[])?;
    // Analytics: every copy, x's included, in order, while payments is
    // still retrying x's first event (its retries are 1.5–3 s apart).
    assert!(
        file_sink_reaches(&copies, work.committed.len(), Duration::from_secs(30)).await,
        "analytics copies: {}\n{}",
        file_sink_deliveries(&copies).len(),
        relay.log_text()
    );
    // (x1's retry is recorded just after its batch's copies were written.)
    let state = || async {
        sqlx::query_as::<_, (i32, bool)>(
            "SELECT attempts, failed_at IS NULL FROM outroute_event_state WHERE event_id = $1",
        )
        .bind(&x1)
        .fetch_optional(&db.pool)
        .await
        .ok()
        .flatten()
    };
    assert!(eventually(Duration::from_secs(5), || async { state().await.is_some() }).await);
    let (attempts, retrying) = state().await.unwrap_or_default();
    assert!(
        retrying && attempts < 3,
        "analytics waited for payments' retries (x1 attempts {attempts})"
    );
    let report = check(&work, &file_sink_deliveries(&copies));
    report.assert_clean();
    assert_eq!(report.delivered_unique, work.committed.len(), "{report}");

    // Payments: y's events go; x's first fails for good after 3 attempts
    // and holds x's later events on this route (order per route).
    let failed = eventually(Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT failed_at IS NOT NULL FROM outroute_event_state WHERE event_id = $1",
        )
        .bind(&x1)
        .fetch_one(&db.pool)
        .await
        .unwrap_or(false)
    })
    .await;
    assert!(failed, "x1 never failed for good:\n{}", relay.log_text());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let paid = consume_kafka(&topic, 1, 7, Duration::from_secs(8))?;
    let aggregates: Vec<&str> = paid.iter().map(|d| d.aggregate()).collect();
    assert_eq!(aggregates, ["y"; 6], "payments' deliveries");
    if !logical {
        assert_eq!(db.unpublished("aggregate_id = 'x'").await, 6);
    }
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outroute_event_state WHERE aggregate_id = 'x' \
         AND waiting_routes = '{payments}' AND 'analytics:done' = ANY(done_legs)",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(
        waiting, 6,
        "x's events wait for payments only, analytics done"
    );
    let (code, list, err) = cli(&["failed", "list", "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        list.contains(&x1) && list.contains("payments"),
        "failed list:\n{list}"
    );

    // Events of x written now, after x1 failed, still reach analytics at
    // once: claims step over them only for payments.
    let mut later = Workload::default();
    for agg in ["x", "y"] {
        let id = uuid::Uuid::new_v4().to_string();
        let seq: i64 = sqlx::query_scalar(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1::uuid, 'order', $2, 'order-updated', '{\"n\": 7}') RETURNING seq",
        )
        .bind(&id)
        .bind(agg)
        .fetch_one(&db.pool)
        .await?;
        later.committed.push(Expected {
            id,
            aggregate_id: agg.into(),
            seq,
        });
    }
    let mut work = work;
    work.committed.extend(later.committed);
    assert!(
        file_sink_reaches(&copies, work.committed.len(), Duration::from_secs(30)).await,
        "analytics did not get x7 while payments holds x:\n{}",
        relay.log_text()
    );
    let paid = consume_kafka(&topic, 1, 8, Duration::from_secs(8))?;
    let aggregates: Vec<&str> = paid.iter().map(|d| d.aggregate()).collect();
    assert_eq!(aggregates, ["y"; 7], "payments' deliveries");

    // The operator gives up on x1: payments' x events go, in order, and
    // analytics (done with them) sends nothing again.
    let (code, out, err) = cli(&["failed", "discard", "--id", &x1, "-c", &cfg])?;
    assert_eq!(code, 0, "{out}{err}");
    let paid = consume_kafka(&topic, 1, 13, Duration::from_secs(30))?;
    let xs: Vec<i64> = paid
        .iter()
        .filter(|d| d.aggregate() == "x")
        .map(Delivered::number)
        .collect();
    assert_eq!(xs, [2, 3, 4, 5, 6, 7], "payments' x deliveries");
    // Only the discarded x1 is left (lease mode: unpublished; log-based
    // capture: in the parked queue).
    let left = || async {
        if logical {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM outroute_event_state WHERE discarded_at IS NULL",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap_or(-1)
                + 1
        } else {
            db.unpublished("").await
        }
    };
    assert!(
        eventually(Duration::from_secs(20), || async { left().await == 1 }).await,
        "events left besides the discarded x1: {}",
        left().await - 1
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let copies = file_sink_deliveries(&copies);
    let report = check(&work, &copies);
    assert_eq!(
        report.duplicates, 0,
        "analytics re-sent copies when payments went on: {report}"
    );
    assert_eq!(copies.len(), work.committed.len());
    Ok(())
}

/// A team whose file has never passed (no last known good copy) does not
/// run, but its events wait for it: another team's copy of them goes out,
/// the rows are not marked, and once the file is fixed the team gets every
/// one of them, in order, while the copy is not sent again.
#[tokio::test(flavor = "multi_thread")]
async fn a_team_whose_file_never_passed_gets_its_events_once_it_does() -> Result<()> {
    waiting_owner(false).await
}

/// The same for a team that owns its aggregate type and keeps it from
/// copies (`grants.<team>.owns`, an `exclusive` route): the copying team
/// never sees those events — neither while the owner's file is refused
/// (its routes may have been exclusive) nor after.
#[tokio::test(flavor = "multi_thread")]
async fn an_owner_keeps_its_events_from_copies() -> Result<()> {
    waiting_owner(true).await
}

async fn waiting_owner(exclusive: bool) -> Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir(if exclusive {
        "subscriptions-exclusive"
    } else {
        "subscriptions-waiting"
    });
    let copies = dir.join("copies.jsonl");
    let owned = dir.join("owned.jsonl");
    let http = free_addr();
    std::fs::create_dir_all(dir.join("teams"))?;
    let config = dir.join("outroute.toml");
    let owns = if exclusive {
        "owns = [\"payment\"]\n"
    } else {
        ""
    };
    std::fs::write(
        &config,
        format!(
            "include = [\"teams/*.toml\"]\n[relay]\ncache_dir = \"{cache}\"\nlanes = 4\n\
             [sources.orders]\nurl = \"{url}\"\n\
             [sinks.copies]\nkind = \"file\"\npath = \"{copies}\"\n\
             [sinks.owned]\nkind = \"file\"\npath = \"{owned}\"\n\
             [grants.analytics]\nsources = [\"orders\"]\nallow = {{ copies = [\"copy.*\"] }}\nplugin_dirs = [\"{dist}\"]\n\
             [grants.payments]\nsources = [\"orders\"]\naggregate_types = [\"payment\"]\n{owns}\
             allow = {{ owned = [\"pay.*\"] }}\nplugin_dirs = [\"{dist}\"]\n\
             [http]\nlisten = \"{http}\"\n",
            cache = std::env::temp_dir().join("outroute-test-cache").display(),
            url = db.url,
            copies = copies.display(),
            owned = owned.display(),
            dist = workspace().join("plugins/dist").display(),
        ),
    )?;
    std::fs::write(
        dir.join("teams/analytics.toml"),
        format!(
            "team = \"analytics\"\n[plugins.copy]\npath = \"{}\"\n\
             [[routes]]\nname = \"copy-all\"\nplugin = \"copy\"\n\
             config = {{ sink = \"copies\", topic = \"copy.{{event_type}}\" }}\nallow = {{ copies = [\"copy.*\"] }}\n",
            plugin("order-router").display()
        ),
    )?;
    // Payments' first file does not parse: the team has never run.
    let payments_file = dir.join("teams/payments.toml");
    std::fs::write(&payments_file, "team = \"payments\"\n[[routes]\n")?;
    db.migrate(&config)?;
    let orders = insert_events(&db.pool, "order", 4, 2).await?;
    let payments = insert_events(&db.pool, "payment", 2, 3).await?;
    let copied = if exclusive {
        orders.committed.len()
    } else {
        orders.committed.len() + payments.committed.len()
    };

    let relay = Relay::start(&config, &[])?;
    assert!(
        file_sink_reaches(&copies, copied, Duration::from_secs(30)).await,
        "copies: {} of {copied}\n{}",
        file_sink_deliveries(&copies).len(),
        relay.log_text()
    );
    // The orders are done; the payment events wait for payments' file.
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.unpublished("").await == payments.committed.len() as i64
        })
        .await,
        "{} rows unpublished\n{}",
        db.unpublished("").await,
        relay.log_text()
    );
    let (_, ready) = http_get(&http, "/readyz").await?;
    assert!(
        ready.contains("route `team:payments` waiting") && ready.contains("teams/payments.toml"),
        "{ready}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        db.unpublished("").await,
        payments.committed.len() as i64,
        "still waiting, not marked"
    );
    assert!(
        file_sink_deliveries(&owned).is_empty(),
        "nothing ran for payments"
    );

    // The file is fixed: payments gets every one of its events.
    let route = if exclusive { "exclusive = true\n" } else { "" };
    std::fs::write(
        &payments_file,
        format!(
            "team = \"payments\"\n[plugins.router]\npath = \"{}\"\n\
             [[routes]]\nname = \"payments-own\"\nplugin = \"router\"\n{route}\
             config = {{ sink = \"owned\", topic = \"pay.{{event_type}}\" }}\nallow = {{ owned = [\"pay.*\"] }}\n",
            plugin("order-router").display()
        ),
    )?;
    let (code, out, err) = cli(&["config", "check", "-c", &config.display().to_string()])?;
    assert_eq!(code, 0, "{out}{err}");
    relay.reload();
    assert!(
        file_sink_reaches(&owned, payments.committed.len(), Duration::from_secs(30)).await,
        "payments got {} of {}\n{}",
        file_sink_deliveries(&owned).len(),
        payments.committed.len(),
        relay.log_text()
    );
    let report = check(&payments, &file_sink_deliveries(&owned));
    println!("payments: {report}");
    report.assert_clean();
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.unpublished("").await == 0
        })
        .await,
        "rows left unmarked\n{}",
        relay.log_text()
    );
    // The copies went out once each, and (exclusive) never a payment event.
    let copies = file_sink_deliveries(&copies);
    let mut ids: Vec<&str> = copies.iter().map(|d| d.id()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(copies.len(), copied, "no copy sent twice");
    assert_eq!(ids.len(), copied);
    let payment_copies = copies
        .iter()
        .filter(|d| payments.committed.iter().any(|e| e.id == d.id()))
        .count();
    assert_eq!(
        payment_copies,
        if exclusive {
            0
        } else {
            payments.committed.len()
        }
    );
    Ok(())
}
