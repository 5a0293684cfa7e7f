//! outroute as a shared platform relay: one process serving three sources
//! (the canonical table and two existing table shapes, in three databases)
//! for two teams whose routes live in their own files; and a team file
//! change applied on SIGHUP while events flow — no restart, no loss — while a
//! change that reaches outside the team's grant is refused and the running
//! config keeps working.
//!
//! One concern, one file: the end-to-end tests of the shared platform relay
//! (sources, teams, grants, reloads).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use outroute_e2e::*;

/// Every `n` of a source's events delivered, and per aggregate the first
/// deliveries in increasing `n` (the order they were written).
fn check_numbered(delivered: &[Delivered], source: &str, want: usize) {
    let mut seen = HashSet::new();
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for d in delivered.iter().filter(|d| {
        d.headers
            .get("ce_source")
            .is_some_and(|s| s.contains(&format!("/{source}/")))
    }) {
        if !seen.insert(d.id().to_string()) {
            continue;
        }
        let n = d.number();
        let prev = last.insert(d.aggregate().to_string(), n).unwrap_or(0);
        assert!(
            n > prev,
            "source {source}: aggregate {} went {prev} → {n}",
            d.aggregate()
        );
    }
    assert_eq!(seen.len(), want, "source {source}: events delivered");
}

async fn seed_billing(db: &TestDb, from: i32, to: i32) -> Result<()> {
    sqlx::query(
        "INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid()::text, 'invoice', 'inv-' || (g % 20), 'invoice-issued', \
                json_build_object('n', g)::text FROM generate_series($1::int, $2::int) g",
    )
    .bind(from)
    .bind(to)
    .execute(&db.pool)
    .await?;
    Ok(())
}

async fn seed_shipping(db: &TestDb, from: i32, to: i32) -> Result<()> {
    sqlx::query(
        "INSERT INTO outbox_events (id, event_type, aggregate_id, payload) \
         SELECT gen_random_uuid(), 'shipment-sent', md5('ship' || (g % 20))::uuid, \
                json_build_object('n', g) FROM generate_series($1::int, $2::int) g",
    )
    .bind(from)
    .bind(to)
    .execute(&db.pool)
    .await?;
    Ok(())
}

fn grants_and_sinks(out: &Path, payments_sources: &str) -> String {
    format!(
        "[sinks.file]\nkind = \"file\"\npath = \"{}\"\n\
         [grants.payments]\nsources = [{payments_sources}]\nallow = {{ file = [\"payments.*\"] }}\nplugin_dirs = [\"{dist}\"]\n\
         [grants.logistics]\nsources = [\"shipping\"]\nallow = {{ file = [\"logistics.**\"] }}\nplugin_dirs = [\"{dist}\"]\n",
        out.display(),
        dist = plugin_dist().display(),
    )
}

fn team(name: &str, plugin: &str, route: &str, extra: &str) -> String {
    format!(
        "team = \"{name}\"\n[plugins.{plugin}]\npath = \"{}\"\n[[routes]]\nname = \"{route}\"\nplugin = \"{plugin}\"\n{extra}\n",
        plugin_path("order-router").display()
    )
}

fn plugin_path(name: &str) -> std::path::PathBuf {
    plugin(name)
}

/// Where the built plugins are: the platform's shared directory the grants
/// let team files use.
fn plugin_dist() -> std::path::PathBuf {
    workspace().join("plugins/dist")
}

fn cache() -> String {
    std::env::temp_dir()
        .join("outroute-test-cache")
        .display()
        .to_string()
}

/// The `shipping` source's table: seed article 000's `outbox_events`
/// shape, its events of aggregate type `shipment`.
fn shipping_table() -> String {
    seed::OUTBOX_EVENTS_MAPPING
        .replace("[store.table]", "[sources.shipping.table]")
        .replace(
            "aggregate_type_value = \"order\"",
            "aggregate_type_value = \"shipment\"",
        )
}

#[tokio::test(flavor = "multi_thread")]
async fn one_relay_three_sources_two_teams() -> Result<()> {
    let orders = TestDb::new().await?;
    let billing = TestDb::new().await?;
    let shipping = TestDb::new().await?;
    sqlx::query(seed::T_OUTBOX_DDL)
        .execute(&billing.pool)
        .await?;
    sqlx::query(seed::OUTBOX_EVENTS_DDL)
        .execute(&shipping.pool)
        .await?;
    let dir = test_dir("platform");
    let out = dir.join("out.jsonl");
    let main = format!(
        "include = [\"teams/*.toml\"]\n[relay]\ncache_dir = \"{}\"\nlanes = 16\n\
         [sources.orders]\nurl = \"{}\"\n\
         [sources.billing]\nurl = \"{}\"\n{}\n\
         [sources.shipping]\nurl = \"{}\"\nlanes = 8\n{}\n\
         {}[http]\nlisten = \"\"\n",
        cache(),
        orders.url,
        billing.url,
        seed::T_OUTBOX_MAPPING.replace("[store.table]", "[sources.billing.table]"),
        shipping.url,
        shipping_table(),
        grants_and_sinks(&out, "\"orders\", \"billing\""),
    );
    std::fs::create_dir_all(dir.join("teams"))?;
    let config = dir.join("outroute.toml");
    std::fs::write(&config, main)?;
    // Payments reads both of its granted sources (no `sources` key).
    std::fs::write(
        dir.join("teams/payments.toml"),
        team(
            "payments",
            "payments-router",
            "payments",
            "aggregate_types = [\"order\", \"invoice\"]\nconfig = { sink = \"file\", topic = \"payments.{aggregate_type}\" }\nallow = { file = [\"payments.*\"] }",
        ),
    )?;
    std::fs::write(
        dir.join("teams/logistics.toml"),
        team(
            "logistics",
            "logistics-router",
            "shipments",
            "sources = [\"shipping\"]\nconfig = { sink = \"file\", topic = \"logistics.{aggregate_type}.{event_type}\" }\nallow = { file = [\"logistics.**\"] }",
        ),
    )?;
    let c = config.display().to_string();
    let (code, o, e) = cli(&["config", "check", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    assert!(
        o.contains("3 sources, 2 routes") && o.contains("2 included files"),
        "{o}"
    );
    let (code, o, e) = cli(&["migrate", "-c", &c])?;
    assert_eq!(code, 0, "migrate: {o}{e}");
    let (code, o, e) = cli(&["migrate", "--table", "-c", &c])?;
    assert_eq!(code, 0, "migrate --table: {o}{e}");
    assert!(
        o.contains("source billing:") && o.contains("source shipping:"),
        "{o}"
    );

    let w = produce(&orders.pool, "ord", 20, 10, 7).await?;
    seed_billing(&billing, 1, 200).await?;
    seed_shipping(&shipping, 1, 200).await?;
    let relay = Relay::start(&config, &[])?;
    let want = w.committed.len() + 400;
    let all = eventually(Duration::from_secs(60), || async {
        file_sink_deliveries(&out)
            .iter()
            .map(|d| d.id().to_string())
            .collect::<HashSet<_>>()
            .len()
            >= want
    })
    .await;
    assert!(all, "all sources drained: {}", relay.log_text());
    // One plugin engine for the whole process, not one per source: its
    // epoch ticker is one thread (each source once made its own engine,
    // ticker and copy of every plugin's code).
    let tickers = std::fs::read_dir(format!("/proc/{}/task", relay.child.id()))?
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim() == "outroute-epoch")
        .count();
    assert_eq!(tickers, 1, "epoch ticker threads of a relay with 3 sources");
    let delivered = file_sink_deliveries(&out);
    let from_orders: Vec<Delivered> = delivered
        .iter()
        .filter(|d| {
            d.headers
                .get("ce_source")
                .is_some_and(|s| s.contains("/orders/"))
        })
        .cloned()
        .collect();
    check(&w, &from_orders).assert_clean();
    check_numbered(&delivered, "billing", 200);
    check_numbered(&delivered, "shipping", 200);
    assert!(
        delivered
            .iter()
            .all(|d| d.topic.starts_with("payments.") || d.topic.starts_with("logistics.")),
        "topics within the grants"
    );

    // Operator commands per source.
    let (code, o, e) = cli(&["status", "--json", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    let v: serde_json::Value = serde_json::from_str(&o)?;
    for s in ["orders", "billing", "shipping"] {
        assert_eq!(v[s]["backlog"], 0, "{s}: {o}");
    }
    let (code, o, e) = cli(&["failed", "list", "--source", "billing", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    assert!(o.contains("no failed events"), "{o}");
    let (code, _, e) = cli(&["status", "--source", "nope", "-c", &c])?;
    assert_ne!(code, 0);
    assert!(e.contains("no source named `nope`"), "{e}");
    drop(relay);
    for db in [orders, billing, shipping] {
        db.drop_db().await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_team_file_change_applies_without_restart() -> Result<()> {
    let orders = TestDb::new().await?;
    let shipping = TestDb::new().await?;
    sqlx::query(seed::OUTBOX_EVENTS_DDL)
        .execute(&shipping.pool)
        .await?;
    let dir = test_dir("reload");
    let out = dir.join("out.jsonl");
    let http = free_addr();
    let main = format!(
        "include = [\"teams/*.toml\"]\n[relay]\ncache_dir = \"{}\"\nlanes = 16\n\
         [sources.orders]\nurl = \"{}\"\n\
         [sources.shipping]\nurl = \"{}\"\n{}\n\
         {}[http]\nlisten = \"{http}\"\n",
        cache(),
        orders.url,
        shipping.url,
        shipping_table(),
        grants_and_sinks(&out, "\"orders\""),
    );
    std::fs::create_dir_all(dir.join("teams"))?;
    let config = dir.join("outroute.toml");
    std::fs::write(&config, main)?;
    std::fs::write(
        dir.join("teams/payments.toml"),
        team(
            "payments",
            "payments-router",
            "payments",
            "sources = [\"orders\"]\nconfig = { sink = \"file\", topic = \"payments.{event_type}\" }\nallow = { file = [\"payments.*\"] }",
        ),
    )?;
    let c = config.display().to_string();
    let (code, o, e) = cli(&["migrate", "-c", &c])?;
    assert_eq!(code, 0, "migrate: {o}{e}");
    // Shipping's events wait: no route reads that source yet.
    seed_shipping(&shipping, 1, 100).await?;
    let relay = Relay::start(&config, &[])?;

    // Orders keep flowing through both reloads.
    let pool = orders.pool.clone();
    let producer = tokio::spawn(async move {
        let mut all = Workload::default();
        for round in 0..10 {
            let w = produce(&pool, &format!("r{round}"), 8, 5, 0).await?;
            all.committed.extend(w.committed);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        anyhow::Ok(all)
    });
    let shipped = |d: &[Delivered]| {
        d.iter()
            .filter(|d| d.topic.starts_with("logistics."))
            .count()
    };
    // Running (orders' events go out) with shipping not started, named as
    // such: its 100 events wait.
    let running = eventually(Duration::from_secs(30), || async {
        file_sink_deliveries(&out)
            .iter()
            .any(|d| d.topic.starts_with("payments."))
            && relay.log_text().contains("no route reads this source")
    })
    .await;
    assert!(running, "{}", relay.log_text());
    assert_eq!(
        shipped(&file_sink_deliveries(&out)),
        0,
        "no route for shipping yet"
    );
    // Waiting, not failed for want of a route.
    assert_eq!(
        shipping
            .count("SELECT count(*) FROM outbox_events WHERE published_at IS NULL")
            .await,
        100
    );
    assert_eq!(
        shipping
            .count("SELECT count(*) FROM outroute_event_state")
            .await,
        0,
        "shipping's events were failed instead of waiting"
    );

    // A new team file: a plugin and a route for the shipping source.
    std::fs::write(
        dir.join("teams/logistics.toml"),
        team(
            "logistics",
            "logistics-router",
            "shipments",
            "config = { sink = \"file\", topic = \"logistics.{event_type}\" }\nallow = { file = [\"logistics.**\"] }",
        ),
    )?;
    let (code, o, e) = cli(&["config", "check", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    relay.reload();
    let applied = eventually(Duration::from_secs(30), || async {
        shipped(&file_sink_deliveries(&out)) >= 100
    })
    .await;
    assert!(applied, "the new route took effect: {}", relay.log_text());
    check_numbered(&file_sink_deliveries(&out), "shipping", 100);

    // A file claiming another team's name: refused for that alone (a file
    // speaks for the team it is named after), nothing else changes.
    std::fs::write(
        dir.join("teams/rogue.toml"),
        team(
            "logistics",
            "rogue-router",
            "rogue",
            "config = { sink = \"file\", topic = \"logistics.stolen\" }\nallow = { file = [\"logistics.*\"] }",
        ),
    )?;
    // Logistics' own file now reaching outside its grant: refused; its last
    // known good copy (kept when the reload above accepted it) runs on.
    std::fs::write(
        dir.join("teams/logistics.toml"),
        team(
            "logistics",
            "logistics-router",
            "shipments",
            "config = { sink = \"file\", topic = \"payments.stolen\" }\nallow = { file = [\"payments.*\"] }",
        ),
    )?;
    let (code, o, e) = cli(&["config", "check", "-c", &c])?;
    assert_ne!(code, 0, "{o}");
    assert!(
        e.contains("teams/rogue.toml:team: this file says team `logistics`")
            && e.contains("teams/logistics.toml:routes[0].allow.file")
            && e.contains("outside team `logistics`'s grant")
            && e.contains("runs the team's last known good copy instead"),
        "{e}"
    );
    relay.reload();
    let refused = eventually(Duration::from_secs(20), || async {
        http_get(&http, "/metrics")
            .await
            .ok()
            .and_then(|(_, m)| metric(&m, "outroute_team_files_refused"))
            == Some(2.0)
    })
    .await;
    assert!(refused, "the two files were refused: {}", relay.log_text());
    let (_, m) = http_get(&http, "/metrics").await?;
    assert_eq!(
        metric(&m, "outroute_config_reloads_total{result=\"rejected\"}"),
        None,
        "a bad team file costs its team, not the reload"
    );
    let (status, body) = http_get(&http, "/readyz").await?;
    assert_eq!(status, 200, "still ready: {body}");
    assert!(
        body.contains("teams/rogue.toml refused (its routes do not run")
            && body.contains("teams/logistics.toml refused (its last known good copy runs)"),
        "{body}"
    );
    assert_eq!(http_get(&http, "/readyz?strict").await?.0, 503);
    // Everything written while the config changed twice went out, in order.
    let w = producer.await??;
    seed_shipping(&shipping, 101, 150).await?;
    let all = eventually(Duration::from_secs(60), || async {
        let d = file_sink_deliveries(&out);
        let ids: HashSet<String> = d.iter().map(|d| d.id().to_string()).collect();
        ids.len() >= w.committed.len() + 150
    })
    .await;
    assert!(all, "drained after the reloads: {}", relay.log_text());
    let delivered = file_sink_deliveries(&out);
    let from_orders: Vec<Delivered> = delivered
        .iter()
        .filter(|d| d.topic.starts_with("payments."))
        .cloned()
        .collect();
    let report = check(&w, &from_orders);
    report.assert_clean();
    assert_eq!(report.lost, 0);
    check_numbered(&delivered, "shipping", 150);
    assert!(
        delivered
            .iter()
            .all(|d| !d.topic.starts_with("payments.stolen")
                && !d.topic.starts_with("logistics.stolen")),
        "a refused file's routes never ran"
    );
    let log = relay.log_text();
    assert_eq!(
        log.matches("outroute relay started").count(),
        1,
        "one start, no restart"
    );
    let applied = log
        .lines()
        .find(|l| l.contains("config reload applied in"))
        .unwrap_or_default();
    eprintln!("{applied}");
    // Only the new source was started; orders kept its relay and lanes.
    assert_eq!(
        log.matches("source started").count(),
        2,
        "orders started once, shipping once: {log}"
    );
    drop(relay);
    orders.drop_db().await;
    shipping.drop_db().await;
    Ok(())
}

/// Team files written to take more than their grant gives are each refused
/// by file and key, naming what was wrong, while an honest team's file is
/// accepted: a route above its grant's ceiling (the value and the ceiling
/// named), `quarantine_after = 0` (never quarantined), a plugin path that
/// leaves the team's directories by `..` or by a symlink, and an
/// `exclusive` route over aggregate types the team does not own. Two
/// grants owning overlapping aggregate types are a main-file error: the
/// relay refuses to start.
#[tokio::test(flavor = "multi_thread")]
async fn team_files_that_overreach_are_refused_by_file_and_key() -> Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("overreach");
    let out = dir.join("out.jsonl");
    let teams = [
        "greedy", "immortal", "escaper", "linker", "grabber", "honest",
    ];
    let mut grants = String::new();
    for t in teams {
        grants.push_str(&format!(
            "[grants.{t}]\nsources = [\"orders\"]\nallow = {{ file = [\"{t}.*\"] }}\nplugin_dirs = [\"{}\"]\n",
            plugin_dist().display()
        ));
        if t == "greedy" {
            grants.push_str("ceilings = { cpu_budget = \"100ms\" }\n");
        }
    }
    let main = |extra_grants: &str| {
        format!(
            "include = [\"teams/*.toml\"]\n[relay]\ncache_dir = \"{}\"\n\
             [sources.orders]\nurl = \"{}\"\n\
             [sinks.file]\nkind = \"file\"\npath = \"{}\"\n{grants}{extra_grants}[http]\nlisten = \"\"\n",
            dir.join("cache").display(),
            db.url,
            out.display(),
        )
    };
    std::fs::create_dir_all(dir.join("teams"))?;
    std::fs::create_dir_all(dir.join("outside"))?;
    let outside = dir.join("outside/router.wasm");
    std::fs::copy(plugin("order-router"), &outside)?;
    let link = dir.join("teams/router.wasm");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&outside, &link)?;
    let config = dir.join("outroute.toml");
    std::fs::write(&config, main(""))?;
    let route = |t: &str, extra: &str| {
        format!(
            "config = {{ sink = \"file\", topic = \"{t}.x\" }}\nallow = {{ file = [\"{t}.*\"] }}\n{extra}"
        )
    };
    let with_plugin = |t: &str, path: &str| {
        format!(
            "team = \"{t}\"\n[plugins.{t}-router]\npath = \"{path}\"\n[[routes]]\nname = \"{t}\"\nplugin = \"{t}-router\"\n{}\n",
            route(t, "")
        )
    };
    std::fs::write(
        dir.join("teams/greedy.toml"),
        team(
            "greedy",
            "greedy-router",
            "greedy",
            &route("greedy", "cpu_budget = \"5s\""),
        ),
    )?;
    std::fs::write(
        dir.join("teams/immortal.toml"),
        team(
            "immortal",
            "immortal-router",
            "immortal",
            &route("immortal", "quarantine_after = 0"),
        ),
    )?;
    std::fs::write(
        dir.join("teams/escaper.toml"),
        with_plugin("escaper", "../outside/router.wasm"),
    )?;
    std::fs::write(
        dir.join("teams/linker.toml"),
        with_plugin("linker", "router.wasm"),
    )?;
    std::fs::write(
        dir.join("teams/grabber.toml"),
        team(
            "grabber",
            "grabber-router",
            "grabber",
            &route("grabber", "aggregate_types = [\"order\"]\nexclusive = true"),
        ),
    )?;
    std::fs::write(
        dir.join("teams/honest.toml"),
        team(
            "honest",
            "honest-router",
            "honest",
            &route("honest", "cpu_budget = \"50ms\""),
        ),
    )?;
    let c = config.display().to_string();
    let (code, o, e) = cli(&["config", "check", "-c", &c])?;
    assert_ne!(code, 0, "{o}{e}");
    for (file, key, reason) in [
        (
            "greedy",
            "routes[0].cpu_budget",
            "\"5s\" is above team `greedy`'s ceiling \"100ms\"",
        ),
        (
            "immortal",
            "routes[0].quarantine_after",
            "0 (never) is above",
        ),
        (
            "escaper",
            "plugins.escaper-router.path",
            "outside team `escaper`'s directories",
        ),
        (
            "linker",
            "plugins.linker-router.path",
            "outside team `linker`'s directories",
        ),
        (
            "grabber",
            "routes[0].exclusive",
            "team `grabber` owns no aggregate types",
        ),
    ] {
        let line = e
            .lines()
            .find(|l| l.contains(&format!("teams/{file}.toml:{key}")))
            .unwrap_or_default();
        assert!(
            line.contains(reason),
            "{file}: `{key}` refused with `{reason}`:\n{e}"
        );
    }
    assert!(
        !e.contains("teams/honest.toml:"),
        "the honest team's file is accepted: {e}"
    );

    // Two grants owning overlapping aggregate types: the main file is
    // wrong, and the relay does not start.
    std::fs::write(
        &config,
        main(
            "[grants.first]\nsources = [\"orders\"]\nowns = [\"order\"]\n[grants.second]\nsources = [\"orders\"]\nowns = [\"ord*\"]\n",
        ),
    )?;
    for t in teams {
        let _ = std::fs::remove_file(dir.join(format!("teams/{t}.toml")));
    }
    let (code, o, e) = cli(&["config", "check", "-c", &c])?;
    assert_ne!(code, 0, "{o}{e}");
    assert!(
        e.contains("grants.second.owns") && e.contains("overlaps `order`, owned by team `first`"),
        "{e}"
    );
    let mut relay = Relay::start(&config, &[])?;
    let exited = relay.wait_exit(Duration::from_secs(20));
    assert!(
        exited.is_some_and(|s| !s.success()),
        "a main file with overlapping owners refuses to start: {}",
        relay.log_text()
    );
    assert!(
        relay.log_text().contains("grants.second.owns"),
        "{}",
        relay.log_text()
    );
    db.drop_db().await;
    Ok(())
}

/// A team's last known good file outlives the relay: after a restart with
/// the team file gone (a bad deploy deleted it), the granted team's routes
/// run from the copy the previous relay kept, and the relay says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_missing_team_file_runs_its_last_good_copy_after_a_restart() -> Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("last-good");
    let out = dir.join("out.jsonl");
    std::fs::create_dir_all(dir.join("teams"))?;
    let config = dir.join("outroute.toml");
    std::fs::write(
        &config,
        format!(
            "include = [\"teams/*.toml\"]\n[relay]\ncache_dir = \"{}\"\n\
             [sources.orders]\nurl = \"{}\"\n\
             [sinks.file]\nkind = \"file\"\npath = \"{}\"\n\
             [grants.payments]\nsources = [\"orders\"]\nallow = {{ file = [\"payments.*\"] }}\nplugin_dirs = [\"{}\"]\n\
             [http]\nlisten = \"\"\n",
            dir.join("cache").display(),
            db.url,
            out.display(),
            plugin_dist().display(),
        ),
    )?;
    let team_file = dir.join("teams/payments.toml");
    std::fs::write(
        &team_file,
        team(
            "payments",
            "payments-router",
            "payments",
            "config = { sink = \"file\", topic = \"payments.{event_type}\" }\nallow = { file = [\"payments.*\"] }",
        ),
    )?;
    db.migrate(&config)?;
    let insert = |agg: &'static str| {
        let pool = db.pool.clone();
        async move {
            let id = uuid::Uuid::new_v4().to_string();
            sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1::uuid, 'order', $2, 'order-created', '{}')")
                .bind(&id)
                .bind(agg)
                .execute(&pool)
                .await
                .map(|_| id)
        }
    };
    let delivered = |id: String| {
        let out = out.clone();
        async move {
            eventually(Duration::from_secs(30), || async {
                file_sink_deliveries(&out)
                    .iter()
                    .any(|d| d.id() == id && d.topic == "payments.order-created")
            })
            .await
        }
    };
    let mut relay = Relay::start(&config, &[])?;
    let first = insert("a").await?;
    assert!(delivered(first).await, "{}", relay.log_text());
    relay.terminate(Duration::from_secs(15));

    std::fs::remove_file(&team_file)?;
    let (code, _, e) = cli(&["config", "check", "-c", &config.display().to_string()])?;
    assert_ne!(code, 0, "{e}");
    assert!(
        e.contains("team `payments` has a grant but no team file: its last known good copy runs"),
        "{e}"
    );
    let relay = Relay::start(&config, &[])?;
    let second = insert("b").await?;
    assert!(
        delivered(second).await,
        "the kept copy serves the team after a restart: {}",
        relay.log_text()
    );
    assert!(
        relay.log_text().contains(
            "team `payments` has a grant but no team file: its last known good copy runs"
        ),
        "{}",
        relay.log_text()
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// A main-file reload that changes `[relay]` (the process's own settings)
/// or fails validation is refused as a whole: logged with the key, counted
/// as `outroute_config_reloads_total{result="rejected"}`, and the running
/// config goes on relaying; the same file's route change alone is then
/// applied.
#[tokio::test(flavor = "multi_thread")]
async fn a_main_file_reload_that_needs_a_restart_or_fails_is_refused_whole() -> Result<()> {
    let db = TestDb::new().await?;
    let dir = test_dir("main-reload");
    let out = dir.join("out.jsonl");
    let http = free_addr();
    let config = write_config(
        &dir,
        &db.url,
        "batch_size = 100",
        &relay_body(
            &http,
            &[TestSink::File(&out)],
            "order-router",
            "r",
            FILE_ROUTE,
        ),
    )?;
    db.migrate(&config)?;
    let relay = Relay::start(&config, &[])?;
    let rejected = || async {
        http_get(&http, "/metrics")
            .await
            .ok()
            .and_then(|(_, m)| metric(&m, "outroute_config_reloads_total{result=\"rejected\"}"))
            .unwrap_or(0.0)
    };
    let original = std::fs::read_to_string(&config)?;
    let flows = |n: usize, total: usize| {
        let (pool, out) = (db.pool.clone(), out.clone());
        async move {
            for i in 0..n {
                sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES (gen_random_uuid(), 'order', $1, 'order-created', '{}')")
                    .bind(format!("a{i}"))
                    .execute(&pool)
                    .await?;
            }
            anyhow::Ok(file_sink_reaches(&out, total, Duration::from_secs(30)).await)
        }
    };
    assert!(flows(1, 1).await?, "{}", relay.log_text());

    // [relay] changed together with the route's topic: nothing applies.
    std::fs::write(
        &config,
        original
            .replace("batch_size = 100", "batch_size = 7")
            .replace(
                "topic = \"orders.{event_type}\"",
                "topic = \"orders.renamed\"",
            ),
    )?;
    relay.reload();
    let refused = eventually(Duration::from_secs(15), || async {
        rejected().await == 1.0
    })
    .await;
    assert!(refused, "{}", relay.log_text());
    let log = relay.log_text();
    assert!(
        log.contains("config reload rejected; the running config is unchanged")
            && log.contains("relay.batch_size"),
        "{log}"
    );
    // A main file that does not validate: refused too.
    std::fs::write(
        &config,
        original.replace("allow = { file", "allow = { nowhere"),
    )?;
    relay.reload();
    let refused = eventually(Duration::from_secs(15), || async {
        rejected().await == 2.0
    })
    .await;
    assert!(refused, "{}", relay.log_text());
    assert!(relay.log_text().contains("nowhere"), "{}", relay.log_text());
    // The running config relays as before: the old topic.
    assert!(flows(2, 3).await?, "{}", relay.log_text());
    assert!(
        file_sink_deliveries(&out)
            .iter()
            .all(|d| d.topic == "orders.order-created"),
        "a refused reload applied a part of itself"
    );
    // The route change alone is applied.
    std::fs::write(
        &config,
        original.replace(
            "topic = \"orders.{event_type}\"",
            "topic = \"orders.renamed\"",
        ),
    )?;
    relay.reload();
    let applied = eventually(Duration::from_secs(15), || async {
        relay.log_text().contains("config reload applied")
    })
    .await;
    assert!(applied, "{}", relay.log_text());
    assert!(flows(3, 6).await?, "{}", relay.log_text());
    assert_eq!(
        file_sink_deliveries(&out)
            .last()
            .map(|d| d.topic.clone())
            .as_deref(),
        Some("orders.renamed")
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}
