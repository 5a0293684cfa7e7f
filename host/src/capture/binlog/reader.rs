//! The binlog reader: owns the replication connection (registered as a
//! replica, streaming from a GTID position), follows the GTID of every
//! transaction, decodes the outbox table's inserts into events and hands
//! them on in commit order, each transaction's end as the position after
//! it. It never decides what happens to an event: `binlog.rs` does.
//!
//! MariaDB specifics (its GTIDs are not MySQL's): the session declares
//! `@mariadb_slave_capability = 4` (send GTID events) and
//! `@slave_connect_state` (start after this GTID position), then a plain
//! `COM_BINLOG_DUMP`; a GTID event (type 162) carries sequence number,
//! domain and flags, its server id is the event header's. A transaction
//! ends with its XID event, or a `COMMIT` query (non-transactional
//! tables), or right after its one statement (a standalone GTID: DDL).

use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use chrono::{DateTime, NaiveDate, Utc};
use futures::StreamExt;
use mysql_async::binlog::events::{EventData, RowsEventData};
use mysql_async::binlog::value::BinlogValue;
use mysql_async::consts::ColumnType;
use mysql_async::prelude::Queryable;
use mysql_async::{BinlogStreamRequest, Value};
use tokio::sync::mpsc;

use crate::capture::decode::{Budget, Room};
use crate::config::{Marking, TableConfig};
use crate::event::{Malformed, RawRow};
use crate::store::mysql::Gtids;
use crate::store::postgres::CAPTURE_LANE;
use crate::store::{Captured, Claim};

/// MariaDB's GTID event, and the flag of a transaction of one statement.
const GTID_EVENT: u8 = 162;
const FL_STANDALONE: u8 = 1;

/// The server sends a heartbeat when it has nothing else for this long; a
/// connection silent for [`SILENT_LIMIT`] is taken for dead.
const HEARTBEAT: Duration = Duration::from_secs(1);
const SILENT_LIMIT: Duration = Duration::from_secs(10);

/// A transaction that touched no outbox row still moves the position,
/// at most this often (so other tables' traffic costs no marks).
const QUIET_MARK_EVERY: Duration = Duration::from_millis(200);

/// What the reader hands the capture loop, in stream order.
pub(super) enum Got {
    /// An insert into the outbox table, and its share of the budget.
    Event(Box<Claim>, Room),
    /// Every event before this was handed on: the stream may resume after
    /// this GTID position once they are handled. Whether the transactions
    /// since the last one held events, and when the last of them was
    /// logged (whole seconds: the binlog's event time).
    Commit(String, bool, Option<DateTime<Utc>>),
    /// The server no longer has the position asked for (purged): its
    /// message.
    Purged(String),
}

/// Where each mapped column sits in the table's binlog row.
struct Shape {
    columns: Vec<String>,
}

impl Shape {
    fn at(&self, name: &str) -> Option<usize> {
        self.columns
            .iter()
            .position(|c| c.eq_ignore_ascii_case(name))
    }
}

pub(super) struct Reader {
    table: TableConfig,
    /// The canonical table: pending rows carry the `published_at`
    /// sentinel.
    canonical: bool,
    schema: String,
    name: String,
    shape: Shape,
    budget: Budget,
    gtids: Gtids,
}

impl Reader {
    pub(super) fn new(
        table: TableConfig,
        canonical: bool,
        schema: String,
        columns: Vec<String>,
        from: &str,
        budget: Budget,
    ) -> Result<Self> {
        let name = match table.name.split_once('.') {
            Some((_, n)) => n.to_string(),
            None => table.name.clone(),
        };
        Ok(Reader {
            table,
            canonical,
            schema,
            name,
            shape: Shape { columns },
            budget,
            gtids: Gtids::parse(from)?,
        })
    }

    /// Stream from the position given to [`Reader::new`] until the
    /// receiver goes or the stream fails (the error is the last item).
    pub(super) async fn run(
        mut self,
        opts: mysql_async::Opts,
        server_id: u32,
        out: mpsc::Sender<Result<Got>>,
    ) {
        if let Err(e) = self.read(opts, server_id, &out).await {
            let purged = e
                .downcast_ref::<mysql_async::Error>()
                .is_some_and(|e| matches!(e, mysql_async::Error::Server(s) if s.code == 1236));
            let item = if purged {
                Ok(Got::Purged(format!("{e}")))
            } else {
                Err(e)
            };
            let _ = out.send(item).await;
        }
    }

    async fn read(
        &mut self,
        opts: mysql_async::Opts,
        server_id: u32,
        out: &mpsc::Sender<Result<Got>>,
    ) -> Result<()> {
        let mut conn = mysql_async::Conn::new(opts)
            .await
            .map_err(|e| anyhow!("opening the replication connection: {e}"))?;
        let from = self.gtids.to_string();
        conn.query_drop("SET @mariadb_slave_capability = 4").await?;
        conn.query_drop(format!("SET @slave_connect_state = '{from}'"))
            .await?;
        conn.query_drop("SET @slave_gtid_strict_mode = 0").await?;
        conn.query_drop(format!(
            "SET @master_heartbeat_period = {}",
            HEARTBEAT.as_nanos()
        ))
        .await?;
        let mut stream = conn
            .get_binlog_stream(
                BinlogStreamRequest::new(server_id)
                    .with_filename(b"")
                    .with_pos(4u64),
            )
            .await
            .map_err(|e| anyhow!("starting the binlog stream: {e}"))?;
        tracing::info!(position = %from, "streaming from the binary log");
        // The transaction being read: standalone (ends after its one
        // statement), and whether it held outbox rows.
        let mut standalone = false;
        let mut rows_in_tx = false;
        let mut last_mark = Instant::now();
        let mut unmarked = false;
        loop {
            let ev = match tokio::time::timeout(SILENT_LIMIT, stream.next()).await {
                Err(_) => bail!(
                    "the binlog stream was silent for {}s (no event, no heartbeat)",
                    SILENT_LIMIT.as_secs()
                ),
                Ok(None) => bail!("the server ended the binlog stream"),
                Ok(Some(Err(e))) => return Err(e.into()),
                Ok(Some(Ok(ev))) => ev,
            };
            let raw_type = ev.header().event_type_raw();
            tracing::trace!(raw_type, len = ev.data().len(), "binlog event");
            if raw_type == GTID_EVENT {
                let d = ev.data();
                if d.len() < 13 {
                    bail!("a GTID event of {} bytes", d.len());
                }
                let seq = u64::from_le_bytes(d[0..8].try_into()?);
                let domain = u32::from_le_bytes(d[8..12].try_into()?);
                standalone = d[12] & FL_STANDALONE != 0;
                self.gtids.set(domain, ev.header().server_id(), seq);
                rows_in_tx = false;
                continue;
            }
            let mut commit = false;
            match ev.read_data()? {
                Some(EventData::XidEvent(_)) => commit = true,
                Some(EventData::QueryEvent(q)) => {
                    commit = standalone || q.query_raw().eq_ignore_ascii_case(b"COMMIT");
                }
                Some(EventData::HeartbeatEvent) => {
                    if unmarked {
                        unmarked = false;
                        last_mark = Instant::now();
                        if out
                            .send(Ok(Got::Commit(self.gtids.to_string(), false, None)))
                            .await
                            .is_err()
                        {
                            return Ok(());
                        }
                    }
                    continue;
                }
                Some(EventData::RowsEvent(re)) => {
                    let (RowsEventData::WriteRowsEventV1(_) | RowsEventData::WriteRowsEvent(_)) =
                        &re
                    else {
                        continue;
                    };
                    let Some(tme) = stream.get_tme(re.table_id()) else {
                        bail!(
                            "a rows event of table id {} without its table map",
                            re.table_id()
                        );
                    };
                    if tme.database_name() != self.schema.as_str()
                        || tme.table_name() != self.name.as_str()
                    {
                        continue;
                    }
                    let logged = tme.columns_count() as usize;
                    if logged > self.shape.columns.len() {
                        bail!(
                            "`{}.{}` has {logged} columns in the binlog and {} in the table: its definition changed; \
                             restarting the stream reads it again",
                            self.schema,
                            self.name,
                            self.shape.columns.len()
                        );
                    }
                    let mut claims = Vec::new();
                    for row in re.rows(tme) {
                        let (_, after) = row?;
                        let Some(after) = after else { continue };
                        if let Some(c) = self.claim(&after) {
                            claims.push(c);
                        }
                    }
                    for c in claims {
                        rows_in_tx = true;
                        let room = self.budget.take(c.bytes()).await?;
                        if out.send(Ok(Got::Event(Box::new(c), room))).await.is_err() {
                            return Ok(());
                        }
                    }
                }
                _ => {}
            }
            if commit {
                standalone = false;
                if rows_in_tx || last_mark.elapsed() >= QUIET_MARK_EVERY {
                    let events = std::mem::take(&mut rows_in_tx);
                    unmarked = false;
                    last_mark = Instant::now();
                    let at = events
                        .then(|| DateTime::from_timestamp(i64::from(ev.header().timestamp()), 0))
                        .flatten();
                    if out
                        .send(Ok(Got::Commit(self.gtids.to_string(), events, at)))
                        .await
                        .is_err()
                    {
                        return Ok(());
                    }
                } else {
                    unmarked = true;
                }
            }
        }
    }

    /// An inserted row as a captured event: `None` when it is not pending
    /// (inserted as published already, or failed).
    fn claim(&self, row: &mysql_async::binlog::row::BinlogRow) -> Option<Claim> {
        let t = &self.table;
        let value = |name: &str| value_of(&self.shape, row, name);
        // Pending, by the marking's rule (as `TableSql` has it).
        let pending = match &t.marking {
            Marking::PublishedAt { column } => match value(column) {
                Some((BinlogValue::Value(Value::Date(y, ..)), _)) if self.canonical => *y == 1000,
                Some((BinlogValue::Value(Value::NULL), _)) | None => !self.canonical,
                _ => false,
            },
            Marking::Status {
                column, pending, ..
            } => {
                value(column)
                    .and_then(|(v, ty)| text(v, ty).ok().flatten())
                    .as_deref()
                    == Some(pending.as_str())
            }
            Marking::Delete | Marking::Queue { .. } => true,
        };
        let failed = t.failed_at.as_deref().is_some_and(|c| {
            value(c).is_some_and(|(v, _)| !matches!(v, BinlogValue::Value(Value::NULL)))
        });
        if !pending || failed {
            return None;
        }
        let mut bad: Option<String> = None;
        let mut col = |name: Option<&str>| -> Option<String> {
            let (v, ty) = value(name?)?;
            match text(v, ty) {
                Ok(s) => s,
                Err(why) => {
                    bad.get_or_insert(format!("column `{}` {why}", name.unwrap_or_default()));
                    None
                }
            }
        };
        let id = col(Some(&t.id)).unwrap_or_default();
        let aggregate_type = match (&t.aggregate_type, &t.aggregate_type_value) {
            (Some(c), _) => col(Some(c)),
            (None, Some(v)) => Some(v.clone()),
            (None, None) => Some(String::new()),
        };
        let aggregate_id = col(Some(&t.aggregate_id));
        let event_type = col(Some(&t.event_type));
        let event_version = col(t.event_version.as_deref());
        let payload = col(Some(&t.payload));
        let headers = col(t.headers.as_deref());
        let created_at = value(&t.created_at).and_then(|(v, ty)| time(v, ty));
        let sequence = match &t.sequence {
            Some(s) => value(s).and_then(|(v, _)| match v {
                BinlogValue::Value(Value::Int(i)) => Some(*i),
                BinlogValue::Value(Value::UInt(u)) => i64::try_from(*u).ok(),
                _ => None,
            }),
            None => created_at.map(|c| c.timestamp_micros()),
        };
        let raw = RawRow {
            id: id.clone(),
            sequence,
            aggregate_type,
            aggregate_id,
            event_type,
            event_version,
            payload,
            headers,
            created_at,
            attempts: 0,
            payload_is_json: false,
        };
        let row = match bad {
            None => raw.validate(),
            Some(reason) => Err(Malformed {
                id,
                sequence: raw.sequence.unwrap_or(0),
                aggregate_type: raw.aggregate_type.clone().unwrap_or_default(),
                aggregate_id: raw.aggregate_id.clone().unwrap_or_default(),
                event_type: raw.event_type.clone().unwrap_or_default(),
                reason,
                raw: Some(Box::new(raw)),
            }),
        };
        Some(Claim {
            lane: CAPTURE_LANE,
            tid: None,
            has_state: false,
            held: Vec::new(),
            done_legs: Vec::new(),
            epoch: None,
            // Streamed: the stream moves past it, so an event that cannot
            // go now is recorded as waiting (its row stays pending).
            captured: Some(Captured {
                commit_lsn: 0,
                parked: false,
                committed_at: None,
            }),
            route: None,
            row,
        })
    }
}

/// Column `name` of a logged row, and its type.
fn value_of<'r>(
    shape: &Shape,
    row: &'r mysql_async::binlog::row::BinlogRow,
    name: &str,
) -> Option<(&'r BinlogValue<'r>, ColumnType)> {
    let i = shape.at(name)?;
    let v = row.as_ref(i)?;
    let ty = row.columns_ref().get(i)?.column_type();
    Some((v, ty))
}

/// A logged value as text (`None`: NULL), or what is wrong with it.
fn text(v: &BinlogValue<'_>, ty: ColumnType) -> Result<Option<String>, String> {
    let v = match v {
        BinlogValue::Value(v) => v,
        BinlogValue::Jsonb(j) => {
            return serde_json::Value::try_from(j.clone())
                .map(|j| Some(j.to_string()))
                .map_err(|e| format!("holds JSON that cannot be read ({e})"));
        }
        BinlogValue::JsonDiff(_) => return Err("holds a partial JSON update".into()),
    };
    Ok(match v {
        Value::NULL => None,
        Value::Bytes(b) if is_timestamp(ty) => Some(
            timestamp(b)
                .map(|t| t.format("%Y-%m-%d %H:%M:%S%.f").to_string())
                .unwrap_or_else(|| String::from_utf8_lossy(b).into_owned()),
        ),
        Value::Bytes(b) => {
            Some(String::from_utf8(b.clone()).map_err(|_| "is not UTF-8 text".to_string())?)
        }
        Value::Int(i) => Some(i.to_string()),
        Value::UInt(u) => Some(u.to_string()),
        Value::Float(f) => Some(f.to_string()),
        Value::Double(d) => Some(d.to_string()),
        Value::Date(..) => time(&BinlogValue::Value(v.clone()), ty)
            .map(|t| t.format("%Y-%m-%d %H:%M:%S%.f").to_string()),
        Value::Time(neg, d, h, m, s, us) => Some(format!(
            "{}{:02}:{m:02}:{s:02}.{us:06}",
            if *neg { "-" } else { "" },
            u32::from(*h) + d * 24
        )),
    })
}

fn is_timestamp(ty: ColumnType) -> bool {
    matches!(
        ty,
        ColumnType::MYSQL_TYPE_TIMESTAMP | ColumnType::MYSQL_TYPE_TIMESTAMP2
    )
}

/// A `TIMESTAMP` as logged: seconds since the epoch, `.micros` optional.
fn timestamp(b: &[u8]) -> Option<DateTime<Utc>> {
    let s = std::str::from_utf8(b).ok()?;
    let (secs, frac) = s.split_once('.').unwrap_or((s, "0"));
    let micros: i64 = format!("{frac:0<6}").get(..6)?.parse().ok()?;
    DateTime::from_timestamp(secs.parse().ok()?, (micros * 1000) as u32)
}

/// A `DATETIME` (taken as UTC, as lease mode reads it) or `TIMESTAMP`.
fn time(v: &BinlogValue<'_>, ty: ColumnType) -> Option<DateTime<Utc>> {
    match v {
        BinlogValue::Value(Value::Date(y, mo, d, h, mi, s, us)) => {
            NaiveDate::from_ymd_opt(i32::from(*y), u32::from(*mo), u32::from(*d))?
                .and_hms_micro_opt(u32::from(*h), u32::from(*mi), u32::from(*s), *us)
                .map(|t| t.and_utc())
        }
        BinlogValue::Value(Value::Bytes(b)) if is_timestamp(ty) => timestamp(b),
        BinlogValue::Value(Value::Bytes(b)) => {
            crate::capture::decode::parse_timestamp(std::str::from_utf8(b).ok()?)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logged_timestamps_and_datetimes_read_as_utc() {
        let t = timestamp(b"1796602813.274347").unwrap();
        assert_eq!(t.timestamp(), 1_796_602_813);
        assert_eq!(t.timestamp_subsec_micros(), 274_347);
        assert_eq!(
            timestamp(b"1796602813").unwrap().timestamp_subsec_micros(),
            0
        );
        assert_eq!(
            timestamp(b"1796602813.5")
                .unwrap()
                .timestamp_subsec_micros(),
            500_000
        );
        let d = BinlogValue::Value(Value::Date(2026, 12, 7, 0, 20, 13, 274_347));
        let t = time(&d, ColumnType::MYSQL_TYPE_DATETIME2).unwrap();
        assert_eq!(t.to_rfc3339(), "2026-12-07T00:20:13.274347+00:00");
    }

    #[test]
    fn text_refuses_what_is_not_utf8() {
        let ok = BinlogValue::Value(Value::Bytes(b"{\"a\":1}".to_vec()));
        assert_eq!(
            text(&ok, ColumnType::MYSQL_TYPE_BLOB).unwrap().as_deref(),
            Some("{\"a\":1}")
        );
        let bad = BinlogValue::Value(Value::Bytes(vec![0xff, 0xfe]));
        assert!(text(&bad, ColumnType::MYSQL_TYPE_BLOB).is_err());
        assert_eq!(
            text(
                &BinlogValue::Value(Value::NULL),
                ColumnType::MYSQL_TYPE_BLOB
            )
            .unwrap(),
            None
        );
    }
}
