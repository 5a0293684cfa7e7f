//! Routes: per source, each route the token sees — its owner, plugin,
//! sinks, failed events and whether it flows or is quarantined (with
//! why) — and resuming a quarantined route after a confirmation: the
//! console's form of `outroute route list|resume`. Below them the shadow
//! rollouts (`shadow.rs`): differing messages side by side, and promote
//! (`outroute plugin promote`, then the relay's own SIGHUP reload).

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};

use super::layout::{self, Nav};
use super::session::Session;
use super::{Console, CsrfForm, html, may_act, not_found, secured, sign_in_first};
use crate::config::{Config, Loaded, RouteConfig};
use crate::store::Store;

#[derive(serde::Deserialize, Default)]
pub struct Done {
    #[serde(default)]
    done: Option<String>,
}

fn resume_link(source: &str, route: &str) -> String {
    format!(
        "/console/routes/{}/{}/resume",
        utf8_percent_encode(source, NON_ALPHANUMERIC),
        utf8_percent_encode(route, NON_ALPHANUMERIC)
    )
}

pub async fn list(State(c): State<Console>, headers: HeaderMap, Query(q): Query<Done>) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(true);
    };
    let (view, loaded) = c.view();
    let Some(loaded) = loaded else {
        return sign_in_first(true);
    };
    let mut sections = Vec::new();
    for (source, health) in &view.sources {
        let routes: Vec<&RouteConfig> = loaded
            .config
            .routes
            .iter()
            .filter(|r| s.sees_route(r) && Config::route_reads(r, source))
            .collect();
        if routes.is_empty() {
            continue;
        }
        let (quarantined, failed) = match health.store() {
            Some(store) => (
                store
                    .quarantined_routes()
                    .await
                    .map_err(|e| format!("{e:#}")),
                store.failed_by_route().await.unwrap_or_default(),
            ),
            None => (Err("its store is not open yet".to_string()), Vec::new()),
        };
        sections.push(html! {
            section aria-labelledby=(format!("routes-{source}")) {
                h2 id=(format!("routes-{source}")) { "Source " code { (source) } }
                @if let Err(e) = &quarantined { p.error { "Cannot read quarantine records: " (e) } }
                table.routes {
                    thead { tr {
                        th scope="col" { "Route" } th scope="col" { "Owner" } th scope="col" { "Plugin" }
                        th scope="col" { "Sinks" } th scope="col" { "Events/s (1 min)" } th scope="col" { "Failed" } th scope="col" { "State" }
                    } }
                    tbody {
                        @for r in &routes {
                            @let q = quarantined.as_ref().ok().and_then(|l| l.iter().find(|q| q.route == r.name));
                            tr data-route=(r.name) {
                                th scope="row" { code { (r.name) } }
                                td { (r.owner()) }
                                td { code { (r.plugin) } }
                                td { (r.allow.keys().cloned().collect::<Vec<_>>().join(", ")) }
                                td data-rate { (c.history.route_rate(source, &r.name).map_or("-".to_string(), |x| format!("{x:.1}"))) }
                                td { a href=(format!("/console/failed?source={}&route={}", enc(source), enc(&r.name))) {
                                    (failed.iter().find(|(n, _)| *n == r.name).map_or(0, |(_, k)| *k))
                                } }
                                td {
                                    @match q {
                                        None => span.state.flowing { "flowing" },
                                        Some(q) => {
                                            span.state.quarantined { "quarantined" }
                                            " since " (layout::time(q.since)) ": " (q.reason)
                                            @if s.operator() {
                                                " " a.button href=(resume_link(source, &r.name)) { "Resume…" }
                                            }
                                        },
                                    }
                                }
                            }
                        }
                    }
                }
            }
        });
    }
    let body = html! {
        (layout::notice(q.done.as_deref()))
        @if sections.is_empty() { p { "This token sees no route." } }
        @for sec in sections { (sec) }
        (shadows(&s, &loaded))
    };
    html(
        StatusCode::OK,
        layout::page("Routes", Some(&s), Nav::Routes, body),
    )
}

/// The shadow rollouts of the routes the token sees: how many events the
/// candidate answered differently and, for operators, the latest of them
/// side by side, with promote.
fn shadows(s: &Session, loaded: &Loaded) -> maud::Markup {
    let report: Vec<crate::shadow::RouteShadow> = crate::shadow::report()
        .into_iter()
        .filter(|r| {
            loaded
                .config
                .routes
                .iter()
                .any(|c| c.name == r.route && s.sees_route(c))
        })
        .collect();
    if report.is_empty() {
        return html! {};
    }
    html! {
        h2 { "Shadow rollouts" }
        @for r in &report {
            @let plugin = loaded.config.routes.iter().find(|c| c.name == r.route).map(|c| c.plugin.clone()).unwrap_or_default();
            section.shadow data-route=(r.route) {
                h3 { "Route " code { (r.route) } " on " code { (r.source) } }
                p {
                    "Candidate " code { (r.candidate) } ": " strong { (r.compared) } " events compared, "
                    strong data-differing=(r.differing) { (r.differing) } " answered differently."
                    @if s.operator() && may_promote(s, loaded, &plugin) {
                        " " a.button href=(format!("/console/plugins/{}/promote", enc(&plugin))) { "Promote…" }
                    }
                }
                @if s.operator() {
                    @for sample in r.samples.iter().rev() {
                        details.diff {
                            summary { "Event " code { (sample.event_id) } " — " (layout::time(sample.at)) }
                            ul.differences { @for d in &sample.differences { li { (d) } } }
                            @if let Some((was, would)) = &sample.sides {
                                div.sides {
                                    div { h4 { "Active plugin" } (super::try_plugin::outcome(was)) }
                                    div { h4 { "Candidate" } (super::try_plugin::outcome(would)) }
                                }
                            }
                        }
                    }
                } @else {
                    p.hint { "The differing messages show payloads: operators see them." }
                }
            }
        }
    }
}

/// A token may promote plugin `plugin`: it has a shadow and every route
/// using it is one the token sees (a plugin shared with another team's
/// routes is the platform's to promote).
fn may_promote(s: &Session, loaded: &Loaded, plugin: &str) -> bool {
    let has_shadow = loaded
        .config
        .plugins
        .get(plugin)
        .is_some_and(|p| p.shadow.is_some());
    let users: Vec<&RouteConfig> = loaded
        .config
        .routes
        .iter()
        .filter(|r| r.plugin == plugin)
        .collect();
    has_shadow && !users.is_empty() && users.iter().all(|r| s.sees_route(r))
}

pub async fn confirm_promote(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(plugin): Path<String>,
) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(true);
    };
    let (_, loaded) = c.view();
    let Some(loaded) = loaded.filter(|l| may_promote(&s, l, &plugin)) else {
        return not_found(&s, "That plugin's shadow");
    };
    if !s.operator() {
        return super::forbidden(&s, "This token is a viewer's: it sees, it does not act.");
    }
    let shadow = loaded
        .config
        .plugins
        .get(&plugin)
        .and_then(|p| p.shadow.clone())
        .unwrap_or_default();
    let body = html! {
        p { "Make " code { (shadow.display()) } " the active version of plugin " code { (plugin) } "?" }
        p { "The config file that declares it is changed (comments and layout kept) and the relay reloads it; every route using the plugin switches to it." }
        form method="post" action=(format!("/console/plugins/{}/promote", enc(&plugin))) {
            input type="hidden" name="csrf" value=(s.csrf);
            button type="submit" { "Promote" }
            " "
            a href="/console/routes" { "Cancel" }
        }
    };
    html(
        StatusCode::OK,
        layout::page("Promote the shadow?", Some(&s), Nav::Routes, body),
    )
}

pub async fn promote(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(plugin): Path<String>,
    axum::Form(form): axum::Form<CsrfForm>,
) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(false);
    };
    let (view, loaded) = c.view();
    let Some(loaded) = loaded.filter(|l| may_promote(&s, l, &plugin)) else {
        return not_found(&s, "That plugin's shadow");
    };
    if let Err(r) = may_act(&s, &form.csrf, &headers) {
        return *r;
    }
    let shadow_config = loaded
        .config
        .plugins
        .get(&plugin)
        .and_then(|p| p.shadow_config.clone());
    let (outcome, done) =
        match crate::shadow::promote(&loaded.files, &plugin, shadow_config.as_ref()) {
            Ok(file) => {
                // The run loop reloads on SIGHUP, as after `outroute plugin promote`.
                // SAFETY: kill(2) on this very process.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGHUP);
                }
                (
                    format!("promoted in {}; reloading", file.display()),
                    "promote",
                )
            }
            Err(e) => (format!("not promoted: {e:#}"), "none"),
        };
    // Recorded with the first source one of its routes reads.
    let store = view.sources.iter().find_map(|(name, h)| {
        loaded
            .config
            .routes
            .iter()
            .any(|r| r.plugin == plugin && Config::route_reads(r, name))
            .then(|| h.store().map(|st| (name.clone(), st.clone())))
            .flatten()
    });
    match store {
        Some((source, st)) => {
            super::audit::record(&st, &s, &source, "promote", &plugin, &outcome).await
        }
        None => {
            tracing::info!(target: "outroute::audit", who = %s.name, action = "promote", subject = %plugin, outcome = %outcome, "console action (no store open to record it in)")
        }
    }
    secured(Redirect::to(&format!("/console/routes?done={done}")).into_response())
}

fn enc(s: &str) -> String {
    utf8_percent_encode(s, NON_ALPHANUMERIC).to_string()
}

/// Source `source`'s store and route `route`, if the token sees both.
fn find<'a>(
    c: &Console,
    s: &Session,
    loaded: &'a Loaded,
    source: &str,
    route: &str,
) -> Option<(std::sync::Arc<Store>, &'a RouteConfig)> {
    let r = loaded
        .config
        .routes
        .iter()
        .find(|r| r.name == route && s.sees_route(r) && Config::route_reads(r, source))?;
    let (view, _) = c.view();
    let store = view
        .sources
        .iter()
        .find(|(n, _)| n == source)
        .and_then(|(_, h)| h.store().cloned())?;
    Some((store, r))
}

pub async fn confirm(
    State(c): State<Console>,
    headers: HeaderMap,
    Path((source, route)): Path<(String, String)>,
) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(true);
    };
    let (_, loaded) = c.view();
    let Some(loaded) = loaded else {
        return not_found(&s, "That route");
    };
    if find(&c, &s, &loaded, &source, &route).is_none() {
        return not_found(&s, "That route");
    }
    if !s.operator() {
        return super::forbidden(&s, "This token is a viewer's: it sees, it does not act.");
    }
    let body = html! {
        p { "Resume route " code { (route) } " on source " code { (source) } "?" }
        p { "Its waiting events become due at once. If its plugin still breaks its limits, the route is quarantined again." }
        form method="post" action=(resume_link(&source, &route)) {
            input type="hidden" name="csrf" value=(s.csrf);
            button type="submit" { "Resume route" }
            " "
            a href="/console/routes" { "Cancel" }
        }
    };
    html(
        StatusCode::OK,
        layout::page("Resume route?", Some(&s), Nav::Routes, body),
    )
}

pub async fn resume(
    State(c): State<Console>,
    headers: HeaderMap,
    Path((source, route)): Path<(String, String)>,
    axum::Form(form): axum::Form<CsrfForm>,
) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(false);
    };
    let (_, loaded) = c.view();
    let Some(loaded) = loaded else {
        return not_found(&s, "That route");
    };
    let Some((store, _)) = find(&c, &s, &loaded, &source, &route) else {
        return not_found(&s, "That route");
    };
    if let Err(r) = may_act(&s, &form.csrf, &headers) {
        return *r;
    }
    let (outcome, done) = match store.resume_route(&route).await {
        Ok((true, due)) => (format!("resumed; {due} waiting event(s) due now"), "resume"),
        Ok((false, due)) => (
            format!("was not quarantined; {due} waiting event(s) due now"),
            "none",
        ),
        Err(e) => (format!("refused by the store: {e:#}"), "none"),
    };
    super::audit::record(&store, &s, &source, "resume", &route, &outcome).await;
    secured(Redirect::to(&format!("/console/routes?done={done}")).into_response())
}
