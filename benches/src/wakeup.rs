//! What the relay costs producers: commits/s of 8 writers with no relay, a
//! relay draining what they write (busy), and a relay asleep beside writers
//! that commit business rows only (idle: what a sleeping source costs its
//! database's other work).

use super::*;

/// What waking the relay costs producers: commits/s of 8 writer connections
/// (one outbox insert per transaction) with no relay, with the relay polling
/// adaptively, and with a NOTIFY in every transaction (relay listening).
pub(crate) async fn wakeup_cost() -> Result<Value> {
    async fn writers(pool: &PgPool, notify: bool, outbox: bool, secs: u64) -> Result<f64> {
        let end = Instant::now() + Duration::from_secs(secs);
        let mut tasks = Vec::new();
        for w in 0..8 {
            let pool = pool.clone();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < end {
                    let mut tx = pool.begin().await?;
                    sqlx::query(if outbox {
                        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'order-created', '{}')"
                    } else {
                        "INSERT INTO business (id, note) VALUES ($1, $2)"
                    })
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
    for (label, relay_mode, outbox) in [
        ("no relay", None, true),
        ("relay polling", Some(false), true),
        ("NOTIFY per commit + LISTEN", Some(true), true),
        ("idle: business rows, no relay", None, false),
        ("idle: business rows, relay asleep", Some(false), false),
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
        sqlx::query("CREATE TABLE business (id uuid PRIMARY KEY, note text)")
            .execute(&db.pool)
            .await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        if relay.is_some() && !outbox {
            // Asleep: the relay's record in the wake table, and a moment
            // more for its last claims.
            let until = Instant::now() + Duration::from_secs(30);
            while Instant::now() < until {
                let asleep: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM outroute_wake WHERE asleep")
                        .fetch_one(&db.pool)
                        .await
                        .unwrap_or(0);
                if asleep > 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        let rate = writers(&db.pool, relay_mode == Some(true), outbox, 8).await?;
        out.insert(label.into(), json!(rate));
        if let Some(mut r) = relay {
            r.terminate(Duration::from_secs(15));
        }
        db.drop_db().await;
    }
    Ok(Value::Object(out))
}
