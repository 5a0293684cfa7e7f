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
//! worker 0's backstop once every [`IDLE_EVERY`]; the background tasks run
//! then too instead of every second or two, and the lease rounds go over
//! the LISTEN connection, so a sleeping source holds one connection.
//!
//! Anything claimed wakes the source.
//!
//! Sleeping is for sources with no events for a second or two: a source
//! asleep costs its producers a notification per insert (at their commit,
//! under a lock every notifying commit of the server takes in turn, held
//! through its WAL flush: 99 quiet databases at 10 inserts/s each queued
//! every producer behind it for seconds). A source whose events merely
//! trickle stays awake, and costs about one claim per event instead of a
//! polling back-off after each ([`Pace`]): worker 0 alone polls it, about
//! once per the gap between its events lately (up to `relay.poll_max`).

use std::sync::atomic::Ordering as AtomicOrdering;

use tokio::sync::{mpsc, oneshot};

use super::background::QuietJob;
use super::*;

/// How often an asleep source's worker 0 claims anyway (a backstop for a
/// notification that never came; a LISTEN connection that died silently is
/// found by its next lease round) and its background tasks (backlog gauge,
/// quarantine records, retention) run. They come together at one moment of
/// each period, fixed per source so that sources spread over it, one task
/// [`IDLE_TURN`] after the other: the one pool connection opened for them
/// serves them all and closes again (`store/postgres.rs`, idle timeout).
/// The claim floors' round runs then too: its sweep below the floors finds
/// a row committed late below them, which no claim sees.
pub(super) const IDLE_EVERY: Duration = Duration::from_secs(60);

/// The gap between two of an asleep source's tasks at its idle moment.
const IDLE_TURN: Duration = Duration::from_millis(250);

/// An asleep source's tasks, in their turn at its idle moment.
#[derive(Debug, Clone, Copy)]
pub(super) enum IdleTurn {
    Backstop = 0,
    Backlog = 1,
    Quarantine = 2,
    Retention = 3,
    Floors = 4,
    Slot = 5,
}

/// The channel the pending queue's trigger notifies a sleeping source on,
/// with the table's name as payload.
pub(super) const WAKE_CHANNEL: &str = "outroute_wake";

/// How long a sleeping source's claim waits for the LISTEN task before it
/// runs on the pool instead (the task may be reconnecting).
const QUIET_ANSWER: Duration = Duration::from_secs(5);

/// How often worker 0 asks whether the transactions it waits for on its way
/// to sleep have ended.
const SETTLED_EVERY: Duration = Duration::from_secs(1);

/// The event rate (per second) below which a source counts as slow: its
/// worker 0 alone polls it, about once per expected event.
pub(super) const TRICKLE_RATE: f64 = 100.0;

/// How many events a source's workers claimed in the current second and
/// the one before: its pace, which sets how often an awake source polls
/// and whether it may fall asleep.
#[derive(Debug, Default)]
pub struct Pace {
    since: Option<Instant>,
    this: u32,
    last: u32,
}

impl Pace {
    fn roll(&mut self, now: Instant) {
        match self.since {
            None => self.since = Some(now),
            Some(since) if now.duration_since(since) >= Duration::from_secs(1) => {
                self.last = if now.duration_since(since) >= Duration::from_secs(2) {
                    0
                } else {
                    self.this
                };
                self.this = 0;
                self.since = Some(now);
            }
            Some(_) => {}
        }
    }

    fn add(&mut self, events: usize, now: Instant) {
        self.roll(now);
        self.this = self.this.saturating_add(events as u32);
    }

    /// Events per second lately: the last second's, or the current one's
    /// so far if faster (counted over at least a quarter of a second).
    fn rate(&mut self, now: Instant) -> f64 {
        self.roll(now);
        let so_far = self
            .since
            .map(|s| now.duration_since(s).as_secs_f64())
            .unwrap_or(0.0)
            .max(0.25);
        f64::from(self.last).max(f64::from(self.this) / so_far)
    }

    /// At most one event in the last second or two.
    fn quiet(&mut self, now: Instant) -> bool {
        self.roll(now);
        self.this + self.last <= 1
    }
}

/// Worker 0's way into sleep, one step per empty claim.
#[derive(Debug, Default)]
pub(super) enum Drowsy {
    /// Polling as usual.
    #[default]
    Awake,
    /// Polling; the source must not sleep (events retrying or deferred,
    /// they come due by the clock), asked again from the instant given.
    Barred(Instant),
    /// Recorded asleep; waiting for these transactions (in progress right
    /// after the record) to end, asked about again from the instant given
    /// (once a second: a long transaction must not cost a statement per poll).
    Waiting(Vec<i64>, Instant),
    /// They have: the next empty claim over every lane puts it to sleep
    /// (and the state starts over for the next time).
    Settled,
}

impl Drowsy {
    /// Events woke the source: the way to sleep starts over (a bar on
    /// sleeping stays until it is due).
    pub(super) fn stirred(&mut self) {
        if !matches!(self, Drowsy::Barred(_)) {
            *self = Drowsy::Awake;
        }
    }
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
        if matches!(state, Drowsy::Waiting(..) | Drowsy::Settled)
            && !self.recorded_asleep.load(AtomicOrdering::Acquire)
        {
            // Another worker claimed events meanwhile and recorded the
            // source awake: start over.
            *state = Drowsy::Awake;
        }
        *state = match std::mem::take(state) {
            Drowsy::Barred(until) if Instant::now() < until => Drowsy::Barred(until),
            Drowsy::Awake | Drowsy::Barred(_) => match self.record_asleep(pg).await {
                Ok(Some(running)) => Drowsy::Waiting(running, Instant::now()),
                Ok(None) => Drowsy::Barred(Instant::now() + SETTLED_EVERY),
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

    /// Record the source asleep (see `PgStore::fall_asleep`), under the
    /// recording lock so a late "awake" cannot overwrite it.
    async fn record_asleep(
        &self,
        pg: &crate::store::postgres::PgStore,
    ) -> anyhow::Result<Option<Vec<i64>>> {
        let _recording = self.recording.lock().await;
        let r = pg.fall_asleep().await;
        if matches!(r, Ok(Some(_))) {
            self.recorded_asleep.store(true, AtomicOrdering::Release);
        }
        r
    }

    /// A claim: while the source sleeps, on the LISTEN connection
    /// (`quiet`, see [`QuietJob`]); otherwise, or if the LISTEN task does
    /// not answer (reconnecting), on the pool.
    pub(super) async fn claim(
        &self,
        lanes: &[i32],
        limit: u32,
        quiet: Option<&mpsc::Sender<QuietJob>>,
    ) -> anyhow::Result<crate::store::Claimed> {
        let job = |reply| QuietJob::Claim {
            lanes: lanes.to_vec(),
            limit,
            reply,
        };
        match self.ask_quiet(quiet, "claim", QUIET_ANSWER, job).await {
            Some(claims) => Ok(claims),
            None => self.store.claim(lanes, limit).await,
        }
    }

    /// Hand `job` to the LISTEN task if the source sleeps, and wait up to
    /// `wait` for its answer; `None`: awake, no LISTEN task, or it failed
    /// or did not answer (the caller runs `what` on the pool instead).
    pub(super) async fn ask_quiet<T>(
        &self,
        quiet: Option<&mpsc::Sender<QuietJob>>,
        what: &str,
        wait: Duration,
        job: impl FnOnce(oneshot::Sender<anyhow::Result<T>>) -> QuietJob,
    ) -> Option<T> {
        let quiet = quiet.filter(|_| self.is_asleep())?;
        let (reply, answer) = oneshot::channel();
        quiet.try_send(job(reply)).ok()?;
        match tokio::time::timeout(wait, answer).await {
            Ok(Ok(Ok(t))) => Some(t),
            Ok(Ok(Err(e))) => {
                tracing::debug!(
                    "{what} on the LISTEN connection failed, on the pool instead: {e:#}"
                );
                None
            }
            _ => {
                tracing::debug!("the LISTEN task did not answer; {what} on the pool");
                None
            }
        }
    }

    fn pace(&self) -> std::sync::MutexGuard<'_, Pace> {
        // Poisoned only by a panic mid-count: the counts are still usable.
        self.pace.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Count `events` claimed or streamed (for [`Pace`]).
    pub(crate) fn paced(&self, events: usize) {
        self.pace().add(events, Instant::now());
    }

    /// Events come slower than [`TRICKLE_RATE`].
    pub(crate) fn slow(&self) -> bool {
        self.pace().rate(Instant::now()) < TRICKLE_RATE
    }

    /// The gap between events at the pace they came lately; zero when none
    /// came.
    pub(super) fn expected_gap(&self) -> Duration {
        let rate = self.pace().rate(Instant::now());
        if rate > 0.0 {
            Duration::from_secs_f64(1.0 / rate)
        } else {
            Duration::ZERO
        }
    }

    /// No events lately (see [`Pace::quiet`]): the source may fall asleep.
    pub(super) fn quiet_lately(&self) -> bool {
        self.pace().quiet(Instant::now())
    }

    /// Whether the source sleeps or is recorded asleep (on its way).
    pub(super) fn drowsy(&self) -> bool {
        self.is_asleep() || self.recorded_asleep.load(AtomicOrdering::Acquire)
    }

    /// Something to do (events claimed): the source is awake, at once for
    /// the other workers and for worker 0's way to sleep. Returns whether
    /// the caller is to record it awake ([`Relay::record_awake`]) after its
    /// batch (not before: the first event after a quiet spell does not
    /// wait for it).
    pub(super) fn stir(&self) -> bool {
        if self.asleep.send_replace(false) {
            metrics::gauge!(m::SOURCE_ASLEEP, "source" => self.source.clone()).set(0.0);
            tracing::debug!("awake");
        }
        self.recorded_asleep.swap(false, AtomicOrdering::AcqRel)
    }

    /// Record the source awake (inserts stop notifying), unless worker 0
    /// recorded it asleep again meanwhile: that newer record stands.
    pub(super) async fn record_awake(&self) {
        let _recording = self.recording.lock().await;
        if self.recorded_asleep.load(AtomicOrdering::Acquire) {
            return;
        }
        if let Some(pg) = self.store.postgres()
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
        tokio::select! {
            _ = shutdown.cancelled() => {},
            _ = notified => {},
            _ = lanes_changed => {},
            _ = awake.wait_for(|asleep| !*asleep) => {},
            _ = tokio::time::sleep_until(self.idle_moment(IdleTurn::Backstop)) => {},
        }
    }

    /// The next idle moment of this source for task `turn` (see
    /// [`IDLE_EVERY`]).
    fn idle_moment(&self, turn: IdleTurn) -> tokio::time::Instant {
        use std::hash::{Hash, Hasher};
        static ORIGIN: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
        let origin = *ORIGIN.get_or_init(tokio::time::Instant::now);
        let period = IDLE_EVERY.as_millis() as u64;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.source.hash(&mut h);
        let offset = h.finish() % period + turn as u64 * IDLE_TURN.as_millis() as u64;
        let now = origin.elapsed().as_millis() as u64;
        // The first moment ≡ offset (mod period) after now.
        let next = now - now % period + offset % period;
        let next = if next <= now { next + period } else { next };
        origin + Duration::from_millis(next)
    }

    /// A background task's pause: `every` while awake; while asleep until
    /// the source's idle moment for `turn`, ended early when it wakes.
    pub(super) async fn background_pause(
        &self,
        every: Duration,
        turn: IdleTurn,
        shutdown: &CancellationToken,
    ) {
        self.paced_pause(every, every, turn, shutdown).await
    }

    /// [`Relay::background_pause`] for a task that runs less often while
    /// events come slowly (claimed or streamed): `slow_every` then, ended
    /// early when a worker finds them coming fast ([`Relay::hurry`]).
    pub(super) async fn paced_pause(
        &self,
        every: Duration,
        slow_every: Duration,
        turn: IdleTurn,
        shutdown: &CancellationToken,
    ) {
        if !self.is_asleep() {
            if slow_every > every && self.slow() {
                let hurry = self.hurry.notified();
                tokio::select! {
                    _ = shutdown.cancelled() => {},
                    _ = hurry => {},
                    _ = tokio::time::sleep(slow_every) => {},
                }
            } else {
                sleep_or_cancel(every, shutdown).await;
            }
            return;
        }
        let mut asleep = self.asleep.subscribe();
        tokio::select! {
            _ = shutdown.cancelled() => {},
            _ = asleep.wait_for(|a| !*a) => {},
            _ = tokio::time::sleep_until(self.idle_moment(turn)) => {},
        }
    }
}
