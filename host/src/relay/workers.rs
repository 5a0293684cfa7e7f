//! The run loop of a source's relay: the lease keeper and background tasks
//! started beside `relay.concurrency` workers, each of which claims a batch
//! from the lanes no other worker has in flight and hands it to
//! [`Relay::process`]; a supervisor restarts a worker that failed.

use super::background::QuietJob;
use super::sleep::{Drowsy, WAKE_CHANNEL};
use super::*;

/// A task aborted when this is dropped: a task that must not outlive its
/// owner (a detached task would keep running after a shutdown gave up on
/// it).
pub(crate) struct AbortOnDrop<T = ()>(pub tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Spawn a task in the current span (so a source's background tasks and
/// workers log with its `source` field).
pub(super) fn spawn_here<F>(f: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(f.in_current_span())
}

impl Relay {
    /// Run until `shutdown` is cancelled, then stop leasing, let in-flight
    /// batches finish (bounded by `relay.shutdown_timeout`) and give the lanes
    /// back.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<()> {
        let wake = Arc::new(Notify::new());
        let (lease_tx, lease_rx) = watch::channel(LeaseView {
            lanes: Vec::new(),
            epochs: Vec::new(),
            valid_until: Instant::now(),
        });
        let stop_leasing = CancellationToken::new();
        // LISTEN for the pending queue's wake-ups (a sleeping source, see
        // `relay/sleep.rs`) and for the producers' own NOTIFY, if any; a
        // sleeping source's lease rounds go over the same connection.
        let mut channels = Vec::new();
        if self.store.postgres().is_some_and(|p| p.wakes()) {
            channels.push(WAKE_CHANNEL.to_string());
        }
        channels.extend(self.config.notify_channel.clone());
        let (quiet_tx, quiet_rx) = tokio::sync::mpsc::channel(4);
        let quiet_tx = (!channels.is_empty() && !self.streams()).then_some(quiet_tx);
        let mut background = vec![
            spawn_here(self.clone().keep_leases(
                lease_tx,
                quiet_tx.clone(),
                stop_leasing.clone(),
                wake.clone(),
            )),
            spawn_here(
                self.clone()
                    .watch_backlog(quiet_tx.clone(), shutdown.clone()),
            ),
            spawn_here(self.clone().reload_plugins(shutdown.clone())),
            spawn_here(
                self.clone()
                    .follow_quarantines(quiet_tx.clone(), shutdown.clone()),
            ),
            spawn_here(self.clone().watch_failed(shutdown.clone())),
        ];
        if self.streams() {
            // One stream (slot or binlog) instead of lane workers.
            background.push(spawn_here(self.clone().watch_slot(shutdown.clone())));
            // Binlog capture marks rows as lease mode does: published ones
            // are kept until retention deletes them.
            if self.store.binlog().is_some()
                && let Some(retention) = self.config.retention
            {
                background.push(spawn_here(self.clone().purge(retention, shutdown.clone())));
            }
            let capture = spawn_here(self.clone().run_capture(lease_rx, shutdown.clone()));
            shutdown.cancelled().await;
            tracing::info!(source = %self.source, "stopping: finishing the in-flight batch");
            let mut capture = AbortOnDrop(capture);
            if tokio::time::timeout(self.config.shutdown_timeout, &mut capture.0)
                .await
                .is_err()
            {
                // Stopped, not left running: a successor in this process
                // streams from the confirmed position under the same relay
                // id, and must not meet this session still publishing,
                // cleaning up or recording.
                capture.0.abort();
                let _ = (&mut capture.0).await;
                tracing::warn!(
                    "the in-flight batch did not finish in time: stopped; the slot re-reads it"
                );
            }
            stop_leasing.cancel();
            for t in background {
                t.abort();
            }
            for sink in self.sinks.values() {
                sink.flush().await;
            }
            if !self.handing_over.load(std::sync::atomic::Ordering::Acquire)
                && let Err(e) = self.store.release_all().await
            {
                tracing::warn!(
                    "could not release the capture lease (it lapses after lease_ttl): {e:#}"
                );
            }
            return Ok(());
        }
        // One warm plugin instance per worker, made while the first lease
        // round runs, so the workers' first batches do not instantiate.
        for plugin in self.plugins.iter().filter_map(|p| p.current()) {
            let workers = self.config.concurrency as usize;
            tokio::task::spawn_blocking(move || plugin.warm(workers));
        }
        if matches!(*self.store, Store::Postgres(_) | Store::MySql(_)) {
            background.push(spawn_here(self.clone().raise_floors(
                lease_rx.clone(),
                quiet_tx.clone(),
                wake.clone(),
                shutdown.clone(),
            )));
        }
        if let Some(retention) = self.config.retention {
            background.push(spawn_here(self.clone().purge(retention, shutdown.clone())));
        }
        if !channels.is_empty() {
            background.push(spawn_here(self.clone().listen(
                channels,
                quiet_rx,
                wake.clone(),
                shutdown.clone(),
            )));
        }
        let mut workers = tokio::task::JoinSet::new();
        for i in 0..self.config.concurrency {
            workers.spawn(
                self.clone()
                    .supervise(
                        i,
                        lease_rx.clone(),
                        quiet_tx.clone(),
                        wake.clone(),
                        shutdown.clone(),
                    )
                    .in_current_span(),
            );
        }

        shutdown.cancelled().await;
        tracing::info!(source = %self.source, "stopping: finishing in-flight batches");
        let drained = tokio::time::timeout(self.config.shutdown_timeout, async {
            while workers.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            // Stopped, not left running: a successor in this process (a
            // reload) claims the same lanes under the same relay id, and
            // must not meet these batches still publishing, marking or
            // recording a hold behind its back.
            workers.abort_all();
            while workers.join_next().await.is_some() {}
            tracing::warn!(
                timeout = ?self.config.shutdown_timeout,
                "in-flight batches did not finish in time: stopped; their rows stay pending (sent messages may go out again) and lanes lapse after lease_ttl"
            );
        }
        stop_leasing.cancel();
        for t in background {
            t.abort();
        }
        for sink in self.sinks.values() {
            sink.flush().await;
        }
        if drained.is_ok()
            && !self.handing_over.load(std::sync::atomic::Ordering::Acquire)
            && let Err(e) = self.store.release_all().await
        {
            tracing::warn!("could not release lanes (they lapse after lease_ttl): {e:#}");
        }
        Ok(())
    }

    /// Keep worker `index` running: a bug that panics inside a batch must not
    /// silently stop its lanes (they would stay leased and never move).
    pub(super) async fn supervise(
        self: Arc<Self>,
        index: u32,
        leases: watch::Receiver<LeaseView>,
        quiet: Option<tokio::sync::mpsc::Sender<QuietJob>>,
        wake: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        loop {
            // Aborted with its supervisor (a shutdown that timed out).
            let mut worker = AbortOnDrop(spawn_here(self.clone().work(
                index,
                leases.clone(),
                quiet.clone(),
                wake.clone(),
                shutdown.clone(),
            )));
            match (&mut worker.0).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::error!(
                        worker = index,
                        "worker crashed, restarting it (its batch stays pending): {e}"
                    );
                    sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                    if shutdown.is_cancelled() {
                        return;
                    }
                }
            }
        }
    }

    /// One worker: claim → process → repeat, polling adaptively when idle.
    pub(super) async fn work(
        self: Arc<Self>,
        index: u32,
        mut leases: watch::Receiver<LeaseView>,
        quiet: Option<tokio::sync::mpsc::Sender<QuietJob>>,
        wake: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        let mut idle = self.config.poll_min;
        // How far an idle worker backs off: to `poll_max`, from where a
        // source on the pending queue falls asleep; one that cannot sleep
        // (no trigger to wake it) goes on to `poll_idle_max`.
        let idle_ceiling = if self.store.postgres().is_some_and(|p| p.wakes()) {
            self.config.poll_max
        } else {
            self.config.poll_idle_max.max(self.config.poll_max)
        };
        let mut outage_backoff = Duration::from_millis(100);
        // The claim walks the lanes in the order given and stops at a full
        // batch: start at the next lane each time so every lane gets its
        // turn at the front however deep the others' backlogs are.
        // Workers start at different places, so two claims at once mostly
        // walk different lanes.
        let mut turn = index as usize * 7;
        // Slow start: a worker's first claim takes an eighth of a batch and
        // each full one doubles it up to `relay.batch_size`, so after a
        // (re)start the first events go out after a short claim and a short
        // publish, not after a full batch of each.
        let mut size = (self.config.batch_size / 8).max(1);
        // Worker 0 puts an idle source to sleep (`relay/sleep.rs`).
        let mut drowsy = Drowsy::default();
        while !shutdown.is_cancelled() {
            let view = leases.borrow_and_update().clone();
            let mut lanes: Vec<i32> = if Instant::now() < view.valid_until {
                view.lanes.clone()
            } else {
                Vec::new()
            };
            if lanes.is_empty() {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = leases.changed() => {},
                    _ = tokio::time::sleep(self.config.poll_max) => {},
                }
                continue;
            }
            let first = turn % lanes.len();
            lanes.rotate_left(first);
            turn = turn.wrapping_add(1);
            let owned = lanes.len();
            let free = self.in_flight.free(&lanes);
            let lanes = free.lanes();
            if lanes.is_empty() {
                // Every lane has a batch in flight in another worker.
                sleep_or_cancel(self.config.poll_min, &shutdown).await;
                continue;
            }
            // Listen for wake-ups from before the claim: a NOTIFY for a
            // commit the claim's snapshot missed still ends the idle wait.
            let notified = wake.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let claim_started = Instant::now();
            let crate::store::Claimed { claims, drained } =
                match self.claim(&lanes, size, quiet.as_ref()).await {
                    Ok(c) => {
                        metrics::histogram!(m::CLAIM_SECONDS, "source" => self.source.clone())
                            .record(claim_started.elapsed().as_secs_f64());
                        self.health.set_store_ok();
                        c
                    }
                    Err(e) => {
                        self.health.store_failed(&e);
                        tracing::warn!(worker = index, "claim failed: {e:#}");
                        sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                        continue;
                    }
                };
            let with_rows: std::collections::HashSet<i32> = claims.iter().map(|c| c.lane).collect();
            let reserved = self.in_flight.take(&free, &with_rows);
            let claims = if reserved.lanes.len() < with_rows.len() {
                // Another worker took some of these lanes meanwhile: their
                // rows stay pending (its batch or the next claim has them).
                let taken: std::collections::HashSet<i32> =
                    reserved.lanes.iter().copied().collect();
                let kept: Vec<Claim> = claims
                    .into_iter()
                    .filter(|c| taken.contains(&c.lane))
                    .collect();
                if kept.is_empty() {
                    drop(reserved);
                    sleep_or_cancel(self.config.poll_min, &shutdown).await;
                    continue;
                }
                kept
            } else {
                claims
            };
            if claims.is_empty() {
                drop(reserved);
                if self.is_asleep() {
                    if index == 0 {
                        self.sleep(notified, &mut leases, &view.lanes, &shutdown)
                            .await;
                    } else {
                        // Worker 0 alone answers notifications and keeps
                        // the backstop (one claim, on one connection, for
                        // the first event after a quiet spell); the others
                        // wait for the source to wake.
                        let mut awake = self.asleep.subscribe();
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = awake.wait_for(|asleep| !*asleep) => {},
                        }
                    }
                    idle = self.config.poll_min;
                    continue;
                }
                if index == 0
                    && idle >= self.config.poll_max
                    && lanes.len() == owned
                    && self.in_flight.none()
                    && self.quiet_lately()
                {
                    // Polling has backed off, no events came for a second
                    // or two and nothing is in flight: one step towards
                    // sleep per empty claim over every lane.
                    self.drift_off(&mut drowsy).await;
                    if self.is_asleep() {
                        continue;
                    }
                }
                if index != 0 && self.slow() {
                    // Events come slowly: worker 0 alone polls for them;
                    // this one waits until it finds more (`Relay::hurry`).
                    let hurry = self.hurry.notified();
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = hurry => {},
                        _ = leases.changed() => {},
                        // In case worker 0 is held up in a long batch.
                        _ = tokio::time::sleep(self.config.poll_idle_max.max(self.config.poll_max)) => {},
                    }
                    idle = self.config.poll_min;
                    continue;
                }
                // About one poll per event the source gets lately, however
                // slowly they come (`sleep.rs`, `Pace`); from the fastest
                // pace up when they come fast or not at all.
                let pause = idle.max(self.expected_gap()).min(idle_ceiling);
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = notified => idle = self.config.poll_min,
                    _ = tokio::time::sleep(pause) => idle = (pause * 2).min(idle_ceiling),
                }
                continue;
            }
            // Events: the source is awake (recorded so after this batch).
            let full = claims.len() as u32 >= size;
            self.paced(claims.len());
            if full || !self.slow() {
                // Events come fast: every worker polls again.
                self.hurry.notify_waiters();
            }
            let record_awake = self.drowsy() && {
                drowsy.stirred();
                self.stir()
            };
            if full {
                size = (size * 2).min(self.config.batch_size);
            }
            let now = Utc::now();
            let pickup = metrics::histogram!(m::PICKUP, "source" => self.source.clone());
            for ev in claims.iter().filter_map(|c| c.row.as_ref().ok()) {
                if ev.attempts == 0 {
                    pickup.record(seconds_since(ev.created_at, now));
                }
            }
            failpoint::hit("after-claim");
            // The lanes with the epochs of the view the claim was made under.
            let mut lease = LeaseGuard::new(leases.clone(), &view, reserved.lanes.clone());
            let mut claims = claims;
            lease.stamp(&mut claims);
            let span = tracing::info_span!("batch", worker = index, events = claims.len());
            let processed = self
                .process(claims, Some(&mut lease))
                .instrument(span)
                .await;
            if record_awake {
                self.record_awake().await;
            }
            match processed {
                Ok(report) if report.outage => {
                    tracing::warn!(backoff = ?outage_backoff, reason = report.outage_reason.as_deref().unwrap_or(""), "every publish failed; backing off");
                    sleep_or_cancel(jitter(outage_backoff), &shutdown).await;
                    outage_backoff = (outage_backoff * 2).min(Duration::from_secs(10));
                }
                Ok(_) => {
                    drop(reserved);
                    outage_backoff = Duration::from_millis(100);
                    idle = self.config.poll_min;
                    if !full {
                        // Took every event there was, and they come
                        // slowly: the next is about one gap away.
                        let pause = if drained && lanes.len() == owned && self.slow() {
                            self.expected_gap().min(idle_ceiling)
                        } else {
                            self.config.poll_min
                        };
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = notified => {},
                            _ = tokio::time::sleep(pause) => {},
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(
                        worker = index,
                        "batch failed, its events stay pending: {e:#}"
                    );
                    sleep_or_cancel(Duration::from_secs(1), &shutdown).await;
                }
            }
        }
    }
}
