//! The operator console: web pages the relay serves itself at `/console`
//! on its HTTP listener, off unless `[http.console]` names a token.
//!
//! A shared relay is run by a platform team and used by many service teams
//! who will never read a Prometheus query. The console shows them what the
//! CLI, `/metrics` and `/readyz` know — is my source behind, which of my
//! events failed and why, is my route quarantined — and lets an operator
//! act on it: retry or discard a failed event, resume a quarantined route.
//!
//! - **Pages** are rendered on the server (maud) and readable without
//!   JavaScript; a small script (`assets/console.js`) only refreshes the
//!   overview's charts and shows times in the viewer's timezone. Every
//!   asset is compiled into the binary: no CDN, no second server.
//! - **Who** (`session.rs`): a token from `[http.console.tokens]` signs in
//!   for a session. A `viewer` sees state, counts and failure reasons but
//!   no payload or header value; an `operator` sees them and acts. A token
//!   with a `team` sees only that team's routes, their events and the
//!   sources they read: every page *and* every request behind it checks,
//!   so another team's event is "not found" whichever URL asks for it.
//! - **Trying** (`try_plugin.rs`): a candidate plugin on a route's last
//!   real events beside the active one, messages side by side; nothing is
//!   published.
//! - **Acting** (`failed.rs`, `routes.rs`): a confirmation page, then a
//!   `POST` with the session's CSRF token; each action is written to the
//!   audit log in the source's store and to the relay's log (`audit.rs`).
//! - **Fleet-wide**: relays, their lanes and the capture lease are read
//!   from the store, so any relay's console shows every relay of a source.
//! - **Charts** (`history.rs`): the last hour of each source, sampled from
//!   what the relay counts in memory every few seconds; a page view runs
//!   statements only for what it shows (failed events, the fleet).

mod audit;
mod configuration;
mod failed;
pub mod history;
mod layout;
mod overview;
mod routes;
pub mod session;
mod try_plugin;

use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use maud::Markup;

use crate::config::{ConsoleConfig, Loaded};
use crate::health::{Readiness, ReadyView};
use crate::plugin::Runtime;
pub use configuration::note_reload;
use history::History;
use session::{Session, Sessions};

/// What every console request sees.
#[derive(Clone)]
pub struct Console {
    config: Arc<ConsoleConfig>,
    ready: Readiness,
    sessions: Arc<Sessions>,
    history: Arc<History>,
    /// The plugin engine for trying candidates, made at the first try.
    runtime: Arc<OnceLock<Runtime>>,
}

/// The routes under `/console`, and the sampling of the charts until
/// `stop`.
pub fn router(
    config: ConsoleConfig,
    ready: Readiness,
    stop: tokio_util::sync::CancellationToken,
) -> Router {
    let history = Arc::new(History::default());
    tokio::spawn(history.clone().keep(ready.clone(), stop));
    let console = Console {
        config: Arc::new(config),
        ready,
        sessions: Arc::new(Sessions::default()),
        history,
        runtime: Arc::new(OnceLock::new()),
    };
    Router::new()
        .route("/console", get(overview::page))
        .route("/console/", get(overview::page))
        .route("/console/live", get(overview::live))
        .route("/console/login", get(login_page).post(login))
        .route("/console/logout", post(logout))
        .route("/console/failed", get(failed::list))
        .route("/console/failed/{source}/{id}", get(failed::event))
        .route(
            "/console/failed/{source}/{id}/{action}",
            get(failed::confirm).post(failed::act),
        )
        .route("/console/routes", get(routes::list))
        .route(
            "/console/routes/{source}/{route}/resume",
            get(routes::confirm).post(routes::resume),
        )
        .route(
            "/console/try",
            get(try_plugin::page).post(try_plugin::run).layer(
                axum::extract::DefaultBodyLimit::max(try_plugin::MAX_UPLOAD + (1 << 20)),
            ),
        )
        .route(
            "/console/plugins/{plugin}/promote",
            get(routes::confirm_promote).post(routes::promote),
        )
        .route("/console/config", get(configuration::page))
        .route("/console/assets/{file}", get(asset))
        .with_state(console)
}

impl Console {
    /// The signed-in session of this request, if any.
    fn session(&self, headers: &HeaderMap) -> Option<Session> {
        let id = session::cookie(headers)?;
        self.sessions.get(&self.config, &id)
    }

    /// The plugin engine candidates are tried on.
    fn runtime(&self, loaded: &Loaded) -> Result<Runtime, String> {
        if let Some(r) = self.runtime.get() {
            return Ok(r.clone());
        }
        let r = Runtime::new(loaded.cache_dir()).map_err(|e| format!("{e:#}"))?;
        Ok(self.runtime.get_or_init(|| r).clone())
    }

    /// The parts and config running now.
    fn view(&self) -> (ReadyView, Option<Arc<Loaded>>) {
        let view = self.ready.get();
        let loaded = view.loaded.clone();
        (view, loaded)
    }
}

/// The headers every console page carries: nothing cached, nothing
/// framed, no script or style from anywhere but the relay.
fn secured(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // `same-origin`: the console's own forms carry their `Origin` (with
    // `no-referrer` a browser sends `Origin: null`).
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    r
}

/// A page.
fn html(status: StatusCode, m: Markup) -> Response {
    secured((status, axum::response::Html(m.into_string())).into_response())
}

/// No session: pages send the browser to sign in; anything else is 401.
fn sign_in_first(page: bool) -> Response {
    if page {
        secured(Redirect::to("/console/login").into_response())
    } else {
        secured(
            (
                StatusCode::UNAUTHORIZED,
                "sign in first: POST /console/login with a token\n",
            )
                .into_response(),
        )
    }
}

/// What a scoped token must not see: the same answer as for something
/// that does not exist, so nothing about another team's events leaks.
fn not_found(s: &Session, what: &str) -> Response {
    html(
        StatusCode::NOT_FOUND,
        layout::page(
            "Not found",
            Some(s),
            layout::Nav::None,
            maud::html! { p { (what) " is not here, or not yours to see." } },
        ),
    )
}

/// Refused: a viewer tried to act, or the form's CSRF token is wrong.
fn forbidden(s: &Session, why: &str) -> Response {
    html(
        StatusCode::FORBIDDEN,
        layout::page(
            "Not allowed",
            Some(s),
            layout::Nav::None,
            maud::html! { p { (why) } },
        ),
    )
}

/// An acting request may go on: the session is an operator's and the
/// form carries its CSRF token; a cross-site `Origin` is refused too.
fn may_act(s: &Session, csrf: &str, headers: &HeaderMap) -> Result<(), Box<Response>> {
    if !s.operator() {
        return Err(Box::new(forbidden(
            s,
            "This token is a viewer's: it sees, it does not act.",
        )));
    }
    if !session::same_secret(csrf.as_bytes(), s.csrf.as_bytes()) {
        return Err(Box::new(forbidden(
            s,
            "The form is out of date or came from elsewhere (CSRF token). Reload the page and try again.",
        )));
    }
    // A browser that hides the origin sends `null` (or nothing): the CSRF
    // token above is what protects then.
    let origin = headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .filter(|o| *o != "null");
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    if let (Some(origin), Some(host)) = (origin, host) {
        let origin_host = origin.split("://").nth(1).unwrap_or(origin);
        if origin_host != host {
            return Err(Box::new(forbidden(
                s,
                "The request came from another site.",
            )));
        }
    }
    Ok(())
}

#[derive(serde::Deserialize)]
struct LoginForm {
    token: String,
}

#[derive(serde::Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

async fn login_page(State(c): State<Console>, headers: HeaderMap) -> Response {
    if c.session(&headers).is_some() {
        return secured(Redirect::to("/console").into_response());
    }
    html(StatusCode::OK, layout::login(None))
}

/// Sign in: a known token gets a session cookie; anything else a 401
/// that says only that the token was not accepted.
async fn login(State(c): State<Console>, axum::Form(f): axum::Form<LoginForm>) -> Response {
    let Some(id) = c.sessions.sign_in(&c.config, f.token.trim()) else {
        tracing::warn!("console: a sign-in with an unknown token was refused");
        return html(
            StatusCode::UNAUTHORIZED,
            layout::login(Some("That token was not accepted.")),
        );
    };
    let cookie = format!(
        "{}={id}; HttpOnly; SameSite=Strict; Path=/console; Max-Age={}",
        session::COOKIE,
        Sessions::max_age(&c.config).as_secs()
    );
    let mut r = Redirect::to("/console").into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    secured(r)
}

async fn logout(
    State(c): State<Console>,
    headers: HeaderMap,
    axum::Form(f): axum::Form<CsrfForm>,
) -> Response {
    if let (Some(id), Some(s)) = (session::cookie(&headers), c.session(&headers))
        && session::same_secret(f.csrf.as_bytes(), s.csrf.as_bytes())
    {
        c.sessions.sign_out(&id);
    }
    let mut r = Redirect::to("/console/login").into_response();
    r.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static(
            "outroute_console=; HttpOnly; SameSite=Strict; Path=/console; Max-Age=0",
        ),
    );
    secured(r)
}

/// The stylesheet and script, compiled in.
async fn asset(axum::extract::Path(file): axum::extract::Path<String>) -> Response {
    let (body, kind) = match file.as_str() {
        "console.css" => (
            include_str!("assets/console.css"),
            "text/css; charset=utf-8",
        ),
        "console.js" => (
            include_str!("assets/console.js"),
            "text/javascript; charset=utf-8",
        ),
        _ => return (StatusCode::NOT_FOUND, "no such asset\n").into_response(),
    };
    let mut r = (StatusCode::OK, body).into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    r.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}
