//! An idle source sleeps (issue 43): once a lease-mode source on the pending
//! queue has nothing to claim, its relay stops polling and waits for the
//! insert trigger's notification — and no event is missed on the way into
//! sleep or out of it. Each test waits well under the sleeping relay's
//! backstop (a claim once a minute), so an event found only by the backstop
//! fails it.

use std::path::Path;
use std::time::Duration;

use outroute_e2e::{
    Relay, TestDb, eventually, file_sink_deliveries, file_sink_reaches, free_addr, http_get,
    metric, plugin, test_dir, write_config,
};

fn file_body(dir: &Path, http: &str) -> String {
    format!(
        "[http]\nlisten = \"{http}\"\n[sinks.file]\nkind = \"file\"\npath = \"{}\"\n[plugins.p]\npath = \"{}\"\n\
         [[routes]]\nname = \"r\"\nplugin = \"p\"\nconfig = {{ sink = \"file\", topic = \"orders.{{event_type}}\" }}\n\
         allow = {{ file = [\"orders.*\"] }}\n",
        dir.join("out.jsonl").display(),
        plugin("order-router").display()
    )
}

async fn insert(pool: &sqlx::PgPool, aggregate: &str) -> anyhow::Result<String> {
    let id = uuid::Uuid::new_v4().to_string();
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1::uuid, 'order', $2, 'order-created', '{}')",
    )
    .bind(&id)
    .bind(aggregate)
    .execute(pool)
    .await?;
    Ok(id)
}

/// A relay on a new database with 8 lanes and the file sink, that has
/// published one event (aggregate `aggregate`): the database, the relay's
/// HTTP address, the sink's file and the relay.
async fn one_published(
    name: &str,
    aggregate: &str,
) -> anyhow::Result<(TestDb, String, std::path::PathBuf, Relay)> {
    one_published_with(name, aggregate, file_body).await
}

/// [`one_published`] with the config body `body(dir, http)`.
async fn one_published_with(
    name: &str,
    aggregate: &str,
    body: impl Fn(&Path, &str) -> String,
) -> anyhow::Result<(TestDb, String, std::path::PathBuf, Relay)> {
    let db = TestDb::new().await?;
    let dir = test_dir(name);
    let http = free_addr();
    let config = write_config(&dir, &db.url, "lanes = 8", &body(&dir, &http))?;
    db.migrate(&config)?;
    let out = dir.join("out.jsonl");
    let relay = Relay::start(&config, &[])?;
    insert(&db.pool, aggregate).await?;
    assert!(
        file_sink_reaches(&out, 1, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    Ok((db, http, out, relay))
}

/// A series of the relay's /metrics (0 when absent).
async fn series(http: &str, name: &str) -> f64 {
    http_get(http, "/metrics")
        .await
        .ok()
        .and_then(|(_, m)| metric(&m, name))
        .unwrap_or(0.0)
}

const ASLEEP: &str = "outroute_source_asleep{source=\"default\"}";
const CLAIMS: &str = "outroute_claim_seconds_count{source=\"default\"}";

#[tokio::test(flavor = "multi_thread")]
async fn an_idle_source_stops_polling_and_its_next_insert_wakes_it() -> anyhow::Result<()> {
    let (db, http, out, relay) = one_published("idle-sleeps", "a1").await?;
    let asleep = eventually(Duration::from_secs(10), || async {
        series(&http, ASLEEP).await == 1.0
    })
    .await;
    assert!(
        asleep,
        "the idle source never fell asleep: {}",
        relay.log_text()
    );
    // Asleep, it does not poll: no claim for seconds but the one as it
    // fell asleep and perhaps the once-a-minute backstop (awake, its two
    // workers claim up to 20 times a second).
    let before = series(&http, CLAIMS).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let claims = series(&http, CLAIMS).await - before;
    assert!(
        claims <= 2.0,
        "{claims} claims in 5 s while asleep: {}",
        relay.log_text()
    );
    // The next insert wakes it, long before the backstop.
    let id = insert(&db.pool, "a2").await?;
    let woke = eventually(Duration::from_secs(10), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == id)
    })
    .await;
    assert!(
        woke,
        "the insert did not wake the source: {}",
        relay.log_text()
    );
    // And it sleeps again once idle.
    let again = eventually(Duration::from_secs(10), || async {
        series(&http, ASLEEP).await == 1.0
    })
    .await;
    assert!(again, "{}", relay.log_text());
    // Producers of a busy source pay no notification: the trigger sends one
    // only while a relay is recorded asleep.
    let asleep_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outroute_wake WHERE source = 'outbox' AND asleep")
            .fetch_one(&db.pool)
            .await?;
    assert_eq!(asleep_rows, 1, "one relay, recorded asleep");
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// A producer transaction that inserted before the relay recorded itself
/// asleep saw no sleeper, so its commit sends no notification: the relay
/// must not sleep before it ended, or its event would wait for the backstop.
#[tokio::test(flavor = "multi_thread")]
async fn an_insert_in_flight_while_the_relay_falls_asleep_is_not_missed() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("idle-in-flight");
    let http = free_addr();
    let config = write_config(&dir, &db.url, "lanes = 8", &file_body(&dir, &http))?;
    db.migrate(&config)?;
    let out = dir.join("out.jsonl");
    // The producer's transaction inserts before any relay runs (no sleeper
    // recorded: its trigger notifies nobody) and stays open.
    let mut tx = db.pool.begin().await?;
    let id = uuid::Uuid::new_v4().to_string();
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1::uuid, 'order', 'b1', 'order-created', '{}')",
    )
    .bind(&id)
    .execute(&mut *tx)
    .await?;
    let relay = Relay::start(&config, &[])?;
    // The relay finds nothing (the row is not committed), records itself
    // asleep, and must then wait for that transaction.
    let recorded = eventually(Duration::from_secs(15), || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outroute_wake WHERE asleep")
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
            == 1
    })
    .await;
    assert!(
        recorded,
        "the relay never went for sleep: {}",
        relay.log_text()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        series(&http, ASLEEP).await,
        0.0,
        "the relay fell asleep while a transaction that missed its record was open: {}",
        relay.log_text()
    );
    tx.commit().await?;
    let sent = eventually(Duration::from_secs(10), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == id)
    })
    .await;
    assert!(
        sent,
        "the event committed after the relay recorded itself asleep waited: {}",
        relay.log_text()
    );
    let asleep = eventually(Duration::from_secs(10), || async {
        series(&http, ASLEEP).await == 1.0
    })
    .await;
    assert!(asleep, "{}", relay.log_text());
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// A sleeping source holds one connection to its database: the LISTEN one,
/// which also carries its lease rounds, while the pool's connections close.
/// Its lanes stay leased all along, and the next insert still wakes it (on
/// a connection opened for it).
#[tokio::test(flavor = "multi_thread")]
async fn a_sleeping_source_holds_one_connection_and_keeps_its_lanes() -> anyhow::Result<()> {
    let (db, http, out, relay) = one_published("idle-one-connection", "c1").await?;
    let connections = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = $1 AND application_name = 'outroute'",
        )
        .bind(&db.name)
        .fetch_one(&db.pool)
        .await
        .unwrap_or(-1)
    };
    let lease_until = || async {
        sqlx::query_scalar::<_, Option<f64>>(
            "SELECT extract(epoch FROM min(lease_until))::float8 FROM outroute_lanes \
             WHERE source = 'outbox' AND lane >= 0 AND owner IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .ok()
        .flatten()
        .unwrap_or(0.0)
    };
    let one = eventually(Duration::from_secs(30), || async {
        series(&http, ASLEEP).await == 1.0 && connections().await == 1
    })
    .await;
    assert!(
        one,
        "asleep {}, {} connections: {}",
        series(&http, ASLEEP).await,
        connections().await,
        relay.log_text()
    );
    // Over two lease rounds (every lease_ttl / 3 = 3.3 s): the leases are
    // renewed and no pool connection is opened for it (the sleeping
    // source's backstop, once a minute, may open one briefly).
    let before = lease_until().await;
    let mut samples = Vec::new();
    for _ in 0..16 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        samples.push(connections().await);
    }
    let renewed = lease_until().await;
    assert!(
        renewed > before + 3.0,
        "the leases were not renewed while asleep ({before} → {renewed}): {}",
        relay.log_text()
    );
    let single = samples.iter().filter(|&&c| c == 1).count();
    assert!(
        single >= samples.len() / 2,
        "connections while asleep, every 0.5 s: {samples:?}"
    );
    assert_eq!(series(&http, ASLEEP).await, 1.0, "{}", relay.log_text());
    let id = insert(&db.pool, "c2").await?;
    let woke = eventually(Duration::from_secs(10), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == id)
    })
    .await;
    assert!(
        woke,
        "the insert did not wake the source: {}",
        relay.log_text()
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// A source that cannot sleep — a table on a lane index, no trigger to
/// notify it — backs off past `relay.poll_max` to `relay.poll_idle_max`:
/// an idle one costs each worker one claim per `poll_idle_max`, not one per
/// `poll_max`, and still finds the next event by polling.
#[tokio::test(flavor = "multi_thread")]
async fn a_source_that_cannot_sleep_backs_off_to_the_idle_ceiling() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("idle-ceiling");
    let http = free_addr();
    let config = write_config(
        &dir,
        &db.url,
        "lanes = 8\nconcurrency = 2\npoll_max = \"50ms\"\npoll_idle_max = \"2s\"",
        &format!(
            "{}{}",
            outroute_e2e::example_table("outbox-published-at.toml")?,
            file_body(&dir, &http)
        ),
    )?;
    db.migrate(&config)?;
    let out = dir.join("out.jsonl");
    let relay = Relay::start(&config, &[])?;
    insert(&db.pool, "d1").await?;
    assert!(
        file_sink_reaches(&out, 1, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    // Backed off: 50 ms doubled six times passes 2 s within ~3.2 s.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = series(&http, CLAIMS).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let claims = series(&http, CLAIMS).await - before;
    // Two workers, one claim each per 2 s: about 8 in 8 s (a worker's claim
    // at a change of its lanes, or a lease round's, may add one or two).
    // At the 50 ms poll_max it would be about 320.
    assert!(
        claims <= 14.0,
        "{claims} claims in 8 idle seconds with poll_idle_max = 2s: {}",
        relay.log_text()
    );
    assert!(
        claims >= 4.0,
        "{claims} claims in 8 idle seconds: the idle source stopped polling"
    );
    assert_eq!(
        series(&http, ASLEEP).await,
        0.0,
        "a source without the trigger fell asleep"
    );
    let id = insert(&db.pool, "d2").await?;
    let found = eventually(Duration::from_secs(10), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == id)
    })
    .await;
    assert!(found, "the next event was not found: {}", relay.log_text());
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// Until `ASLEEP` reads 1: the source fell asleep.
async fn falls_asleep(http: &str, relay: &Relay) {
    let asleep = eventually(Duration::from_secs(20), || async {
        series(http, ASLEEP).await == 1.0
    })
    .await;
    assert!(
        asleep,
        "the idle source never fell asleep: {}",
        relay.log_text()
    );
}

/// A source whose events trickle in (5 a second here, a quiet service)
/// costs about a claim per event, not a polling back-off after each (about
/// 17 claims per event at this rate before: both workers from 1 ms up to
/// `poll_max`, then a sleep and wake record): worker 0 alone polls, about
/// once per expected event. And it stays awake through the trickle, so
/// its producers pay no notification per insert.
#[tokio::test(flavor = "multi_thread")]
async fn a_source_whose_events_trickle_costs_about_a_claim_per_event() -> anyhow::Result<()> {
    let (db, http, out, relay) = one_published("idle-trickle", "t0").await?;
    falls_asleep(&http, &relay).await;
    let mut ids = Vec::new();
    let mut before = None;
    for i in 0..40 {
        ids.push(insert(&db.pool, &format!("t{}", i + 1)).await?);
        tokio::time::sleep(Duration::from_millis(200)).await;
        if i == 9 {
            // From here on its pace is known.
            before = Some(series(&http, CLAIMS).await);
        }
    }
    let claims = series(&http, CLAIMS).await - before.unwrap_or(0.0);
    let all = eventually(Duration::from_secs(10), || async {
        let got = file_sink_deliveries(&out);
        ids.iter().all(|id| got.iter().any(|d| d.id() == id))
    })
    .await;
    assert!(
        all,
        "the trickle was not all published: {}",
        relay.log_text()
    );
    // 30 events over 6 s: worker 0 polls every 100 ms (`poll_max`; the
    // gap is 200 ms) — about 60 claims, 2 per event.
    assert!(
        claims <= 80.0,
        "{claims} claims for 30 trickling events: {}",
        relay.log_text()
    );
    assert!(claims >= 25.0, "{claims} claims for 30 events");
    assert_eq!(
        series(&http, ASLEEP).await,
        0.0,
        "the source slept through a trickle (each insert notified): {}",
        relay.log_text()
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// A burst wakes a sleeping source (its producers stop paying a
/// notification per insert) and it falls asleep again after it.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_wakes_a_sleeping_source_and_it_sleeps_again() -> anyhow::Result<()> {
    let (db, http, out, relay) = one_published("idle-burst", "b0").await?;
    falls_asleep(&http, &relay).await;
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'b' || g, 'order-created', '{}' \
         FROM generate_series(1, 2000) g",
    )
    .execute(&db.pool)
    .await?;
    let awake = eventually(Duration::from_secs(10), || async {
        series(&http, ASLEEP).await == 0.0
    })
    .await;
    assert!(
        awake,
        "2000 events did not wake the source: {}",
        relay.log_text()
    );
    assert!(
        file_sink_reaches(&out, 2001, Duration::from_secs(60)).await,
        "{}",
        relay.log_text()
    );
    falls_asleep(&http, &relay).await;
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// An event left retrying by the batch that woke a sleeping source comes
/// due by the clock, which notifies nobody: the source stays awake, and the
/// retries run on time (asleep, they would wait for the once-a-minute
/// backstop).
#[tokio::test(flavor = "multi_thread")]
async fn an_event_left_retrying_keeps_a_woken_source_awake() -> anyhow::Result<()> {
    let hostile = |dir: &Path, http: &str| {
        format!(
            "[http]\nlisten = \"{http}\"\n[sinks.file]\nkind = \"file\"\npath = \"{}\"\n[plugins.h]\npath = \"{}\"\n\
             [[routes]]\nname = \"r\"\nplugin = \"h\"\nmax_attempts = 3\nbackoff_min = \"200ms\"\nbackoff_max = \"400ms\"\n\
             config = {{ sink = \"file\", topic = \"orders.x\" }}\nallow = {{ file = [\"orders.*\"] }}\n",
            dir.join("out.jsonl").display(),
            plugin("hostile").display()
        )
    };
    let (db, http, _out, relay) = one_published_with("idle-retry", "r0", hostile).await?;
    falls_asleep(&http, &relay).await;
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'r1', 'order-created', '{\"hostile\": \"retry\"}')",
    )
    .execute(&db.pool)
    .await?;
    // Three attempts 200–400 ms apart: failed within seconds.
    let failed = eventually(Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outroute_event_state WHERE failed_at IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap_or(0)
            == 1
    })
    .await;
    assert!(
        failed,
        "the retrying event did not reach its third attempt in 20 s: {}",
        relay.log_text()
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}
