//! Try a plugin: run a candidate — one of the configured plugins (or its
//! shadow), or a `.wasm` uploaded from the page — on the last N real events
//! of a route, beside the route's active plugin, and show what it would do
//! differently, message by message. Nothing is published (`trial.rs`).
//! Operators only (the messages show payloads), within their team's routes;
//! every try is in the audit log.

use std::path::PathBuf;

use axum::extract::{Multipart, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use maud::{Markup, html};

use super::layout::{self, Nav};
use super::session::Session;
use super::{Console, html, may_act, sign_in_first};
use crate::config::Config;
use crate::event::Outcome;

/// Largest plugin the page takes.
pub const MAX_UPLOAD: usize = 32 << 20;
/// Most events one try runs.
const MOST: usize = 200;

pub async fn page(State(c): State<Console>, headers: HeaderMap) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(true);
    };
    html(
        StatusCode::OK,
        layout::page(
            "Try a plugin",
            Some(&s),
            Nav::Try,
            form(&c, &s, &Choice::default()),
        ),
    )
}

/// What the form was filled with.
#[derive(Default)]
struct Choice {
    route: String,
    plugin: String,
    last: usize,
    config: String,
}

fn form(c: &Console, s: &Session, ch: &Choice) -> Markup {
    let (_, loaded) = c.view();
    let Some(loaded) = loaded else {
        return html! { p { "The relay is starting." } };
    };
    if !s.operator() {
        return html! { p { "Trying a plugin shows event payloads: it needs an operator's token." } };
    }
    let routes = s.route_names(&loaded);
    let mut plugins: Vec<(String, String)> = Vec::new();
    for (name, p) in &loaded.config.plugins {
        let used_by_mine = loaded
            .config
            .routes
            .iter()
            .any(|r| r.plugin == *name && s.sees_route(r));
        if !used_by_mine {
            continue;
        }
        plugins.push((name.clone(), format!("{name} ({})", p.path.display())));
        if let Some(sh) = &p.shadow {
            plugins.push((
                format!("{name}#shadow"),
                format!("{name}'s shadow ({})", sh.display()),
            ));
        }
    }
    let last = if ch.last == 0 { 20 } else { ch.last };
    html! {
        p { "Runs a candidate on a route's newest published events beside the route's active plugin. Nothing is published." }
        form.try method="post" action="/console/try" enctype="multipart/form-data" {
            input type="hidden" name="csrf" value=(s.csrf);
            label { "Route " select name="route" required {
                @for r in &routes { option value=(r) selected[ch.route == *r] { (r) } }
            } }
            label { "Candidate: a configured plugin " select name="plugin" {
                option value="" { "— or upload one below —" }
                @for (v, label) in &plugins { option value=(v) selected[ch.plugin == *v] { (label) } }
            } }
            label { "Candidate: upload a .wasm " input type="file" name="wasm" accept=".wasm,application/wasm"; }
            label { "Events " input type="number" name="last" min="1" max=(MOST) value=(last); }
            label { "Candidate config (JSON; empty: the route's) " textarea name="config" rows="3" cols="40" { (ch.config) } }
            button type="submit" { "Try" }
        }
    }
}

pub async fn run(State(c): State<Console>, headers: HeaderMap, mut mp: Multipart) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(false);
    };
    let mut ch = Choice::default();
    let mut csrf = String::new();
    let mut wasm: Option<Vec<u8>> = None;
    loop {
        let field = match mp.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return refused(&c, &s, &ch, &format!("the form could not be read: {e}")),
        };
        let name = field.name().unwrap_or_default().to_string();
        let bytes = match field.bytes().await {
            Ok(b) => b,
            Err(e) => return refused(&c, &s, &ch, &format!("the form could not be read: {e}")),
        };
        let text = || String::from_utf8_lossy(&bytes).trim().to_string();
        match name.as_str() {
            "csrf" => csrf = text(),
            "route" => ch.route = text(),
            "plugin" => ch.plugin = text(),
            "last" => ch.last = text().parse().unwrap_or(20),
            "config" => ch.config = text(),
            "wasm" if !bytes.is_empty() => wasm = Some(bytes.to_vec()),
            _ => {}
        }
    }
    if let Err(r) = may_act(&s, &csrf, &headers) {
        return *r;
    }
    match try_it(&c, &s, &ch, wasm).await {
        Ok(result) => html(
            StatusCode::OK,
            layout::page(
                "Try a plugin",
                Some(&s),
                Nav::Try,
                html! { (form(&c, &s, &ch)) (result) },
            ),
        ),
        Err(why) => refused(&c, &s, &ch, &why),
    }
}

fn refused(c: &Console, s: &Session, ch: &Choice, why: &str) -> Response {
    html(
        StatusCode::BAD_REQUEST,
        layout::page(
            "Try a plugin",
            Some(s),
            Nav::Try,
            html! { p.error role="alert" { (why) } (form(c, s, ch)) },
        ),
    )
}

/// A file removed when dropped (the uploaded candidate).
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn try_it(
    c: &Console,
    s: &Session,
    ch: &Choice,
    wasm: Option<Vec<u8>>,
) -> Result<Markup, String> {
    let (view, loaded) = c.view();
    let loaded = loaded.ok_or("the relay is starting")?;
    let routes = crate::routing::Routes::compile(&loaded.config).map_err(|e| e.to_string())?;
    let route = routes
        .0
        .iter()
        .find(|r| r.name() == ch.route && s.sees_route(&r.config))
        .ok_or_else(|| format!("no route `{}` that this token sees", ch.route))?;
    let active = loaded
        .config
        .plugins
        .get(&route.config.plugin)
        .map(|p| loaded.resolve(&p.path))
        .ok_or_else(|| {
            format!(
                "route `{}` has no plugin `{}`",
                ch.route, route.config.plugin
            )
        })?;
    // The candidate: an upload, or a plugin of this token's routes.
    let mut _upload = None;
    let (candidate, named) = match (wasm, ch.plugin.as_str()) {
        (Some(bytes), _) => {
            if bytes.len() > MAX_UPLOAD {
                return Err(format!("the upload is over {} MiB", MAX_UPLOAD >> 20));
            }
            if !bytes.starts_with(b"\0asm") {
                return Err("the upload is not a WebAssembly file (no \\0asm header)".into());
            }
            let path = std::env::temp_dir().join(format!(
                "outroute-console-try-{}.wasm",
                uuid::Uuid::new_v4()
            ));
            std::fs::write(&path, &bytes).map_err(|e| format!("cannot keep the upload: {e}"))?;
            _upload = Some(TempFile(path.clone()));
            (path, "an uploaded plugin".to_string())
        }
        (None, "") => return Err("choose a configured plugin or upload a .wasm".into()),
        (None, name) => {
            let (base, shadow) = match name.strip_suffix("#shadow") {
                Some(b) => (b, true),
                None => (name, false),
            };
            let mine = loaded
                .config
                .routes
                .iter()
                .any(|r| r.plugin == base && s.sees_route(r));
            let p = loaded
                .config
                .plugins
                .get(base)
                .filter(|_| mine)
                .ok_or_else(|| format!("no plugin `{base}` of this token's routes"))?;
            let path = if shadow {
                p.shadow
                    .as_ref()
                    .ok_or_else(|| format!("plugin `{base}` has no shadow"))?
            } else {
                &p.path
            };
            (loaded.resolve(path), format!("plugin {name}"))
        }
    };
    let candidate_config = if ch.config.is_empty() {
        route.config.config.clone()
    } else {
        serde_json::from_str(&ch.config)
            .map_err(|e| format!("the candidate config is not JSON: {e}"))?
    };
    let last = ch.last.clamp(1, MOST);
    let mut events = Vec::new();
    let mut store_for_audit = None;
    for (name, health) in &view.sources {
        if !Config::route_reads(&route.config, name) {
            continue;
        }
        let Some(store) = health.store() else {
            continue;
        };
        let mine = crate::trial::recent_events(store, route, last)
            .await
            .map_err(|e| format!("source {name}: {e:#}"))?;
        events.extend(mine);
        store_for_audit.get_or_insert((name.clone(), store.clone()));
    }
    if events.is_empty() {
        return Ok(
            html! { p { "Route " code { (ch.route) } " has no published events to try the candidate on." } },
        );
    }
    let rt = c.runtime(&loaded)?;
    let trial = crate::trial::run(rt, route, active, candidate, candidate_config, events)
        .await
        .map_err(|e| format!("{e:#}"))?;
    let differing = trial.differing();
    if let Some((source, store)) = &store_for_audit {
        let outcome = format!(
            "{} events, {} different, candidate {named}",
            trial.events.len(),
            differing.len()
        );
        super::audit::record(store, s, source, "try", &ch.route, &outcome).await;
    }
    Ok(html! {
        h2 { "Result" }
        p id="summary" data-tried=(trial.events.len()) data-different=(differing.len()) {
            (trial.events.len()) " events of route " code { (ch.route) } ": "
            strong { (trial.events.len() - differing.len()) " the same" } ", "
            strong { (differing.len()) " different" } " (candidate: " (named) ")."
        }
        @for (i, words) in differing.iter().take(50) {
            @let e = &trial.events[*i];
            section.diff {
                h3 { "Event " code { (e.id) } " — " (e.event_type) ", " (e.aggregate_type) " " (e.aggregate_id) }
                ul.differences { @for w in words { li { (w) } } }
                div.sides {
                    div { h4 { "Active plugin" } (outcome(&trial.was[*i])) }
                    div { h4 { "Candidate" } (outcome(&trial.would[*i])) }
                }
            }
        }
    })
}

/// One plugin answer: its messages, or its rejection.
pub(super) fn outcome(o: &Outcome) -> Markup {
    match o {
        Err(r) => html! { p.error { "Rejected: " (r.reason()) } },
        Ok(messages) if messages.is_empty() => {
            html! { p { "No message (marked published, nothing sent)." } }
        }
        Ok(messages) => html! {
            @for m in messages {
                dl.message {
                    dt { "Sink, topic" } dd { (m.sink) " " code { (m.topic) } }
                    dt { "Key" } dd { code { (m.key.as_deref().map(String::from_utf8_lossy).unwrap_or_default()) } }
                    @if let Some(p) = m.partition { dt { "Partition" } dd { (p) } }
                    @if !m.headers.is_empty() {
                        dt { "Headers" } dd { @for (k, v) in &m.headers { code { (k) "=" (v) } " " } }
                    }
                    dt { "Payload" } dd { pre { (shorten(&String::from_utf8_lossy(&m.payload))) } }
                }
            }
        },
    }
}

fn shorten(t: &str) -> String {
    if t.len() > 2048 {
        format!("{}… ({} bytes)", &t[..t.floor_char_boundary(2048)], t.len())
    } else {
        t.to_string()
    }
}
