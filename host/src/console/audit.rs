//! The console's audit log: every action taken from the console — who
//! (the token's name), what (`retry`, `discard`, `resume`), on what (an
//! event id, a route), when, and what came of it — appended to the
//! source's store (`outroute_audit`) and written to the relay's log. An
//! entry the store cannot take is still logged, with why.

use chrono::Utc;

use super::session::Session;
use crate::store::{AuditEntry, Store};

pub async fn record(
    store: &Store,
    s: &Session,
    source: &str,
    action: &str,
    subject: &str,
    outcome: &str,
) {
    let entry = AuditEntry {
        at: Utc::now(),
        source: source.to_string(),
        who: s.name.clone(),
        action: action.to_string(),
        subject: subject.to_string(),
        outcome: outcome.to_string(),
    };
    let stored = store.audit(&entry).await;
    match stored {
        Ok(()) => tracing::info!(
            target: "outroute::audit",
            who = %entry.who, team = s.team.as_deref().unwrap_or("-"), source, action, subject, outcome,
            "console action"
        ),
        Err(e) => tracing::warn!(
            target: "outroute::audit",
            who = %entry.who, team = s.team.as_deref().unwrap_or("-"), source, action, subject, outcome,
            "console action (not in the store's audit log: {e:#})"
        ),
    }
}
