//! MySQL/MariaDB table shapes and the plugin contract across databases
//! (issue 44): the seed article's Spring `t_outbox` relayed as it is
//! through a mapping, mapped tables marked by `delete` and `published_at`,
//! and one plugin routing the same events from a PostgreSQL and a MariaDB
//! outbox to identical messages.

use std::collections::BTreeMap;
use std::time::Duration;

use outroute_e2e::*;

/// Seed article 004's Spring `t_outbox`, as it is, mapped: `migrate
/// --table` adds only an invisible lane column and its index (the
/// producers' column-less `INSERT` and `SELECT *` still see eight
/// columns); every committed event goes out once in per-aggregate order
/// and its row turns `SENT`; rolled-back rows never exist; a row that is
/// not JSON or has no aggregate id fails with its reason and stays
/// `PENDING`. A table whose id is not unique, or that lacks a mapped
/// column, is refused by name.
#[tokio::test(flavor = "multi_thread")]
async fn the_seed_t_outbox_on_mysql_is_relayed_as_it_is() -> anyhow::Result<()> {
    use sqlx::Row;
    let db = MyDb::new().await?;
    sqlx::query(T_OUTBOX).execute(&db.pool).await?;
    let dir = test_dir("mysql-t-outbox");
    let out = dir.join("out.jsonl");
    let config = write_config_with(
        &dir,
        &db.url,
        T_OUTBOX_MAPPING,
        "lanes = 4\npoll_max = \"100ms\"",
        &file_route_body(&out),
    )?;
    let c = config.to_string_lossy().to_string();
    let (code, o, e) = cli(&["migrate", "--table", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    assert!(
        o.contains("VIRTUAL INVISIBLE") && o.contains("LOCK=NONE"),
        "{o}"
    );
    assert!(
        db.count("SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = 'outbox'")
            .await
            == 0,
        "the canonical table was created beside the mapped one"
    );
    // The producers' statements that name no columns are unchanged.
    sqlx::query(
        "INSERT INTO t_outbox VALUES ('legacy-1', 'order', 'legacy', 'order-created', '{}', 'PENDING', 0, NOW())",
    )
    .execute(&db.pool)
    .await?;
    let row = sqlx::query("SELECT * FROM t_outbox")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(row.columns().len(), 8);
    for (id, agg, payload) in [
        ("bad-json", Some("bad"), "not json"),
        ("no-agg", None, "{}"),
    ] {
        sqlx::query(
            "INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, status, retry_count, \
             create_time) VALUES (?, 'order', ?, 'order-created', ?, 'PENDING', 0, NOW())",
        )
        .bind(id)
        .bind(agg)
        .bind(payload)
        .execute(&db.pool)
        .await?;
    }
    let mut relay = Relay::start(&config, &[])?;
    let mut work = produce_t_outbox(&db.pool, "agg", 20, 6, 7).await?;
    assert!(!work.rolled_back.is_empty());
    work.committed.push(Expected {
        id: "legacy-1".into(),
        aggregate_id: "legacy".into(),
        seq: 0,
    });
    let pending = "SELECT count(*) FROM t_outbox WHERE status = 'PENDING'";
    let drained = eventually(Duration::from_secs(60), || async {
        db.count(pending).await == 2 && file_sink_deliveries(&out).len() >= work.committed.len()
    })
    .await;
    assert!(
        drained,
        "{} pending, {} delivered of {}\n{}",
        db.count(pending).await,
        file_sink_deliveries(&out).len(),
        work.committed.len(),
        relay.log_text()
    );
    let report = check(&work, &file_sink_deliveries(&out));
    println!("t_outbox: {report}");
    report.assert_clean();
    assert_eq!(
        db.count("SELECT count(*) FROM t_outbox WHERE status = 'SENT'")
            .await,
        work.committed.len() as i64
    );
    assert_eq!(
        db.count("SELECT count(*) FROM t_outbox").await,
        work.committed.len() as i64 + 2,
        "rolled-back rows are in the table"
    );
    let (code, list, e) = cli(&["failed", "list", "--json", "-c", &c])?;
    assert_eq!(code, 0, "{list}{e}");
    assert!(
        list.contains("bad-json") && list.contains("not valid JSON"),
        "{list}"
    );
    assert!(
        list.contains("no-agg") && list.contains("aggregate_id is NULL"),
        "{list}"
    );
    // The attempts mirror into the table's own counter.
    assert!(
        db.count("SELECT retry_count FROM t_outbox WHERE event_id = 'bad-json'")
            .await
            >= 1
    );
    let (code, out_s, e) = cli(&["status", "--json", "-c", &c])?;
    assert_eq!(code, 0, "{out_s}{e}");
    let v: serde_json::Value = serde_json::from_str(&out_s)?;
    let s = v.as_array().and_then(|a| a.first()).unwrap_or(&v);
    assert_eq!(s["failed"], 2, "{out_s}");
    // The two failed rows are still `PENDING` (no failed status mapped):
    // counted, and the oldest of them aged, through the lane index.
    assert_eq!(s["backlog"], 2, "{out_s}");
    assert!(
        s["oldest_pending_age_seconds"]
            .as_f64()
            .is_some_and(|a| a >= 0.0),
        "{out_s}"
    );
    relay.terminate(Duration::from_secs(15));

    // Refused by name: an id that is not unique, a column that is not there.
    sqlx::query(
        "CREATE TABLE t_dup (event_id varchar(64) NOT NULL, aggregate_type varchar(64), aggregate_id varchar(64), \
         event_type varchar(64), payload longtext, status varchar(16), retry_count int NOT NULL, create_time datetime)",
    )
    .execute(&db.pool)
    .await?;
    for (mapping, want) in [
        (
            T_OUTBOX_MAPPING.replace("\"t_outbox\"", "\"t_dup\""),
            "table.id: `event_id` must be NOT NULL and unique",
        ),
        (
            T_OUTBOX_MAPPING.replace("\"create_time\"", "\"created\""),
            "table.created_at = `created`",
        ),
    ] {
        let d = test_dir("mysql-t-outbox-refused");
        let cfg = write_config_with(&d, &db.url, &mapping, "lanes = 4", &file_route_body(&out))?;
        let (code, o, e) = cli(&["migrate", "--table", "-c", &cfg.to_string_lossy()])?;
        assert_ne!(code, 0, "{o}{e}");
        assert!(format!("{o}{e}").contains(want), "wanted `{want}`:\n{o}{e}");
    }
    db.drop_db().await;
    Ok(())
}

/// One plugin, built once, routes PostgreSQL and MariaDB events
/// identically: the same events (ids, aggregates, types, versions, payload
/// bytes, producer headers, times) in a PostgreSQL outbox and a MariaDB
/// outbox, relayed by one relay through one route, come out as the same
/// messages — topic, partition key, payload bytes and every header but
/// `ce_source`, which names the source.
#[tokio::test(flavor = "multi_thread")]
async fn one_plugin_routes_postgres_and_mariadb_events_identically() -> anyhow::Result<()> {
    let pg = TestDb::new().await?;
    let my = MyDb::new().await?;
    let dir = test_dir("mysql-same-plugin");
    let out = dir.join("out.jsonl");
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("outroute.toml");
    std::fs::write(
        &config,
        format!(
            "[relay]\ncache_dir = \"{cache}\"\npoll_max = \"100ms\"\n\
             [sinks.file]\nkind = \"file\"\npath = \"{out}\"\n[plugins.p]\npath = \"{plugin}\"\n\
             [sources.pg]\nurl = \"{pg}\"\n[sources.my]\nurl = \"{my}\"\n\
             [[routes]]\nname = \"orders\"\nplugin = \"p\"\nsources = [\"pg\", \"my\"]\n\
             config = {{ sink = \"file\", topic = \"orders.{{event_type}}\" }}\nallow = {{ file = [\"orders.*\"] }}\n",
            cache = std::env::temp_dir().join("outroute-test-cache").display(),
            out = out.display(),
            plugin = plugin("order-router").display(),
            pg = pg.url,
            my = my.url,
        ),
    )?;
    let c = config.to_string_lossy().to_string();
    let (code, o, e) = cli(&["migrate", "-c", &c])?;
    assert_eq!(code, 0, "{o}{e}");
    let n = 24;
    for i in 0..n {
        let id = uuid::Uuid::new_v4().to_string();
        let agg = format!("o-{}", i % 4);
        let ty = ["order-created", "order-paid", "order-shipped"][i % 3];
        let version = 1 + (i % 2) as i32;
        // Bytes a re-serialising store would change: spacing, key order,
        // a decimal with a trailing zero, escapes and non-ASCII text.
        let payload = format!(
            "{{ \"z\": 1, \"order_id\" : \"{agg}\", \"total\": 10.50, \"note\": \"caf\\u00e9 ☕ \\\"{i}\\\"\" }}"
        );
        let headers = format!(
            "{{\"traceparent\": \"00-{:032x}-{:016x}-01\", \"tenant\": \"acme\"}}",
            i + 1,
            i + 1
        );
        let at = format!("2026-12-01 10:00:{:02}.{:06}", i, i * 1001);
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, created_at) \
             VALUES ($1::uuid, 'order', $2, $3, $4, $5::json, $6::json, ($7::timestamp AT TIME ZONE 'UTC'))",
        )
        .bind(&id)
        .bind(&agg)
        .bind(ty)
        .bind(version)
        .bind(&payload)
        .bind(&headers)
        .bind(&at)
        .execute(&pg.pool)
        .await?;
        sqlx::query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, created_at) \
             VALUES (?, 'order', ?, ?, ?, ?, ?, ?)",
        )
        .bind(&id)
        .bind(&agg)
        .bind(ty)
        .bind(version)
        .bind(&payload)
        .bind(&headers)
        .bind(&at)
        .execute(&my.pool)
        .await?;
    }
    let mut relay = Relay::start(&config, &[])?;
    let all = eventually(Duration::from_secs(60), || async {
        file_sink_deliveries(&out).len() >= 2 * n
    })
    .await;
    let delivered = file_sink_deliveries(&out);
    assert!(
        all,
        "{} of {} delivered\n{}",
        delivered.len(),
        2 * n,
        relay.log_text()
    );
    relay.terminate(Duration::from_secs(15));
    let mut by_id: BTreeMap<String, Vec<&Delivered>> = BTreeMap::new();
    for d in &delivered {
        by_id.entry(d.id().to_string()).or_default().push(d);
    }
    assert_eq!(by_id.len(), n, "event ids");
    for (id, pair) in &by_id {
        let [a, b] = pair.as_slice() else {
            panic!("{id}: {} messages", pair.len());
        };
        let sources: Vec<&str> = pair
            .iter()
            .filter_map(|d| d.headers.get("ce_source").map(String::as_str))
            .collect();
        assert_ne!(sources.first(), sources.get(1), "{id}: one source twice");
        let strip = |d: &Delivered| {
            let mut h = d.headers.clone();
            h.remove("ce_source");
            h
        };
        assert_eq!(a.topic, b.topic, "{id}");
        assert_eq!(a.key, b.key, "{id}");
        assert_eq!(
            String::from_utf8_lossy(&a.payload),
            String::from_utf8_lossy(&b.payload),
            "{id}"
        );
        assert_eq!(strip(a), strip(b), "{id}");
    }
    pg.drop_db().await;
    my.drop_db().await;
    Ok(())
}

/// The other markings on a mapped MySQL table, with an AUTO_INCREMENT
/// column mapped as `sequence`: `delete` (a published row leaves the
/// table) and `published_at` (NULL while pending, stamped when
/// published). Every event goes out once in per-aggregate order, and the
/// table says so afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn mapped_mysql_tables_marked_by_delete_or_published_at() -> anyhow::Result<()> {
    for (marking, done) in [
        (
            "{ style = \"delete\" }",
            "SELECT count(*) = 0 FROM app_events",
        ),
        (
            "{ style = \"published_at\", column = \"sent_at\" }",
            "SELECT count(*) = 0 FROM app_events WHERE sent_at IS NULL",
        ),
    ] {
        let db = MyDb::new().await?;
        sqlx::query(
            "CREATE TABLE app_events (n BIGINT NOT NULL AUTO_INCREMENT UNIQUE, event_id CHAR(36) NOT NULL PRIMARY KEY, \
             agg VARCHAR(64) NOT NULL, kind VARCHAR(64) NOT NULL, body TEXT NOT NULL, \
             at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), sent_at DATETIME(6) NULL) ENGINE = InnoDB",
        )
        .execute(&db.pool)
        .await?;
        let dir = test_dir("mysql-markings");
        let out = dir.join("out.jsonl");
        let mapping = format!(
            "[store.table]\nname = \"app_events\"\nid = \"event_id\"\nsequence = \"n\"\naggregate_type_value = \"order\"\n\
             aggregate_id = \"agg\"\nevent_type = \"kind\"\npayload = \"body\"\ncreated_at = \"at\"\nmarking = {marking}"
        );
        let config = write_config_with(
            &dir,
            &db.url,
            &mapping,
            "lanes = 4\npoll_max = \"100ms\"",
            &file_route_body(&out),
        )?;
        let c = config.to_string_lossy().to_string();
        let (code, o, e) = cli(&["migrate", "--table", "-c", &c])?;
        assert_eq!(code, 0, "{marking}: {o}{e}");
        let mut relay = Relay::start(&config, &[])?;
        let mut work = Workload::default();
        for i in 0..40usize {
            let id = uuid::Uuid::new_v4().to_string();
            let agg = format!("a-{}", i % 5);
            let seq = sqlx::query(
                "INSERT INTO app_events (event_id, agg, kind, body) VALUES (?, ?, 'order-updated', ?)",
            )
            .bind(&id)
            .bind(&agg)
            .bind(format!("{{\"i\": {i}}}"))
            .execute(&db.pool)
            .await?
            .last_insert_id() as i64;
            work.committed.push(Expected {
                id,
                aggregate_id: agg,
                seq,
            });
        }
        let finished = eventually(Duration::from_secs(30), || async {
            db.count(done).await == 1 && file_sink_deliveries(&out).len() >= work.committed.len()
        })
        .await;
        assert!(
            finished,
            "{marking}: not all published\n{}",
            relay.log_text()
        );
        let report = check(&work, &file_sink_deliveries(&out));
        println!("{marking}: {report}");
        report.assert_clean();
        relay.terminate(Duration::from_secs(15));
        db.drop_db().await;
    }
    Ok(())
}
