//! Failed events: the list (filtered by source, route, owner, event type
//! and how recently they failed), one event in full (payload and headers
//! for operators only), and retry or discard after a confirmation — the
//! console's form of `outroute failed list|show|retry|discard`, scoped to
//! the token's team.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};

use super::layout::{self, Nav};
use super::session::Session;
use super::{Console, CsrfForm, html, may_act, not_found, secured, sign_in_first};
use crate::config::Loaded;
use crate::store::{FailedEvent, Filter, Store};

/// Most events one list shows.
const SHOWN: usize = 200;

#[derive(serde::Deserialize, Default)]
pub struct ListQuery {
    #[serde(default)]
    source: String,
    #[serde(default)]
    route: String,
    #[serde(default)]
    owner: String,
    #[serde(default)]
    event_type: String,
    /// Failed within this long (`1h`, `30m`); empty: any time.
    #[serde(default)]
    within: String,
    #[serde(default)]
    done: Option<String>,
}

fn non_empty(s: &str) -> Option<String> {
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

pub fn link(source: &str, id: &str) -> String {
    format!(
        "/console/failed/{}/{}",
        utf8_percent_encode(source, NON_ALPHANUMERIC),
        utf8_percent_encode(id, NON_ALPHANUMERIC)
    )
}

/// The routes a query may name: the token's team's (all without a team),
/// narrowed to `owner`'s; `None`: no narrowing at all.
fn routes_in_scope(loaded: &Loaded, s: &Session, owner: Option<&str>) -> Option<Vec<String>> {
    if s.team.is_none() && owner.is_none() {
        return None;
    }
    let mut names: Vec<String> = loaded
        .config
        .routes
        .iter()
        .filter(|r| s.sees_route(r) && owner.is_none_or(|o| r.owner() == o))
        .map(|r| r.name.clone())
        .collect();
    // A refused team file's stand-in route.
    for t in [s.team.as_deref(), owner].into_iter().flatten() {
        if s.team.as_deref().is_none_or(|mine| mine == t) && owner.is_none_or(|o| o == t) {
            names.push(format!("team:{t}"));
        }
    }
    names.sort();
    names.dedup();
    Some(names)
}

pub async fn list(
    State(c): State<Console>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(true);
    };
    let (view, loaded) = c.view();
    let Some(loaded) = loaded else {
        return sign_in_first(true);
    };
    let within = non_empty(&q.within).map(|w| humantime::parse_duration(&w));
    let mut problems: Vec<String> = Vec::new();
    let cutoff = match within {
        Some(Ok(d)) => chrono::Duration::from_std(d)
            .ok()
            .map(|d| chrono::Utc::now() - d),
        Some(Err(e)) => {
            problems.push(format!(
                "“failed within” is not a duration like 1h or 30m: {e}"
            ));
            None
        }
        None => None,
    };
    let owner = non_empty(&q.owner);
    let scope = routes_in_scope(&loaded, &s, owner.as_deref());
    let route = non_empty(&q.route);
    let routes: Vec<Option<String>> = match (&scope, &route) {
        (Some(names), Some(r)) => names
            .iter()
            .filter(|n| *n == r)
            .cloned()
            .map(Some)
            .collect(),
        (Some(names), None) => names.iter().cloned().map(Some).collect(),
        (None, r) => vec![r.clone()],
    };
    let mut found: Vec<(String, FailedEvent)> = Vec::new();
    let sources: Vec<&String> = view
        .sources
        .iter()
        .map(|(n, _)| n)
        .filter(|n| s.sees_source(&loaded, n))
        .collect();
    for (name, health) in &view.sources {
        if !sources.contains(&name) || non_empty(&q.source).is_some_and(|x| &x != name) {
            continue;
        }
        let Some(store) = health.store() else {
            problems.push(format!("source {name}: its store is not open yet"));
            continue;
        };
        for r in &routes {
            let f = Filter {
                route: r.clone(),
                event_type: non_empty(&q.event_type),
                limit: Some(SHOWN as i64 + 1),
                ..Filter::default()
            };
            match store.failed_list(&f).await {
                Ok(l) => found.extend(
                    l.into_iter()
                        .filter(|e| s.sees_event_of(&loaded, e.route.as_deref()))
                        .filter(|e| {
                            cutoff.is_none_or(|t| e.failed_at.unwrap_or(e.first_error_at) >= t)
                        })
                        .map(|e| (name.clone(), e)),
                ),
                Err(e) => problems.push(format!("source {name}: {e:#}")),
            }
        }
    }
    let more = found.len() > SHOWN;
    found.truncate(SHOWN);
    let visible_routes = s.route_names(&loaded);
    let body = html! {
        (layout::notice(q.done.as_deref()))
        form.filters method="get" action="/console/failed" {
            label { "Source " select name="source" {
                option value="" { "any" }
                @for n in &sources { option value=(n) selected[q.source == **n] { (n) } }
            } }
            label { "Route " select name="route" {
                option value="" { "any" }
                @for r in &visible_routes { option value=(r) selected[q.route == *r] { (r) } }
            } }
            label { "Owner " input type="text" name="owner" value=(q.owner) size="12"; }
            label { "Event type " input type="text" name="event_type" value=(q.event_type) size="16"; }
            label { "Failed within " input type="text" name="within" value=(q.within) size="6" placeholder="1h"; }
            button type="submit" { "Filter" }
        }
        @for p in &problems { p.error role="alert" { (p) } }
        @if found.is_empty() {
            p { "No failed events match." }
        } @else {
            p { (found.len()) @if more { "+" } " failed event(s)" @if more { " (the first " (SHOWN) "; narrow the filter)" } }
            table.events {
                thead { tr {
                    th scope="col" { "Event" } th scope="col" { "Source" } th scope="col" { "Type" }
                    th scope="col" { "Aggregate" } th scope="col" { "Route" } th scope="col" { "Owner" }
                    th scope="col" { "Attempts" } th scope="col" { "Failed" } th scope="col" { "Reason" }
                } }
                tbody {
                    @for (source, e) in &found {
                        tr {
                            td { a href=(link(source, &e.id)) { code { (e.id) } } }
                            td { (source) }
                            td { (e.event_type) }
                            td { (e.aggregate_type) " " (e.aggregate_id) }
                            td { (e.route.as_deref().unwrap_or("-")) }
                            td { (loaded.owner_of(e.route.as_deref()).0) }
                            td { (e.attempts) }
                            td { (layout::time(e.failed_at.unwrap_or(e.first_error_at))) }
                            td.reason { (e.reason.as_deref().unwrap_or("-")) }
                        }
                    }
                }
            }
        }
    };
    html(
        StatusCode::OK,
        layout::page("Failed events", Some(&s), Nav::Failed, body),
    )
}

/// Source `source`'s store and its failed event `id` (discarded too),
/// if the token sees both.
async fn find(
    c: &Console,
    s: &Session,
    source: &str,
    id: &str,
) -> Result<(std::sync::Arc<Loaded>, std::sync::Arc<Store>, FailedEvent), Box<Response>> {
    let (view, loaded) = c.view();
    let gone = || Box::new(not_found(s, "That failed event"));
    let Some(loaded) = loaded else {
        return Err(gone());
    };
    let Some(store) = view
        .sources
        .iter()
        .find(|(n, _)| n == source && s.sees_source(&loaded, n))
        .and_then(|(_, h)| h.store().cloned())
    else {
        return Err(gone());
    };
    let f = Filter {
        ids: vec![id.to_string()],
        include_discarded: true,
        ..Filter::default()
    };
    let e = match store.failed_list(&f).await {
        Ok(l) => l.into_iter().next(),
        Err(e) => {
            return Err(Box::new(html(
                StatusCode::SERVICE_UNAVAILABLE,
                layout::page(
                    "Source unavailable",
                    Some(s),
                    Nav::Failed,
                    html! { p.error { "Cannot read source " (source) ": " (format!("{e:#}")) } },
                ),
            )));
        }
    };
    match e {
        Some(e) if s.sees_event_of(&loaded, e.route.as_deref()) => Ok((loaded, store, e)),
        _ => Err(gone()),
    }
}

pub async fn event(
    State(c): State<Console>,
    headers: HeaderMap,
    Path((source, id)): Path<(String, String)>,
    Query(q): Query<ListQuery>,
) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(true);
    };
    let (loaded, store, e) = match find(&c, &s, &source, &id).await {
        Ok(x) => x,
        Err(r) => return resolved_here(&c, &s, &source, &id).await.unwrap_or(*r),
    };
    let row = store.event_row(&id).await;
    let history = store
        .audit_recent(&source, 500)
        .await
        .map(|l| {
            l.into_iter()
                .filter(|a| a.subject == id)
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let (owner, contact) = loaded.owner_of(e.route.as_deref());
    let state = if e.discarded_at.is_some() {
        "discarded"
    } else {
        "failed"
    };
    let body = html! {
        (layout::notice(q.done.as_deref()))
        dl.event {
            dt { "State" } dd data-state=(state) { (state) }
            dt { "Source" } dd { (source) }
            dt { "Event type" } dd { (e.event_type) }
            dt { "Aggregate" } dd { (e.aggregate_type) " " (e.aggregate_id) }
            dt { "Route" } dd { (e.route.as_deref().unwrap_or("-")) }
            dt { "Owner" } dd { (owner) @if let Some(c) = contact { " (" (c) ")" } }
            dt { "Plugin" } dd { (e.plugin.as_deref().unwrap_or("-")) " " (e.plugin_version.as_deref().unwrap_or("")) }
            dt { "Attempts" } dd { (e.attempts) }
            dt { "First error" } dd { (layout::time(e.first_error_at)) }
            @if let Some(t) = e.failed_at { dt { "Failed" } dd { (layout::time(t)) } }
            @if let Some(t) = e.discarded_at { dt { "Discarded" } dd { (layout::time(t)) } }
            dt { "Holds its aggregate" } dd { (if e.holds_aggregate { "yes: later events of this aggregate wait" } else { "no" }) }
            dt { "Reason" } dd.reason { (e.reason.as_deref().unwrap_or("-")) }
        }
        (content(&s, &e, &row))
        @if !history.is_empty() {
            h2 { "History" }
            ul.history {
                @for a in &history {
                    li { (layout::time(a.at)) " — " (a.who) ": " (a.action) " — " (a.outcome) }
                }
            }
        }
        @if s.operator() && e.discarded_at.is_none() {
            p.actions {
                a.button href=(format!("{}/retry", link(&source, &id))) { "Retry…" }
                " "
                a.button.danger href=(format!("{}/discard", link(&source, &id))) { "Discard…" }
            }
        }
        p { a href="/console/failed" { "All failed events" } }
    };
    html(
        StatusCode::OK,
        layout::page(&format!("Event {id}"), Some(&s), Nav::Failed, body),
    )
}

/// The event's payload and headers (operators), or only their sizes.
fn content(
    s: &Session,
    e: &FailedEvent,
    row: &anyhow::Result<Option<(crate::store::Claim, bool)>>,
) -> Markup {
    let parked = e.row.as_ref().map(|r| r.to_string());
    let (payload, headers): (Option<String>, Vec<(String, String)>) = match row {
        Ok(Some((claim, _))) => match &claim.row {
            Ok(ev) => (
                Some(String::from_utf8_lossy(&ev.payload).into_owned()),
                ev.headers.clone(),
            ),
            Err(m) => (
                Some(format!("(the row is not an event: {})", m.reason)),
                Vec::new(),
            ),
        },
        _ => (parked.clone(), Vec::new()),
    };
    html! {
        h2 { "Payload" }
        @match (&payload, s.operator()) {
            (None, _) => p { "The row is no longer in the table." },
            (Some(p), true) => pre.payload { (pretty(p)) },
            (Some(p), false) => p.hidden-payload { "Hidden: " (p.len()) " bytes. Viewer tokens see no payload bytes." },
        }
        @if !headers.is_empty() {
            h2 { "Headers" }
            @if s.operator() {
                table.headers { tbody { @for (k, v) in &headers { tr { th scope="row" { (k) } td { code { (v) } } } } } }
            } @else {
                p { (headers.len()) " header(s); values hidden from viewer tokens." }
            }
        }
    }
}

/// JSON indented when it parses, else as it is.
fn pretty(p: &str) -> String {
    serde_json::from_str::<serde_json::Value>(p)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or_else(|| p.to_string())
}

fn action_word(action: &str) -> Option<(&'static str, &'static str)> {
    match action {
        "retry" => Some((
            "Retry",
            "It goes back in line with its attempts reset; the relay publishes it in outbox order on its next claim.",
        )),
        "discard" => Some((
            "Discard",
            "The relay gives up on it: it is never published, and later events of its aggregate stop waiting for it.",
        )),
        _ => None,
    }
}

pub async fn confirm(
    State(c): State<Console>,
    headers: HeaderMap,
    Path((source, id, action)): Path<(String, String, String)>,
) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(true);
    };
    let Some((word, what)) = action_word(&action) else {
        return not_found(&s, "That action");
    };
    let (_, _, e) = match find(&c, &s, &source, &id).await {
        Ok(x) => x,
        Err(r) => return *r,
    };
    if !s.operator() {
        return super::forbidden(&s, "This token is a viewer's: it sees, it does not act.");
    }
    let body = html! {
        p { (word) " event " code { (id) } " (" (e.event_type) ", route " (e.route.as_deref().unwrap_or("-")) ")?" }
        p { (what) }
        form method="post" action=(format!("{}/{action}", link(&source, &id))) {
            input type="hidden" name="csrf" value=(s.csrf);
            button type="submit" class=[(action == "discard").then_some("danger")] { (word) " event" }
            " "
            a href=(link(&source, &id)) { "Cancel" }
        }
    };
    html(
        StatusCode::OK,
        layout::page(&format!("{word} event?"), Some(&s), Nav::Failed, body),
    )
}

pub async fn act(
    State(c): State<Console>,
    headers: HeaderMap,
    Path((source, id, action)): Path<(String, String, String)>,
    axum::Form(form): axum::Form<CsrfForm>,
) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(false);
    };
    if action_word(&action).is_none() {
        return not_found(&s, "That action");
    }
    let (loaded, store, e) = match find(&c, &s, &source, &id).await {
        Ok(x) => x,
        Err(r) => return *r,
    };
    if let Err(r) = may_act(&s, &form.csrf, &headers) {
        return *r;
    }
    let f = Filter {
        ids: vec![id.clone()],
        ..Filter::default()
    };
    let retry = action == "retry";
    let done = if retry {
        store.failed_retry(&f).await
    } else {
        store.failed_discard(&f).await
    };
    let n = match done {
        Ok(n) => n,
        Err(err) => {
            let outcome = format!("refused by the store: {err:#}");
            super::audit::record(&store, &s, &source, &action, &id, &outcome).await;
            return html(
                StatusCode::SERVICE_UNAVAILABLE,
                layout::page(
                    "Not done",
                    Some(&s),
                    Nav::Failed,
                    html! { p.error { (outcome) } },
                ),
            );
        }
    };
    let outcome = if n == 0 {
        "nothing changed (it was no longer failed)".to_string()
    } else if retry {
        format!("{n} event(s) put back in line")
    } else {
        format!("{n} event(s) discarded")
    };
    let told = if n > 0 {
        tell_dead_letter(&c, &loaded, &source, &e, retry).await
    } else {
        String::new()
    };
    super::audit::record(
        &store,
        &s,
        &source,
        &action,
        &id,
        &format!("{outcome}{told}"),
    )
    .await;
    let done = if n == 0 { "none" } else { action.as_str() };
    secured(Redirect::to(&format!("{}?done={done}", link(&source, &id))).into_response())
}

/// A route with a dead-letter topic hears what became of an event it was
/// told failed (as `outroute failed retry|discard` does): `""`, or why not.
async fn tell_dead_letter(
    c: &Console,
    loaded: &Loaded,
    source: &str,
    e: &FailedEvent,
    retry: bool,
) -> String {
    use crate::relay::dead_letter::{Resolution, ResolutionRecord, send_resolution};
    let Some(route) = loaded
        .config
        .routes
        .iter()
        .find(|r| Some(r.name.as_str()) == e.route.as_deref() && r.dead_letter.is_some())
    else {
        return String::new();
    };
    let table = match loaded.config.source(source) {
        Ok(sc) => sc.table().name,
        Err(err) => return format!("; no resolution record: {err:#}"),
    };
    let ce_source = crate::relay::ce_source(&loaded.config, source, &table);
    let (view, _) = c.view();
    let record = ResolutionRecord {
        event: e,
        resolution: if retry {
            Resolution::Retried
        } else {
            Resolution::Discarded
        },
        route,
        source,
        ce_source: &ce_source,
    };
    match send_resolution(&view.sinks, record, loaded.config.relay.publish_timeout).await {
        Ok(()) => "; resolution record published to the dead-letter topic".into(),
        Err(err) => format!("; the resolution record could not be published: {err}"),
    }
}

/// An event no longer failed that this token (or its team) acted on from
/// the console: its page shows what became of it — pending or published —
/// and its history, nothing more. `None` for any other event.
async fn resolved_here(c: &Console, s: &Session, source: &str, id: &str) -> Option<Response> {
    let (view, loaded) = c.view();
    let loaded = loaded?;
    let store = view
        .sources
        .iter()
        .find(|(n, _)| n == source && s.sees_source(&loaded, n))
        .and_then(|(_, h)| h.store().cloned())?;
    let team_of = |who: &str| c.config.tokens.get(who).and_then(|t| t.team.clone());
    let history: Vec<_> = store
        .audit_recent(source, 500)
        .await
        .ok()?
        .into_iter()
        .filter(|a| a.subject == id)
        .filter(|a| s.team.is_none() || team_of(&a.who) == s.team)
        .collect();
    if history.is_empty() {
        return None;
    }
    let state = match store.event_row(id).await {
        Ok(Some((_, true))) => "published",
        Ok(Some((_, false))) => "pending",
        Ok(None) => "no longer in the table",
        Err(_) => "unknown (the source cannot be read)",
    };
    let body = html! {
        dl.event {
            dt { "State" } dd data-state=(state) { (state) }
            dt { "Source" } dd { (source) }
        }
        p.hint { "It is no longer failed. Reload to see it change." }
        h2 { "History" }
        ul.history {
            @for a in &history {
                li { (layout::time(a.at)) " — " (a.who) ": " (a.action) " — " (a.outcome) }
            }
        }
        p { a href="/console/failed" { "All failed events" } }
    };
    Some(html(
        StatusCode::OK,
        layout::page(&format!("Event {id}"), Some(s), Nav::Failed, body),
    ))
}
