//! Configuration: the config running (secrets and URL passwords shown as
//! `***`), each team's grant and team file — accepted, or refused with
//! its reasons — and the last reload's result. A team's token sees its own
//! team's part only.

use std::sync::Mutex;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use chrono::{DateTime, Utc};
use maud::html;

use super::layout::{self, Nav};
use super::{Console, html, sign_in_first};
use crate::config::Config;

/// The last reload: when, its result (`applied`, `unchanged`,
/// `rejected`) and what it said.
static LAST_RELOAD: Mutex<Option<(DateTime<Utc>, String, String)>> = Mutex::new(None);

/// Remember a reload's result for the page (`ops/run.rs` calls it).
pub fn note_reload(result: &str, detail: String) {
    let mut last = LAST_RELOAD.lock().unwrap_or_else(|e| e.into_inner());
    *last = Some((Utc::now(), result.to_string(), detail));
}

/// The config as shown: the credentials in source and NATS URLs masked
/// as every log line masks them (`Secret`s already show as `***`).
fn shown(config: &Config) -> String {
    let mut c = config.clone();
    for s in c.sources.values_mut() {
        s.url = crate::config::redact_url(&s.url);
    }
    for sink in c.sinks.values_mut() {
        if let crate::config::SinkConfig::Nats(n) = sink {
            n.url = crate::config::redact_url(&n.url);
        }
    }
    toml::to_string_pretty(&c).unwrap_or_else(|e| format!("(cannot show the config: {e})"))
}

pub async fn page(State(c): State<Console>, headers: HeaderMap) -> Response {
    let Some(s) = c.session(&headers) else {
        return sign_in_first(true);
    };
    let (view, loaded) = c.view();
    let Some(loaded) = loaded else {
        return sign_in_first(true);
    };
    let team = s.team.clone();
    let grants: Vec<_> = loaded
        .config
        .grants
        .iter()
        .filter(|(t, _)| team.as_ref().is_none_or(|mine| mine == *t))
        .collect();
    let accepted: Vec<_> = loaded
        .accepted_teams
        .iter()
        .filter(|(t, _, _)| team.as_ref().is_none_or(|mine| mine == t))
        .collect();
    // A refused file names no team we could trust: a team's token sees
    // the refusals of files it has a good copy of, or named after it.
    let refused: Vec<_> = loaded
        .refused
        .iter()
        .filter(|r| {
            team.is_none()
                || accepted.iter().any(|(_, f, _)| *f == r.file)
                || team.as_deref() == r.file.file_stem().and_then(|x| x.to_str())
        })
        .collect();
    let last = LAST_RELOAD
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let body = html! {
        h2 { "Last reload" }
        @match &last {
            None => p { "No reload since the relay started." },
            Some((at, result, detail)) => {
                p { (layout::time(*at)) ": " strong { (result) } }
                @if s.team.is_none() { pre.detail { (detail) } }
            },
        }
        h2 { "Team files" }
        @if accepted.is_empty() && refused.is_empty() { p { "None." } }
        ul.teams {
            @for (t, f, _) in &accepted { li { "team " strong { (t) } ": " code { (f.display()) } " — accepted" } }
            @for r in &refused {
                li.refused {
                    code { (r.file.display()) } " — refused ("
                    (if r.last_good { "its last known good copy runs" } else { "its routes do not run; their events wait" })
                    ")"
                    ul { @for p in &r.problems { li { code { (p.key) } ": " (p.reason) } } }
                }
            }
        }
        h2 { "Grants" }
        @if grants.is_empty() { p { "None." } }
        @for (t, g) in &grants {
            h3 { "Team " (t) }
            pre { (toml::to_string_pretty(g).unwrap_or_default()) }
        }
        @if s.team.is_none() {
            h2 { "Effective configuration" }
            p.hint { "Secrets and URL passwords are shown as ***. Sources up: "
                (view.sources.iter().filter(|(_, h)| h.database.is_up()).count()) " of " (view.sources.len()) "." }
            pre.config { (shown(&loaded.config)) }
        } @else {
            h2 { "Your routes" }
            @for r in loaded.config.routes.iter().filter(|r| s.sees_route(r)) {
                h3 { code { (r.name) } }
                pre { (toml::to_string_pretty(r).unwrap_or_default()) }
            }
        }
    };
    html(
        StatusCode::OK,
        layout::page("Configuration", Some(&s), Nav::Config, body),
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_config_shown_masks_every_credential() {
        let text = "[sources.orders]\nurl = \"postgres://relay:pg-secret@db/orders\"\n\
                    [sinks.nats]\nkind = \"nats\"\nurl = \"nats://nats-token-secret@nats:4222\"\n\
                    [http.console.tokens.ops]\nrole = \"operator\"\ntoken = \"console-token-secret\"\n";
        let config: crate::config::Config = match toml::from_str(text) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        let shown = super::shown(&config);
        for secret in ["pg-secret", "nats-token-secret", "console-token-secret"] {
            assert!(!shown.contains(secret), "{secret} shown:\n{shown}");
        }
        assert!(shown.contains("***"), "{shown}");
    }
}
