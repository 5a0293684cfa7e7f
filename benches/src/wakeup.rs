//! What an idle relay costs the database while it waits for events
//! (statements per second by wake-up mode).

use super::*;

/// What waking the relay costs producers: commits/s of 8 writer connections
/// (one outbox insert per transaction) with no relay, with the relay polling
/// adaptively, and with a NOTIFY in every transaction (relay listening).
pub(crate) async fn wakeup_cost() -> Result<Value> {
    async fn writers(pool: &PgPool, notify: bool, secs: u64) -> Result<f64> {
        let end = Instant::now() + Duration::from_secs(secs);
        let mut tasks = Vec::new();
        for w in 0..8 {
            let pool = pool.clone();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < end {
                    let mut tx = pool.begin().await?;
                    sqlx::query("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'order-created', '{}')")
                        .bind(uuid::Uuid::new_v4())
                        .bind(format!("w{w}-{}", n % 50))
                        .execute(&mut *tx)
                        .await?;
                    if notify {
                        sqlx::query("NOTIFY outbox_new").execute(&mut *tx).await?;
                    }
                    tx.commit().await?;
                    n += 1;
                }
                anyhow::Ok(n)
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await??;
        }
        Ok(total as f64 / secs as f64)
    }
    let mut out = serde_json::Map::new();
    for (label, relay_mode) in [
        ("no relay", None),
        ("relay polling", Some(false)),
        ("NOTIFY per commit + LISTEN", Some(true)),
    ] {
        let db = bench_db().await?;
        let dir = test_dir("wakeup");
        let relay_cfg = if relay_mode == Some(true) {
            "notify_channel = \"outbox_new\""
        } else {
            ""
        };
        let config = write_config_with(
            &dir,
            store_keys(),
            &db.url,
            relay_cfg,
            &format!("{}{}", canonical().mapping(), file_sink_body(&dir)),
        )?;
        db.migrate(&config)?;
        migrate_table(canonical(), &config)?;
        let relay = match relay_mode {
            Some(_) => Some(Relay::start(&config, &[("RUST_LOG", "warn")])?),
            None => None,
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        let rate = writers(&db.pool, relay_mode == Some(true), 8).await?;
        out.insert(label.into(), json!(rate));
        if let Some(mut r) = relay {
            r.terminate(Duration::from_secs(15));
        }
        db.drop_db().await;
    }
    Ok(Value::Object(out))
}
