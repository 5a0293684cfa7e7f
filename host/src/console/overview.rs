//! The overview: per source the token sees, whether it is up, its
//! backlog, oldest pending event, events/s and commit → ack time, with the
//! last hour as charts (refreshed live by the script from `/console/live`),
//! and the fleet: every live relay of the source, its lanes and who holds
//! the capture lease — read from the store, so it covers other processes.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use maud::{Markup, html};

use super::layout::{self, Nav, age, chart};
use super::session::Session;
use super::{Console, html, sign_in_first};
use crate::store::RelayStatus;

pub async fn page(State(c): State<Console>, headers: HeaderMap) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(true);
    };
    let fleet = fleet(&c, &s).await;
    let body = html! {
        section id="live" aria-live="off" { (live_part(&c, &s)) }
        h2 { "Fleet" }
        p.hint { "Every relay that shares these sources, as the stores record them." }
        (fleet)
    };
    html(
        StatusCode::OK,
        layout::page("Overview", Some(&s), Nav::Overview, body),
    )
}

/// The charts and figures alone, for the script's refresh.
pub async fn live(State(c): State<Console>, headers: HeaderMap) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(false);
    };
    html(StatusCode::OK, live_part(&c, &s))
}

fn live_part(c: &Console, s: &Session) -> Markup {
    let (view, loaded) = c.view();
    let Some(loaded) = loaded else {
        return html! { p { "The relay is starting." } };
    };
    let sources: Vec<_> = view
        .sources
        .iter()
        .filter(|(name, _)| s.sees_source(&loaded, name))
        .collect();
    html! {
        @if sources.is_empty() {
            p { "No source here reads a route this token sees." }
        }
        @for (name, health) in sources {
            @let samples = c.history.of(name);
            @let (backlog, oldest) = health.backlog();
            @let last = samples.last();
            section.source aria-labelledby=(format!("src-{name}")) {
                h2 id=(format!("src-{name}")) { "Source " code { (name) } }
                @match health.database.why_down() {
                    None => p.up { "Up" },
                    Some((why, since)) => p.down { "Down since " (layout::time(since)) ": " (why) },
                }
                dl.figures {
                    dt { "Backlog" } dd data-figure="backlog" { (backlog) }
                    dt { "Oldest unpublished" } dd { (oldest.map_or("none".to_string(), age)) }
                    dt { "Events/s" } dd data-figure="rate" { (format!("{:.1}", last.map_or(0.0, |l| l.rate))) }
                    dt { "Commit → ack" } dd { (last.and_then(|l| l.latency_ms).map_or("-".to_string(), |ms| age(ms / 1000.0))) }
                }
                div.charts {
                    (chart("Events/s", "/s", &samples, |x| x.rate))
                    (chart("Backlog", "", &samples, |x| x.backlog as f64))
                    (chart("Oldest unpublished", " s", &samples, |x| x.oldest.unwrap_or(0.0)))
                    (chart("Commit → ack", " ms", &samples, |x| x.latency_ms.unwrap_or(0.0)))
                }
            }
        }
    }
}

async fn fleet(c: &Console, s: &Session) -> Markup {
    let (view, loaded) = c.view();
    let Some(loaded) = loaded else {
        return html! {};
    };
    let mut rows: Vec<(String, Result<Vec<RelayStatus>, String>)> = Vec::new();
    for (name, health) in &view.sources {
        if !s.sees_source(&loaded, name) {
            continue;
        }
        let Some(store) = health.store() else {
            rows.push((name.clone(), Err("its store is not open yet".into())));
            continue;
        };
        rows.push((
            name.clone(),
            store.fleet().await.map_err(|e| format!("{e:#}")),
        ));
    }
    html! {
        table.fleet {
            thead { tr { th scope="col" { "Source" } th scope="col" { "Relay" } th scope="col" { "Host, pid" } th scope="col" { "Heartbeat" } th scope="col" { "Lanes" } th scope="col" { "Lease epochs" } } }
            tbody {
                @for (source, relays) in &rows {
                    @match relays {
                        Err(e) => tr { td { code { (source) } } td colspan="5" { "cannot read: " (e) } },
                        Ok(list) if list.is_empty() => tr { td { code { (source) } } td colspan="5" { "no relay recorded (SQLite: this relay alone)" } },
                        Ok(list) => {
                            @for r in list {
                                tr {
                                    td { code { (source) } }
                                    td { code { (r.relay_id) } }
                                    td { (r.hostname) ", " (r.pid) }
                                    td { (age(r.heartbeat_age_seconds)) " ago" }
                                    td { (lanes(&r.lanes)) }
                                    td title="a lane's epoch grows each time the lane changes hands" { (epochs(&r.epochs)) }
                                }
                            }
                        },
                    }
                }
            }
        }
    }
}

/// The lowest and highest lease epoch of a relay's lanes.
fn epochs(e: &[i64]) -> String {
    match (e.iter().min(), e.iter().max()) {
        (Some(a), Some(b)) if a == b => a.to_string(),
        (Some(a), Some(b)) => format!("{a}–{b}"),
        _ => "-".into(),
    }
}

/// Lanes as ranges (`0–31, 40`), the capture lease named.
fn lanes(l: &[i32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    if l.contains(&crate::store::postgres::CAPTURE_LANE) {
        parts.push("capture lease".into());
    }
    let mut it = l.iter().copied().filter(|x| *x >= 0).peekable();
    while let Some(a) = it.next() {
        let mut b = a;
        while it.peek() == Some(&(b + 1)) {
            b += 1;
            it.next();
        }
        parts.push(if a == b {
            a.to_string()
        } else {
            format!("{a}–{b}")
        });
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn lanes_read_as_ranges() {
        assert_eq!(super::lanes(&[0, 1, 2, 5, 7, 8]), "0–2, 5, 7–8");
        assert_eq!(super::lanes(&[-1]), "capture lease");
        assert_eq!(super::lanes(&[]), "none");
    }
}
