//! A sink still starting: one whose broker could not be reached (or whose
//! stream could not be created) when the relay started or reloaded.
//!
//! It stands in the sink map under the sink's name, so every route keeps
//! its place, and builds the real sink again in the background with
//! backoff until it works. Until then every message for it fails as
//! [`PublishError::Unavailable`]: the events of the routes that publish to
//! it wait (no attempt counted, nothing marked) exactly as they do when a
//! running broker goes away, and every other sink and route runs on. Once
//! built it passes everything through to the real sink.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use tokio::sync::Semaphore;

use super::{Ack, Outgoing, Permit, PublishError, Sink};

/// Builds the real sink (one attempt).
pub type Build = Box<dyn Fn() -> BoxFuture<'static, anyhow::Result<Arc<dyn Sink>>> + Send + Sync>;

/// Longest wait between two attempts to build the sink.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Longest one attempt may take (a JetStream request to a server that is
/// not there waits for its timeout).
const ATTEMPT: Duration = Duration::from_secs(10);

pub struct StartingSink {
    name: String,
    built: OnceLock<Arc<dyn Sink>>,
    /// Why the last attempt failed, and since when the sink is not up.
    down: Mutex<(String, DateTime<Utc>)>,
}

impl StartingSink {
    /// A sink `name` whose first build failed with `first_error`; `build`
    /// is tried again in the background until it succeeds or the sink is
    /// dropped (a reload replaced it).
    pub fn spawn(name: &str, first_error: &anyhow::Error, build: Build) -> Arc<Self> {
        tracing::warn!(sink = %name, "sink not started, retrying in the background (routes publishing to it wait): {first_error:#}");
        let sink = Arc::new(StartingSink {
            name: name.to_string(),
            built: OnceLock::new(),
            down: Mutex::new((format!("{first_error:#}"), Utc::now())),
        });
        tokio::spawn(retry(Arc::downgrade(&sink), build));
        sink
    }

    fn unavailable(&self) -> PublishError {
        let why = self.down.lock().map(|d| d.0.clone()).unwrap_or_default();
        PublishError::Unavailable(format!("sink `{}` is not started yet: {why}", self.name))
    }
}

/// Build the sink until it works, with backoff; stops when nobody holds
/// the [`StartingSink`] any more.
async fn retry(sink: Weak<StartingSink>, build: Build) {
    let mut backoff = Duration::from_millis(250);
    loop {
        tokio::time::sleep(crate::backoff::jitter(backoff)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        if sink.strong_count() == 0 {
            return;
        }
        let result = match tokio::time::timeout(ATTEMPT, build()).await {
            Ok(r) => r,
            Err(_) => Err(anyhow::anyhow!("no answer within {}s", ATTEMPT.as_secs())),
        };
        let Some(s) = sink.upgrade() else {
            return;
        };
        match result {
            Ok(built) => {
                let _ = s.built.set(built);
                tracing::info!(sink = %s.name, "sink started");
                return;
            }
            Err(e) => {
                tracing::debug!(sink = %s.name, "sink still not started: {e:#}");
                if let Ok(mut d) = s.down.lock() {
                    d.0 = format!("{e:#}");
                }
            }
        }
    }
}

#[async_trait::async_trait]
impl Sink for StartingSink {
    fn in_flight(&self) -> Option<&Arc<Semaphore>> {
        self.built.get().and_then(|s| s.in_flight())
    }

    async fn send(&self, m: Outgoing<'_>, permit: Permit) -> Result<Ack, PublishError> {
        match self.built.get() {
            Some(s) => s.send(m, permit).await,
            None => Err(self.unavailable()),
        }
    }

    fn session(&self) -> u64 {
        self.built.get().map_or(0, |s| s.session())
    }

    fn keeps_order_in_flight(&self) -> bool {
        self.built.get().is_none_or(|s| s.keeps_order_in_flight())
    }

    async fn abandon(&self) {
        if let Some(s) = self.built.get() {
            s.abandon().await;
        }
    }

    async fn connected(&self) -> bool {
        match self.built.get() {
            Some(s) => s.connected().await,
            None => false,
        }
    }

    fn down_reason(&self) -> Option<(String, DateTime<Utc>)> {
        match self.built.get() {
            Some(s) => s.down_reason(),
            None => self.down.lock().ok().map(|d| d.clone()),
        }
    }

    async fn flush(&self) {
        if let Some(s) = self.built.get() {
            s.flush().await;
        }
    }
}
