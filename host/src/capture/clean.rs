//! The cleaner of logical capture: per mark every partition worker handled,
//! in stream order, delete the rows of the events before it (in bulk), then
//! confirm the slot up to it ([`Relay::clean`]). Binlog capture records its
//! position instead (`binlog.rs`).

use super::*;

/// Work for the cleaner: the rows to delete and the slot position to
/// confirm after.
pub(super) struct CleanupJob {
    pub(super) rows: CapturedRows,
    pub(super) confirm: Option<Lsn>,
}

impl CleanupJob {
    /// Append `later`, the next job in stream order: its rows, and its
    /// position if it has one.
    fn merge(&mut self, later: CleanupJob) {
        self.rows.append(later.rows);
        if later.confirm.is_some() {
            self.confirm = later.confirm;
        }
    }
}

/// How long the cleaner waits for more work while a job holds fewer than
/// [`CLEANUP_CHUNK`] rows (see [`Relay::clean`]).
pub(super) const CLEANUP_LINGER: Duration = Duration::from_millis(100);

/// Take the marks up to `all` off the queue: their events' rows and the
/// last one's position.
pub(super) fn confirmable(
    marks: &mut std::collections::VecDeque<(u64, Lsn, CapturedRows)>,
    all: u64,
) -> CleanupJob {
    let mut rows = CapturedRows::default();
    let mut confirm = None;
    while marks.front().is_some_and(|(n, _, _)| *n <= all) {
        if let Some((_, lsn, r)) = marks.pop_front() {
            rows.append(r);
            confirm = Some(lsn);
        }
    }
    CleanupJob { rows, confirm }
}

impl Relay {
    /// The cleaner: per confirmable mark, in stream order, delete the rows
    /// of the events before it, then confirm the slot up to it. It stops (and
    /// so the stream restarts from the confirmed position) on a failed
    /// delete or a lost lease.
    pub(super) async fn clean(
        self: Arc<Self>,
        mut work: mpsc::Receiver<CleanupJob>,
        confirm: watch::Sender<Lsn>,
        mut lease: LeaseGuard,
    ) {
        let Some(pg) = self.store.logical() else {
            return;
        };
        let table = self
            .capture
            .as_ref()
            .is_some_and(|l| l.input == LogicalInput::Table);
        let mut noted: Option<Instant> = None;
        while let Some(mut job) = work.recv().await {
            // Take the jobs queued behind it too, and while they hold few
            // rows wait up to CLEANUP_LINGER for more: at a trickle every
            // event is a mark of its own, and one DELETE and one confirm per
            // event cost the relay and PostgreSQL more than the event's
            // publishing. The slot is confirmed that much later (a crash
            // republishes it: duplicates, never a loss).
            let linger = tokio::time::Instant::now() + CLEANUP_LINGER;
            while job.rows.seqs.len() < CLEANUP_CHUNK {
                match tokio::time::timeout_at(linger, work.recv()).await {
                    Ok(Some(more)) => job.merge(more),
                    // Shutdown (the sender is gone) or time: clean now.
                    Ok(None) | Err(_) => break,
                }
            }
            if table && !job.rows.is_empty() {
                match pg.delete_captured(&job.rows).await {
                    Ok(n) if n > 0 => {
                        metrics::counter!(m::PURGED, "source" => self.source.clone()).increment(n)
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!("deleting captured rows failed: {e:#}");
                        return;
                    }
                }
            }
            failpoint::hit("mid-mark");
            if !lease.still_valid() {
                tracing::warn!(
                    "capture lease lost before confirming; the next owner re-reads from the confirmed position"
                );
                return;
            }
            if let Some(to) = job.confirm {
                let _ = confirm.send(to);
                // Now and then on record: after a promotion it says where
                // what may have been missed begins.
                if noted.is_none_or(|at| at.elapsed() >= CONFIRMED_NOTE_INTERVAL) {
                    if let Err(e) = pg.note_confirmed(&to.to_string()).await {
                        tracing::debug!("recording the confirmed position: {e:#}");
                    }
                    noted = Some(Instant::now());
                }
            }
        }
    }
}
