//! The HTTP endpoint of `outroute run` (`[http] listen`): `/metrics`
//! (Prometheus text from the recorder `metrics.rs` installed), `/healthz`
//! (the process lives), `/readyz` (what `health.rs` says is up, `?strict`
//! for all of it), `/shadow` (shadow comparisons, which show event
//! content: only with the bearer token `http.token`) and, with
//! `[http.console]`, the operator console under `/console`
//! (`console/mod.rs`).

use anyhow::{Context, Result};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::health::Readiness;

#[derive(Clone)]
struct AppState {
    prom: PrometheusHandle,
    ready: Readiness,
    /// `http.token`: what the endpoints showing event content require.
    token: Option<crate::config::Secret>,
}

/// The request carries `Authorization: Bearer <http.token>` (compared in
/// constant time); always false without a configured token.
fn authorised(token: Option<&crate::config::Secret>, headers: &axum::http::HeaderMap) -> bool {
    let Some(token) = token else {
        return false;
    };
    let Some(given) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    crate::console::session::same_secret(given.as_bytes(), token.expose().as_bytes())
}

/// `/shadow`: the shadow plugins' differences, which show payload bytes,
/// keys and headers of live events — only with the bearer token.
async fn shadow(
    State(s): State<AppState>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if !authorised(s.token.as_ref(), &headers) {
        let why = if s.token.is_none() {
            "/shadow shows event content: set http.token (or OUTROUTE_HTTP__TOKEN, http.token_file) to serve it\n"
        } else {
            "/shadow needs `Authorization: Bearer <http.token>`\n"
        };
        return (
            StatusCode::UNAUTHORIZED,
            [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
            why,
        )
            .into_response();
    }
    axum::Json(crate::shadow::report()).into_response()
}

async fn metrics(State(s): State<AppState>) -> String {
    s.prom.render()
}

/// `/readyz`: ready while some source is live; `/readyz?strict`: only
/// while every source, sink and route is up. Either lists what is not.
async fn readyz(State(s): State<AppState>, uri: axum::http::Uri) -> (StatusCode, String) {
    let strict = uri.query().is_some_and(|q| {
        q.split('&')
            .any(|p| p == "strict" || p.starts_with("strict="))
    });
    let a = s.ready.assess(true).await;
    let code = if a.ready(strict) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, a.render(strict))
}

/// Serve `/metrics`, `/healthz`, `/readyz` (open), `/shadow` (with
/// `token` only) and the console (with `console` only) until `shutdown`.
pub async fn serve(
    listen: &str,
    prom: PrometheusHandle,
    ready: Readiness,
    token: Option<crate::config::Secret>,
    console: Option<crate::config::ConsoleConfig>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<tokio::task::JoinHandle<()>> {
    let console = console
        .filter(|c| !c.tokens.is_empty())
        .map(|c| crate::console::router(c, ready.clone(), shutdown.clone()));
    let serves_console = console.is_some();
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/shadow", get(shadow))
        .with_state(AppState {
            prom,
            ready: ready.clone(),
            token,
        });
    let app = match console {
        Some(c) => app.merge(c),
        None => app,
    };
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => anyhow::bail!(
            "http.listen: cannot bind {listen}: the address is in use (another relay on this host?). \
             Give each relay its own address, e.g. OUTROUTE_HTTP__LISTEN=127.0.0.1:9465, or port 0 for \
             any free port (logged at start), or \"\" for no HTTP endpoint"
        ),
        Err(e) => return Err(e).with_context(|| format!("http.listen: cannot bind {listen}")),
    };
    let bound = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| listen.to_string());
    if serves_console {
        tracing::info!(listen = %bound, "serving /metrics, /healthz, /readyz and the console at /console");
    } else {
        tracing::info!(listen = %bound, "serving /metrics, /healthz, /readyz");
    }
    tokio::spawn(ready.watch(shutdown.clone()));
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
    }))
}
