//! The shared set-up of every section: the benchmark database, the outbox
//! shapes and how they are filled, relay configs, topics.

use super::*;

/// How pre-filled tables are made (see `--aggregates`, `--analyse`).
#[derive(Clone, Copy)]
pub(crate) struct Fill {
    pub(crate) aggregates: usize,
    pub(crate) analyse: bool,
    pub(crate) ordering: &'static str,
}

/// The canonical table as `--marking` maps it (log-based capture reads the
/// table as it is).
pub(crate) fn canonical() -> Shape {
    if STAMP.load(Ordering::Relaxed) && MODE.load(Ordering::Relaxed) != 2 {
        Shape::CanonicalStamp
    } else {
        Shape::Canonical
    }
}

pub(crate) async fn bench_db() -> Result<TestDb> {
    match MODE.load(Ordering::Relaxed) {
        0 => TestDb::new().await,
        _ => TestDb::new_logical().await,
    }
}

/// `[store]` keys of the current mode.
pub(crate) fn store_keys() -> &'static str {
    match MODE.load(Ordering::Relaxed) {
        2 => "capture = \"logical\"",
        _ => "",
    }
}

/// `write_config` with the mode's `[store]` keys.
pub(crate) fn write_config_with(
    dir: &Path,
    store: &str,
    url: &str,
    relay: &str,
    body: &str,
) -> Result<PathBuf> {
    outroute_e2e::write_config_with(dir, url, store, relay, body)
}

/// The store URL the relay gets in the drain runs (`--pg-sslmode`).
pub(crate) fn relay_url(url: &str) -> String {
    match SSLMODE.get().and_then(|m| m.as_deref()) {
        Some(mode) if url.contains('?') => format!("{url}&sslmode={mode}"),
        Some(mode) => format!("{url}?sslmode={mode}"),
        None => url.to_string(),
    }
}

pub(crate) const PAYLOAD_BYTES: usize = 1024;

pub(crate) fn payload(i: usize) -> Value {
    // ~1 KB of JSON, v1 order shape (schema-gate upcasts it).
    let pad = "x".repeat(PAYLOAD_BYTES - 120);
    json!({"order_id": format!("o-{i}"), "customer": format!("c-{}", i % 977), "total": (i % 1000) as f64 + 0.5, "note": pad})
}

/// Insert `n` 1 KB events quickly (multi-row INSERTs from 4 connections),
/// one aggregate per event unless `--aggregates` says otherwise.
pub(crate) async fn fill(pool: &PgPool, n: usize) -> Result<()> {
    let how = FILL.get().copied().unwrap_or(Fill {
        aggregates: 0,
        analyse: false,
        ordering: "aggregate",
    });
    let per = n.div_ceil(4);
    let mut tasks = Vec::new();
    for w in 0..4 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let lo = w * per;
            let hi = ((w + 1) * per).min(n);
            let mut i = lo;
            while i < hi {
                let end = (i + 500).min(hi);
                let mut qb = sqlx::QueryBuilder::new(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) ",
                );
                qb.push_values(i..end, |mut b, k| {
                    b.push_bind(uuid::Uuid::new_v4())
                        .push_bind("order")
                        .push_bind(match how.aggregates {
                            0 => format!("o-{k}"),
                            a => format!("o-{}", k % a),
                        })
                        .push_bind("order-created")
                        .push_bind(payload(k));
                });
                qb.build().execute(&pool).await?;
                i = end;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    if how.analyse {
        sqlx::query("VACUUM ANALYZE outbox").execute(pool).await?;
    }
    Ok(())
}

pub(crate) fn file_sink_body(dir: &Path) -> String {
    format!(
        "[http]\nlisten = \"\"\n[sinks.file]\nkind = \"file\"\npath = \"{}\"\n[plugins.p]\npath = \"{}\"\n[[routes]]\nname = \"r\"\nplugin = \"p\"\nconfig = {{ sink = \"file\", topic = \"bench.{{event_type}}\" }}\nallow = {{ file = [\"**\"] }}\n",
        dir.join("out.jsonl").display(),
        plugin("order-router").display()
    )
}

/// Messages the file sink of [`file_sink_body`] in `dir` holds. A run
/// whose relay should have published checks it is not 0: a relay whose
/// every event failed (a route that may not use its sink) costs its
/// producers something else entirely.
pub(crate) fn file_sink_messages(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("out.jsonl"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

pub(crate) fn relay_body(sink: &str, t: &str, http: &str) -> String {
    let sink_cfg = match sink {
        "kafka" => format!(
            "[sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{KAFKA}\"\n{}",
            match LINGER_MS.get().copied().flatten() {
                Some(ms) => format!("linger_ms = {ms}\n"),
                None => String::new(),
            }
        ),
        _ => format!("[sinks.nats]\nkind = \"nats\"\nurl = \"{NATS}\"\n"),
    };
    let mut copies = String::new();
    for i in 1..=EXTRA_ROUTES.get().copied().unwrap_or(0) {
        copies.push_str(&format!(
            "[[routes]]\nname = \"copy{i}\"\nplugin = \"order-router\"\nconfig = {{ sink = \"{sink}\", topic = \"b{t}.c{i}.{{event_type}}\" }}\nallow = {{ {sink} = [\"b{t}.c{i}.*\"] }}\n"
        ));
    }
    if FAILING_ROUTE.get().copied().unwrap_or(false) {
        copies.push_str(&format!(
            "[plugins.hostile]\npath = \"{}\"\n[[routes]]\nname = \"payments\"\nplugin = \"hostile\"\n\
             config = {{ sink = \"{sink}\", topic = \"b{t}.pay.{{event_type}}\" }}\nallow = {{ {sink} = [\"b{t}.pay.*\"] }}\n\
             max_attempts = 3\nbackoff_min = \"1s\"\nbackoff_max = \"2s\"\n",
            plugin("hostile").display()
        ));
    }
    format!(
        "[http]\nlisten = \"{http}\"\n{sink_cfg}[plugins.order-router]\npath = \"{}\"\n[[routes]]\nname = \"orders\"\nplugin = \"order-router\"\nconfig = {{ sink = \"{sink}\", topic = \"b{t}.{{event_type}}\" }}\nallow = {{ {sink} = [\"b{t}.*\"] }}\n{copies}",
        plugin("order-router").display()
    )
}

/// Create the Kafka topic of the bench's route and of each extra route.
pub(crate) async fn create_topics(t: &str) -> Result<()> {
    create_topic(
        &format!("b{t}.order-created"),
        PARTITIONS.load(Ordering::Relaxed),
    )
    .await?;
    for i in 1..=EXTRA_ROUTES.get().copied().unwrap_or(0) {
        create_topic(&format!("b{t}.c{i}.order-created"), 3).await?;
    }
    if FAILING_ROUTE.get().copied().unwrap_or(false) {
        create_topic(&format!("b{t}.pay.order-created"), 3).await?;
    }
    Ok(())
}

/// outroute draining `n` pre-inserted events through order-router.
/// The outbox table a drain reads: the canonical one, or one of the seed
/// articles' existing shapes (given its lane index by `migrate --table`).
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Shape {
    /// The canonical table, pending rows listed in `outroute_queue` (the default).
    Canonical,
    /// The canonical table, rows deleted once published (`marking = delete`).
    CanonicalDelete,
    /// The canonical table, rows stamped by `published_at`.
    CanonicalStamp,
    TOutbox,
    OutboxEvents,
}

impl Shape {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Shape::Canonical => "outbox, marking queue",
            Shape::CanonicalDelete => "outbox, marking delete",
            Shape::CanonicalStamp => "outbox, marking published_at",
            Shape::TOutbox => "t_outbox",
            Shape::OutboxEvents => "outbox_events",
        }
    }

    pub(crate) fn mapping(self) -> String {
        // The canonical table's columns, mapped explicitly to pick a marking.
        let canonical = |marking: &str| {
            format!(
                "[store.table]\nname = \"outbox\"\nid = \"id\"\nsequence = \"seq\"\n\
                 aggregate_type = \"aggregate_type\"\naggregate_id = \"aggregate_id\"\n\
                 event_type = \"event_type\"\nevent_version = \"event_version\"\n\
                 payload = \"payload\"\nheaders = \"headers\"\ncreated_at = \"created_at\"\n\
                 attempts = \"attempts\"\nlast_error = \"last_error\"\nfailed_at = \"failed_at\"\n\
                 marking = {marking}\n"
            )
        };
        match self {
            Shape::Canonical => String::new(),
            Shape::CanonicalDelete => canonical("{ style = \"delete\" }"),
            Shape::CanonicalStamp => canonical("{ style = \"published_at\" }"),
            Shape::TOutbox => seed::T_OUTBOX_MAPPING.into(),
            Shape::OutboxEvents => seed::OUTBOX_EVENTS_MAPPING.into(),
        }
    }

    pub(crate) fn pending(self) -> &'static str {
        match self {
            Shape::Canonical => "SELECT count(*) FROM outroute_queue WHERE source = 'outbox'",
            Shape::CanonicalDelete => "SELECT count(*) FROM outbox",
            Shape::CanonicalStamp => "SELECT count(*) FROM outbox WHERE published_at IS NULL",
            Shape::TOutbox => "SELECT count(*) FROM t_outbox WHERE status = 'PENDING'",
            Shape::OutboxEvents => "SELECT count(*) FROM outbox_events WHERE published_at IS NULL",
        }
    }

    /// Create the existing table and fill it with `n` ~1 KB events, one
    /// aggregate each, in the seed articles' DDL.
    pub(crate) async fn create_and_fill(self, pool: &PgPool, n: usize) -> Result<()> {
        let (create, insert) = match self {
            Shape::Canonical | Shape::CanonicalDelete | Shape::CanonicalStamp => {
                return fill(pool, n).await;
            }
            Shape::TOutbox => (
                seed::T_OUTBOX_DDL,
                "INSERT INTO t_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                 SELECT gen_random_uuid()::text, 'order', 'o-' || g, 'order-created', \
                        json_build_object('order_id', 'o-' || g, 'total', g, 'note', repeat('x', 900))::text \
                 FROM generate_series($1::bigint, $2::bigint) g",
            ),
            Shape::OutboxEvents => (
                seed::OUTBOX_EVENTS_DDL,
                "INSERT INTO outbox_events (id, event_type, aggregate_id, payload) \
                 SELECT gen_random_uuid(), 'order-created', gen_random_uuid(), \
                        json_build_object('order_id', 'o-' || g, 'total', g, 'note', repeat('x', 900)) \
                 FROM generate_series($1::bigint, $2::bigint) g",
            ),
        };
        sqlx::query(create).execute(pool).await?;
        let mut done = 0;
        while done < n {
            let end = (done + 50_000).min(n);
            sqlx::query(insert)
                .bind(done as i64)
                .bind(end as i64 - 1)
                .execute(pool)
                .await?;
            done = end;
        }
        Ok(())
    }
}

/// After `outroute migrate`: `migrate --table` for a mapped table (its lane
/// index, or the pending queue's trigger and backfill).
pub(crate) fn migrate_table(shape: Shape, config: &Path) -> Result<()> {
    if shape != Shape::Canonical {
        let c = config.to_string_lossy().to_string();
        let (code, out, err) = outroute_e2e::cli(&["migrate", "--table", "-c", &c])?;
        anyhow::ensure!(code == 0, "migrate --table: {out}{err}");
    }
    Ok(())
}
