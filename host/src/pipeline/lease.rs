//! A batch's hold on its lanes: the lease epochs it was claimed under and
//! how long they stay valid. Sending stops waiting for acknowledgements a
//! safety margin before a lease lapses ([`LeaseGuard::still_valid`]), and marks
//! carry the epochs ([`LeaseGuard::stamp`]) so a relay that lost its lanes
//! marks nothing.

use super::*;

/// The lanes a batch was claimed from, checked before every event is sent
/// and bounding how long acknowledgements are awaited: a relay never sends
/// for lanes it no longer holds.
#[derive(Clone)]
pub struct LeaseGuard {
    view: watch::Receiver<LeaseView>,
    /// The claimed lanes, each with its lease epoch at claim time.
    lanes: Vec<(i32, i64)>,
    /// The claimed lanes are all in the current view, same epochs.
    lanes_owned: bool,
}

/// The lanes a relay may claim from, and until when that is safe.
#[derive(Debug, Clone)]
pub struct LeaseView {
    pub lanes: Vec<i32>,
    /// Each lane's lease epoch (same order as `lanes`).
    pub epochs: Vec<i64>,
    pub valid_until: Instant,
}

impl LeaseView {
    pub(crate) fn epoch_of(&self, lane: i32) -> Option<i64> {
        self.lanes
            .iter()
            .position(|l| *l == lane)
            .and_then(|i| self.epochs.get(i).copied())
    }
}

impl LeaseGuard {
    /// Guard a batch claimed from `lanes` under `claimed_under` (the view
    /// the claim was made with: its epochs are the ones the batch may use).
    /// A lane missing from that view makes the guard not held.
    pub fn new(
        view: watch::Receiver<LeaseView>,
        claimed_under: &LeaseView,
        lanes: Vec<i32>,
    ) -> Self {
        let missing = lanes.iter().any(|l| claimed_under.epoch_of(*l).is_none());
        let lanes = lanes
            .into_iter()
            .map(|l| (l, claimed_under.epoch_of(l).unwrap_or(-1)))
            .collect();
        let mut g = LeaseGuard {
            view,
            lanes,
            lanes_owned: false,
        };
        g.refresh();
        g.lanes_owned &= !missing;
        g
    }

    fn refresh(&mut self) {
        let v = self.view.borrow_and_update();
        self.lanes_owned = self.lanes.iter().all(|(l, e)| v.epoch_of(*l) == Some(*e));
    }

    /// Stamp each claim with its lane's epoch, for the mark's fencing.
    pub fn stamp(&self, claims: &mut [Claim]) {
        for c in claims {
            c.epoch = self
                .lanes
                .iter()
                .find(|(l, _)| *l == c.lane)
                .map(|(_, e)| *e);
        }
    }

    /// Every claimed lane is still in the current, unexpired lease view
    /// (lanes released over the fair share or lost leave the view at once).
    pub fn still_valid(&mut self) -> bool {
        if self.view.has_changed().unwrap_or(true) {
            self.refresh();
        }
        self.lanes_owned && Instant::now() < self.view.borrow().valid_until
    }

    pub(super) fn valid_until(&self) -> Instant {
        self.view.borrow().valid_until
    }

    /// The current view's validity while every claimed lane is still in it
    /// with its claim-time epoch (a lease round may have renewed it since
    /// the batch began); `None` once a lane was released or taken over.
    pub(super) fn renewed_until(&self) -> Option<Instant> {
        let v = self.view.borrow();
        self.lanes
            .iter()
            .all(|(l, e)| v.epoch_of(*l) == Some(*e))
            .then_some(v.valid_until)
    }
}
