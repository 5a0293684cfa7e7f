//! Plugin isolation against the real relay: hostile plugins (endless loop,
//! 1 GiB allocation, panic, forbidden topic, unknown sink, oversize payload,
//! rejection, endless retries) each fail only their own event with a
//! specific reason while good events keep flowing; a poisoned aggregate
//! holds back only itself until an operator discards its failed event; a
//! relay that makes no progress turns not-ready; plugins hot-reload.
//!
//! One concern, one file: the end-to-end tests of plugin isolation, one
//! hostile mode each.

use std::time::Duration;

use outroute::event::Event;
use outroute::plugin::{Answer, Limit, Limits, PluginHandle, Runtime};
use outroute_e2e::*;

#[tokio::test(flavor = "multi_thread")]
async fn hostile_plugins_fail_only_their_event_and_poison_holds_only_its_aggregate()
-> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let t = tag();
    let topic = format!("h{t}.order-updated");
    create_topic(&topic, 2).await?;
    let http = free_addr();
    let dir = test_dir("hostile");
    let config = write_config(
        &dir,
        &db.url,
        "lease_ttl = \"3s\"\nbatch_size = 50",
        &relay_body(
            &http,
            &[TestSink::Kafka],
            "hostile",
            "hostile",
            &format!(
                "config = {{ sink = \"kafka\", topic = \"h{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"h{t}.*\"] }}\n\
                 cpu_budget = \"20ms\"\nmemory_mib = 32\nmax_attempts = 2\nbackoff_min = \"50ms\"\nbackoff_max = \"100ms\"\n\
                 on_failure = \"block\"\nquarantine_after = 0"
            ),
        ),
    )?;
    db.migrate(&config)?;

    let modes = [
        "loop",
        "oom",
        "trap",
        "forbidden-topic",
        "unknown-sink",
        "oversize",
        "reject",
        "fan-out-bomb",
        "sleep-loop",
        "log-flood",
    ];
    let mut hostile_ids = Vec::new();
    for m in modes {
        hostile_ids.push((
            m,
            insert_order_event(&db, &format!("bad-{m}"), serde_json::json!({"hostile": m})).await?,
        ));
    }
    let poison = insert_order_event(&db, "poison", serde_json::json!({"hostile": "retry"})).await?;
    let mut held = Vec::new();
    for i in 0..5 {
        held.push(insert_order_event(&db, "poison", serde_json::json!({"n": i})).await?);
    }
    let mut good = Vec::new();
    // Misbehaviour that is contained without failing: a 10 s sleep (time
    // does not pass for plugins), 1 MiB of stderr (a ring buffer), a few ms
    // of CPU (within the budget).
    for m in ["sleep", "stderr-flood", "slow"] {
        good.push(
            insert_order_event(
                &db,
                &format!("benign-{m}"),
                serde_json::json!({"hostile": m}),
            )
            .await?,
        );
    }
    for i in 0..100 {
        good.push(
            insert_order_event(
                &db,
                &format!("good-{}", i % 25),
                serde_json::json!({"n": i}),
            )
            .await?,
        );
    }

    let mut relay = Relay::start(&config, &[])?;
    let delivered = consume_kafka(&topic, 2, good.len(), Duration::from_secs(60))?;
    let ids: std::collections::HashSet<&str> = delivered.iter().map(|d| d.id()).collect();
    for g in &good {
        assert!(
            ids.contains(g.as_str()),
            "good event {g} not delivered\n{}",
            relay.log_text()
        );
    }
    for h in held.iter().chain([&poison]) {
        assert!(!ids.contains(h.as_str()), "held event {h} was published");
    }

    // Every hostile event failed with its own reason.
    let cfg = config.to_str().unwrap_or_default().to_string();
    let all_failed = eventually(Duration::from_secs(30), || async {
        cli(&["failed", "list", "--json", "-c", &cfg])
            .is_ok_and(|(_, out, _)| out.matches("\"id\"").count() == modes.len() + 1)
    })
    .await;
    let (_, out, _) = cli(&["failed", "list", "--json", "-c", &cfg])?;
    assert!(all_failed, "{out}\n{}", relay.log_text());
    let failed: serde_json::Value = serde_json::from_str(&out)?;
    let reason_of = |id: &str| -> String {
        failed
            .as_array()
            .and_then(|a| a.iter().find(|f| f["id"] == id))
            .map(|f| {
                format!(
                    "{} [plugin {} {}]",
                    f["reason"].as_str().unwrap_or(""),
                    f["plugin"],
                    f["plugin_version"]
                )
            })
            .unwrap_or_default()
    };
    let expect = [
        ("loop", "exceeded its CPU budget (20 ms"),
        ("oom", "exceeded its memory cap of 32 MiB"),
        ("trap", "hostile plugin panics on purpose"),
        ("forbidden-topic", "may not publish to `payroll.salaries`"),
        ("unknown-sink", "may not publish to sink `nowhere`"),
        ("oversize", "over the sink's max_message_bytes"),
        ("reject", "hostile plugin rejects this event"),
        (
            "fan-out-bomb",
            "returned 10000 messages for one event (routes[].max_messages_per_event = 100)",
        ),
        ("sleep-loop", "exceeded its CPU budget (20 ms"),
        ("log-flood", "wrote more than 100 log lines"),
    ];
    for ((mode, id), (m2, needle)) in hostile_ids.iter().zip(expect) {
        assert_eq!(*mode, m2);
        let r = reason_of(id);
        assert!(r.contains(needle), "{mode}: reason `{r}` lacks `{needle}`");
        assert!(r.contains("[plugin \"hostile\" \"0.1.0\"]"), "{r}");
    }
    assert!(
        reason_of(&poison).contains("gave up after 2 attempts"),
        "{}",
        reason_of(&poison)
    );

    // The relay survived all of it.
    assert!(
        relay.child.try_wait()?.is_none(),
        "relay died:\n{}",
        relay.log_text()
    );
    let (_, metrics) = http_get(&http, "/metrics").await?;
    assert!(
        metric(&metrics, "outroute_events_failed_total{route=\"hostile\"}").unwrap_or(0.0) >= 8.0,
        "{metrics}"
    );
    assert!(
        metrics.contains("outroute_rejections_total{route=\"hostile\",kind=\"invalid\"}"),
        "{metrics}"
    );

    // Held, not merely unseen so far: with every other event out and every
    // hostile one failed, the poisoned aggregate's six events are all still
    // pending in the table (a consumer read proves nothing about events
    // that could still arrive).
    assert_eq!(
        db.unpublished("o.aggregate_id = 'poison'").await,
        held.len() as i64 + 1,
        "the poisoned aggregate's held events left the table before the discard\n{}",
        relay.log_text()
    );

    // The operator discards the poisoned event: the held ones follow, in order.
    let (code, out, err) = cli(&["failed", "discard", "--id", &poison, "-c", &cfg])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 event(s) discarded"));
    let after = consume_kafka(&topic, 2, good.len() + held.len(), Duration::from_secs(30))?;
    let poison_order: Vec<&str> = after
        .iter()
        .filter(|d| d.aggregate() == "poison")
        .map(|d| d.id())
        .collect();
    assert_eq!(
        poison_order,
        held.iter().map(String::as_str).collect::<Vec<_>>()
    );
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_relay_that_makes_no_progress_is_not_ready() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let http = free_addr();
    let dir = test_dir("stall");
    let config = write_config(
        &dir,
        &db.url,
        "stall_after = \"2s\"",
        &relay_body(
            &http,
            &[TestSink::File(&dir.join("out.jsonl"))],
            "hostile",
            "stuck",
            "config = { mode = \"retry\", sink = \"file\", topic = \"x.{event_type}\" }\nallow = { file = [\"x.*\"] }\n\
             max_attempts = 1000\nbackoff_min = \"100ms\"\nbackoff_max = \"200ms\"",
        ),
    )?;
    db.migrate(&config)?;
    insert_order_event(&db, "a", serde_json::json!({})).await?;
    let mut relay = Relay::start(&config, &[])?;
    let not_ready = eventually(Duration::from_secs(15), || async {
        http_get(&http, "/readyz")
            .await
            .is_ok_and(|(s, b)| s == 503 && b.contains("nothing published"))
    })
    .await;
    assert!(not_ready, "{:?}", http_get(&http, "/readyz").await);
    assert_eq!(
        http_get(&http, "/healthz").await?.0,
        200,
        "alive even when not ready"
    );
    let (_, m) = http_get(&http, "/metrics").await?;
    assert!(
        metric(&m, "outroute_retries_total{route=\"stuck\"}").unwrap_or(0.0) >= 2.0,
        "{m}"
    );
    assert_eq!(metric(&m, "outroute_backlog_events"), Some(1.0));
    relay.terminate(Duration::from_secs(15));
    db.drop_db().await;
    Ok(())
}

fn event() -> Event {
    Event {
        id: "e1".into(),
        sequence: 1,
        aggregate_type: "order".into(),
        aggregate_id: "o1".into(),
        event_type: "created".into(),
        event_version: 1,
        payload: b"{}".to_vec(),
        headers: vec![],
        created_at: chrono::Utc::now(),
        attempts: 0,
    }
}

#[test]
fn hot_reload_switches_versions_and_survives_a_bad_file() -> anyhow::Result<()> {
    let dir = test_dir("reload");
    let file = dir.join("plugin.wasm");
    std::fs::copy(plugin("order-router"), &file)?;
    let rt = Runtime::new(Some(dir.join("cache")))?;
    let limits = Limits {
        cpu_budget: Duration::from_millis(100),
        ..Limits::default()
    };
    let config = serde_json::json!({"sink": "kafka", "topic": "orders.{event_type}"});
    let handle = PluginHandle::load(&rt, &file, config, limits)?;
    let v1 = handle.current().expect("plugin");
    assert_eq!(v1.info.name, "order-router");
    assert_eq!(handle.reload_if_changed()?, None, "nothing changed");

    // A new version replaces the file: new work goes to it; work holding
    // the old version finishes on it.
    std::thread::sleep(Duration::from_millis(20));
    std::fs::copy(plugin("hostile"), &file)?;
    let switched = handle.reload_if_changed()?;
    assert_eq!(switched.map(|i| i.name), Some("hostile".to_string()));
    assert_eq!(handle.current().expect("plugin").info.name, "hostile");
    assert!(
        matches!(v1.route_batch(&[event()])[0], Answer::Outcome(Ok(_))),
        "old version still routes in-flight work"
    );

    // A broken file is reported and the running version stays.
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(&file, b"\0asm not really")?;
    let err = handle.reload_if_changed().expect_err("bad file accepted");
    assert!(
        format!("{err:#}").contains("not a valid component"),
        "{err:#}"
    );
    assert_eq!(handle.current().expect("plugin").info.name, "hostile");
    Ok(())
}

#[test]
fn a_plugin_whose_init_refuses_its_config_is_refused_at_start() -> anyhow::Result<()> {
    let dir = test_dir("init");
    let rt = Runtime::new(Some(dir.join("cache")))?;
    let limits = Limits {
        cpu_budget: Duration::from_millis(100),
        ..Limits::default()
    };
    let err = PluginHandle::load(
        &rt,
        &plugin("schema-gate"),
        serde_json::json!({"topik": 1}),
        limits,
    )
    .err()
    .expect("bad config accepted");
    let text = format!("{err:#}");
    assert!(
        text.contains("refused its route config") && text.contains("topik"),
        "{text}"
    );
    Ok(())
}

/// The compiled-plugin cache holds native code: a garbage, a foreign
/// (another plugin's, validly cached) and a bit-flipped artifact planted at
/// a plugin's cache key are each detected, deleted and recompiled — the
/// plugin that runs is always the one compiled from its own file.
#[test]
fn planted_cache_artifacts_are_recompiled_never_run() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = test_dir("cache-tamper");
    let cache = dir.join("cache");
    let rt = Runtime::new(Some(cache.clone()))?;
    let mine = plugin("order-router");
    let theirs = plugin("hostile");
    let at = rt
        .artifact_path(&mine)?
        .ok_or_else(|| anyhow::anyhow!("no disk cache"))?;
    let routes_as_itself = |rt: &Runtime| -> anyhow::Result<bool> {
        let c = rt.compile(&mine)?;
        let limits = Limits {
            cpu_budget: Duration::from_millis(100),
            ..Limits::default()
        };
        let h = PluginHandle::load(rt, &mine, serde_json::Value::Null, limits)?;
        let name = h.current().map(|p| p.info.name.clone()).unwrap_or_default();
        assert_eq!(name, "order-router", "another plugin ran in its place");
        Ok(c.from_cache)
    };
    assert!(!rt.compile(&mine)?.from_cache, "first compile");
    assert!(routes_as_itself(&rt)?, "a clean cached artifact is used");
    let good = std::fs::read(&at)?;

    // Garbage.
    std::fs::write(&at, vec![0xCC; 4096])?;
    assert!(!routes_as_itself(&rt)?, "garbage artifact was loaded");
    assert_eq!(std::fs::read(&at)?, good, "recompiled and cached again");

    // Foreign: another plugin's artifact, with that plugin's valid MAC.
    rt.compile(&theirs)?;
    let foreign = rt
        .artifact_path(&theirs)?
        .ok_or_else(|| anyhow::anyhow!("no disk cache"))?;
    std::fs::copy(&foreign, &at)?;
    assert!(!routes_as_itself(&rt)?, "foreign artifact was loaded");

    // One flipped bit in the code.
    let mut flipped = good.clone();
    let i = flipped.len() / 2;
    flipped[i] ^= 0x01;
    std::fs::write(&at, &flipped)?;
    assert!(!routes_as_itself(&rt)?, "bit-flipped artifact was loaded");

    // Another installation (another key) cannot plant artifacts either.
    let other = dir.join("other-cache");
    let rt2 = Runtime::new(Some(other.clone()))?;
    rt2.compile(&mine)?;
    let theirs_at = rt2
        .artifact_path(&mine)?
        .ok_or_else(|| anyhow::anyhow!("no disk cache"))?;
    std::fs::copy(&theirs_at, &at)?;
    assert!(
        !routes_as_itself(&rt)?,
        "another installation's artifact was loaded"
    );

    // A cache directory others can write to is refused, with the reason.
    let open = dir.join("open-cache");
    std::fs::create_dir_all(&open)?;
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777))?;
    let err = Runtime::new(Some(open))
        .err()
        .expect("world-writable cache accepted");
    assert!(
        format!("{err:#}").contains("writable by other users"),
        "{err:#}"
    );
    // And none at all is fine: compiled in memory.
    assert!(!Runtime::new(None)?.compile(&mine)?.from_cache);
    Ok(())
}

fn hostile_event(id: &str, mode: Option<&str>) -> Event {
    let payload = match mode {
        Some(m) => serde_json::json!({"hostile": m}),
        None => serde_json::json!({}),
    };
    Event {
        id: id.into(),
        aggregate_id: id.into(),
        payload: payload.to_string().into_bytes(),
        ..event()
    }
}

fn hostile_plugin(config: serde_json::Value, limits: Limits) -> anyhow::Result<PluginHandle> {
    let rt = Runtime::new(Some(test_dir("limits").join("cache")))?;
    PluginHandle::load(&rt, &plugin("hostile"), config, limits)
}

/// A loop inside `route-batch` is found by re-routing one event at a time;
/// the looping event is charged its CPU budget and the route's later events
/// in the batch wait for the next batch instead of each costing a budget.
#[test]
fn a_loop_in_a_batch_costs_one_budget_and_the_rest_wait() -> anyhow::Result<()> {
    let limits = Limits {
        cpu_budget: Duration::from_millis(20),
        ..Limits::default()
    };
    let handle = hostile_plugin(serde_json::Value::Null, limits)?;
    let p = handle.current().expect("plugin");
    let events: Vec<Event> = (0..10)
        .map(|i| hostile_event(&format!("e{i}"), (i == 3).then_some("loop")))
        .collect();
    let answers = p.route_batch(&events);
    assert_eq!(answers.len(), 10);
    for a in &answers[..3] {
        assert!(matches!(a, Answer::Outcome(Ok(m)) if m.len() == 1), "{a:?}");
    }
    assert!(
        matches!(&answers[3], Answer::Breach { limit: Limit::CpuBudget, reason } if reason.contains("exceeded its CPU budget (20 ms of CPU time")),
        "{:?}",
        answers[3]
    );
    for a in &answers[4..] {
        assert!(
            matches!(a, Answer::Later { after } if after == "e3"),
            "{a:?}"
        );
    }
    // The next batch (the loop gone) routes normally on a fresh instance.
    let answers = p.route_batch(&events[4..]);
    assert!(
        answers.iter().all(|a| matches!(a, Answer::Outcome(Ok(_)))),
        "{answers:?}"
    );
    Ok(())
}

/// No WASI call blocks: a 10 s sleep returns at once (time does not pass
/// for plugins), a sleep loop is stopped by the CPU budget, 1 MiB of stderr
/// never fails the guest, a log flood breaks the log limit, a memory bomb
/// breaks the memory cap.
#[test]
fn sleeps_return_at_once_and_limits_name_what_was_broken() -> anyhow::Result<()> {
    let limits = Limits {
        cpu_budget: Duration::from_millis(20),
        memory_bytes: 32 << 20,
        ..Limits::default()
    };
    let handle = hostile_plugin(serde_json::Value::Null, limits)?;
    let p = handle.current().expect("plugin");
    let started = std::time::Instant::now();
    let a = p.route_batch(&[hostile_event("s", Some("sleep"))]);
    assert!(matches!(&a[0], Answer::Outcome(Ok(_))), "{a:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "slept {:?}",
        started.elapsed()
    );
    let a = p.route_batch(&[hostile_event("sl", Some("sleep-loop"))]);
    assert!(
        matches!(
            &a[0],
            Answer::Breach {
                limit: Limit::CpuBudget,
                ..
            }
        ),
        "{a:?}"
    );
    let a = p.route_batch(&[hostile_event("err", Some("stderr-flood"))]);
    assert!(matches!(&a[0], Answer::Outcome(Ok(_))), "{a:?}");
    let a = p.route_batch(&[hostile_event("log", Some("log-flood"))]);
    assert!(
        matches!(&a[0], Answer::Breach { limit: Limit::Log, reason } if reason.contains("more than 100 log lines")),
        "{a:?}"
    );
    let a = p.route_batch(&[hostile_event("oom", Some("oom"))]);
    assert!(
        matches!(&a[0], Answer::Breach { limit: Limit::Memory, reason } if reason.contains("memory cap of 32 MiB")),
        "{a:?}"
    );
    // A trap quotes the guest's last stderr lines, not stale ones.
    let a = p.route_batch(&[hostile_event("t", Some("trap"))]);
    assert!(
        matches!(&a[0], Answer::Outcome(Err(r)) if r.reason().contains("hostile plugin panics on purpose") && !r.reason().contains("hostile stderr line")),
        "{a:?}"
    );
    Ok(())
}

/// `route-batch` answering the wrong number of outcomes is a plugin bug:
/// the batch is routed one event at a time instead of failing.
#[test]
fn a_route_batch_count_mismatch_falls_back_to_route() -> anyhow::Result<()> {
    let handle = hostile_plugin(
        serde_json::json!({"mode": "wrong-count"}),
        Limits::default(),
    )?;
    let p = handle.current().expect("plugin");
    let events: Vec<Event> = (0..5)
        .map(|i| hostile_event(&format!("w{i}"), None))
        .collect();
    let answers = p.route_batch(&events);
    assert_eq!(answers.len(), 5);
    assert!(
        answers.iter().all(|a| matches!(a, Answer::Outcome(Ok(_)))),
        "{answers:?}"
    );
    Ok(())
}

/// The hostile plugin with no memory for idle instances.
fn no_idle_budget() -> anyhow::Result<PluginHandle> {
    hostile_plugin(
        serde_json::Value::Null,
        Limits {
            max_idle_bytes: 0,
            ..Limits::default()
        },
    )
}

/// Idle instances are kept within the route's byte budget.
#[test]
fn the_idle_pool_is_bounded_in_bytes() -> anyhow::Result<()> {
    let none = no_idle_budget()?;
    let p = none.current().expect("plugin");
    p.route_batch(&[hostile_event("a", None)]);
    assert_eq!(p.idle(), (0, 0));
    let some = hostile_plugin(serde_json::Value::Null, Limits::default())?;
    let p = some.current().expect("plugin");
    p.route_batch(&[hostile_event("a", None)]);
    let (n, bytes) = p.idle();
    assert!(
        n >= 1 && bytes > 0 && bytes <= 64 << 20,
        "{n} instances, {bytes} bytes"
    );
    Ok(())
}

/// Warming makes instances up to the count asked, within the pool's
/// bounds (at most 8, and the byte budget).
#[test]
fn warming_fills_the_idle_pool_within_its_bounds() -> anyhow::Result<()> {
    let handle = hostile_plugin(serde_json::Value::Null, Limits::default())?;
    let p = handle.current().expect("plugin");
    assert_eq!(p.idle().0, 1, "the instance that answered describe is kept");
    p.warm(3);
    assert_eq!(p.idle().0, 3);
    p.warm(2);
    assert_eq!(p.idle().0, 3, "warming never drops instances");
    p.warm(100);
    assert_eq!(p.idle().0, 8, "at most 8 idle instances");
    let none = no_idle_budget()?;
    let p = none.current().expect("plugin");
    p.warm(4);
    assert_eq!(p.idle().0, 0, "no instance fits a zero byte budget");
    let answers = p.route_batch(&[hostile_event("a", None)]);
    assert!(matches!(answers.as_slice(), [Answer::Outcome(Ok(_))]));
    Ok(())
}

/// In a live relay a plugin has no world to reach: no file (not even
/// `/etc/hostname`), no directory listing, no socket (not even to the
/// database on loopback), no environment variables, no arguments. The
/// `hostile` plugin's `probe-world` mode tries each and publishes what it
/// got back.
#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_reaches_no_file_socket_or_environment() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (config, out) = file_sink_config(&db, "probe-world", "", "hostile", "r", FILE_ROUTE)?;
    insert_order_event(&db, "probe", serde_json::json!({"hostile": "probe-world"})).await?;
    // The relay has a rich environment of its own to leak.
    let relay = Relay::start(&config, &[("OUTROUTE_TEST_SECRET", "hunter2")])?;
    let sent = eventually(Duration::from_secs(30), || async {
        !file_sink_deliveries(&out).is_empty()
    })
    .await;
    assert!(sent, "{}", relay.log_text());
    let delivered = file_sink_deliveries(&out);
    let report: serde_json::Value = serde_json::from_slice(&delivered[0].payload)?;
    for probe in ["file", "dir", "socket"] {
        assert!(
            report[probe].get("error").is_some(),
            "the plugin reached the world through `{probe}`: {report}"
        );
    }
    assert_eq!(report["env"], serde_json::json!([]), "{report}");
    assert_eq!(report["args"], 0, "{report}");
    // No clock: it stands at the Unix epoch.
    assert_eq!(report["clock_ns"], "0", "{report}");
    // `wasi:random` is one fixed stream for every instance: a fresh
    // instance in `plugin test` draws what the live relay's drew.
    let random = report["random"].as_str().unwrap_or_default().to_string();
    assert!(!random.is_empty(), "{report}");
    let one = test_dir("probe-world").join("one.json");
    std::fs::write(
        &one,
        r#"{"aggregate_type": "order", "aggregate_id": "probe", "event_type": "order-updated", "payload": {"hostile": "probe-world"}}"#,
    )?;
    let hostile = plugin("hostile").display().to_string();
    let (code, out, err) = cli(&[
        "plugin",
        "test",
        &hostile,
        "--config",
        r#"{"sink": "file", "topic": "orders.{event_type}"}"#,
        "--event",
        one.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(code, 0, "{out}{err}");
    let tried: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(
        tried[0]["messages"][0]["payload"]["random"].as_str(),
        Some(random.as_str()),
        "the live relay drew {random}; plugin test drew otherwise: {out}"
    );
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// What a plugin returns is checked before anything is sent: it may not set
/// the relay's own headers (`ce_*` but `ce_dataschema`, `Nats-*`), nor go
/// over its route's `max_bytes_per_event` or `max_log_bytes_per_event`;
/// each such event fails alone, naming what it broke, while the rest go
/// out. A message without a key is keyed by its aggregate id, unless the
/// route says `default_key = "none"` (applied by reload).
#[tokio::test(flavor = "multi_thread")]
async fn a_plugins_messages_are_held_to_reserved_headers_and_route_limits() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let route = |default_key: &str| {
        format!(
            "{FILE_ROUTE}\nmax_bytes_per_event = 1048576\nmax_log_bytes_per_event = 4096\n\
             max_attempts = 1\ndefault_key = \"{default_key}\""
        )
    };
    let (config, out) = file_sink_config(
        &db,
        "plugin-output",
        "",
        "hostile",
        "r",
        &route("aggregate-id"),
    )?;
    let mut ids = std::collections::BTreeMap::new();
    for mode in [
        "spoof-header",
        "spoof-nats",
        "oversize",
        "big-log",
        "dataschema",
        "no-key",
        "plain",
    ] {
        ids.insert(
            mode,
            insert_order_event(
                &db,
                &format!("agg-{mode}"),
                serde_json::json!({"hostile": mode}),
            )
            .await?,
        );
    }
    let relay = Relay::start(&config, &[])?;
    let cfg = config.to_str().unwrap_or_default().to_string();
    let failed = || -> anyhow::Result<serde_json::Value> {
        let (_, out, _) = cli(&["failed", "list", "--json", "-c", &cfg])?;
        Ok(serde_json::from_str(&out)?)
    };
    let settled = eventually(Duration::from_secs(30), || async {
        file_sink_deliveries(&out).len() == 3
            && failed().is_ok_and(|f| f.as_array().is_some_and(|a| a.len() == 4))
    })
    .await;
    let failures = failed()?;
    assert!(settled, "{failures}\n{}", relay.log_text());
    let reason_of = |id: &str| -> String {
        failures
            .as_array()
            .and_then(|a| a.iter().find(|f| f["id"] == id))
            .and_then(|f| f["reason"].as_str())
            .unwrap_or_default()
            .to_string()
    };
    for (mode, needle) in [
        ("spoof-header", "header `ce_id` is reserved"),
        ("spoof-nats", "header `Nats-Msg-Id` is reserved"),
        (
            "oversize",
            "returned 2097152 payload bytes for one event (routes[].max_bytes_per_event = 1048576)",
        ),
        ("big-log", "4096 log bytes for one event"),
    ] {
        let r = reason_of(&ids[mode]);
        assert!(r.contains(needle), "{mode}: {r}");
    }
    let delivered = file_sink_deliveries(&out);
    let by_id = |id: &str| delivered.iter().find(|d| d.id() == id).cloned();
    let schema = by_id(&ids["dataschema"]).ok_or_else(|| anyhow::anyhow!("dataschema"))?;
    assert_eq!(
        schema.headers.get("ce_dataschema").map(String::as_str),
        Some("urn:test:order:1")
    );
    let keyless = by_id(&ids["no-key"]).ok_or_else(|| anyhow::anyhow!("no-key"))?;
    assert_eq!(keyless.key.as_deref(), Some("agg-no-key"), "{keyless:?}");
    assert!(by_id(&ids["plain"]).is_some());

    // default_key = "none": a keyless message goes out without a key.
    std::fs::write(
        &config,
        std::fs::read_to_string(&config)?
            .replace("default_key = \"aggregate-id\"", "default_key = \"none\""),
    )?;
    relay.reload();
    let reloaded = eventually(Duration::from_secs(15), || async {
        relay.log_text().contains("config reload applied")
    })
    .await;
    assert!(reloaded, "{}", relay.log_text());
    let unkeyed =
        insert_order_event(&db, "agg-unkeyed", serde_json::json!({"hostile": "no-key"})).await?;
    let sent = eventually(Duration::from_secs(20), || async {
        file_sink_deliveries(&out).iter().any(|d| d.id() == unkeyed)
    })
    .await;
    assert!(sent, "{}", relay.log_text());
    let delivered = file_sink_deliveries(&out);
    let d = delivered
        .iter()
        .find(|d| d.id() == unkeyed)
        .ok_or_else(|| anyhow::anyhow!("unkeyed"))?;
    assert_eq!(d.key, None, "{d:?}");
    drop(relay);
    db.drop_db().await;
    Ok(())
}

/// `outroute replay` says how it went in its exit status: 0 when every
/// selected event was re-published, non-zero (with the count on stderr and
/// each event's reason on stdout) when a plugin now refuses some of them.
#[tokio::test(flavor = "multi_thread")]
async fn replay_exits_non_zero_when_it_could_not_republish_every_selected_event()
-> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (config, out) = file_sink_config(&db, "replay-exit", "", "hostile", "r", FILE_ROUTE)?;
    // Two events that route themselves whatever the route's mode, one that
    // follows the route's mode.
    let kept = [
        insert_order_event(&db, "a", serde_json::json!({"hostile": "plain"})).await?,
        insert_order_event(&db, "b", serde_json::json!({"hostile": "plain"})).await?,
    ];
    let follower = insert_order_event(&db, "c", serde_json::json!({})).await?;
    let mut relay = Relay::start(&config, &[])?;
    assert!(
        file_sink_reaches(&out, 3, Duration::from_secs(30)).await,
        "{}",
        relay.log_text()
    );
    relay.terminate(Duration::from_secs(15));
    assert_eq!(db.published("").await, 3);
    let cfg = config.display().to_string();
    let (code, stdout, stderr) = cli(&["replay", "-c", &cfg, "--aggregate-type", "order"])?;
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("selected 3 published event(s); re-published 3"),
        "{stdout}"
    );

    // The route now rejects what it is not told otherwise.
    std::fs::write(
        &config,
        std::fs::read_to_string(&config)?.replace(
            "config = { sink = \"file\"",
            "config = { mode = \"reject\", sink = \"file\"",
        ),
    )?;
    let before = file_sink_deliveries(&out).len();
    let (code, stdout, stderr) = cli(&["replay", "-c", &cfg, "--aggregate-type", "order"])?;
    assert_ne!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("selected 3 published event(s); re-published 2; 1 could not be")
            && stdout.contains(&format!("{follower}: "))
            && stdout.contains("hostile plugin rejects this event"),
        "{stdout}"
    );
    assert!(
        stderr.contains("replay incomplete: 1 of 3 selected event(s) were not re-published"),
        "{stderr}"
    );
    let again: Vec<String> = file_sink_deliveries(&out)[before..]
        .iter()
        .map(|d| d.id().to_string())
        .collect();
    assert_eq!(again.len(), 2, "{again:?}");
    assert!(kept.iter().all(|k| again.contains(k)), "{again:?}");
    db.drop_db().await;
    Ok(())
}
