//! Which lanes have a batch in flight. A lane is in at most one batch at a
//! time, so the events of one aggregate are never in two batches (the
//! ordering rules in `pipeline.rs` work within a batch); workers claim from
//! the lanes free when they start and keep only those no batch took since.

use std::collections::HashMap;

/// The lanes with events in a batch in flight: a lane is in at most one
/// batch at a time, so the events of one aggregate are never in two
/// batches (the ordering rules in `pipeline.rs` work within a batch).
///
/// Workers claim at the same time (each from the lanes free when it
/// starts) and take a lane only if no batch had it since their claim
/// began: every release bumps the lane's generation, so a claim whose
/// snapshot may predate another batch's marks and failure records never
/// uses that lane; its rows there stay pending for the next claim.
#[derive(Debug, Default)]
pub struct InFlight(std::sync::Mutex<HashMap<i32, Lane>>);

/// One lane's place in [`InFlight`].
#[derive(Debug, Default, Clone, Copy)]
pub struct Lane {
    busy: bool,
    /// Releases so far.
    generation: u64,
}

/// The free lanes a claim starts from, with their generations.
pub struct Free(Vec<(i32, u64)>);

/// Lanes one worker took; given back when dropped (also on a panic).
pub struct Reserved<'a> {
    set: &'a InFlight,
    pub lanes: Vec<i32>,
}

impl InFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, Lane>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Those of `lanes` (in order) that no batch has now.
    pub fn free(&self, lanes: &[i32]) -> Free {
        let set = self.lock();
        Free(
            lanes
                .iter()
                .filter_map(|l| match set.get(l) {
                    Some(s) if s.busy => None,
                    s => Some((*l, s.map_or(0, |s| s.generation))),
                })
                .collect(),
        )
    }

    /// Take the lanes of `with_rows` that are still as `free` saw them;
    /// the others were taken (and maybe given back) meanwhile.
    pub fn take(&self, free: &Free, with_rows: &std::collections::HashSet<i32>) -> Reserved<'_> {
        let mut set = self.lock();
        let lanes = free
            .0
            .iter()
            .filter(|(l, _)| with_rows.contains(l))
            .filter_map(|(l, generation)| {
                let s = set.entry(*l).or_default();
                (!s.busy && s.generation == *generation).then(|| {
                    s.busy = true;
                    *l
                })
            })
            .collect();
        Reserved { set: self, lanes }
    }
}

impl InFlight {
    /// No lane has a batch in flight.
    pub fn none(&self) -> bool {
        self.lock().values().all(|l| !l.busy)
    }
}

impl Free {
    pub fn lanes(&self) -> Vec<i32> {
        self.0.iter().map(|(l, _)| *l).collect()
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        let mut set = self.set.lock();
        for l in &self.lanes {
            let s = set.entry(*l).or_default();
            s.busy = false;
            s.generation += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn a_lane_is_in_one_batch_and_never_taken_from_a_claim_older_than_its_last_batch() {
        let f = InFlight::default();
        let all = [0, 1, 2, 3];
        // Two workers claim at once from the same free lanes.
        let a_free = f.free(&all);
        let b_free = f.free(&all);
        let a = f.take(&a_free, &HashSet::from([0, 1]));
        assert_eq!(a.lanes, vec![0, 1]);
        // B's claim also found rows in lane 1: A has it, so B keeps only 2.
        let b = f.take(&b_free, &HashSet::from([1, 2]));
        assert_eq!(b.lanes, vec![2]);
        assert_eq!(f.free(&all).lanes(), vec![3]);
        // A's batch ends; lane 0 is free again, but a claim that began while
        // A had it (or before A gave it back) may not take it.
        let stale = f.free(&[3]);
        let before_release = Free(vec![(0, 0)]);
        drop(a);
        assert!(
            f.take(&before_release, &HashSet::from([0]))
                .lanes
                .is_empty()
        );
        let fresh = f.free(&[0]);
        assert_eq!(f.take(&fresh, &HashSet::from([0])).lanes, vec![0]);
        // Lanes without rows are never taken.
        assert!(f.take(&stale, &HashSet::new()).lanes.is_empty());
        drop(b);
        assert_eq!(f.free(&all).lanes(), vec![0, 1, 2, 3]);
    }
}
