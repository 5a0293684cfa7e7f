//! Workloads and the invariant checker: business transactions that write
//! outbox rows (some rolled back on purpose), crashes at chosen points, and
//! [`check`], which every end-to-end test ends with: everything committed
//! delivered, nothing rolled back, each aggregate in order.

use super::*;

/// One event a producer committed.
#[derive(Debug, Clone)]
pub struct Expected {
    pub id: String,
    pub aggregate_id: String,
    pub seq: i64,
}

/// What the producers wrote.
#[derive(Debug, Default)]
pub struct Workload {
    pub committed: Vec<Expected>,
    pub rolled_back: Vec<String>,
}

/// Business transactions: each updates an order and inserts its event in
/// the same transaction; every `rollback_every`-th one rolls back. Four
/// producers run at once, each owning a quarter of the aggregates, so the
/// events of one aggregate are committed in order.
pub async fn produce(
    pool: &PgPool,
    prefix: &str,
    aggregates: usize,
    per_aggregate: usize,
    rollback_every: usize,
) -> Result<Workload> {
    let mut tasks = Vec::new();
    for worker in 0..4usize {
        let pool = pool.clone();
        let prefix = prefix.to_string();
        tasks.push(tokio::spawn(async move {
            let mut w = Workload::default();
            let mut n = 0usize;
            for round in 0..per_aggregate {
                for a in (worker..aggregates).step_by(4) {
                    n += 1;
                    let agg = format!("{prefix}-{a}");
                    let id = uuid::Uuid::new_v4().to_string();
                    let mut tx = pool.begin().await?;
                    sqlx::query(
                        "INSERT INTO orders (id, version) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET version = $2",
                    )
                    .bind(&agg)
                    .bind(round as i32)
                    .execute(&mut *tx)
                    .await?;
                    let seq: i64 = sqlx::query_scalar(
                        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) \
                         VALUES ($1::uuid, 'order', $2, 'order-updated', $3, $4) RETURNING seq",
                    )
                    .bind(&id)
                    .bind(&agg)
                    .bind(serde_json::json!({"order_id": agg, "version": round}))
                    .bind(serde_json::json!({"traceparent": format!("00-{:032x}-{:016x}-01", n + 1, round + 1)}))
                    .fetch_one(&mut *tx)
                    .await?;
                    if rollback_every > 0 && n.is_multiple_of(rollback_every) {
                        tx.rollback().await?;
                        w.rolled_back.push(id);
                    } else {
                        tx.commit().await?;
                        w.committed.push(Expected { id, aggregate_id: agg, seq });
                    }
                }
            }
            anyhow::Ok(w)
        }));
    }
    let mut all = Workload::default();
    for t in tasks {
        let w = t.await??;
        all.committed.extend(w.committed);
        all.rolled_back.extend(w.rolled_back);
    }
    all.committed.sort_by_key(|e| e.seq);
    Ok(all)
}

/// `per_aggregate` events for each of `aggregates` aggregates of type
/// `aggregate_type` (ids `<type>-<n>`, event type `paid`), one transaction
/// each, in order: events a route other than the order routes selects.
pub async fn insert_events(
    pool: &PgPool,
    aggregate_type: &str,
    aggregates: usize,
    per_aggregate: usize,
) -> Result<Workload> {
    let mut w = Workload::default();
    for round in 0..per_aggregate {
        for a in 0..aggregates {
            let id = uuid::Uuid::new_v4().to_string();
            let agg = format!("{aggregate_type}-{a}");
            let seq: i64 = sqlx::query_scalar(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1::uuid, $2, $3, 'paid', $4) RETURNING seq",
            )
            .bind(&id)
            .bind(aggregate_type)
            .bind(&agg)
            .bind(serde_json::json!({ "round": round }))
            .fetch_one(pool)
            .await?;
            w.committed.push(Expected {
                id,
                aggregate_id: agg,
                seq,
            });
        }
    }
    Ok(w)
}

/// The crash-point drill: for each point, `iterations` times, commit a
/// workload (prefix `<point>-<i>`), start the relay armed to abort at that
/// point (at its 1st, 2nd or 3rd pass) and check it did. Returns everything
/// committed (in outbox order) and the crash count; a clean relay must then
/// deliver all of it.
pub async fn crash_at_points(
    pool: &PgPool,
    config: &Path,
    points: &[&str],
    iterations: usize,
) -> Result<(Workload, usize)> {
    let mut all = Workload::default();
    let mut crashes = 0;
    for point in points {
        for i in 0..iterations {
            let w = produce(pool, &format!("{point}-{i}"), 20, 6, 9).await?;
            all.committed.extend(w.committed);
            all.rolled_back.extend(w.rolled_back);
            let hit = (1 + i % 3).to_string();
            let mut relay = Relay::start(
                config,
                &[
                    ("OUTROUTE_FAILPOINT", point),
                    ("OUTROUTE_FAILPOINT_HIT", &hit),
                ],
            )?;
            let status = relay.wait_exit(Duration::from_secs(60));
            let log = relay.log_text();
            if !(status.is_some_and(|s| !s.success())
                && log.contains(&format!("failpoint `{point}` reached")))
            {
                bail!(
                    "relay did not crash at {point} (is {} built with --features failpoints? scripts/test does that): {status:?}\n{log}",
                    bin().display()
                );
            }
            crashes += 1;
        }
    }
    all.committed.sort_by_key(|e| e.seq);
    Ok((all, crashes))
}

/// A message as a consumer saw it.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub topic: String,
    pub partition: i32,
    pub key: Option<String>,
    pub headers: BTreeMap<String, String>,
    pub payload: Vec<u8>,
    /// When the consumer read it.
    pub received_at: chrono::DateTime<chrono::Utc>,
}

impl Delivered {
    /// Commit (the row's `created_at`, header `ce_time`) to the consumer
    /// reading the message.
    pub fn latency(&self) -> Option<Duration> {
        let created = self.headers.get("ce_time")?;
        let created = chrono::DateTime::parse_from_rfc3339(created).ok()?;
        (self.received_at - created.with_timezone(&chrono::Utc))
            .to_std()
            .ok()
    }

    pub fn id(&self) -> &str {
        self.headers.get("ce_id").map(String::as_str).unwrap_or("")
    }
    pub fn aggregate(&self) -> &str {
        self.headers
            .get("ce_aggregateid")
            .map(String::as_str)
            .unwrap_or("")
    }
    /// The payload's `n` field (the tests' event numbers), or -1.
    pub fn number(&self) -> i64 {
        serde_json::from_slice::<serde_json::Value>(&self.payload)
            .ok()
            .and_then(|v| v["n"].as_i64())
            .unwrap_or(-1)
    }

    pub fn seq(&self) -> i64 {
        self.headers
            .get("ce_sequence")
            .and_then(|s| s.parse().ok())
            .unwrap_or(-1)
    }
}

/// Invariants every end-to-end test checks (seed article 000).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    pub committed: usize,
    pub delivered_unique: usize,
    /// Committed events never delivered.
    pub lost: usize,
    /// Delivered events that were never committed (rolled back or invented).
    pub phantom: usize,
    /// First deliveries of an aggregate's events out of outbox order.
    pub order_violations: usize,
    /// Extra deliveries of an already-delivered event id (allowed: at-least-once).
    pub duplicates: usize,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "committed={} delivered={} lost={} phantom={} order_violations={} duplicates={}",
            self.committed,
            self.delivered_unique,
            self.lost,
            self.phantom,
            self.order_violations,
            self.duplicates
        )
    }
}

impl Report {
    pub fn assert_clean(&self) {
        assert!(
            self.lost == 0 && self.phantom == 0 && self.order_violations == 0,
            "delivery invariants broken: {self}"
        );
    }
}

/// What a file sink wrote (JSON lines), as deliveries in write order.
pub fn file_sink_deliveries(path: &Path) -> Vec<Delivered> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| Delivered {
            topic: v["topic"].as_str().unwrap_or_default().to_string(),
            partition: 0,
            key: v["key"].as_str().map(str::to_string),
            headers: v["headers"]
                .as_object()
                .map(|h| {
                    h.iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                        .collect()
                })
                .unwrap_or_default(),
            payload: v["payload"].to_string().into_bytes(),
            received_at: chrono::Utc::now(),
        })
        .collect()
}

/// Check one destination's deliveries (in the order the consumer read them,
/// which per aggregate is partition/stream order).
pub fn check(w: &Workload, delivered: &[Delivered]) -> Report {
    let committed: HashMap<&str, &Expected> =
        w.committed.iter().map(|e| (e.id.as_str(), e)).collect();
    let mut seen: HashSet<&str> = HashSet::new();
    let mut last_seq: HashMap<&str, i64> = HashMap::new();
    let mut r = Report {
        committed: w.committed.len(),
        ..Report::default()
    };
    for d in delivered {
        let id = d.id();
        let Some(e) = committed.get(id) else {
            r.phantom += 1;
            continue;
        };
        if !seen.insert(id) {
            r.duplicates += 1;
            continue;
        }
        let last = last_seq.entry(e.aggregate_id.as_str()).or_insert(i64::MIN);
        if e.seq < *last {
            r.order_violations += 1;
        }
        *last = (*last).max(e.seq);
    }
    r.delivered_unique = seen.len();
    r.lost = w.committed.len() - seen.len();
    r
}
