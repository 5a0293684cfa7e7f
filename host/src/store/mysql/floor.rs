//! Claim floors on MySQL/MariaDB: where each lane's deep walk starts, so a
//! claim does not step over the index entries of rows already published.
//!
//! Marking a row changes its lane-index key (`published_at`, the status)
//! or deletes it; the old entry stays in the pending range, delete-marked,
//! until InnoDB's purge removes it. Purge falls behind under a deep drain,
//! and a claim that walks each lane from its first entry grows slower the
//! further the drain goes (a 1,000,000 backlog: the last tenth drained at
//! 14,200 events/s against 21,100 for the first). A *floor* per lane lets
//! the walk start at `seq >= floor`: one index descent past them.
//!
//! A floor must never pass a row that is or may become pending. As on
//! PostgreSQL (`postgres/floor.rs`), two things could put one below it:
//!
//! * **Rows not yet visible.** AUTO_INCREMENT takes its number at insert;
//!   the transaction may commit much later. MySQL has no `xmin`, so a
//!   round reads the ids of the transactions running
//!   (`information_schema.INNODB_TRX`), and a floor candidate only applies
//!   at a later round that finds none of them running any more: a row
//!   numbered below `M` (a sequence number a claim saw before the
//!   candidate's round) was inserted by then, by a transaction that round
//!   saw, so once they all ended it is visible or gone. Only transactions
//!   that have written a row count (`trx_rows_modified > 0`): a long
//!   read-only one (a report, a backup) cannot hold a number below `M` —
//!   and it is what holds purge back, when floors matter most. The new floor is
//!   `min(lowest pending seq now, M + 1)`. InnoDB refreshes that table at
//!   most every 100 ms, so `M` is the one seen a round *earlier* (rounds are
//!   [`ROUND_INTERVAL`] apart): a transaction that inserted before `M` was
//!   seen is in any snapshot of the table taken after that. (One window
//!   remains, as on PostgreSQL: the instant inside an `INSERT` between
//!   taking the number and writing the row. The sweep finds such a row.)
//!   Reading that table needs the `PROCESS` privilege; without it the
//!   relay runs without floors and says so once.
//! * **Rows that become pending again.** `failed retry` puts a failed row
//!   (which left the pending range: `failed_at` is in it) back, with a live
//!   state row. Each round reads, per lane, the lowest sequence number of
//!   the live, not-failed state rows and lowers a floor above it.
//!
//! As a backstop, every [`SWEEP_INTERVAL`] a round also looks below each
//! floor; a pending row found there lowers the floor to it (logged). Floors
//! live in the relay's memory per lane; a lane this relay no longer owns is
//! forgotten, and walked from its first entry if it comes back. Tables
//! ordered by `created_at` (no sequence column) and tables without the lane
//! index get no floors.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::Result;
use sqlx::Row;

use super::MySqlStore;

/// How often floors move up (two small statements per round).
pub const ROUND_INTERVAL: Duration = Duration::from_millis(250);
/// How often a round also looks below the floors (the backstop).
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// A floor waiting for the transactions its round saw running to end.
#[derive(Debug, Clone)]
struct Candidate {
    running: HashSet<String>,
    /// `M`: a sequence number of the lane seen before that round.
    seen: i64,
}

#[derive(Debug, Clone)]
struct Lane {
    /// The walk starts at `seq >= floor` (`None`: from the first entry).
    floor: Option<i64>,
    candidate: Option<Candidate>,
    /// What claims had seen of the lane at the previous round (`M` for the
    /// next candidate).
    seen_before: Option<i64>,
    last_sweep: Instant,
}

/// The floors of the lanes one relay claims from.
#[derive(Debug, Default)]
pub(super) struct Floors {
    lanes: HashMap<i32, Lane>,
    /// Per lane: the highest sequence number of the latest claim that
    /// returned rows of it (the latest, not the highest ever: one row with
    /// an explicit number far above the rest lifts nothing for long).
    seen: HashMap<i32, i64>,
    /// The server refused `INNODB_TRX` (no `PROCESS` privilege): no floors.
    off: bool,
    /// When the last round started: rounds are at least [`ROUND_INTERVAL`]
    /// apart, longer than InnoDB caches `INNODB_TRX` (see the header).
    last_round: Option<Instant>,
}

impl Floors {
    /// The floor of `lane`, if it has one.
    pub fn of(&self, lane: i32) -> Option<i64> {
        self.lanes.get(&lane).and_then(|l| l.floor)
    }

    /// A claim returned these rows (lane, sequence number).
    pub fn saw(&mut self, rows: impl IntoIterator<Item = (i32, i64)>) {
        let mut latest: HashMap<i32, i64> = HashMap::new();
        for (lane, seq) in rows {
            let s = latest.entry(lane).or_insert(seq);
            *s = (*s).max(seq);
        }
        self.seen.extend(latest);
    }
}

/// What a round asks, per lane: its floor, and whether it sweeps below it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ask {
    lane: i32,
    floor: Option<i64>,
    sweep: bool,
}

impl Floors {
    /// Forget the lanes not in `lanes` (another relay took them) and say
    /// what this round asks of the rest; `None` when floors are off.
    fn plan(&mut self, lanes: &[i32], now: Instant) -> Option<Vec<Ask>> {
        if self.off {
            return None;
        }
        self.lanes.retain(|l, _| lanes.contains(l));
        self.seen.retain(|l, _| lanes.contains(l));
        Some(
            lanes
                .iter()
                .map(|l| {
                    let s = self.lanes.get(l);
                    Ask {
                        lane: *l,
                        floor: s.and_then(|s| s.floor),
                        sweep: s.is_some_and(|s| {
                            s.floor.is_some() && now.duration_since(s.last_sweep) >= SWEEP_INTERVAL
                        }),
                    }
                })
                .collect(),
        )
    }

    /// Apply what a round read. Returns the lanes whose floor came down:
    /// (lane, new floor, a sweep found a row below it — else a retried
    /// event's state row is there).
    fn apply(&mut self, asked: &[Ask], round: &Round, now: Instant) -> Vec<(i32, i64, bool)> {
        let seen_now = self.seen.clone();
        let mut lowered = Vec::new();
        for a in asked {
            let s = self.lanes.entry(a.lane).or_insert(Lane {
                floor: None,
                candidate: None,
                seen_before: None,
                last_sweep: now,
            });
            if a.sweep {
                s.last_sweep = now;
            }
            let below = round.below.get(&a.lane).copied();
            let state = round.state.get(&a.lane).copied();
            let retried = state.filter(|st| s.floor.is_some_and(|f| *st < f));
            if let Some(to) = below.into_iter().chain(retried).min() {
                // Start there again, and take no candidate from this round:
                // its `M` predates that row's claim.
                lowered.push((a.lane, to, below == Some(to)));
                s.floor = Some(to);
                s.candidate = None;
                s.seen_before = seen_now.get(&a.lane).copied();
                continue;
            }
            if let Some(c) = &s.candidate
                && c.running.is_disjoint(&round.running)
            {
                // Every transaction running at the candidate's round has
                // ended: nothing can appear below this round's lowest
                // pending row but rows numbered after `M`.
                let first = round.first.get(&a.lane).copied().unwrap_or(i64::MAX);
                let to = first
                    .min(c.seen.saturating_add(1))
                    .min(state.unwrap_or(i64::MAX));
                s.floor = Some(s.floor.map_or(to, |f| f.max(to)));
                s.candidate = None;
            }
            if s.candidate.is_none()
                && let Some(seen) = s.seen_before
            {
                s.candidate = Some(Candidate {
                    running: round.running.clone(),
                    seen,
                });
            }
            s.seen_before = seen_now.get(&a.lane).copied();
        }
        lowered
    }
}

/// What one round read.
#[derive(Debug, Default)]
struct Round {
    running: HashSet<String>,
    /// Per lane asked: the lowest pending `seq >= floor`.
    first: HashMap<i32, i64>,
    /// Per lane swept: the lowest pending `seq < floor`.
    below: HashMap<i32, i64>,
    /// Per lane: the lowest sequence number of a live, not-failed state row.
    state: HashMap<i32, i64>,
}

impl MySqlStore {
    /// Claims may walk from floors: the table is ordered by a sequence
    /// column and has its lane index.
    fn floors_apply(&self) -> bool {
        self.sql.by_seq && self.lane_index
    }

    /// The floor of each of `lanes` that has one (where its deep walk starts).
    pub(super) fn floors_of(&self, lanes: &[i32]) -> HashMap<i32, i64> {
        if !self.floors_apply() {
            return HashMap::new();
        }
        let floors = self.floors.lock().unwrap_or_else(|p| p.into_inner());
        lanes
            .iter()
            .filter_map(|l| floors.of(*l).map(|f| (*l, f)))
            .collect()
    }

    /// A claim returned these rows (lane, sequence number).
    pub(super) fn floors_saw(&self, rows: impl IntoIterator<Item = (i32, i64)>) {
        if self.floors_apply() {
            self.floors
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .saw(rows);
        }
    }

    /// One round over the lanes this relay owns (see the module header):
    /// apply candidates whose transactions ended, take new ones, lower
    /// floors below which a row turned up. Returns whether one was lowered.
    pub async fn raise_floors(&self, lanes: &[i32]) -> Result<bool> {
        if !self.floors_apply() || lanes.is_empty() {
            return Ok(false);
        }
        let now = Instant::now();
        let asked = {
            let mut f = self.floors.lock().unwrap_or_else(|p| p.into_inner());
            if f.last_round
                .is_some_and(|t| now.duration_since(t) < ROUND_INTERVAL)
            {
                return Ok(false);
            }
            f.last_round = Some(now);
            f.plan(lanes, now)
        };
        let Some(asked) = asked else {
            return Ok(false);
        };
        let round = match self.floor_round(&asked).await {
            Ok(r) => r,
            Err(e) if is_access_denied(&e) => {
                tracing::warn!(
                    source = %self.source,
                    "claim floors off: reading information_schema.INNODB_TRX needs the PROCESS \
                     privilege (GRANT PROCESS ON *.* TO the relay's user); a deep backlog drains \
                     slower without them"
                );
                self.floors.lock().unwrap_or_else(|p| p.into_inner()).off = true;
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        let lowered = self
            .floors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .apply(&asked, &round, now);
        for (lane, seq, late) in &lowered {
            if *late {
                metrics::counter!(crate::metrics::FLOOR_LOWERED,
                    "source" => crate::store::postgres::source_name(&self.key).to_string())
                .increment(1);
                tracing::warn!(
                    lane,
                    seq,
                    "a pending row turned up below the lane's claim floor (a transaction that took \
                     its sequence number long before it committed): the lane is walked from it again"
                );
            } else {
                tracing::debug!(lane, seq, "a retried event below the lane's claim floor");
            }
        }
        Ok(!lowered.is_empty())
    }

    /// Read one round: the running transactions first, then (so a row of
    /// one that ended since is seen) each lane's lowest pending row from
    /// its floor, below it where it sweeps, and the state rows' lowest.
    async fn floor_round(&self, asked: &[Ask]) -> Result<Round> {
        let running: HashSet<String> = sqlx::query_scalar(
            "SELECT CAST(trx_id AS CHAR) FROM information_schema.INNODB_TRX \
                 WHERE trx_rows_modified > 0",
        )
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .collect();
        let s = &self.sql;
        let (lane_col, index) = (
            format!("o.{}", super::lane_column(self.lanes)),
            super::lane_index_name(self.lanes),
        );
        let Some(seq_col) = s.seq_column() else {
            anyhow::bail!("claim floors need a sequence column");
        };
        let walk = |cmp: &str| {
            format!(
                "(SELECT {seq} FROM {t} o FORCE INDEX ({index}) WHERE {lane_col} = ? AND {pending} \
                   AND {seq_col} {cmp} ? ORDER BY {order} LIMIT 1)",
                seq = s.seq,
                t = s.table,
                pending = s.pending,
                order = s.order,
            )
        };
        let sql = asked
            .iter()
            .map(|a| {
                format!(
                    "SELECT CAST(? AS SIGNED) AS lane, {first} AS first, {below} AS below",
                    first = walk(">="),
                    below = if a.sweep { walk("<") } else { "NULL".into() },
                )
            })
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        let mut q = sqlx::query(&sql);
        for a in asked {
            let floor = a.floor.unwrap_or(i64::MIN);
            q = q.bind(a.lane).bind(a.lane).bind(floor);
            if a.sweep {
                q = q.bind(a.lane).bind(floor);
            }
        }
        let mut round = Round {
            running,
            ..Round::default()
        };
        for r in q.fetch_all(&self.pool).await? {
            let lane = i32::try_from(r.try_get::<i64, _>("lane")?).unwrap_or(-1);
            if let Some(first) = r.try_get::<Option<i64>, _>("first")? {
                round.first.insert(lane, first);
            }
            if let Some(below) = r.try_get::<Option<i64>, _>("below")? {
                round.below.insert(lane, below);
            }
        }
        // The state rows' lanes from their aggregate, as the lane column
        // computes it (exact for utf8mb4 text, which the canonical table
        // has; a mapped table in another character set may see a retried
        // event's lane only at the next sweep).
        let state: Vec<(i64, i64)> = sqlx::query_as(&format!(
            "SELECT CAST(CRC32(CONCAT(aggregate_type, ':', aggregate_id)) % {lanes} AS SIGNED), \
               CAST(MIN(seq) AS SIGNED) \
             FROM outroute_event_state FORCE INDEX (outroute_event_state_failed) \
             WHERE source = ? AND failed_at IS NULL AND discarded_at IS NULL GROUP BY 1",
            lanes = self.lanes
        ))
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?;
        round.state = state
            .into_iter()
            .filter_map(|(lane, seq)| Some((i32::try_from(lane).ok()?, seq)))
            .collect();
        Ok(round)
    }
}

/// The server refused for want of a privilege (MySQL/MariaDB error 1227,
/// "Access denied; you need the PROCESS privilege").
fn is_access_denied(e: &anyhow::Error) -> bool {
    e.downcast_ref::<sqlx::Error>()
        .and_then(|e| e.as_database_error())
        .and_then(|d| d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .is_some_and(|m| m.number() == 1227)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(ids: &[&str]) -> HashSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    /// A round of lane 1: these transactions running, this lowest pending
    /// row, this lowest retried state row.
    fn round(ids: &[&str], first: Option<i64>, state: Option<i64>) -> Round {
        Round {
            running: running(ids),
            first: first.map(|f| (1, f)).into_iter().collect(),
            below: HashMap::new(),
            state: state.map(|s| (1, s)).into_iter().collect(),
        }
    }

    fn step(f: &mut Floors, r: Round, now: Instant) -> Vec<(i32, i64, bool)> {
        let asked = f.plan(&[1], now).unwrap_or_default();
        f.apply(&asked, &r, now)
    }

    #[test]
    fn a_floor_rises_only_once_the_transactions_its_round_saw_have_ended() {
        let now = Instant::now();
        let mut f = Floors::default();
        f.saw([(1, 500)]);
        // Round 1 notes what claims saw (500); round 2 takes it as M with
        // the transactions running then (t7: a producer still open).
        step(&mut f, round(&["t7"], Some(501), None), now);
        f.saw([(1, 900)]);
        step(&mut f, round(&["t7", "t8"], Some(901), None), now);
        assert_eq!(f.of(1), None, "no candidate applies in its own round");
        // t7 still runs: the floor stays where it was.
        step(&mut f, round(&["t7"], Some(950), None), now);
        assert_eq!(f.of(1), None, "t7 may still commit a row below 501");
        // t7 ended, and its row (seq 300) committed: the floor stops there.
        step(&mut f, round(&["t9"], Some(300), None), now);
        assert_eq!(f.of(1), Some(300));
    }

    #[test]
    fn a_floor_never_passes_a_sequence_number_seen_after_its_round() {
        let now = Instant::now();
        let mut f = Floors::default();
        f.saw([(1, 500)]);
        step(&mut f, round(&[], Some(501), None), now);
        f.saw([(1, 5_000)]);
        step(&mut f, round(&["t1"], Some(5_001), None), now);
        // Nothing pending now, but M was 500: a row numbered 501..5000 may
        // belong to a transaction the candidate's round did not see.
        step(&mut f, round(&[], None, None), now);
        assert_eq!(f.of(1), Some(501));
        // The next candidate (M = 5,000) applies a round later.
        step(&mut f, round(&[], None, None), now);
        assert_eq!(f.of(1), Some(5_001));
    }

    #[test]
    fn a_retried_event_below_the_floor_brings_it_down_at_once() {
        let now = Instant::now();
        let mut f = Floors::default();
        f.saw([(1, 1_000)]);
        step(&mut f, round(&[], Some(1_001), None), now);
        step(&mut f, round(&[], Some(1_001), None), now);
        step(&mut f, round(&[], Some(1_001), None), now);
        assert_eq!(f.of(1), Some(1_001));
        // `failed retry` of event 40: a live state row below the floor.
        let lowered = step(&mut f, round(&[], Some(1_001), Some(40)), now);
        assert_eq!(lowered, vec![(1, 40, false)]);
        assert_eq!(f.of(1), Some(40));
        // While it waits, the floor stays at or below it.
        step(&mut f, round(&[], Some(1_001), Some(40)), now);
        step(&mut f, round(&[], Some(1_001), Some(40)), now);
        assert_eq!(f.of(1), Some(40));
    }

    #[test]
    fn a_sweep_that_finds_a_row_below_the_floor_lowers_it() {
        let now = Instant::now();
        let mut f = Floors::default();
        f.saw([(1, 1_000)]);
        for _ in 0..3 {
            step(&mut f, round(&[], None, None), now);
        }
        assert_eq!(f.of(1), Some(1_001));
        let later = now + SWEEP_INTERVAL;
        let asked = f.plan(&[1], later).unwrap_or_default();
        assert_eq!(
            asked,
            vec![Ask {
                lane: 1,
                floor: Some(1_001),
                sweep: true
            }]
        );
        let mut r = round(&[], None, None);
        r.below.insert(1, 77);
        assert_eq!(f.apply(&asked, &r, later), vec![(1, 77, true)]);
        assert_eq!(f.of(1), Some(77));
        // Swept now: not again before the next interval.
        let asked = f.plan(&[1], later).unwrap_or_default();
        assert!(!asked[0].sweep);
    }

    #[test]
    fn a_lane_another_relay_took_is_forgotten() {
        let now = Instant::now();
        let mut f = Floors::default();
        f.saw([(1, 1_000), (2, 2_000)]);
        let asked = f.plan(&[1, 2], now).unwrap_or_default();
        for _ in 0..3 {
            f.apply(&asked, &Round::default(), now);
        }
        assert_eq!((f.of(1), f.of(2)), (Some(1_001), Some(2_001)));
        f.plan(&[2], now);
        assert_eq!((f.of(1), f.of(2)), (None, Some(2_001)));
    }

    #[test]
    fn without_the_process_privilege_there_are_no_rounds() {
        let mut f = Floors {
            off: true,
            ..Floors::default()
        };
        assert_eq!(f.plan(&[1], Instant::now()), None);
    }
}
