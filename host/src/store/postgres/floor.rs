//! Claim floors: where each lane's walk starts, so a claim never steps over
//! the rows already published.
//!
//! Marking a row (UPDATE or DELETE) leaves its entry in the lane index until
//! VACUUM removes it (under the pending queue, the default, publishing
//! deletes the event's queue entry, which stays in the queue's index the
//! same way; the rounds then walk the queue, see `floor_round_queue`). Every claim walks a lane from its oldest pending entry,
//! so without help it steps over every row the lane published since the last
//! VACUUM: on a server with autovacuum off (or behind), draining a 1M backlog
//! got slower the further it went. A *floor* per lane lets the claim start at
//! `seq >= floor` instead: one index descent straight past the dead entries.
//!
//! The floor is only an optimisation of *where to start looking*; it must
//! never pass a row that is or may become pending, or that row would be
//! skipped. Two things could put one below it:
//!
//! * **Rows not yet visible.** A producer's transaction takes its sequence
//!   number at insert and may commit later, so a row with a lower `seq` can
//!   appear after higher ones were seen. A floor candidate is therefore
//!   computed from a snapshot *and only applied once every transaction that
//!   was running when the previous round looked has ended* (the later
//!   snapshot's `xmin` is past the earlier one's `xmax`), and it never goes
//!   past `M + 1`, where `M` is a sequence number this relay saw before that
//!   earlier round: anything allocated since is higher. (One window remains:
//!   a transaction whose *first* write is the outbox insert, between the
//!   `nextval` of its row and the moment it gets its transaction id — a few
//!   microseconds inside one INSERT, longer only under a slow `BEFORE INSERT`
//!   trigger. The sweep below still finds such a row.)
//! * **Rows that become pending again.** `failed retry` clears a failed
//!   row's marker. The floor never passes the lowest sequence number of any
//!   event with a state row that is not discarded (retrying, failed).
//!
//! As a backstop, every [`SWEEP_INTERVAL`] a round also looks below each
//! floor; a pending row found there lowers the floor to it (and is logged),
//! so nothing is ever left behind. Floors are kept per lane in the relay's
//! memory; a relay that takes a lane over starts it from the bottom.
//! Tables ordered by a timestamp (no `sequence` column), a nullable
//! sequence column or a sequence with `CACHE` > 1 (a session may insert a
//! lower number after another's higher one) get no floors.
//!
//! `M` is per lane too, and the *latest* claim's, not the highest ever: a
//! row with an explicit sequence number far above the rest (an import, a
//! `setval` backwards) would otherwise lift every lane's floor above every
//! row to come, each then waiting for the sweep, until restart. Now only its
//! own lane's next row waits for one sweep; its claim brings `M` back down.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How often floors move up (one small statement per round).
pub const ROUND_INTERVAL: Duration = Duration::from_millis(250);
/// How often a round also looks below the floors (the backstop).
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// The lowest floor: walk the lane from its first entry.
pub const BOTTOM: i64 = i64::MIN;

/// A candidate waiting for the transactions of its round to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Candidate {
    /// `xmax` of the round's snapshot: every transaction with a lower id
    /// must have ended before the candidate may apply.
    xmax: i64,
    /// A sequence number of this lane seen before that round (`M`): any
    /// row allocated since is higher.
    seen: i64,
}

#[derive(Debug, Clone, Copy)]
struct Lane {
    floor: i64,
    candidate: Option<Candidate>,
    last_round: Instant,
    last_sweep: Instant,
}

/// What one round read, from one snapshot, for the lanes it asked about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Round {
    /// Per lane (in the order asked): the highest sequence number of the
    /// lane's latest claim *before* the round's statement was sent
    /// ([`Due::seen`]): allocated before its snapshot.
    pub seen: Vec<Option<i64>>,
    pub xmin: i64,
    pub xmax: i64,
    /// Per lane (in the order asked): the lowest pending `seq >= floor`.
    pub first: Vec<Option<i64>>,
    /// Per lane: the lowest `seq` of an event with a live state row.
    pub state: Vec<Option<i64>>,
    /// Per lane: was it swept (looked below its floor) this round?
    pub swept: Vec<bool>,
    /// Per lane swept: the lowest pending `seq < floor`.
    pub below: Vec<Option<i64>>,
}

/// The floors of the lanes one relay claims from.
#[derive(Debug, Default)]
pub struct Floors {
    lanes: HashMap<i32, Lane>,
    /// Per lane: the highest sequence number of the latest claim that
    /// returned rows of it.
    seen: HashMap<i32, i64>,
}

/// The lanes a round is due for, and which of them also sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due {
    pub lanes: Vec<i32>,
    pub sweep: Vec<bool>,
    /// What claims had seen of each lane when the round was decided on
    /// (goes into [`Round::seen`]; a claim that returns while the round runs
    /// may see rows allocated after its snapshot).
    pub seen: Vec<Option<i64>>,
}

impl Floors {
    /// The floor of each lane, in order (BOTTOM for a lane never seen).
    pub fn of(&self, lanes: &[i32]) -> Vec<i64> {
        lanes
            .iter()
            .map(|l| self.lanes.get(l).map_or(BOTTOM, |s| s.floor))
            .collect()
    }

    /// A claim returned these rows (lane, sequence number): for each lane,
    /// its highest is what the lane has seen now.
    pub fn saw(&mut self, rows: impl IntoIterator<Item = (i32, i64)>) {
        let mut latest: HashMap<i32, i64> = HashMap::new();
        for (lane, seq) in rows {
            let s = latest.entry(lane).or_insert(seq);
            *s = (*s).max(seq);
        }
        self.seen.extend(latest);
    }

    /// Which of these lanes are due a round (none for [`ROUND_INTERVAL`]),
    /// and which of those also sweep? `None`: none is due.
    pub fn due(&self, lanes: &[i32], now: Instant) -> Option<Due> {
        let mut due = Due {
            lanes: Vec::new(),
            sweep: Vec::new(),
            seen: Vec::new(),
        };
        for l in lanes {
            match self.lanes.get(l) {
                Some(s) if now.duration_since(s.last_round) < ROUND_INTERVAL => {}
                s => {
                    due.lanes.push(*l);
                    due.seen.push(self.seen.get(l).copied());
                    due.sweep.push(s.is_some_and(|s| {
                        s.floor != BOTTOM && now.duration_since(s.last_sweep) >= SWEEP_INTERVAL
                    }));
                }
            }
        }
        (!due.lanes.is_empty()).then_some(due)
    }

    /// Apply a round read for `lanes`. Returns the lanes whose floor a sweep
    /// had to lower (a row turned up below it), with the row's sequence.
    pub fn apply(&mut self, lanes: &[i32], round: &Round, now: Instant) -> Vec<(i32, i64)> {
        let mut lowered = Vec::new();
        for (i, lane) in lanes.iter().enumerate() {
            let s = self.lanes.entry(*lane).or_insert(Lane {
                floor: BOTTOM,
                candidate: None,
                last_round: now,
                last_sweep: now,
            });
            s.last_round = now;
            if round.swept.get(i) == Some(&true) {
                s.last_sweep = now;
                if let Some(Some(below)) = round.below.get(i) {
                    // Something pending below the floor: start there again,
                    // and take no candidate from this round, whose `seen`
                    // predates that row's claim.
                    lowered.push((*lane, *below));
                    s.floor = *below;
                    s.candidate = None;
                    continue;
                }
            }
            if let Some(c) = s.candidate
                && round.xmin >= c.xmax
            {
                // Every transaction that was running when the candidate's
                // round looked has ended: nothing below `first` (from this
                // snapshot) can still appear, except rows allocated after
                // that round, which are above `c.seen`.
                let first = round.first.get(i).copied().flatten().unwrap_or(i64::MAX);
                let state = round.state.get(i).copied().flatten().unwrap_or(i64::MAX);
                let to = first.min(state).min(c.seen.saturating_add(1));
                s.floor = s.floor.max(to);
                s.candidate = None;
            }
            if s.candidate.is_none()
                && let Some(Some(seen)) = round.seen.get(i)
            {
                let seen = *seen;
                s.candidate = Some(Candidate {
                    xmax: round.xmax,
                    seen,
                });
            }
        }
        lowered
    }

    /// Make the next round of every lane a sweep (diagnosis, tests).
    pub fn sweep_soon(&mut self, now: Instant) {
        for s in self.lanes.values_mut() {
            if let Some(t) = now.checked_sub(SWEEP_INTERVAL) {
                s.last_sweep = t;
            }
            if let Some(t) = now.checked_sub(ROUND_INTERVAL) {
                s.last_round = t;
            }
        }
    }

    /// Forget a lane (another relay took it): start from the bottom if it
    /// comes back.
    pub fn forget_except(&mut self, owned: &[i32]) {
        self.lanes.retain(|l, _| owned.contains(l));
        self.seen.retain(|l, _| owned.contains(l));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(xmin: i64, xmax: i64, first: Option<i64>, state: Option<i64>) -> Round {
        Round {
            seen: vec![],
            xmin,
            xmax,
            first: vec![first],
            state: vec![state],
            swept: vec![],
            below: vec![],
        }
    }

    /// The round as the relay sends it: with what claims had seen then.
    fn seen(f: &Floors, lanes: &[i32], r: Round) -> Round {
        Round {
            seen: lanes.iter().map(|l| f.seen.get(l).copied()).collect(),
            ..r
        }
    }

    #[test]
    fn a_claim_that_returns_while_a_round_runs_does_not_move_its_candidate() {
        let now = Instant::now();
        let mut f = Floors::default();
        f.saw([(9, 400)]);
        // The round is decided on (seen 400) and its snapshot has xmax 1000.
        let decided = f.due(&[9], now).map(|d| d.seen);
        assert_eq!(decided, Some(vec![Some(400)]));
        // Meanwhile a transaction (xid 1001, seq 500 in lane 9) is open and
        // a claim returns seq 501 of the lane before the round's answer.
        f.saw([(9, 501)]);
        f.apply(
            &[9],
            &Round {
                seen: vec![Some(400)],
                ..round(900, 1000, None, None)
            },
            now,
        );
        // Next round: every transaction below 1000 has ended (1001 has not).
        f.apply(&[9], &seen(&f, &[9], round(1001, 1100, None, None)), now);
        assert_eq!(
            f.of(&[9]),
            vec![401],
            "the floor passed the open row at 500"
        );
    }

    #[test]
    fn a_floor_waits_for_the_transactions_of_its_round() {
        let now = Instant::now();
        let mut f = Floors::default();
        f.saw([(3, 100)]);
        // Round 1: candidate (xmax 50, seen 100); nothing applies yet.
        f.apply(&[3], &seen(&f, &[3], round(40, 50, Some(90), None)), now);
        assert_eq!(f.of(&[3]), vec![BOTTOM]);
        // Round 2: a transaction older than 50 still runs (xmin 45).
        f.apply(&[3], &seen(&f, &[3], round(45, 60, Some(95), None)), now);
        assert_eq!(f.of(&[3]), vec![BOTTOM]);
        // Round 3: all of them ended; the floor is this round's first row.
        f.apply(&[3], &seen(&f, &[3], round(50, 70, Some(97), None)), now);
        assert_eq!(f.of(&[3]), vec![97]);
    }

    #[test]
    fn a_floor_never_passes_what_was_seen_before_its_round_nor_a_live_state_row() {
        let now = Instant::now();
        let mut f = Floors::default();
        f.saw([(1, 10), (2, 10)]);
        f.apply(
            &[1, 2],
            &Round {
                seen: vec![Some(10); 2],
                xmin: 1,
                xmax: 5,
                first: vec![None, None],
                state: vec![None, None],
                swept: vec![],
                below: vec![],
            },
            now,
        );
        f.saw([(1, 500), (2, 500)]);
        // Lane 1 empty: floor is seen + 1 of the candidate's round (11),
        // not 501. Lane 2: a failed event at 7 keeps the floor at 7.
        f.apply(
            &[1, 2],
            &Round {
                seen: vec![Some(500); 2],
                xmin: 5,
                xmax: 9,
                first: vec![None, Some(400)],
                state: vec![None, Some(7)],
                swept: vec![],
                below: vec![],
            },
            now,
        );
        assert_eq!(f.of(&[1, 2]), vec![11, 7]);
    }

    #[test]
    fn floors_only_rise_except_when_a_sweep_finds_a_row_below() {
        let now = Instant::now();
        let mut f = Floors::default();
        f.saw([(0, 1_000)]);
        f.apply(&[0], &seen(&f, &[0], round(1, 2, Some(800), None)), now);
        f.apply(&[0], &seen(&f, &[0], round(2, 3, Some(900), None)), now);
        assert_eq!(f.of(&[0]), vec![900]);
        // A later round whose first row is lower (cannot happen unless a
        // row reappeared) does not lower the floor...
        f.apply(&[0], &seen(&f, &[0], round(3, 4, Some(850), None)), now);
        assert_eq!(f.of(&[0]), vec![900]);
        // ...but a sweep that finds a pending row below does.
        let lowered = f.apply(
            &[0],
            &Round {
                swept: vec![true],
                below: vec![Some(42)],
                ..round(4, 5, Some(950), None)
            },
            now,
        );
        assert_eq!(lowered, vec![(0, 42)]);
        assert_eq!(f.of(&[0]), vec![42]);
    }

    #[test]
    fn rounds_are_paced_per_lane_and_sweeps_come_due() {
        let t0 = Instant::now();
        let due = |lanes: Vec<i32>, sweep: Vec<bool>, seen| Some(Due { lanes, sweep, seen });
        let mut f = Floors::default();
        assert_eq!(
            f.due(&[4, 6], t0),
            due(vec![4, 6], vec![false, false], vec![None, None])
        );
        f.saw([(4, 10), (6, 10)]);
        f.apply(&[4, 6], &seen(&f, &[4, 6], round(1, 2, Some(5), None)), t0);
        let soon = t0 + Duration::from_millis(10);
        assert_eq!(f.due(&[4, 6], soon), None);
        assert_eq!(
            f.due(&[1, 4], soon),
            due(vec![1], vec![false], vec![None]),
            "only the lane never seen"
        );
        f.apply(&[4, 6], &seen(&f, &[4, 6], round(2, 3, Some(5), None)), t0);
        // Lane 4's floor is its first row, lane 6's (empty) what was seen + 1.
        assert_eq!(f.of(&[4, 6]), vec![5, 11]);
        let later = t0 + SWEEP_INTERVAL;
        assert_eq!(
            f.due(&[4, 6], later),
            due(vec![4, 6], vec![true, true], vec![Some(10); 2])
        );
        assert_eq!(
            f.due(&[7], later),
            due(vec![7], vec![false], vec![None]),
            "a lane at the bottom never sweeps"
        );
    }

    #[test]
    fn one_high_sequence_number_lifts_only_its_own_lane_and_only_once() {
        let now = Instant::now();
        let mut f = Floors::default();
        // An import wrote seq 10^12 into lane 1; lane 2 goes on at ~100.
        f.saw([(1, 1_000_000_000_000), (2, 100)]);
        f.apply(&[1, 2], &seen(&f, &[1, 2], round(1, 2, None, None)), now);
        f.apply(&[1, 2], &seen(&f, &[1, 2], round(2, 3, None, None)), now);
        assert_eq!(f.of(&[1, 2]), vec![1_000_000_000_001, 101]);
        // Lane 1's next ordinary row (seq 105) waits for a sweep, which
        // lowers the floor to it; once claimed, the lane's floor follows
        // the ordinary numbers again.
        let lowered = f.apply(
            &[1],
            &Round {
                swept: vec![true],
                below: vec![Some(105)],
                ..seen(&f, &[1], round(3, 4, None, None))
            },
            now,
        );
        assert_eq!(lowered, vec![(1, 105)]);
        f.saw([(1, 105)]);
        f.apply(&[1], &seen(&f, &[1], round(4, 5, None, None)), now);
        f.apply(&[1], &seen(&f, &[1], round(5, 6, None, None)), now);
        assert_eq!(f.of(&[1]), vec![106]);
    }
}
