//! Sleeping while idle, the relay's side (the database's is
//! `store/postgres/wake.rs`, which explains why no wake-up is lost).
//!
//! A lease-mode source on the pending queue whose workers keep finding
//! nothing falls asleep in three steps, taken by worker 0 at successive
//! empty claims once its polling has backed off to `relay.poll_max` and no
//! batch is in flight ([`Drowsy`]): record the source asleep (inserts start
//! notifying), wait until the transactions then in progress have ended,
//! then one more empty claim over every owned lane. Asleep, every worker
//! waits for a notification (the LISTEN task), a change of its lanes, or
//! [`SLEEP_BACKSTOP`]; the background tasks run every [`IDLE_EVERY`]
//! instead of every second or two. Anything claimed wakes the source.

use std::sync::atomic::Ordering as AtomicOrdering;

use super::*;

/// The longest an asleep source goes without a claim: a backstop for a
/// notification that never came (a LISTEN connection that died silently is
/// found within `store.statement_timeout` and wakes the workers anyway).
pub(super) const SLEEP_BACKSTOP: Duration = Duration::from_secs(30);

/// The channel the pending queue's trigger notifies a sleeping source on,
/// with the table's name as payload.
pub(super) const WAKE_CHANNEL: &str = "outroute_wake";

/// How often the background tasks (backlog gauge, quarantine records, claim
/// floors) run while the source sleeps; they run again at once when it wakes.
pub(super) const IDLE_EVERY: Duration = Duration::from_secs(30);

/// How often worker 0 asks whether the transactions it waits for on its way
/// to sleep have ended.
const SETTLED_EVERY: Duration = Duration::from_secs(1);

/// Worker 0's way into sleep, one step per empty claim.
#[derive(Debug, Default)]
pub(super) enum Drowsy {
    /// Polling as usual.
    #[default]
    Awake,
    /// Recorded asleep; waiting for these transactions (in progress right
    /// after the record) to end, asked about again from the instant given
    /// (once a second: a long transaction must not cost a statement per poll).
    Waiting(Vec<i64>, Instant),
    /// They have: the next empty claim over every lane puts it to sleep
    /// (and the state starts over for the next time).
    Settled,
}

impl Relay {
    pub(super) fn is_asleep(&self) -> bool {
        *self.asleep.borrow()
    }

    /// One step towards sleep after an empty claim that covered every owned
    /// lane (see the module comment).
    pub(super) async fn drift_off(&self, state: &mut Drowsy) {
        let Some(pg) = self.store.postgres().filter(|p| p.wakes()) else {
            return;
        };
        if !matches!(state, Drowsy::Awake) && !self.recorded_asleep.load(AtomicOrdering::Acquire) {
            // Another worker claimed events meanwhile and recorded the
            // source awake: start over.
            *state = Drowsy::Awake;
        }
        *state = match std::mem::take(state) {
            Drowsy::Awake => match pg.fall_asleep().await {
                Ok(Some(running)) => {
                    self.recorded_asleep.store(true, AtomicOrdering::Release);
                    Drowsy::Waiting(running, Instant::now())
                }
                Ok(None) => Drowsy::Awake,
                Err(e) => {
                    tracing::debug!("could not record the source asleep: {e:#}");
                    Drowsy::Awake
                }
            },
            Drowsy::Waiting(running, next) if Instant::now() < next => {
                Drowsy::Waiting(running, next)
            }
            Drowsy::Waiting(running, _) => match pg.settled(&running).await {
                Ok(true) => Drowsy::Settled,
                Ok(false) => Drowsy::Waiting(running, Instant::now() + SETTLED_EVERY),
                Err(e) => {
                    tracing::debug!("could not check the transactions in progress: {e:#}");
                    Drowsy::Waiting(running, Instant::now() + SETTLED_EVERY)
                }
            },
            Drowsy::Settled => {
                // This empty claim began after every transaction that could
                // have missed the record had ended: what commits from now on
                // notifies.
                self.asleep.send_replace(true);
                metrics::gauge!(m::SOURCE_ASLEEP, "source" => self.source.clone()).set(1.0);
                tracing::debug!("idle: sleeping until the next insert");
                Drowsy::Awake
            }
        };
    }

    /// Whether the source sleeps or is recorded asleep (on its way).
    pub(super) fn drowsy(&self) -> bool {
        self.is_asleep() || self.recorded_asleep.load(AtomicOrdering::Acquire)
    }

    /// Something to do (events claimed): the source is awake, and recorded
    /// so if it was asleep or on its way (inserts stop notifying).
    pub(super) async fn stir(&self) {
        if self.asleep.send_replace(false) {
            metrics::gauge!(m::SOURCE_ASLEEP, "source" => self.source.clone()).set(0.0);
            tracing::debug!("awake");
        }
        if self.recorded_asleep.swap(false, AtomicOrdering::AcqRel)
            && let Some(pg) = self.store.postgres()
            && let Err(e) = pg.wake_up().await
        {
            tracing::debug!("could not record the source awake: {e:#}");
        }
    }

    /// Wait while asleep: until a notification (`notified`), a change of
    /// the lane set, another worker waking the source, the backstop or
    /// shutdown.
    pub(super) async fn sleep(
        &self,
        notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
        leases: &mut watch::Receiver<LeaseView>,
        lanes: &[i32],
        shutdown: &CancellationToken,
    ) {
        let mut awake = self.asleep.subscribe();
        let lanes_changed = async {
            // A lease round sends a new view every round; only a different
            // set of lanes may bring rows nobody will notify about (a dead
            // relay's pending events).
            while leases.changed().await.is_ok() {
                let mut now = leases.borrow_and_update().lanes.clone();
                now.sort_unstable();
                let mut before = lanes.to_vec();
                before.sort_unstable();
                if now != before {
                    return;
                }
            }
        };
        let backstop = tokio::select! {
            _ = shutdown.cancelled() => false,
            _ = notified => false,
            _ = lanes_changed => false,
            _ = awake.wait_for(|asleep| !*asleep) => false,
            _ = tokio::time::sleep(SLEEP_BACKSTOP) => true,
        };
        if backstop
            && let Some(pg) = self.store.postgres()
            && let Err(e) = pg.still_asleep().await
        {
            tracing::debug!("could not renew the asleep record: {e:#}");
        }
    }

    /// A background task's pause: `every` while awake; while asleep up to
    /// [`IDLE_EVERY`], ended early when the source wakes.
    pub(super) async fn background_pause(&self, every: Duration, shutdown: &CancellationToken) {
        if !self.is_asleep() {
            sleep_or_cancel(every, shutdown).await;
            return;
        }
        let mut asleep = self.asleep.subscribe();
        tokio::select! {
            _ = shutdown.cancelled() => {},
            _ = asleep.wait_for(|a| !*a) => {},
            _ = tokio::time::sleep(IDLE_EVERY) => {},
        }
    }
}
