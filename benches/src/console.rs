//! Section `console`: what the operator console costs the relay. One source
//! at a steady `rate` events/s to Kafka; the relay's CPU over three windows
//! of `secs` each: the console off, the console on with nobody signed in,
//! and the console on with one browser (headless Chromium through the
//! tests' Playwright, `scripts/deps`) holding the overview open — its
//! live figures fetched every 5 s.

use super::*;

const TOKEN: &str = "bench-console-token-0123456789";

/// Keep the overview open in a browser until killed.
const BROWSER: &str = r##"
import os, time
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    b = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"])
    page = b.new_page()
    page.goto(os.environ["CONSOLE"] + "/console/login")
    page.fill("input[name=token]", os.environ["TOKEN"])
    page.click("button[type=submit]")
    page.wait_for_selector("#live")
    print("overview open", flush=True)
    while True:
        time.sleep(1)
"##;

/// The relay's CPU share (% of one core) over `secs`.
async fn cpu_over(pid: u32, secs: u64) -> f64 {
    let before = proc_stats(pid).0;
    tokio::time::sleep(Duration::from_secs(secs)).await;
    (proc_stats(pid).0 - before) / secs as f64 * 100.0
}

pub(crate) async fn console_cost(secs: u64, rate: u64) -> Result<Value> {
    let python = PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
        .join(".cache/outroute/tools/browser/bin/python");
    anyhow::ensure!(
        python.exists(),
        "{} is missing: run scripts/deps",
        python.display()
    );
    let db = bench_db().await?;
    let t = tag();
    create_topics(&t).await?;
    let dir = test_dir("console-cost");
    let http = outroute_e2e::free_addr();
    let body = relay_body("kafka", &t, &http);
    let with_console =
        format!("{body}[http.console.tokens.ops]\nrole = \"operator\"\ntoken = \"{TOKEN}\"\n");
    let configs = [("off", body), ("on", with_console)];
    // One writer, paced: `rate / 100` rows every 10 ms.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (pool, stop) = (db.pool.clone(), stop.clone());
        let per_tick = (rate / 100).max(1) as i64;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            let mut n = 0i64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let _ = sqlx::query(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                     SELECT gen_random_uuid(), 'order', 'o-' || (g % 1000), 'order-created', '{\"n\": 1}'::jsonb \
                     FROM generate_series($1::bigint, $2::bigint) g",
                )
                .bind(n)
                .bind(n + per_tick - 1)
                .execute(&pool)
                .await;
                n += per_tick;
            }
        })
    };
    let mut figures = serde_json::Map::new();
    for (i, (name, cfg_body)) in configs.iter().enumerate() {
        let config = write_config_with(
            &dir,
            store_keys(),
            &db.url,
            "",
            &format!("{}{cfg_body}", canonical().mapping()),
        )?;
        if i == 0 {
            db.migrate(&config)?;
            migrate_table(canonical(), &config)?;
        }
        let mut relay = Relay::start(&config, &[("RUST_LOG", "warn")])?;
        let pid = relay.child.id();
        tokio::time::sleep(Duration::from_secs(5)).await;
        let nobody = cpu_over(pid, secs).await;
        eprintln!("   console {name}, nobody looking: relay {nobody:.1} % of a core");
        figures.insert(format!("relay_cpu_pct_console_{name}"), json!(nobody));
        if *name == "on" {
            let mut browser = std::process::Command::new(&python)
                .args(["-c", BROWSER])
                .env("CONSOLE", format!("http://{http}"))
                .env("TOKEN", TOKEN)
                .stdout(std::process::Stdio::piped())
                .spawn()?;
            // Signed in and on the overview before the window starts.
            tokio::time::sleep(Duration::from_secs(8)).await;
            let open = cpu_over(pid, secs).await;
            let _ = browser.kill();
            let _ = browser.wait();
            eprintln!("   console on, a browser on the overview: relay {open:.1} % of a core");
            figures.insert("relay_cpu_pct_browser_open".into(), json!(open));
        }
        relay.terminate(Duration::from_secs(15));
    }
    stop.store(true, Ordering::Relaxed);
    let _ = writer.await;
    figures.insert("rate".into(), json!(rate));
    figures.insert("secs".into(), json!(secs));
    Ok(Value::Object(figures))
}

pub(crate) fn console_rows(c: &Value) -> Vec<(String, String)> {
    let f = |k: &str| c[k].as_f64().unwrap_or(0.0);
    vec![(
        format!("console @{}/s, relay CPU", c["rate"]),
        format!(
            "off {:.1} %, on (nobody) {:.1} %, on (browser on overview) {:.1} % of a core",
            f("relay_cpu_pct_console_off"),
            f("relay_cpu_pct_console_on"),
            f("relay_cpu_pct_browser_open"),
        ),
    )]
}
