//! Binlog capture's store half on MariaDB (`capture = "binlog"`; the
//! stream itself is `capture/binlog.rs`): the capture lease, the stream's
//! recorded position, the server checks, the replication connection's
//! options, the table's columns in binlog order, and the read-back of
//! events whose aggregates wait.
//!
//! The outbox table stays the truth: a streamed event's row is marked
//! published exactly as in lease mode (after the broker acknowledged), and
//! an event that cannot go now stays pending in the table with a state
//! record (`outroute_event_state`: retrying, failed, or waiting behind an
//! earlier event of its aggregate). So the table is the parked queue, and
//! nothing the stream passed can be lost: whatever is still pending is
//! either ahead of the recorded position (the stream brings it again) or
//! has a state record (read back here, in order, when due).

use std::collections::BTreeMap;

use super::*;
use crate::store::postgres::{CAPTURE_LANE, HeldAggregates};

/// Replica server ids outroute registers with are drawn from this range
/// (a source's id is fixed: see [`MySqlStore::replica_server_id`]).
const SERVER_ID_BASE: u32 = 0x7000_0000;

/// Where a binlog source's stream resumes (`outroute_binlog`).
#[derive(Debug, Clone, PartialEq)]
pub struct BinlogPosition {
    /// A MariaDB GTID position: `domain-server-sequence`, comma-separated.
    pub gtid: String,
    /// The rows written before `gtid` were all read from the table.
    pub backfilled: bool,
}

/// A GTID position as MariaDB writes it: `d-s-n` triples, comma-separated
/// (empty: the very start). Checked before it goes into a `SET`.
pub fn valid_gtid_position(p: &str) -> bool {
    p.is_empty()
        || p.split(',').all(|t| {
            let parts: Vec<&str> = t.trim().split('-').collect();
            parts.len() == 3 && parts.iter().all(|n| n.parse::<u64>().is_ok())
        })
}

/// A GTID position being followed: per replication domain, the server id
/// and sequence number of its last transaction. (MariaDB numbers a
/// domain's transactions in one sequence, whichever server wrote them.)
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gtids(BTreeMap<u32, (u32, u64)>);

impl Gtids {
    /// Read `d-s-n,d-s-n` (as checked by [`valid_gtid_position`]).
    pub fn parse(p: &str) -> Result<Self> {
        let mut m = BTreeMap::new();
        for t in p.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let n: Vec<&str> = t.split('-').collect();
            let [d, s, q] = n.as_slice() else {
                bail!("`{t}` is not a GTID (domain-server-sequence)");
            };
            m.insert(d.parse()?, (s.parse()?, q.parse()?));
        }
        Ok(Gtids(m))
    }

    /// The transaction `seq` of `domain`, written by `server`, was read.
    pub fn set(&mut self, domain: u32, server: u32, seq: u64) {
        self.0.insert(domain, (server, seq));
    }

    /// Transactions `ahead` holds that this position has not passed, over
    /// every domain.
    pub fn behind(&self, ahead: &Gtids) -> u64 {
        ahead
            .0
            .iter()
            .map(|(d, (_, seq))| seq.saturating_sub(self.0.get(d).map_or(0, |(_, s)| *s)))
            .sum()
    }
}

impl std::fmt::Display for Gtids {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|(d, (s, q))| format!("{d}-{s}-{q}"))
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// A binlog source's position against the server's binary log, as
/// `status` shows it.
#[derive(Debug, Clone, serde::Serialize, PartialEq)]
pub struct BinlogStatus {
    /// Where the stream resumes (`outroute_binlog`); none before its
    /// first start.
    pub position: Option<String>,
    /// The rows written before `position` were all read from the table.
    pub backfilled: bool,
    /// The server's last logged transactions (`@@gtid_binlog_pos`).
    pub server_position: String,
    /// Transactions the server logged past `position`, of every table
    /// (the stream passes most over; the position moves past them within
    /// a minute even when none is an event).
    pub behind_transactions: Option<u64>,
    /// The position at the start of the server's oldest binary log file.
    pub oldest_position: Option<String>,
    /// `position` is older than the oldest file: the server no longer has
    /// what follows it, and the next stream re-reads the table's pending
    /// rows instead (duplicates at most).
    pub purged: bool,
    /// The server's binary log files and their bytes (`SHOW BINARY LOGS`;
    /// none without the BINLOG MONITOR privilege).
    pub files: Option<i64>,
    pub bytes: Option<i64>,
    /// How long the server keeps binary logs (`binlog_expire_logs_seconds`;
    /// 0: until purged by hand). A relay stopped for longer loses its
    /// position (not its events: they stay pending in the table).
    pub expire_seconds: Option<i64>,
}

impl MySqlStore {
    /// `capture = "binlog"`.
    pub fn binlog(&self) -> bool {
        self.binlog.is_some()
    }

    /// The source's lanes (lease mode's; binlog capture drains the table
    /// through them).
    pub fn lane_count(&self) -> u32 {
        self.lanes
    }

    /// The capture lease (lane -1 of `outroute_lanes`): one relay streams;
    /// the others wait as standbys and take it over once it lapsed, its
    /// epoch bumped (marks and the recorded position are fenced by it).
    /// Heartbeats the relay like a lease round.
    pub async fn capture_lease(&self) -> Result<Leases> {
        let ttl = micros(self.lease_ttl);
        let mut tx = self.pool.begin().await?;
        let relays = self.heartbeat(&mut tx).await?;
        let taken = sqlx::query(
            "UPDATE outroute_lanes SET epoch = epoch + IF(owner <=> ? AND lease_until > UTC_TIMESTAMP(6), 0, 1), \
               owner = ?, lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             WHERE source = ? AND lane = ? AND (owner <=> ? OR owner IS NULL OR lease_until <= UTC_TIMESTAMP(6))",
        )
        .bind(&self.relay_id)
        .bind(&self.relay_id)
        .bind(ttl)
        .bind(&self.source)
        .bind(CAPTURE_LANE)
        .bind(&self.relay_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let held: Option<(i64, i64)> = sqlx::query_as(
            "SELECT epoch, lease_until > UTC_TIMESTAMP(6) FROM outroute_lanes \
             WHERE source = ? AND lane = ? AND owner = ?",
        )
        .bind(&self.source)
        .bind(CAPTURE_LANE)
        .bind(&self.relay_id)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await.context("renewing the capture lease")?;
        let mut leases = Leases {
            relays: relays.max(1),
            ..Leases::default()
        };
        if let (Some((epoch, live)), true) = (held, taken > 0)
            && live != 0
        {
            leases.lanes = vec![CAPTURE_LANE];
            leases.epochs = vec![epoch];
        }
        Ok(leases)
    }

    /// What binlog capture needs of the server, each missing piece named
    /// with the setting that fixes it.
    pub(super) async fn check_binlog(&self) -> Result<()> {
        let key = &self.key;
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&self.pool)
            .await?;
        if !version.contains("MariaDB") {
            bail!(
                "{key}.capture: `binlog` reads MariaDB's binary log by its GTID positions (MariaDB 10.6+); \
                 this server is MySQL {version}, whose GTIDs differ and are not read yet: use `capture = \"lease\"`"
            );
        }
        let (log_bin, format, image, compress): (i64, String, String, i64) = sqlx::query_as(
            "SELECT @@log_bin, CAST(@@GLOBAL.binlog_format AS CHAR), CAST(@@GLOBAL.binlog_row_image AS CHAR), @@log_bin_compress",
        )
        .fetch_one(&self.pool)
        .await?;
        let mut wrong = Vec::new();
        if log_bin == 0 {
            wrong.push("the binary log is off (start the server with `log_bin`)".to_string());
        }
        if !format.eq_ignore_ascii_case("ROW") {
            wrong.push(format!("`binlog_format` is {format} (set ROW)"));
        }
        if !image.eq_ignore_ascii_case("FULL") {
            wrong.push(format!(
                "`binlog_row_image` is {image} (set FULL: every column of an insert)"
            ));
        }
        if compress != 0 {
            wrong.push(
                "`log_bin_compress` is on (compressed row events are not read; set it OFF)".into(),
            );
        }
        if !wrong.is_empty() {
            bail!(
                "{key}.capture: `binlog` needs the server's row-based binary log: {}",
                wrong.join("; ")
            );
        }
        sqlx::query("INSERT IGNORE INTO outroute_lanes (source, lane) VALUES (?, ?)")
            .bind(&self.source)
            .bind(CAPTURE_LANE)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The replication connection's options (the source's URL, password
    /// and TLS) and the replica server id it registers with.
    pub fn replication(&self) -> Option<(mysql_async::Opts, u32)> {
        self.binlog
            .as_ref()
            .map(|o| (o.clone(), self.replica_server_id()))
    }

    /// A server id for this relay's replication connection of this
    /// source, outside the ids real replicas usually take. Per relay:
    /// MariaDB refuses a second replica with an id already connected
    /// (error 4052), and a frozen old owner's connection must not keep the
    /// new owner out (the old one's marks and records are fenced anyway).
    fn replica_server_id(&self) -> u32 {
        use std::hash::BuildHasher;
        let h = foldhash::fast::FixedState::with_seed(7).hash_one((
            self.key.as_str(),
            self.source.as_str(),
            self.relay_id.as_str(),
        ));
        SERVER_ID_BASE + (h % 0x0FFF_FFFF) as u32
    }

    /// The table's columns in the binlog's order (`ordinal_position`; an
    /// invisible virtual lane column is logged too) and the database the
    /// table is in.
    pub async fn binlog_columns(&self) -> Result<(String, Vec<String>)> {
        let schema: String = match &self.sql.schema {
            Some(s) => s.clone(),
            None => sqlx::query_scalar::<_, Option<String>>("SELECT DATABASE()")
                .fetch_one(&self.pool)
                .await?
                .ok_or_else(|| anyhow!("{}.url names no database", self.key))?,
        };
        let columns: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(column_name AS CHAR) FROM information_schema.columns \
             WHERE table_schema = ? AND table_name = ? ORDER BY ordinal_position",
        )
        .bind(&schema)
        .bind(&self.sql.bare_name)
        .fetch_all(&self.pool)
        .await?;
        Ok((schema, columns))
    }

    /// Where the stream resumes, if it ran before.
    pub async fn binlog_position(&self) -> Result<Option<BinlogPosition>> {
        let row: Option<(String, i64)> = sqlx::query_as(
            "SELECT CAST(position AS CHAR), backfilled FROM outroute_binlog WHERE source = ?",
        )
        .bind(&self.source)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|(gtid, b)| BinlogPosition {
            gtid,
            backfilled: b != 0,
        }))
    }

    /// A position before which every transaction is visible to a read
    /// that starts now: the binlog position of a consistent snapshot
    /// (MariaDB names it with the snapshot, so no transaction can be in
    /// the binlog before it yet invisible to the table read that follows),
    /// as a GTID position.
    ///
    /// With it, the highest sequence number the snapshot holds (tables
    /// with a sequence): every row above it committed after the position,
    /// so the stream brings it.
    pub async fn snapshot_position(&self) -> Result<(String, Option<i64>)> {
        // Text protocol: these statements are not all preparable.
        let mut conn = self.pool.acquire().await?;
        (&mut *conn)
            .execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            .await?;
        let rows = (&mut *conn)
            .fetch_all("SHOW STATUS LIKE 'binlog_snapshot_%'")
            .await?;
        let bound: Option<i64> = if self.sql.by_seq {
            let sql = format!(
                "SELECT CAST(MAX({}) AS SIGNED) FROM {} o",
                self.sql.seq, self.sql.table
            );
            (&mut *conn).fetch_one(sql.as_str()).await?.try_get(0)?
        } else {
            None
        };
        (&mut *conn).execute("COMMIT").await?;
        let mut status: Vec<(String, String)> = Vec::new();
        for r in &rows {
            status.push((r.try_get(0)?, r.try_get(1)?));
        }
        let get = |name: &str| {
            status
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        };
        let (Some(file), Some(pos)) =
            (get("binlog_snapshot_file"), get("binlog_snapshot_position"))
        else {
            bail!(
                "the server named no binlog position for a consistent snapshot (is the binary log on?)"
            );
        };
        let pos: u64 = pos
            .parse()
            .map_err(|_| anyhow!("binlog_snapshot_position `{pos}` is not a number"))?;
        let gtid: Option<String> = sqlx::query_scalar("SELECT BINLOG_GTID_POS(?, ?)")
            .bind(&file)
            .bind(pos)
            .fetch_one(&self.pool)
            .await?;
        let gtid = gtid.ok_or_else(|| anyhow!("BINLOG_GTID_POS({file}, {pos}) gave nothing"))?;
        if !valid_gtid_position(&gtid) {
            bail!("the server's GTID position `{gtid}` is not `domain-server-sequence`");
        }
        Ok((gtid, bound))
    }

    /// The recorded position against the server's binary log (`status`).
    pub async fn binlog_status(&self) -> Result<BinlogStatus> {
        let recorded = self.binlog_position().await?;
        let (server, expire): (String, Option<i64>) = sqlx::query_as(
            "SELECT CAST(@@GLOBAL.gtid_binlog_pos AS CHAR), CAST(@@GLOBAL.binlog_expire_logs_seconds AS SIGNED)",
        )
        .fetch_one(&self.pool)
        .await?;
        // Needs BINLOG MONITOR: without it the files stay unknown. (Text
        // protocol, as every `SHOW` here.)
        let logs: Option<Vec<(String, u64)>> = match (&self.pool)
            .fetch_all("SHOW BINARY LOGS")
            .await
            .and_then(|rows| {
                rows.iter()
                    .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                    .collect::<Result<Vec<(String, u64)>, sqlx::Error>>()
            }) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::debug!("SHOW BINARY LOGS: {e}");
                None
            }
        };
        let oldest = match logs.as_ref().and_then(|l| l.first()) {
            Some((file, _)) => {
                sqlx::query_scalar::<_, Option<String>>("SELECT BINLOG_GTID_POS(?, 4)")
                    .bind(file)
                    .fetch_one(&self.pool)
                    .await?
            }
            None => None,
        };
        let server_gtids = Gtids::parse(&server)?;
        let at = match &recorded {
            Some(p) => Some(Gtids::parse(&p.gtid)?),
            None => None,
        };
        let purged = match (&at, &oldest) {
            (Some(at), Some(oldest)) => at.behind(&Gtids::parse(oldest)?) > 0,
            _ => false,
        };
        Ok(BinlogStatus {
            behind_transactions: at.as_ref().map(|a| a.behind(&server_gtids)),
            position: recorded.as_ref().map(|p| p.gtid.clone()),
            backfilled: recorded.is_some_and(|p| p.backfilled),
            server_position: server,
            oldest_position: oldest,
            purged,
            files: logs.as_ref().map(|l| l.len() as i64),
            bytes: logs
                .as_ref()
                .map(|l| l.iter().map(|(_, b)| *b).sum::<u64>() as i64),
            expire_seconds: expire,
        })
    }

    /// Forget the recorded position (the server no longer has it), fenced
    /// like [`MySqlStore::save_position`]: the next stream starts afresh.
    pub async fn forget_position(&self, epoch: i64) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        if !self.holds_capture(&mut tx, epoch).await? {
            return Ok(false);
        }
        sqlx::query("DELETE FROM outroute_binlog WHERE source = ?")
            .bind(&self.source)
            .execute(&mut *tx)
            .await?;
        tx.commit()
            .await
            .context("forgetting the binlog position")?;
        Ok(true)
    }

    /// Does this relay hold the capture lease at `epoch`? Read with a
    /// shared lock on the lease row, so no take-over slips in before `tx`
    /// ends.
    async fn holds_capture(
        &self,
        tx: &mut sqlx::Transaction<'_, MySql>,
        epoch: i64,
    ) -> Result<bool> {
        let mine: Option<i64> = sqlx::query_scalar(
            "SELECT epoch FROM outroute_lanes WHERE source = ? AND lane = ? AND owner = ? \
             AND lease_until > UTC_TIMESTAMP(6) LOCK IN SHARE MODE",
        )
        .bind(&self.source)
        .bind(CAPTURE_LANE)
        .bind(&self.relay_id)
        .fetch_optional(&mut **tx)
        .await?;
        Ok(mine == Some(epoch))
    }

    /// Record the stream's position, fenced by the capture lease at
    /// `epoch` (a shared lock on the lease row: no take-over can slip in
    /// between). False: the lease is lost; nothing was written.
    pub async fn save_position(&self, position: &BinlogPosition, epoch: i64) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        if !self.holds_capture(&mut tx, epoch).await? {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO outroute_binlog (source, position, backfilled, epoch, updated_at) \
             VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6)) \
             ON DUPLICATE KEY UPDATE position = VALUES(position), backfilled = VALUES(backfilled), \
               epoch = VALUES(epoch), updated_at = VALUES(updated_at)",
        )
        .bind(&self.source)
        .bind(&position.gtid)
        .bind(i8::from(position.backfilled))
        .bind(epoch)
        .execute(&mut *tx)
        .await?;
        tx.commit().await.context("recording the binlog position")?;
        Ok(true)
    }

    /// Aggregates whose events wait: one of their unpublished events has a
    /// state record that is retrying (or waiting) or blocks. Their later
    /// stream events stay pending in the table and are read back in order
    /// ([`MySqlStore::held_events`]).
    pub async fn held_aggregates(&self) -> Result<HeldAggregates> {
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT CAST(aggregate_type AS CHAR), CAST(aggregate_id AS CHAR) FROM outroute_event_state FORCE INDEX (outroute_event_state_aggregate) \
             WHERE source = ? AND discarded_at IS NULL \
               AND (failed_at IS NULL OR blocks_until > UTC_TIMESTAMP(6)) \
             GROUP BY 1, 2",
        )
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|a| (a, vec!["*".to_string()]))
            .collect())
    }

    /// The due pending rows of `held`'s aggregates, each aggregate's in
    /// outbox order, at most `limit` in all: what a lease-mode claim of
    /// their lanes would return of them (rows behind a blocking event, or
    /// not due yet, are not), through the lane index, fenced as the
    /// capture's.
    pub async fn held_events(&self, held: &HeldAggregates, limit: u32) -> Result<Vec<Claim>> {
        let s = &self.sql;
        let lane = if self.lane_index {
            format!("o.{}", lane_column(self.lanes))
        } else {
            s.lane.clone()
        };
        let index = if self.lane_index {
            format!(" FORCE INDEX ({})", lane_index_name(self.lanes))
        } else {
            String::new()
        };
        let hold = match self.ordering {
            Ordering::None => String::new(),
            Ordering::Aggregate | Ordering::Strict => format!(
                " AND NOT EXISTS (SELECT 1 FROM outroute_event_state b FORCE INDEX (outroute_event_state_aggregate) \
                   WHERE b.source = ? AND b.aggregate_type = {at} AND b.aggregate_id = {ai} \
                   AND {before} AND b.blocks_until > UTC_TIMESTAMP(6))",
                at = s.aggregate_type_bin,
                ai = s.aggregate_id_bin,
                before = s.before(),
            ),
        };
        // One branch per aggregate: its lane, then the aggregate itself.
        let branch = format!(
            "(SELECT {cols}, st.event_id IS NOT NULL AS has_state, \
               COALESCE(st.attempts, 0) AS attempts, CAST(COALESCE(st.done_legs, '[]') AS CHAR) AS done_legs \
             FROM {table} o{index} \
             LEFT JOIN outroute_event_state st ON st.source = ? AND st.event_id = {id} \
             WHERE {lane} = CRC32(CONCAT(?, ':', ?)) % {lanes} AND {at} = ? AND {ai} = ? AND {pending} \
               AND (st.event_id IS NULL OR (st.failed_at IS NULL AND st.next_attempt_at <= UTC_TIMESTAMP(6))){hold} \
             ORDER BY {order} LIMIT ?)",
            cols = s.cols,
            table = s.table,
            id = s.id_bin,
            lanes = self.lanes,
            at = s.aggregate_type_bin,
            ai = s.aggregate_id_bin,
            pending = s.pending,
            order = s.order,
        );
        let aggregates: Vec<&(String, String)> = held.keys().collect();
        let mut out = Vec::new();
        for chunk in aggregates.chunks(32) {
            if out.len() >= limit as usize {
                break;
            }
            let sql = vec![branch.as_str(); chunk.len()].join(" UNION ALL ");
            let mut q = sqlx::query(&sql);
            for (t, a) in chunk {
                q = q.bind(&self.source).bind(t).bind(a).bind(t).bind(a);
                if self.ordering != Ordering::None {
                    q = q.bind(&self.source);
                }
                q = q.bind(i64::from(limit));
            }
            let rows = q
                .fetch_all(&self.pool)
                .await
                .context("reading waiting events")?;
            for r in &rows {
                out.push(to_claim(r, CAPTURE_LANE)?);
            }
        }
        out.truncate(limit as usize);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::{Gtids, valid_gtid_position};

    #[test]
    fn gtid_positions_round_trip_and_count_what_lies_ahead() {
        let mut g = Gtids::parse("0-1-4,1-2-99").unwrap();
        g.set(0, 3, 7);
        assert_eq!(g.to_string(), "0-3-7,1-2-99");
        assert_eq!(Gtids::parse("").unwrap().to_string(), "");
        assert!(Gtids::parse("0-1").is_err());
        let server = Gtids::parse("0-3-10,1-2-99,2-5-3").unwrap();
        // 3 more in domain 0, none in 1, all 3 of a domain not yet seen.
        assert_eq!(g.behind(&server), 6);
        assert_eq!(server.behind(&g), 0);
        // A purged position: the oldest file starts past it.
        assert_eq!(g.behind(&Gtids::parse("0-1-5").unwrap()), 0);
        assert!(g.behind(&Gtids::parse("0-1-8").unwrap()) > 0);
    }

    #[test]
    fn gtid_positions_are_checked_before_they_reach_sql() {
        for ok in ["", "0-1-4", "0-1-4,1-2-99", "0-1-4, 1-2-99"] {
            assert!(valid_gtid_position(ok), "{ok}");
        }
        for bad in [
            "0-1",
            "0-1-x",
            "0-1-4'; DROP TABLE t; --",
            "a-b-c",
            "0-1-4-5",
        ] {
            assert!(!valid_gtid_position(bad), "{bad}");
        }
    }
}
