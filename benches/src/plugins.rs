//! Section 1: plugin cost per event on a warm instance (single call and a
//! batch of 100), for each example plugin.

use super::*;

pub(crate) fn event(i: usize, version: u32) -> Event {
    Event {
        id: uuid::Uuid::new_v4().to_string(),
        sequence: i as i64,
        aggregate_type: "order".into(),
        aggregate_id: format!("o-{}", i % 500),
        event_type: "order-created".into(),
        event_version: version,
        payload: payload(i).to_string().into_bytes(),
        headers: vec![(
            "traceparent".into(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        )],
        created_at: chrono::Utc::now(),
        attempts: 0,
    }
}

/// Per-event cost on a warm instance, single calls and batches of 100.
pub(crate) fn bench_plugins() -> Result<Value> {
    let rt = Runtime::new(Some(std::env::temp_dir().join("outroute-bench-cache")))?;
    let limits = Limits {
        cpu_budget: Duration::from_millis(100),
        ..Limits::default()
    };
    let mut out = serde_json::Map::new();
    let cases = [
        (
            "order-router",
            json!({"sink": "kafka", "topic": "orders.{event_type}"}),
            1u32,
            20_000usize,
        ),
        (
            "schema-gate",
            json!({"sink": "kafka", "topic": "orders.v2"}),
            1,
            20_000,
        ),
        (
            "python-router",
            json!({"sink": "kafka", "prefix": "orders"}),
            1,
            2_000,
        ),
        (
            "js-router",
            json!({"sink": "kafka", "prefix": "orders"}),
            1,
            2_000,
        ),
    ];
    for (name, config, version, n) in cases {
        let path = plugin(name);
        let handle = PluginHandle::load(&rt, &path, config, limits)?;
        let p = handle.current().context("plugin")?;
        let events: Vec<Event> = (0..100).map(|i| event(i, version)).collect();
        for e in &events {
            let r = p.route_batch(std::slice::from_ref(e));
            anyhow::ensure!(
                matches!(r[0], Answer::Outcome(Ok(_))),
                "{name} rejected the bench event: {:?}",
                r[0]
            );
        }
        let t = Instant::now();
        for i in 0..n {
            let _ = p.route_batch(std::slice::from_ref(&events[i % 100]));
        }
        out.insert(
            format!("{name} single"),
            json!(t.elapsed().as_secs_f64() * 1e6 / n as f64),
        );
        let t = Instant::now();
        for _ in 0..n / 100 {
            let _ = p.route_batch(&events);
        }
        out.insert(
            format!("{name} batch100"),
            json!(t.elapsed().as_secs_f64() * 1e6 / n as f64),
        );
    }
    Ok(Value::Object(out))
}
