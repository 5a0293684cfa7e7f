//! The monitoring shipped in `examples/monitoring`: the alerting rules pass
//! `promtool check rules` and their own unit tests (`promtool test rules`,
//! cases in `outroute-alerts.test.yml`), and every series and label the
//! rules and the Grafana dashboard query is one the relay exports — a
//! renamed metric or label would leave an alert that never fires and a
//! panel that stays empty, silently.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use outroute::metrics::{ALL, Kind};
use outroute_e2e::workspace;

fn monitoring() -> PathBuf {
    workspace().join("examples/monitoring")
}

/// promtool, unpacked from Debian's prometheus package by `scripts/deps`.
fn promtool() -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(".cache/outroute/tools/bin/promtool")
}

#[test]
fn the_alerting_rules_pass_promtool_and_their_unit_tests() {
    for args in [
        ["check", "rules", "outroute-alerts.yml"],
        ["test", "rules", "outroute-alerts.test.yml"],
    ] {
        let out = Command::new(promtool())
            .args(args)
            .current_dir(monitoring())
            .output()
            .unwrap_or_else(|e| panic!("{} (run scripts/deps): {e}", promtool().display()));
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The `expr:` of every rule: one line, or a folded block (`expr: >` and
/// the more indented lines under it). The file is ours and written in
/// those two forms; a YAML parser would be a dependency for this alone.
fn rule_exprs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let Some((indent, rest)) = line.split_once("expr:") else {
            continue;
        };
        if !indent.trim().is_empty() {
            continue;
        }
        let rest = rest.trim();
        if rest == ">" {
            let mut e = String::new();
            while let Some(next) = lines.peek() {
                if next.len() - next.trim_start().len() <= indent.len() || next.trim().is_empty() {
                    break;
                }
                e.push_str(next.trim());
                e.push(' ');
                lines.next();
            }
            out.push(e);
        } else {
            out.push(rest.to_string());
        }
    }
    out
}

/// The series (by exported name; a histogram's `_bucket` is its name) and
/// the labels an expression uses: label matchers of a selector and
/// `by (…)`/`on (…)` groupings.
fn used(expr: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut series = BTreeSet::new();
    for (i, _) in expr.match_indices("outroute_") {
        series.insert(ident(&expr[i..]));
    }
    let mut labels = BTreeSet::new();
    for (open, close) in [('{', '}'), ('(', ')')] {
        for (i, _) in expr.match_indices(open) {
            let inner = &expr[i + 1..];
            let Some(end) = inner.find(close) else {
                continue;
            };
            let inner = &inner[..end];
            let before = expr[..i].trim_end();
            if open == '{' {
                // `name{label="v", other=~"x"}`
                for m in inner.split(',') {
                    let key = ident(m.trim());
                    if !key.is_empty() && m.contains('=') {
                        labels.insert(key);
                    }
                }
            } else if before.ends_with(" by") || before.ends_with(" on") || before.ends_with("(by")
            {
                for l in inner.split(',') {
                    labels.insert(ident(l.trim()));
                }
            }
        }
    }
    (series, labels)
}

#[test]
fn rules_and_dashboard_use_only_series_and_labels_the_relay_exports() {
    let rules =
        std::fs::read_to_string(monitoring().join("outroute-alerts.yml")).unwrap_or_default();
    let mut exprs = rule_exprs(&rules);
    assert!(exprs.len() >= 10, "found {} rule expressions", exprs.len());
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(monitoring().join("outroute-dashboard.json")).unwrap_or_default(),
    )
    .expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().cloned().unwrap_or_default();
    let before = exprs.len();
    for p in &panels {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                exprs.push(e.to_string());
            }
        }
    }
    assert!(
        exprs.len() - before >= 20,
        "dashboard queries: {}",
        exprs.len() - before
    );
    let mut seen = BTreeSet::new();
    for e in &exprs {
        let (series, labels) = used(e);
        assert!(!series.is_empty(), "no outroute series in `{e}`");
        let mut allowed: BTreeSet<&str> = BTreeSet::new();
        for name in &series {
            let known = ALL.iter().find(|s| {
                s.name == name
                    || (s.kind == Kind::Histogram
                        && ["_bucket", "_sum", "_count"]
                            .iter()
                            .any(|suffix| format!("{}{suffix}", s.name) == *name))
            });
            let s = known
                .unwrap_or_else(|| panic!("`{name}` in `{e}` is not a series the relay exports"));
            seen.insert(s.name);
            allowed.extend(s.labels.iter().copied());
            if s.kind == Kind::Histogram {
                allowed.insert("le");
            }
        }
        for l in &labels {
            assert!(
                allowed.contains(l.as_str()),
                "label `{l}` in `{e}` is not one of its series' labels ({allowed:?})"
            );
        }
    }
    // What the go-live checklist asks operators to watch is on it.
    for must in [
        "outroute_backlog_events",
        "outroute_oldest_pending_age_seconds",
        "outroute_failed_events",
        "outroute_route_quarantined",
        "outroute_slot_lag_bytes",
        "outroute_source_up",
        "outroute_sink_up",
        "outroute_dead_letters_total",
    ] {
        assert!(seen.contains(must), "nothing watches {must}");
    }
}

#[test]
fn the_expression_reader_sees_series_and_labels() {
    let (s, l) = used(
        "sum by (source, route) (rate(outroute_x_total{kind=\"a\",sink=~\"k\"}[5m])) unless on (source) outroute_y",
    );
    assert_eq!(
        s.into_iter().collect::<Vec<_>>(),
        vec!["outroute_x_total", "outroute_y"]
    );
    assert_eq!(
        l.into_iter().collect::<Vec<_>>(),
        vec!["kind", "route", "sink", "source"]
    );
    let e = rule_exprs(
        "  - alert: A\n    expr: >\n      a > 0\n      unless b\n    for: 5m\n  - alert: B\n    expr: c == 1\n",
    );
    assert_eq!(e, vec!["a > 0 unless b ".to_string(), "c == 1".to_string()]);
}
