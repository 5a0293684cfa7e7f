//! What every console page shares: the frame (navigation, who is signed
//! in, sign-out), the sign-in form, times and charts.
//!
//! Plain HTML first: forms and links work without JavaScript, the
//! navigation is a list of links, every chart has its figures in text
//! beside it, and a time shows UTC until the script rewrites it in the
//! viewer's timezone (UTC stays on hover).

use chrono::{DateTime, SecondsFormat, Utc};
use maud::{DOCTYPE, Markup, html};

use super::history::Sample;
use super::session::Session;

/// Which page the navigation marks as current.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Nav {
    Overview,
    Failed,
    Routes,
    Try,
    Config,
    None,
}

pub fn page(title: &str, s: Option<&Session>, nav: Nav, body: Markup) -> Markup {
    let link = |href: &str, label: &str, this: Nav| {
        html! {
            li { a href=(href) aria-current=[(nav == this).then_some("page")] { (label) } }
        }
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outroute console" }
                link rel="stylesheet" href="/console/assets/console.css";
                script src="/console/assets/console.js" defer {}
            }
            body {
                a.skip href="#main" { "Skip to content" }
                header {
                    span.brand { "outroute" }
                    @if let Some(s) = s {
                        nav aria-label="Console" {
                            ul {
                                (link("/console", "Overview", Nav::Overview))
                                (link("/console/failed", "Failed events", Nav::Failed))
                                (link("/console/routes", "Routes", Nav::Routes))
                                (link("/console/try", "Try a plugin", Nav::Try))
                                (link("/console/config", "Configuration", Nav::Config))
                            }
                        }
                        div.who {
                            span { "Signed in as " strong { (s.describe()) } }
                            form method="post" action="/console/logout" {
                                input type="hidden" name="csrf" value=(s.csrf);
                                button type="submit" { "Sign out" }
                            }
                        }
                    }
                }
                main id="main" {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

pub fn login(error: Option<&str>) -> Markup {
    page(
        "Sign in",
        None,
        Nav::None,
        html! {
            @if let Some(e) = error {
                p.error role="alert" { (e) }
            }
            form.login method="post" action="/console/login" {
                label for="token" { "Console token" }
                input id="token" type="password" name="token" autocomplete="current-password" required autofocus;
                button type="submit" { "Sign in" }
            }
            p.hint { "Tokens are configured under " code { "[http.console.tokens]" } "." }
        },
    )
}

/// A time: UTC in the text and on hover; the script shows it local.
pub fn time(t: DateTime<Utc>) -> Markup {
    let utc = t.format("%Y-%m-%d %H:%M:%S UTC").to_string();
    html! {
        time datetime=(t.to_rfc3339_opts(SecondsFormat::Secs, true)) title=(utc) { (utc) }
    }
}

/// A duration in seconds, short.
pub fn age(secs: f64) -> String {
    if secs < 1.0 {
        format!("{:.0} ms", secs * 1000.0)
    } else if secs < 120.0 {
        format!("{secs:.1} s")
    } else if secs < 7200.0 {
        format!("{:.0} min", secs / 60.0)
    } else {
        format!("{:.1} h", secs / 3600.0)
    }
}

/// A line chart of `values` (oldest first) over the last hour, with its
/// latest value and its peak in text for those who cannot see it.
pub fn chart(label: &str, unit: &str, samples: &[Sample], value: fn(&Sample) -> f64) -> Markup {
    const W: f64 = 360.0;
    const H: f64 = 64.0;
    let values: Vec<f64> = samples.iter().map(value).collect();
    let peak = values.iter().copied().fold(0.0f64, f64::max);
    let last = values.last().copied().unwrap_or(0.0);
    let scale = if peak > 0.0 { peak } else { 1.0 };
    // Up to 720 samples across the width: a point every half pixel.
    let n = values.len().max(2) as f64 - 1.0;
    let points: String = values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            format!(
                "{:.1},{:.1} ",
                i as f64 / n * W,
                H - 2.0 - v / scale * (H - 4.0)
            )
        })
        .collect();
    let summary = format!(
        "{label}: now {}, peak {} over the last {}",
        fmt_value(last, unit),
        fmt_value(peak, unit),
        span(samples)
    );
    html! {
        figure.chart {
            figcaption { (label) ": " strong data-value=(format!("{last:.3}")) { (fmt_value(last, unit)) } }
            svg viewBox=(format!("0 0 {W} {H}")) preserveAspectRatio="none" role="img" aria-label=(summary) {
                title { (summary) }
                polyline points=(points) fill="none" stroke="currentColor" stroke-width="1.5" vector-effect="non-scaling-stroke" {}
            }
            span.peak { "peak " (fmt_value(peak, unit)) }
        }
    }
}

fn span(samples: &[Sample]) -> String {
    match (samples.first(), samples.last()) {
        (Some(a), Some(b)) => age((b.at - a.at).num_milliseconds() as f64 / 1000.0),
        _ => "0 s".into(),
    }
}

fn fmt_value(v: f64, unit: &str) -> String {
    if v >= 100.0 || v == v.trunc() {
        format!("{v:.0}{unit}")
    } else {
        format!("{v:.1}{unit}")
    }
}

/// A notice after an action, from a fixed list (never the request's text).
pub fn notice(done: Option<&str>) -> Markup {
    let text = match done {
        Some("retry") => "Put back in line: the relay publishes it on its next claim.",
        Some("discard") => "Discarded: it no longer holds back its aggregate.",
        Some("resume") => "Route resumed: its waiting events are due now.",
        Some("promote") => {
            "Promoted: the shadow is the active version once the relay has reloaded."
        }
        Some("none") => "Nothing changed: it was no longer in that state.",
        _ => return html! {},
    };
    html! { p.notice role="status" { (text) } }
}
