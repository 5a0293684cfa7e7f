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
//! **Held backlogs.** The floor stops at the first event with a live state
//! row, and the rows after it that a hold keeps back (every later event of
//! an aggregate whose event failed or waits for a retry) would be walked
//! past, row by row, by every claim: an aggregate holding 300k pending
//! events made each claim of its lane read 300k rows. So a lane whose
//! lowest live state row holds (the *holder*, at `H`) also gets a *skip*:
//! `(H, R)`, where no row can be claimed, and the claim walks `[floor, H]`
//! then `[R, …)`. Each round walks up to [`SKIP_WALK`] rows from the
//! current `R` (twice that while it also confirms a candidate) for the
//! first row a claim could take; the end found becomes
//! a candidate, applied by a later round the same way as a floor (once the
//! transactions of the candidate's round have ended, and only as far as
//! that later round's own walk confirms), so a row that commits late in the
//! range is seen. A skip holds only while nothing in it can have changed:
//! each claim checks that the holder still holds every route and that the
//! other live state rows in the range are the ones the round saw (count,
//! sequence numbers, routes held); otherwise it walks the lane whole. A
//! new holder, a reload (the routes) or a lane hand-over drops the skip.
//! Left: a row written with an explicit sequence number inside a skipped
//! range, for an aggregate that is not held, waits until the skip goes.
//!
//! `M` is per lane too, and the *latest* claim's, not the highest ever: a
//! row with an explicit sequence number far above the rest (an import, a
//! `setval` backwards) would otherwise lift every lane's floor above every
//! row to come, each then waiting for the sweep, until restart. Now only its
//! own lane's next row waits for one sweep; its claim brings `M` back down.
//!
//! One concern, one file: claim floors — the rounds that raise them, the
//! sweep below them and their tests — which only make sense read together.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How often floors move up (one small statement per round).
pub const ROUND_INTERVAL: Duration = Duration::from_millis(250);
/// How often a round also looks below the floors (the backstop).
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// The lowest floor: walk the lane from its first entry.
pub const BOTTOM: i64 = i64::MIN;

/// Rows a round walks per lane past a holder, looking for the first row a
/// claim could take (the growth of a skip per round, and its cost bound).
pub const SKIP_WALK: i64 = 10_000;

/// A range of a lane no claim can take a row from now: `(from, to)`, both
/// ends excluded, `from` the holder's sequence number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skip {
    pub from: i64,
    pub to: i64,
    /// The other live state rows in the range when it was confirmed (see
    /// `TableSql::skip_fingerprint`): the claim takes the skip only while
    /// they are still the same.
    pub fingerprint: String,
}

/// A skip end found by a round, waiting for the transactions of that
/// round to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SkipCandidate {
    from: i64,
    to: i64,
    xmax: i64,
}

/// Where each lane's claim walks, as the claim statement takes it: one
/// stretch per lane from its floor, and for a lane with a skip a second one
/// from the skip's end (the statement drops it, and walks the first one to
/// the end, when the skip no longer holds). In walking order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Starts {
    pub lanes: Vec<i32>,
    /// Where the stretch starts: the floor, or the skip's end.
    pub from: Vec<i64>,
    /// 0: from the floor; 1: from the skip's end.
    pub part: Vec<i32>,
    pub skip_from: Vec<Option<i64>>,
    pub skip_to: Vec<Option<i64>>,
    pub skip_fingerprint: Vec<Option<String>>,
}

impl Starts {
    /// These lanes walked whole, from their first entry.
    pub fn bottom(lanes: &[i32]) -> Self {
        let mut st = Starts::default();
        for l in lanes {
            st.push(*l, BOTTOM, 0, None);
        }
        st
    }

    /// Does any lane have a skip (the claim then walks stretches)?
    pub fn any_skip(&self) -> bool {
        self.part.iter().any(|p| *p != 0)
    }

    fn push(&mut self, lane: i32, from: i64, part: i32, skip: Option<&Skip>) {
        self.lanes.push(lane);
        self.from.push(from);
        self.part.push(part);
        self.skip_from.push(skip.map(|k| k.from));
        self.skip_to.push(skip.map(|k| k.to));
        self.skip_fingerprint
            .push(skip.map(|k| k.fingerprint.clone()));
    }
}

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

#[derive(Debug, Clone)]
struct Lane {
    floor: i64,
    candidate: Option<Candidate>,
    skip: Option<Skip>,
    skip_candidate: Option<SkipCandidate>,
    last_round: Instant,
    last_sweep: Instant,
}

/// What one round read, from one snapshot, for the lanes it asked about.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
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
    /// Per lane: the holder's sequence number (the lowest of a live state
    /// row that holds its aggregate), if any.
    pub holder: Vec<Option<i64>>,
    /// Per lane with a holder: the first row a claim could take past the
    /// skip (or the holder), or one past the last row walked.
    pub resume: Vec<Option<i64>>,
    /// Per lane: the fingerprint of the current skip's range now.
    pub fingerprint_now: Vec<Option<String>>,
    /// Per lane with a skip candidate: the fingerprint of the range it
    /// would skip (up to the lower of its end and `resume`).
    pub fingerprint_candidate: Vec<Option<String>>,
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
    /// Per lane: the current skip (from, to) and the candidate's end.
    pub skip_from: Vec<Option<i64>>,
    pub skip_to: Vec<Option<i64>>,
    pub candidate_to: Vec<Option<i64>>,
}

impl Floors {
    /// The floor of each lane, in order (BOTTOM for a lane never seen).
    pub fn of(&self, lanes: &[i32]) -> Vec<i64> {
        lanes
            .iter()
            .map(|l| self.lanes.get(l).map_or(BOTTOM, |s| s.floor))
            .collect()
    }

    /// Where each lane's claim walks: floors and skips, in order.
    pub fn starts(&self, lanes: &[i32]) -> Starts {
        let mut st = Starts::default();
        for l in lanes {
            let lane = self.lanes.get(l);
            let skip = lane.and_then(|s| s.skip.as_ref());
            st.push(*l, lane.map_or(BOTTOM, |s| s.floor), 0, skip);
            if let Some(k) = skip {
                st.push(*l, k.to, 1, Some(k));
            }
        }
        st
    }

    /// The current skip of a lane (tests, diagnosis).
    pub fn skip(&self, lane: i32) -> Option<Skip> {
        self.lanes.get(&lane).and_then(|s| s.skip.clone())
    }

    /// Drop every skip (the routes changed: a row a skip passed may be
    /// taken by a new route).
    pub fn forget_skips(&mut self) {
        for s in self.lanes.values_mut() {
            s.skip = None;
            s.skip_candidate = None;
        }
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
            skip_from: Vec::new(),
            skip_to: Vec::new(),
            candidate_to: Vec::new(),
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
                    let skip = s.and_then(|s| s.skip.as_ref());
                    due.skip_from.push(skip.map(|k| k.from));
                    due.skip_to.push(skip.map(|k| k.to));
                    due.candidate_to
                        .push(s.and_then(|s| s.skip_candidate).map(|c| c.to));
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
                skip: None,
                skip_candidate: None,
                last_round: now,
                last_sweep: now,
            });
            s.last_round = now;
            apply_skip(s, i, round);
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

/// A round's answer for lane `i`, applied to its skip (see the module
/// header): dropped when the holder changed or the range's other state rows
/// did; a candidate applied as far as this round's own walk confirms it;
/// a new candidate when the walk found more to skip.
fn apply_skip(s: &mut Lane, i: usize, round: &Round) {
    let Some(holder) = round.holder.get(i).copied().flatten() else {
        s.skip = None;
        s.skip_candidate = None;
        return;
    };
    let now = round.fingerprint_now.get(i).cloned().flatten();
    if s.skip
        .as_ref()
        .is_some_and(|k| k.from != holder || now.as_deref() != Some(k.fingerprint.as_str()))
    {
        s.skip = None;
        s.skip_candidate = None;
    }
    if s.skip_candidate.is_some_and(|c| c.from != holder) {
        s.skip_candidate = None;
    }
    let resume = round.resume.get(i).copied().flatten();
    let start = |s: &Lane| s.skip.as_ref().map_or(holder.saturating_add(1), |k| k.to);
    if let Some(c) = s.skip_candidate
        && round.xmin >= c.xmax
    {
        // Every transaction running when the candidate's round looked has
        // ended, and this round's walk (from the same start) confirms the
        // rows up to `resume` from a snapshot that sees all of theirs.
        if let (Some(r), Some(fingerprint)) = (
            resume,
            round.fingerprint_candidate.get(i).cloned().flatten(),
        ) {
            let to = r.min(c.to);
            if to > start(s) {
                s.skip = Some(Skip {
                    from: holder,
                    to,
                    fingerprint,
                });
            }
        }
        s.skip_candidate = None;
    }
    if s.skip_candidate.is_none()
        && let Some(r) = resume
        && r > start(s)
    {
        s.skip_candidate = Some(SkipCandidate {
            from: holder,
            to: r,
            xmax: round.xmax,
        });
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
            ..Default::default()
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
                ..Default::default()
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
                ..Default::default()
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
        let due = |lanes: Vec<i32>, sweep: Vec<bool>, seen: Vec<Option<i64>>| {
            let none = vec![None; lanes.len()];
            Some(Due {
                lanes,
                sweep,
                seen,
                skip_from: none.clone(),
                skip_to: none.clone(),
                candidate_to: none,
            })
        };
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

    fn skip_round(
        xmin: i64,
        xmax: i64,
        holder: Option<i64>,
        resume: Option<i64>,
        now: Option<&str>,
        candidate: Option<&str>,
    ) -> Round {
        Round {
            holder: vec![holder],
            resume: vec![resume],
            fingerprint_now: vec![now.map(str::to_string)],
            fingerprint_candidate: vec![candidate.map(str::to_string)],
            ..round(xmin, xmax, None, holder)
        }
    }

    #[test]
    fn a_skip_grows_only_as_far_as_a_later_round_confirms_and_goes_with_its_holder() {
        let now = Instant::now();
        let mut f = Floors::default();
        // Round 1: holder at 10, rows up to 5000 cannot be taken: a candidate.
        f.apply(
            &[0],
            &skip_round(1, 50, Some(10), Some(5000), None, None),
            now,
        );
        assert_eq!(f.skip(0), None);
        // Round 2: a transaction of round 1 still runs: nothing applies.
        f.apply(
            &[0],
            &skip_round(40, 60, Some(10), Some(5000), None, Some("0:0:0")),
            now,
        );
        assert_eq!(f.skip(0), None);
        // Round 3: they ended, but a row that committed since can be taken
        // at 3000: the skip ends there, not at the candidate's 5000.
        f.apply(
            &[0],
            &skip_round(50, 70, Some(10), Some(3000), None, Some("0:0:0")),
            now,
        );
        let skip = f.skip(0).map(|k| (k.from, k.to));
        assert_eq!(skip, Some((10, 3000)));
        assert_eq!(f.starts(&[0]).from, vec![BOTTOM, 3000]);
        // A state row inside changed (retried, discarded): the skip goes.
        f.apply(
            &[0],
            &skip_round(70, 80, Some(10), Some(3000), Some("1:20:5"), None),
            now,
        );
        assert_eq!(f.skip(0), None);
        // Grown again; then the holder is published (another holds): gone.
        f.apply(
            &[0],
            &skip_round(80, 90, Some(10), Some(4000), None, None),
            now,
        );
        f.apply(
            &[0],
            &skip_round(90, 95, Some(10), Some(4000), None, Some("0:0:0")),
            now,
        );
        assert_eq!(f.skip(0).map(|k| k.to), Some(4000));
        f.apply(
            &[0],
            &skip_round(95, 99, Some(7000), Some(7001), Some("0:0:0"), None),
            now,
        );
        assert_eq!(f.skip(0), None);
        // A reload (routes) drops every skip.
        f.apply(
            &[0],
            &skip_round(99, 100, Some(7000), Some(9000), None, None),
            now,
        );
        f.apply(
            &[0],
            &skip_round(100, 101, Some(7000), Some(9000), None, Some("0:0:0")),
            now,
        );
        assert!(f.skip(0).is_some());
        f.forget_skips();
        assert_eq!(f.skip(0), None);
    }
}
