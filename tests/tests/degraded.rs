//! One unreachable database or missing plugin never stops the rest of a
//! shared relay: each source, sink and route comes up on its own, what is
//! down waits (nothing marked, nothing lost) and joins once it is back,
//! without a restart. `/readyz`, `outroute status`, the `*_up` gauges and
//! the commands over every source say what is down and why.
//!
//! The database that goes down is a cluster of this file's own
//! (`scripts/pg-logical` under another name and port), never the shared one.

use std::path::Path;
use std::time::{Duration, Instant};

use outroute_e2e::*;

/// The own cluster's name and port (one test at a time uses it).
const OWN: (&str, u16) = ("outroute_outage", 5436);

static OWN_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Three sources `a`, `b` (shared cluster) and `c`, each with a route of its
/// own publishing `<source>.<event type>` to one file sink.
fn three_sources(urls: [&str; 3], http: &str, out: &Path) -> String {
    let mut s = format!(
        "[relay]\ncache_dir = \"{}\"\npoll_max = \"200ms\"\n\n[http]\nlisten = \"{http}\"\n\
         [sinks.file]\nkind = \"file\"\npath = \"{}\"\n[plugins.p]\npath = \"{}\"\n",
        std::env::temp_dir().join("outroute-test-cache").display(),
        out.display(),
        plugin("order-router").display()
    );
    for (name, url) in ["a", "b", "c"].iter().zip(urls) {
        s.push_str(&format!(
            "[sources.{name}]\nurl = \"{url}\"\n\
             [[routes]]\nname = \"r{name}\"\nplugin = \"p\"\nsources = [\"{name}\"]\n\
             config = {{ sink = \"file\", topic = \"{name}.{{event_type}}\" }}\nallow = {{ file = [\"{name}.*\"] }}\n"
        ));
    }
    s
}

fn write(dir: &Path, body: &str) -> anyhow::Result<std::path::PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("outroute.toml");
    std::fs::write(&path, body)?;
    Ok(path)
}

/// The deliveries of one source (topic prefix `<source>.`).
fn of(out: &Path, source: &str) -> Vec<Delivered> {
    file_sink_deliveries(out)
        .into_iter()
        .filter(|d| d.topic.starts_with(&format!("{source}.")))
        .collect()
}

async fn delivered_all(out: &Path, source: &str, w: &Workload, within: Duration) -> bool {
    eventually(within, || async { check(w, &of(out, source)).lost == 0 }).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_source_whose_database_is_down_at_start_waits_alone_and_joins_without_a_restart()
-> anyhow::Result<()> {
    let _own = OWN_CLUSTER.lock().await;
    let cluster = OwnCluster::start(OWN.0, OWN.1)?;
    let (a, b) = (TestDb::new().await?, TestDb::new().await?);
    let c = TestDb::new_at(&cluster.admin_url()).await?;
    let dir = test_dir("degraded-start");
    let out = dir.join("out.jsonl");
    let http = free_addr();
    let config = write(&dir, &three_sources([&a.url, &b.url, &c.url], &http, &out))?;
    a.migrate(&config)?;
    // c's backlog, committed before its database goes down.
    let c_backlog = produce(&c.pool, "c", 8, 5, 7).await?;
    c.pool.close().await;
    cluster.stop()?;

    let mut relay = Relay::start(&config, &[])?;
    // a and b deliver while c's database is down.
    let wa = produce(&a.pool, "a", 8, 5, 7).await?;
    let wb = produce(&b.pool, "b", 8, 5, 7).await?;
    for (name, w) in [("a", &wa), ("b", &wb)] {
        assert!(
            delivered_all(&out, name, w, Duration::from_secs(30)).await,
            "source {name} not delivered while c is down: {}\n{}",
            check(w, &of(&out, name)),
            relay.log_text()
        );
    }
    assert!(
        relay.child.try_wait()?.is_none(),
        "the relay exited: {}",
        relay.log_text()
    );
    // Visible: ready (two sources live), c named with its reason; strict
    // readiness fails; the gauges say which source is up.
    // (The first attempt to reach c takes the pool's 5 s to give up.)
    let named = eventually(Duration::from_secs(20), || async {
        http_get(&http, "/readyz").await.is_ok_and(|(code, body)| {
            code == 200
                && body.contains("2 of 3 sources live")
                && body.contains("source `c`: database unreachable since")
                && body.to_lowercase().contains("connection refused")
        })
    })
    .await;
    assert!(named, "{:?}", http_get(&http, "/readyz").await);
    let (code, body) = http_get(&http, "/readyz?strict").await?;
    assert_eq!(code, 503, "{body}");
    let (_, text) = http_get(&http, "/metrics").await?;
    assert_eq!(
        metric(&text, "outroute_source_up{source=\"a\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "outroute_source_up{source=\"c\"}"),
        Some(0.0),
        "{text}"
    );
    // `status` reports every source, names the one it could not reach and
    // exits non-zero.
    let cfg = config.to_string_lossy().to_string();
    let (code, stdout, stderr) = cli(&["status", "-c", &cfg])?;
    assert_ne!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("source a:") && stdout.contains("source b:") && stdout.contains("backlog"),
        "{stdout}"
    );
    assert!(
        stderr.contains("source `c` failed") && stderr.contains("1 of 3 sources failed"),
        "{stderr}"
    );
    // c comes back: its backlog goes out without a restart, in order.
    let back = Instant::now();
    cluster.restart()?;
    assert!(
        delivered_all(&out, "c", &c_backlog, Duration::from_secs(30)).await,
        "c's backlog not delivered after its database came back: {}\n{}",
        check(&c_backlog, &of(&out, "c")),
        relay.log_text()
    );
    println!(
        "c's backlog ({} events) delivered {} ms after its database was started (PostgreSQL's own start-up included)",
        c_backlog.committed.len(),
        back.elapsed().as_millis()
    );
    for (name, w) in [("a", &wa), ("b", &wb), ("c", &c_backlog)] {
        let r = check(w, &of(&out, name));
        assert_eq!(r.phantom, 0, "{name}: {r}");
        r.assert_clean();
    }
    let ready = eventually(Duration::from_secs(10), || async {
        http_get(&http, "/readyz?strict")
            .await
            .is_ok_and(|(code, _)| code == 200)
    })
    .await;
    assert!(ready, "{:?}", http_get(&http, "/readyz?strict").await);

    // Mid-run: c's database stops again; a keeps delivering meanwhile.
    cluster.stop()?;
    let went_down = eventually(Duration::from_secs(15), || async {
        http_get(&http, "/metrics")
            .await
            .is_ok_and(|(_, t)| metric(&t, "outroute_source_up{source=\"c\"}") == Some(0.0))
    })
    .await;
    assert!(went_down, "c not reported down: {}", relay.log_text());
    let wa2 = produce(&a.pool, "a2", 8, 5, 0).await?;
    assert!(
        eventually(Duration::from_secs(30), || async {
            check(&wa2, &of(&out, "a")).lost == 0
        })
        .await,
        "a stopped while c was down mid-run: {}",
        check(&wa2, &of(&out, "a"))
    );
    cluster.restart()?;
    relay.terminate(Duration::from_secs(15));
    a.drop_db().await;
    b.drop_db().await;
    let c = TestDb {
        pool: sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy(&c.url)?,
        ..c
    };
    c.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn commands_over_every_source_go_through_the_reachable_ones_and_name_the_other()
-> anyhow::Result<()> {
    let a = TestDb::new().await?;
    let dir = test_dir("degraded-migrate");
    let out = dir.join("out.jsonl");
    // Nobody listens on port 1.
    let config = write(
        &dir,
        &three_sources(
            [
                &a.url,
                "postgres://root@127.0.0.1:1/test",
                &a.url.replace("/outroute_t_", "/outroute_none_"),
            ],
            "",
            &out,
        ),
    )?;
    let cfg = config.to_string_lossy().to_string();
    let (code, stdout, stderr) = cli(&["migrate", "-c", &cfg])?;
    assert_ne!(code, 0, "{stdout}{stderr}");
    assert!(
        stderr.contains("source `b` failed")
            && stderr.to_lowercase().contains("connection refused")
            && stderr.contains("source `c` failed")
            && stderr.contains("2 of 3 sources failed (each reported above): b, c"),
        "{stderr}"
    );
    // a, first in line, was migrated all the same.
    assert_eq!(
        a.count("SELECT count(*) FROM information_schema.tables WHERE table_name = 'outbox'")
            .await,
        1
    );
    for args in [
        vec!["failed", "list", "-c", &cfg],
        vec!["config", "check", "--store", "-c", &cfg],
    ] {
        let (code, stdout, stderr) = cli(&args)?;
        assert_ne!(code, 0, "{args:?}: {stdout}{stderr}");
        assert!(
            stderr.contains("2 of 3 sources failed (each reported above): b, c"),
            "{args:?}: {stderr}"
        );
    }
    let (_, stdout, _) = cli(&["config", "check", "--store", "-c", &cfg])?;
    assert!(stdout.contains("sources.a: table `outbox` ok"), "{stdout}");
    a.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_teams_plugin_file_missing_holds_only_its_route_until_the_file_arrives()
-> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("degraded-plugin");
    let out = dir.join("out.jsonl");
    // Team payments' file names its plugin relative to itself; the team
    // has not shipped the file yet.
    let missing = dir.join("teams").join("payments.wasm");
    let http = free_addr();
    let body = format!(
        "include = [\"teams/*.toml\"]\n[store]\nurl = \"{}\"\n[relay]\ncache_dir = \"{}\"\npoll_max = \"200ms\"\n\
         [http]\nlisten = \"{http}\"\n\
         [sinks.file]\nkind = \"file\"\npath = \"{}\"\n\
         [grants.payments]\nsources = [\"default\"]\nallow = {{ file = [\"payments.*\"] }}\n\
         [plugins.orders]\npath = \"{}\"\n\
         [[routes]]\nname = \"orders\"\nplugin = \"orders\"\naggregate_types = [\"order\"]\n\
         config = {{ sink = \"file\", topic = \"orders.{{event_type}}\" }}\nallow = {{ file = [\"orders.*\"] }}\n",
        db.url,
        std::env::temp_dir().join("outroute-test-cache").display(),
        out.display(),
        plugin("order-router").display(),
    );
    let config = write(&dir, &body)?;
    std::fs::create_dir_all(dir.join("teams"))?;
    std::fs::write(
        dir.join("teams/payments.toml"),
        "team = \"payments\"\n[plugins.payments]\npath = \"payments.wasm\"\n\
         [[routes]]\nname = \"payments\"\nplugin = \"payments\"\naggregate_types = [\"payment\"]\n\
         config = { sink = \"file\", topic = \"payments.{event_type}\" }\nallow = { file = [\"payments.*\"] }\n",
    )?;
    db.migrate(&config)?;
    // `config check` still says the file is missing.
    let (code, _, err) = cli(&["config", "check", "-c", &config.to_string_lossy()])?;
    assert_ne!(code, 0);
    assert!(
        err.contains("route `payments`") && err.contains("payments.wasm"),
        "{err}"
    );

    let payments = insert_events(&db.pool, "payment", 4, 3).await?;
    let mut relay = Relay::start(&config, &[])?;
    let orders = produce(&db.pool, "o", 8, 3, 0).await?;
    assert!(
        eventually(Duration::from_secs(30), || async {
            check(&orders, &of(&out, "orders")).lost == 0
        })
        .await,
        "orders not delivered beside a route without its plugin: {}",
        relay.log_text()
    );
    check(&orders, &of(&out, "orders")).assert_clean();
    let (code, body) = http_get(&http, "/readyz").await?;
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("route `payments` waiting since") && body.contains("plugin not loaded"),
        "{body}"
    );
    let (_, text) = http_get(&http, "/metrics").await?;
    assert_eq!(
        metric(
            &text,
            "outroute_route_waiting{route=\"payments\",reason=\"plugin\"}"
        ),
        Some(1.0),
        "{text}"
    );
    // Nothing of payments went out or was marked, nothing failed.
    assert!(of(&out, "payments").is_empty());
    assert_eq!(
        db.unpublished("o.aggregate_type = 'payment'").await,
        payments.committed.len() as i64
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL")
            .await,
        0
    );
    // The team ships its file: the route's events go out, in order.
    std::fs::copy(plugin("order-router"), &missing)?;
    assert!(
        eventually(Duration::from_secs(30), || async {
            check(&payments, &of(&out, "payments")).lost == 0
        })
        .await,
        "payments not delivered once its plugin arrived: {}",
        relay.log_text()
    );
    check(&payments, &of(&out, "payments")).assert_clean();
    let (_, text) = http_get(&http, "/metrics").await?;
    assert_eq!(
        metric(
            &text,
            "outroute_route_waiting{route=\"payments\",reason=\"plugin\"}"
        ),
        Some(0.0),
        "{text}"
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}
