//! The operator console in a real browser: Debian's Chromium, headless,
//! driven by Playwright (`tests/browser/console.py`, installed by
//! `scripts/deps`) against a real relay on PostgreSQL, tansu and NATS.
//!
//! The scene: route `orders` (owner orders-team, Kafka) with two events
//! failed for good (their topic was not allowed; the allow-list is then
//! fixed by a reload), route `risky` (owner billing, NATS) quarantined by
//! an event whose plugin call loops, and events flowing all along. The
//! browser then signs in as an operator, watches the overview's chart move,
//! finds a failed event by owner, retries it and sees it published,
//! discards the looping event and resumes the quarantined route, uploads
//! a candidate plugin and sees how it would route the live events, compares
//! the running shadow's differing messages side by side and promotes it; signs in
//! as team billing and can neither see nor act on orders-team's events (the
//! pages and the requests behind them); signs in as a viewer and sees no
//! payload byte. Afterwards the store's audit log holds exactly the
//! operator's five actions, and the retried event reached Kafka.
//!
//! Screenshots of each page go to the test's folder (printed), or to
//! `OUTROUTE_CONSOLE_SHOTS` (the README's come from there).

use std::time::Duration;

use outroute_e2e::*;

const OPERATOR: &str = "op-token-5c1d0a77e2f94b10";
const VIEWER: &str = "viewer-token-8a2b6c4d1e3f5a70";
const BILLING: &str = "billing-token-3f9e1d7c5b2a4e60";

fn config_body(http: &str, t: &str, orders_allow: &str) -> String {
    format!(
        "[http]\nlisten = \"{http}\"\n\
         [http.console.tokens.ops]\nrole = \"operator\"\ntoken = \"{OPERATOR}\"\n\
         [http.console.tokens.auditor]\nrole = \"viewer\"\ntoken = \"{VIEWER}\"\n\
         [http.console.tokens.billing-ops]\nrole = \"operator\"\nteam = \"billing\"\ntoken = \"{BILLING}\"\n\
         [sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{KAFKA}\"\n\
         [sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\n\
         create_stream = {{ name = \"CON{t}\", subjects = [\"con{t}.bad.>\"] }}\n\
         [plugins.p]\npath = \"{router}\"\nshadow = \"{redact}\"\n\
         shadow_config = {{ sink = \"kafka\", topic = \"con{t}.{{event_type}}\", paths = [\"n\"] }}\n\
         [plugins.h]\npath = \"{hostile}\"\n\
         [[routes]]\nname = \"orders\"\nplugin = \"p\"\naggregate_types = [\"order\"]\nowner = \"orders-team\"\n\
         config = {{ sink = \"kafka\", topic = \"con{t}.{{event_type}}\" }}\nallow = {{ kafka = [\"{orders_allow}\"] }}\n\
         [[routes]]\nname = \"risky\"\nplugin = \"h\"\naggregate_types = [\"bad\"]\nowner = \"billing\"\n\
         config = {{ sink = \"nats\", topic = \"con{t}.bad.{{event_type}}\" }}\nallow = {{ nats = [\"con{t}.bad.*\"] }}\n\
         cpu_budget = \"20ms\"\nmemory_mib = 32\nmax_attempts = 1\nquarantine_after = 1\nquarantine_probe_interval = \"1h\"\n",
        router = plugin("order-router").display(),
        hostile = plugin("hostile").display(),
        redact = plugin("pii-redact").display(),
    )
}

async fn insert(
    db: &TestDb,
    aggregate_type: &str,
    aggregate: &str,
    event_type: &str,
    payload: serde_json::Value,
) -> anyhow::Result<String> {
    let id = uuid::Uuid::new_v4().to_string();
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1::uuid, $2, $3, $4, $5)",
    )
    .bind(&id)
    .bind(aggregate_type)
    .bind(aggregate)
    .bind(event_type)
    .bind(payload)
    .execute(&db.pool)
    .await?;
    Ok(id)
}

async fn failed_for_good(db: &TestDb, id: &str) -> bool {
    sqlx::query_scalar::<_, bool>(
        "SELECT failed_at IS NOT NULL FROM outroute_event_state WHERE event_id = $1",
    )
    .bind(id)
    .fetch_optional(&db.pool)
    .await
    .ok()
    .flatten()
    .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_console_in_a_browser_scopes_acts_and_audits() -> anyhow::Result<()> {
    let python = dirs_tools().join("browser/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/deps (it installs Playwright and Chromium)",
        python.display()
    );
    let db = TestDb::new().await?;
    let t = tag();
    create_topic(&format!("con{t}.order-updated"), 1).await?;
    create_topic(&format!("con{t}.poison"), 1).await?;
    let dir = test_dir("console");
    let http = free_addr();
    let config = write_config(
        &dir,
        &db.url,
        "lease_ttl = \"3s\"",
        &config_body(&http, &t, &format!("con{t}.order-updated")),
    )?;
    db.migrate(&config)?;
    let poison_mark = format!("poison-{t}-retried");
    let kept_mark = format!("kept-{t}-secret");
    let poison = insert(
        &db,
        "order",
        "o-1",
        "poison",
        serde_json::json!({ "mark": poison_mark }),
    )
    .await?;
    let kept = insert(
        &db,
        "order",
        "o-2",
        "poison",
        serde_json::json!({ "mark": kept_mark }),
    )
    .await?;
    let hostile = insert(
        &db,
        "bad",
        "b-1",
        "updated",
        serde_json::json!({ "hostile": "loop" }),
    )
    .await?;

    let mut relay = Relay::start(&config, &[])?;
    let scene = eventually(Duration::from_secs(60), || async {
        let quarantined: Option<bool> = sqlx::query_scalar(
            "SELECT quarantined_since IS NOT NULL FROM outroute_route_counts WHERE route = 'risky'",
        )
        .fetch_optional(&db.pool)
        .await
        .ok()
        .flatten();
        failed_for_good(&db, &poison).await
            && failed_for_good(&db, &kept).await
            && failed_for_good(&db, &hostile).await
            && quarantined == Some(true)
    })
    .await;
    assert!(scene, "the scene did not come about\n{}", relay.log_text());
    // The cause is fixed: every topic of the route is allowed now.
    std::fs::write(
        &config,
        std::fs::read_to_string(&config)?.replace(
            &format!("\"con{t}.order-updated\"]"),
            &format!("\"con{t}.*\"]"),
        ),
    )?;
    relay.reload();
    let reloaded = eventually(Duration::from_secs(30), || async {
        relay.log_text().contains("config reload applied")
    })
    .await;
    assert!(reloaded, "{}", relay.log_text());

    // Events flow while the browser looks.
    let flowing = {
        let pool = db.pool.clone();
        tokio::spawn(async move {
            let mut i = 0u64;
            loop {
                let _ = sqlx::query(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                     VALUES (gen_random_uuid(), 'order', $1, 'order-updated', '{\"n\": 1}'::jsonb)",
                )
                .bind(format!("flow-{}", i % 50))
                .execute(&pool)
                .await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    let shots = std::env::var("OUTROUTE_CONSOLE_SHOTS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| dir.join("shots"));
    std::fs::create_dir_all(&shots)?;
    let run = {
        let (python, shots) = (python.clone(), shots.clone());
        let env: Vec<(&str, String)> = vec![
            ("CONSOLE", format!("http://{http}")),
            ("OPERATOR_TOKEN", OPERATOR.into()),
            ("VIEWER_TOKEN", VIEWER.into()),
            ("BILLING_TOKEN", BILLING.into()),
            ("POISON_ID", poison.clone()),
            ("POISON_MARK", poison_mark.clone()),
            ("KEPT_ID", kept.clone()),
            ("KEPT_MARK", kept_mark.clone()),
            ("HOSTILE_ID", hostile.clone()),
            ("CANDIDATE", plugin("pii-redact").display().to_string()),
            (
                "CANDIDATE_CONFIG",
                format!(
                    "{{\"sink\": \"kafka\", \"topic\": \"con{t}.{{event_type}}\", \"paths\": [\"n\"]}}"
                ),
            ),
            ("SHOTS", shots.display().to_string()),
        ];
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(python)
                .arg(workspace().join("tests/browser/console.py"))
                .envs(env)
                .output()
        })
        .await??
    };
    flowing.abort();
    let out = String::from_utf8_lossy(&run.stdout);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "the browser test failed:\n{out}\n{err}\nrelay log:\n{}",
        relay.log_text()
    );
    println!("{out}screenshots: {}", shots.display());

    // The retried event reached Kafka.
    let delivered = consume_kafka(&format!("con{t}.poison"), 1, 1, Duration::from_secs(30))?;
    assert!(
        delivered.iter().any(|d| d.id() == poison),
        "the retried event was not published: {delivered:?}"
    );
    // The audit log: the operator's five actions, nothing from the others
    // (their attempts were refused before anything was done).
    let audit: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT who, action, subject FROM outroute_audit WHERE source = 'default' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await?;
    assert_eq!(
        audit,
        vec![
            ("ops".to_string(), "retry".to_string(), poison.clone()),
            ("ops".to_string(), "discard".to_string(), hostile.clone()),
            ("ops".to_string(), "resume".to_string(), "risky".to_string()),
            ("ops".to_string(), "try".to_string(), "orders".to_string()),
            ("ops".to_string(), "promote".to_string(), "p".to_string()),
        ],
        "{}",
        relay.log_text()
    );
    assert!(
        failed_for_good(&db, &kept).await,
        "the kept event is still failed"
    );
    // The promoted shadow is the plugin's path now, in the file.
    let text = std::fs::read_to_string(&config)?;
    assert!(
        text.contains(&plugin("pii-redact").display().to_string()) && !text.contains("shadow ="),
        "{text}"
    );
    let log = relay.log_text();
    assert!(
        log.contains("console action") && log.contains("who=ops"),
        "the relay's log records the actions: {log}"
    );
    assert!(
        !log.contains(OPERATOR) && !log.contains(BILLING) && !log.contains(VIEWER),
        "a token reached the log"
    );
    relay.terminate(Duration::from_secs(10));
    Ok(())
}

/// The tools directory `scripts/deps` installs into.
fn dirs_tools() -> std::path::PathBuf {
    std::path::PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
        .join(".cache/outroute/tools")
}
