//! Who is signed in to the console: a token from `[http.console.tokens]`
//! is exchanged once for a session (a random id in an `HttpOnly`,
//! `SameSite=Strict` cookie), which carries the token's name, role and
//! team, and a CSRF token every form that acts must send back.
//!
//! Sessions live in this process only (a restart signs everyone out) and
//! are bounded: at most [`MAX_SESSIONS`], the oldest dropped first, so a
//! client signing in over and over cannot grow the relay's memory.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::RngCore;

use crate::config::{ConsoleConfig, ConsoleRole, Loaded, RouteConfig};

/// The cookie that holds the session id.
pub const COOKIE: &str = "outroute_console";

/// Most sessions kept at once.
const MAX_SESSIONS: usize = 10_000;

/// A signed-in token: what it may see and do.
#[derive(Clone, Debug)]
pub struct Session {
    /// The token's name in `[http.console.tokens]`: who the audit log names.
    pub name: String,
    pub role: ConsoleRole,
    /// Only this team's routes and events; `None`: all of them.
    pub team: Option<String>,
    /// What every acting form sends back (`csrf`).
    pub csrf: String,
    expires: Instant,
}

impl Session {
    /// May act (retry, discard, resume) and see payloads and headers.
    pub fn operator(&self) -> bool {
        self.role == ConsoleRole::Operator
    }

    /// Sees route `r` (and its events): every route without a team, else
    /// the routes its team owns.
    pub fn sees_route(&self, r: &RouteConfig) -> bool {
        self.team.as_deref().is_none_or(|t| r.owner() == t)
    }

    /// Sees an event whose failure names `route` (`None`: no route took
    /// it, e.g. a row that was not an event; `team:<t>`: a refused team
    /// file's stand-in route).
    pub fn sees_event_of(&self, loaded: &Loaded, route: Option<&str>) -> bool {
        match &self.team {
            None => true,
            Some(team) => route.is_some() && loaded.owner_of(route).0 == *team,
        }
    }

    /// The names of the routes it sees.
    pub fn route_names<'a>(&self, loaded: &'a Loaded) -> Vec<&'a str> {
        loaded
            .config
            .routes
            .iter()
            .filter(|r| self.sees_route(r))
            .map(|r| r.name.as_str())
            .collect()
    }

    /// Sees source `name`: some route it sees reads it.
    pub fn sees_source(&self, loaded: &Loaded, name: &str) -> bool {
        self.team.is_none()
            || loaded
                .config
                .routes
                .iter()
                .any(|r| self.sees_route(r) && crate::config::Config::route_reads(r, name))
    }

    /// The role as the page shows it, with the team.
    pub fn describe(&self) -> String {
        let role = match self.role {
            ConsoleRole::Viewer => "viewer",
            ConsoleRole::Operator => "operator",
        };
        match &self.team {
            Some(t) => format!("{} ({role}, team {t})", self.name),
            None => format!("{} ({role})", self.name),
        }
    }
}

/// The signed-in sessions by id.
#[derive(Default)]
pub struct Sessions(Mutex<HashMap<String, Session>>);

/// `a == b` in time that depends only on their lengths.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

fn random_hex() -> String {
    let mut b = [0u8; 32];
    rand::rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sign in with `token`: the new session's id, or `None` when no
    /// configured token is `token` (every token is compared, each in
    /// constant time).
    pub fn sign_in(&self, console: &ConsoleConfig, token: &str) -> Option<String> {
        let mut found = None;
        for (name, t) in &console.tokens {
            let Some(secret) = &t.token else { continue };
            if same_secret(secret.expose().as_bytes(), token.as_bytes()) {
                found = Some((name, t));
            }
        }
        let (name, t) = found?;
        let id = random_hex();
        let session = Session {
            name: name.clone(),
            role: t.role,
            team: t.team.clone(),
            csrf: random_hex(),
            expires: Instant::now() + console.session_ttl,
        };
        let mut all = self.lock();
        let now = Instant::now();
        all.retain(|_, s| s.expires > now);
        while all.len() >= MAX_SESSIONS {
            let Some(oldest) = all
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            all.remove(&oldest);
        }
        all.insert(id.clone(), session);
        Some(id)
    }

    /// The live session `id`, if any. A session whose token no longer
    /// has the same role and team in `console` (changed at a restart) is
    /// not live.
    pub fn get(&self, console: &ConsoleConfig, id: &str) -> Option<Session> {
        let mut all = self.lock();
        let s = all.get(id)?.clone();
        let still = console
            .tokens
            .get(&s.name)
            .is_some_and(|t| t.role == s.role && t.team == s.team);
        if s.expires <= Instant::now() || !still {
            all.remove(id);
            return None;
        }
        Some(s)
    }

    pub fn sign_out(&self, id: &str) {
        self.lock().remove(id);
    }

    /// How long sessions last, for the cookie's `Max-Age`.
    pub fn max_age(console: &ConsoleConfig) -> Duration {
        console.session_ttl
    }
}

/// The session id in the request's `Cookie` header.
pub fn cookie(headers: &axum::http::HeaderMap) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ConsoleToken, Secret};

    fn console() -> ConsoleConfig {
        let mut c = ConsoleConfig::default();
        c.tokens.insert(
            "ops".into(),
            ConsoleToken {
                role: ConsoleRole::Operator,
                team: None,
                token: Some(Secret::new("ops-token-0123456789")),
                token_file: None,
            },
        );
        c.tokens.insert(
            "payments".into(),
            ConsoleToken {
                role: ConsoleRole::Viewer,
                team: Some("payments".into()),
                token: Some(Secret::new("payments-token-0123456789")),
                token_file: None,
            },
        );
        c
    }

    #[test]
    fn a_token_signs_in_as_its_name_and_a_wrong_one_does_not() {
        let c = console();
        let s = Sessions::default();
        assert!(s.sign_in(&c, "ops-token-012345678").is_none());
        assert!(s.sign_in(&c, "").is_none());
        let Some(id) = s.sign_in(&c, "payments-token-0123456789") else {
            panic!("the payments token was refused");
        };
        let Some(got) = s.get(&c, &id) else {
            panic!("no session after signing in");
        };
        assert_eq!(got.name, "payments");
        assert_eq!(got.team.as_deref(), Some("payments"));
        assert!(!got.operator());
        assert!(s.get(&c, "not-a-session").is_none());
        s.sign_out(&id);
        assert!(s.get(&c, &id).is_none());
    }

    #[test]
    fn a_session_ends_when_its_token_changes_role() {
        let mut c = console();
        let s = Sessions::default();
        let Some(id) = s.sign_in(&c, "payments-token-0123456789") else {
            panic!("refused");
        };
        if let Some(t) = c.tokens.get_mut("payments") {
            t.role = ConsoleRole::Operator;
        }
        assert!(s.get(&c, &id).is_none());
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut h = axum::http::HeaderMap::new();
        h.insert(
            axum::http::header::COOKIE,
            axum::http::HeaderValue::from_static("a=1; outroute_console=abc; b=2"),
        );
        assert_eq!(cookie(&h).as_deref(), Some("abc"));
    }
}
