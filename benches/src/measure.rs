//! How figures are taken: process CPU and RSS from /proc, PostgreSQL's and
//! the brokers' CPU, percentiles, and Prometheus histogram buckets read
//! from the relay's /metrics.

use super::*;

/// CPU seconds (user + system) and peak RSS of a process.
pub(crate) fn proc_stats(pid: u32) -> (f64, f64) {
    let ticks = 100.0; // CLK_TCK on Linux
    let cpu = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let after = s.rsplit_once(')')?.1.split_whitespace().collect::<Vec<_>>();
            let ut: f64 = after.get(11)?.parse().ok()?;
            let st: f64 = after.get(12)?.parse().ok()?;
            Some((ut + st) / ticks)
        })
        .unwrap_or(0.0);
    let hwm = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1024.0;
    (cpu, hwm)
}

/// CPU seconds used so far by every process whose command line matches.
pub(crate) fn group_cpu(pattern: &str) -> f64 {
    std::process::Command::new("pgrep")
        .args(["-f", pattern])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.trim().parse::<u32>().ok())
                .map(|pid| proc_stats(pid).0)
                .sum()
        })
        .unwrap_or(0.0)
}

/// The TCP traffic of every established connection to a broker's `port`,
/// seen from the broker's side (`ss -ti`): per connection, bytes received,
/// bytes sent, data segments received. What a relay's requests cost the
/// broker to take in, by size and by number.
pub(crate) fn broker_traffic(port: u16) -> HashMap<String, [f64; 3]> {
    let out = std::process::Command::new("ss")
        .args(["-tinH", "state", "established"])
        .arg(format!("( sport = :{port} )"))
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let mut conns = HashMap::new();
    let mut name = None;
    for line in out.lines() {
        if !line.starts_with(char::is_whitespace) {
            // "0 0 127.0.0.1:9092 127.0.0.1:48716": the connection.
            name = line.split_whitespace().nth(3).map(str::to_string);
            continue;
        }
        let field = |key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        if let Some(peer) = name.take() {
            conns.insert(
                peer,
                [
                    field("bytes_received:"),
                    field("bytes_acked:"),
                    field("data_segs_in:"),
                ],
            );
        }
    }
    conns
}

/// Per-event figures of two [`broker_traffic`] readings over `n` events
/// (connections opened in between count from zero).
pub(crate) fn traffic_per_event(
    before: &HashMap<String, [f64; 3]>,
    after: &HashMap<String, [f64; 3]>,
    n: usize,
) -> Value {
    let mut sum = [0.0; 3];
    for (peer, a) in after {
        let b = before.get(peer).copied().unwrap_or_default();
        for i in 0..3 {
            sum[i] += (a[i] - b[i]).max(0.0);
        }
    }
    let per = |i: usize| sum[i] / n.max(1) as f64;
    json!({ "bytes_in": per(0), "bytes_out": per(1), "segments_in": per(2) })
}

/// The cost figures every drain reports for `n` events: CPU seconds of the
/// relay, PostgreSQL and the broker over a `window`-second run, per event
/// and in cores, the broker's traffic per event and the relay's peak RSS.
pub(crate) fn cost_figures(
    n: usize,
    window: f64,
    [relay, pg, broker]: [f64; 3],
    traffic: Value,
    rss: f64,
) -> serde_json::Map<String, Value> {
    let per = |s: f64| s * 1e6 / n.max(1) as f64;
    [
        ("cores", json!(relay / window)),
        ("postgres_cores", json!(pg / window)),
        ("relay_us_per_event", json!(per(relay))),
        ("postgres_us_per_event", json!(per(pg))),
        ("broker_us_per_event", json!(per(broker))),
        ("broker_traffic_per_event", traffic),
        ("peak_rss_mib", json!(rss)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

pub(crate) const GROUPS: [(&str, &str); 2] =
    [("tansu", "tansu broker"), ("nats-server", "nats-server")];

/// Fields of `/proc/<pid>/stat` after the command name.
pub(crate) fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        s.rsplit_once(')')?
            .1
            .split_whitespace()
            .map(str::to_string)
            .collect(),
    )
}

/// CPU seconds PostgreSQL has used so far: the postmaster, every live
/// child (backends, parallel workers, background processes), and every
/// child that already exited (the postmaster's cumulative children time,
/// which is where short-lived parallel query workers end up).
pub(crate) async fn pg_cpu(pool: &PgPool) -> f64 {
    let ticks = 100.0;
    let Ok(backend) = sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
    else {
        return 0.0;
    };
    let Some(postmaster) =
        stat_fields(backend as u32).and_then(|f| f.get(1).and_then(|p| p.parse::<u32>().ok()))
    else {
        return 0.0;
    };
    let num = |f: &[String], i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let own = stat_fields(postmaster)
        .map(|f| num(&f, 11) + num(&f, 12) + num(&f, 13) + num(&f, 14))
        .unwrap_or(0.0);
    let children: f64 = std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(stat_fields)
                .filter(|f| f.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(postmaster))
                .map(|f| num(&f, 11) + num(&f, 12))
                .sum()
        })
        .unwrap_or(0.0);
    (own + children) / ticks
}

/// "N events/s, C cores, peak RSS M MiB" of a drain's figures.
pub(crate) fn rate_line(d: &Value) -> String {
    let f = |k: &str| d[k].as_f64().unwrap_or(0.0);
    format!(
        "{:.0} events/s, {:.2} cores, peak RSS {:.0} MiB",
        f("events_per_s"),
        f("cores"),
        f("peak_rss_mib")
    )
}

/// "relay + PostgreSQL (+ broker) = total µs" CPU per event of a drain's
/// figures (the broker's share where the run measured it).
pub(crate) fn cpu_line(d: &Value) -> String {
    let f = |k: &str| d[k].as_f64().unwrap_or(0.0);
    let (relay, pg) = (f("relay_us_per_event"), f("postgres_us_per_event"));
    match d["broker_us_per_event"].as_f64() {
        Some(b) => format!(
            "relay {relay:.1} + PostgreSQL {pg:.1} + broker {b:.1} = {:.1} µs",
            relay + pg + b
        ),
        None => format!(
            "relay {relay:.1} + PostgreSQL {pg:.1} = {:.1} µs",
            relay + pg
        ),
    }
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The share of histogram `name`'s observations above bucket bound `le`
/// (seconds; must be one of its bounds): "p99 ≤ 2 ms" holds when the share
/// above 0.002 is at most 1 %.
pub(crate) fn bucket_share_above(metrics: &str, name: &str, le: f64) -> Option<f64> {
    let count = |bound: &str| {
        metrics
            .lines()
            .filter(|l| l.starts_with(&format!("{name}_bucket")))
            .filter(|l| l.split("le=\"").nth(1).and_then(|x| x.split('"').next()) == Some(bound))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let total = count("+Inf");
    (total > 0.0).then(|| 1.0 - count(&le.to_string()) / total)
}

/// The metrics text `after` with every histogram bucket less its count in
/// `before`: the histograms of what happened between the two reads (the
/// history run's measured window, not the history's own drain).
pub(crate) fn buckets_since(before: &str, after: &str) -> String {
    let earlier: HashMap<&str, f64> = before
        .lines()
        .filter(|l| l.contains("_bucket{"))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k, v.parse().ok()?))
        })
        .collect();
    after
        .lines()
        .map(|l| match l.rsplit_once(' ') {
            Some((k, v)) if l.contains("_bucket{") => {
                let v: f64 = v.parse().unwrap_or(0.0);
                format!("{k} {}", v - earlier.get(k).copied().unwrap_or(0.0))
            }
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Upper bound (ms) of the histogram bucket holding quantile `q`.
pub(crate) fn bucket_quantile(metrics: &str, name: &str, q: f64) -> Value {
    quantile_of(&buckets(metrics, name, ""), q)
}

/// Histogram `name`'s cumulative buckets `(le, count)`, summed over the
/// series whose labels contain `labels` (e.g. `source="a"`).
pub(crate) fn buckets(metrics: &str, name: &str, labels: &str) -> Vec<(f64, f64)> {
    let mut sums: Vec<(f64, f64)> = Vec::new();
    for (le, v) in metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}_bucket")) && l.contains(labels))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let v: f64 = l.rsplit(' ').next()?.parse().ok()?;
            Some((le, v))
        })
    {
        match sums.iter_mut().find(|(b, _)| *b == le) {
            Some(slot) => slot.1 += v,
            None => sums.push((le, v)),
        }
    }
    sums.sort_by(|a, b| a.0.total_cmp(&b.0));
    sums
}

/// Upper bound (ms) of the bucket of cumulative `buckets` holding
/// quantile `q`.
pub(crate) fn quantile_of(buckets: &[(f64, f64)], q: f64) -> Value {
    let total = buckets.last().map(|b| b.1).unwrap_or(0.0);
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| {
            if le.is_finite() {
                json!(le * 1000.0)
            } else {
                json!("inf")
            }
        })
        .unwrap_or(Value::Null)
}

/// Claim and pickup figures of a latency run, as table rows.
pub(crate) fn push_claim_figures(table: &mut Vec<(String, String)>, label: &str, l: &Value) {
    let rate = l["achieved_rate"].as_f64().unwrap_or(0.0).round();
    for (what, key) in [
        ("claim statement", "claim_ms_bucket"),
        ("batch (claimed→marked)", "batch_ms_bucket"),
        ("pickup (commit→claim)", "pickup_ms_bucket"),
    ] {
        table.push((
            format!("latency @{rate}/s {what}{label}"),
            format!(
                "p50 ≤ {} ms, p99 ≤ {} ms{}",
                l[key]["p50"],
                l[key]["p99"],
                match l[key]["share_over_2ms"].as_f64() {
                    Some(s) => format!(" ({:.2} % over 2 ms)", s * 100.0),
                    None => String::new(),
                }
            ),
        ));
    }
    table.push((
        format!("latency @{rate}/s producer transaction (BEGIN→COMMIT){label}"),
        format!(
            "p50 {:.1} ms, p99 {:.1} ms (inside lease mode's pickup: created_at is the start)",
            l["producer_tx_ms"]["p50"].as_f64().unwrap_or(0.0),
            l["producer_tx_ms"]["p99"].as_f64().unwrap_or(0.0)
        ),
    ));
}
