//! Reading the stream: the reader task turns replication messages into
//! captured events (table rows by their column mapping, or logical-message
//! envelopes) and transaction ends, in commit order, each event taking its
//! share of the memory [`Budget`] before it is passed on. It never decides
//! what happens to an event: `dispatch.rs` does.

use super::*;

/// Bytes of captured events the relay holds at once: the reader takes an
/// event's share ([`Room`]) before passing it on, and gives it back when
/// the batch that handled it ends. A slow or failing sink so stops the
/// reading instead of filling the memory; the replication client then
/// stops reading the socket (and keeps the connection alive).
#[derive(Clone)]
pub(super) struct Budget {
    pub(super) room: Arc<Semaphore>,
    /// The whole budget, in KiB.
    pub(super) units: u32,
}

/// An event's share of the [`Budget`]: given back when dropped.
pub(super) type Room = OwnedSemaphorePermit;

impl Budget {
    /// `(concurrency × BATCHES_IN_FLIGHT + 1)` batches of `max_batch_bytes`:
    /// every worker's batches out, and the next one being gathered.
    pub(super) fn of(config: &crate::config::RelayConfig) -> Self {
        let batches = u64::from(config.concurrency.max(1)) * BATCHES_IN_FLIGHT as u64 + 1;
        let kib = (batches.saturating_mul(config.max_batch_bytes) / 1024).clamp(1, u32::MAX as u64);
        let units = kib as u32;
        Budget {
            room: Arc::new(Semaphore::new(units as usize)),
            units,
        }
    }

    /// Wait for room for `bytes` (at most the whole budget, so an event
    /// larger than it still goes, alone).
    pub(super) async fn take(&self, bytes: u64) -> Result<Room> {
        let want = bytes.div_ceil(1024).clamp(1, u64::from(self.units)) as u32;
        self.room
            .clone()
            .acquire_many_owned(want)
            .await
            .map_err(|_| anyhow!("the capture budget was closed"))
    }
}

/// The envelope of a tableless event: the content of
/// `pg_logical_emit_message(true, '<prefix>', '<envelope JSON>')`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    pub id: String,
    #[serde(default)]
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    #[serde(default)]
    pub event_version: Option<serde_json::Value>,
    pub payload: Option<Box<serde_json::value::RawValue>>,
    #[serde(default)]
    pub headers: Option<serde_json::Value>,
}

/// What the reader task hands the capture loop, in stream order.
#[derive(Debug)]
pub(super) enum Item {
    /// A captured event and, once the reader took it, its share of the
    /// [`Budget`].
    Event(Box<Claim>, Option<Room>),
    /// The end of a transaction: once its events are handled the slot may
    /// be confirmed up to `end`.
    Commit { end: Lsn, at: DateTime<Utc> },
    /// Nothing is open on the server's side up to `at`: confirmable once
    /// everything before it is handled.
    Idle { at: Lsn },
}

/// A timestamp in PostgreSQL's ISO text form, with or without a zone.
/// (The formats are parsed once: parsing them per row was most of the cost.)
pub(super) fn parse_timestamp(s: &str) -> Option<DateTime<Utc>> {
    use chrono::format::{Item, Parsed, StrftimeItems, parse};
    use std::sync::LazyLock;
    static ZONED: LazyLock<Vec<Item<'static>>> = LazyLock::new(|| {
        StrftimeItems::new("%Y-%m-%d %H:%M:%S%.f%#z")
            .parse_to_owned()
            .unwrap_or_default()
    });
    static PLAIN: LazyLock<Vec<Item<'static>>> = LazyLock::new(|| {
        StrftimeItems::new("%Y-%m-%d %H:%M:%S%.f")
            .parse_to_owned()
            .unwrap_or_default()
    });
    let mut zoned = Parsed::new();
    if parse(&mut zoned, s, ZONED.iter()).is_ok()
        && let Ok(t) = zoned.to_datetime()
    {
        return Some(t.with_timezone(&Utc));
    }
    let mut plain = Parsed::new();
    parse(&mut plain, s, PLAIN.iter()).ok()?;
    plain
        .to_naive_datetime_with_offset(0)
        .ok()
        .map(|n: NaiveDateTime| n.and_utc())
}

/// Column positions of the mapped columns in one published relation.
pub(super) struct RowShape {
    pub(super) id: Option<usize>,
    pub(super) sequence: Option<usize>,
    pub(super) aggregate_type: Option<usize>,
    pub(super) aggregate_id: Option<usize>,
    pub(super) event_type: Option<usize>,
    pub(super) event_version: Option<usize>,
    pub(super) payload: Option<usize>,
    pub(super) headers: Option<usize>,
    pub(super) created_at: Option<usize>,
    /// The payload column is `json`/`jsonb` (see [`RawRow::payload_is_json`]).
    pub(super) payload_is_json: bool,
    /// How many keys map each column: a value mapped once moves out of the
    /// decoded row, one mapped twice is copied.
    pub(super) uses: Vec<u8>,
}

impl RowShape {
    pub(super) fn of(rel: &pgoutput::Relation, t: &TableConfig) -> Self {
        let pos = |c: &Option<String>| {
            c.as_ref()
                .and_then(|c| rel.columns.iter().position(|n| n == c))
        };
        let req = |c: &String| rel.columns.iter().position(|n| n == c);
        let payload = req(&t.payload);
        let mut shape = RowShape {
            payload_is_json: payload
                .and_then(|i| rel.types.get(i))
                .is_some_and(|ty| pgoutput::JSON_TYPES.contains(ty)),
            uses: vec![0; rel.columns.len()],
            id: req(&t.id),
            sequence: pos(&t.sequence),
            aggregate_type: pos(&t.aggregate_type),
            aggregate_id: req(&t.aggregate_id),
            event_type: req(&t.event_type),
            event_version: pos(&t.event_version),
            payload,
            headers: pos(&t.headers),
            created_at: req(&t.created_at),
        };
        for i in [
            shape.id,
            shape.sequence,
            shape.aggregate_type,
            shape.aggregate_id,
            shape.event_type,
            shape.event_version,
            shape.payload,
            shape.headers,
            shape.created_at,
        ]
        .into_iter()
        .flatten()
        {
            shape.uses[i] = shape.uses[i].saturating_add(1);
        }
        shape
    }

    pub(super) fn row(&self, t: &TableConfig, mut values: Vec<pgoutput::Value>) -> RawRow {
        // Each value moves out of the decoded row, unless two keys map its
        // column: then each gets a copy.
        let mut text = |i: Option<usize>| {
            let i = i?;
            match values.get_mut(i) {
                Some(pgoutput::Value::Text(s)) if self.uses.get(i) == Some(&1) => {
                    Some(std::mem::take(s))
                }
                Some(pgoutput::Value::Text(s)) => Some(s.clone()),
                _ => None,
            }
        };
        let created_at = text(self.created_at).and_then(|s| parse_timestamp(&s));
        let sequence = match t.sequence {
            Some(_) => text(self.sequence).and_then(|s| s.parse::<i64>().ok()),
            None => created_at.map(|c| c.timestamp_micros()),
        };
        RawRow {
            id: text(self.id).unwrap_or_default(),
            sequence,
            aggregate_type: match &t.aggregate_type {
                Some(_) => text(self.aggregate_type),
                None => t.aggregate_type_value.clone(),
            },
            aggregate_id: text(self.aggregate_id),
            event_type: text(self.event_type),
            event_version: text(self.event_version),
            payload: text(self.payload),
            headers: text(self.headers),
            created_at,
            attempts: 0,
            payload_is_json: self.payload_is_json,
        }
    }
}

/// A logical message's envelope as an event (`sequence`: the message's
/// LSN), or the reason it cannot be one.
#[allow(clippy::result_large_err)]
pub(super) fn envelope_event(
    content: &[u8],
    lsn: Lsn,
    at: DateTime<Utc>,
) -> Result<Event, Malformed> {
    let lsn_seq = lsn.as_u64() as i64;
    // Without a usable id the message's position names it.
    let unnamed = |reason: String| Malformed {
        id: format!("lsn-{}", lsn.to_pg_string()),
        sequence: lsn_seq,
        aggregate_type: String::new(),
        aggregate_id: String::new(),
        event_type: String::new(),
        reason,
        raw: None,
    };
    let env: Envelope = match serde_json::from_slice(content) {
        Ok(e) => e,
        Err(e) => {
            return Err(unnamed(format!(
                "logical message is not an outroute envelope: {e}"
            )));
        }
    };
    if env.id.trim().is_empty() {
        // Every event is known by its id (state row, `ce_id`): an empty
        // one would be taken for every other envelope without one.
        return Err(unnamed("the envelope's `id` is empty".into()));
    }
    RawRow {
        id: env.id,
        sequence: Some(lsn_seq),
        aggregate_type: Some(env.aggregate_type.unwrap_or_default()),
        aggregate_id: env.aggregate_id,
        event_type: env.event_type,
        event_version: env.event_version.map(|v| match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        }),
        payload: env.payload.map(|p| p.get().to_string()),
        headers: env.headers.map(|h| h.to_string()),
        created_at: Some(at),
        attempts: 0,
        // A `RawValue`: serde_json has just checked it.
        payload_is_json: true,
    }
    .validate()
}

/// Postgres micros since 2000-01-01 → UTC.
pub(super) fn pg_time(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros + 946_684_800_000_000).unwrap_or_else(Utc::now)
}

/// The reader: owns the replication session, decodes what it brings into
/// [`Item`]s, and reports confirmed positions back to the server.
pub(super) struct Reader {
    pub(super) input: LogicalInput,
    pub(super) prefix: String,
    pub(super) table: TableConfig,
    /// The mapped table's oid, resolved at start: a relation is ours by it,
    /// never by a name another schema may share.
    pub(super) table_oid: Option<u32>,
    pub(super) relations: pgoutput::Relations,
    pub(super) shapes: std::collections::HashMap<u32, RowShape>,
    /// Inside a transaction: its commit LSN, commit time.
    pub(super) open: Option<(i64, DateTime<Utc>)>,
    pub(super) budget: Budget,
}

impl Reader {
    pub(super) async fn run(
        mut self,
        mut client: ReplicationClient,
        out: mpsc::Sender<Result<Item>>,
        mut confirmed: watch::Receiver<Lsn>,
    ) {
        loop {
            let ev = tokio::select! {
                ev = client.recv() => ev,
                changed = confirmed.changed() => {
                    if changed.is_err() { break; }
                    client.update_applied_lsn(*confirmed.borrow_and_update());
                    continue;
                }
            };
            let item = match ev {
                Ok(Some(ev)) => match self.decode(ev) {
                    Ok(Some(Item::Event(c, _))) => {
                        // Wait for room, passing confirmations on meanwhile.
                        let take = self.budget.take(c.bytes());
                        tokio::pin!(take);
                        let room = loop {
                            tokio::select! {
                                room = &mut take => break room,
                                changed = confirmed.changed() => {
                                    if changed.is_err() { break Err(anyhow!("the capture loop stopped")); }
                                    client.update_applied_lsn(*confirmed.borrow_and_update());
                                }
                            }
                        };
                        room.map(|room| Item::Event(c, Some(room)))
                    }
                    Ok(Some(item)) => Ok(item),
                    Ok(None) => continue,
                    Err(e) => Err(e),
                },
                Ok(None) => Err(anyhow!("the replication stream ended")),
                Err(e) => Err(anyhow!("replication stream: {e}")),
            };
            let stop = item.is_err();
            if out.send(item).await.is_err() || stop {
                break;
            }
        }
        client.stop();
        let _ = client.shutdown().await;
    }

    pub(super) fn decode(&mut self, ev: ReplicationEvent) -> Result<Option<Item>> {
        Ok(match ev {
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            } => {
                self.open = Some((final_lsn.as_u64() as i64, pg_time(commit_time_micros)));
                None
            }
            ReplicationEvent::Commit {
                end_lsn,
                commit_time_micros,
                ..
            } => {
                self.open = None;
                Some(Item::Commit {
                    end: end_lsn,
                    at: pg_time(commit_time_micros),
                })
            }
            ReplicationEvent::KeepAlive { wal_end, .. } if self.open.is_none() => {
                Some(Item::Idle { at: wal_end })
            }
            ReplicationEvent::KeepAlive { .. } | ReplicationEvent::StoppedAt { .. } => None,
            ReplicationEvent::Message {
                transactional,
                lsn,
                prefix,
                content,
            } => {
                if self.input != LogicalInput::Messages || prefix != self.prefix {
                    return Ok(None);
                }
                let (commit_lsn, at) = match (transactional, self.open) {
                    (true, Some(o)) => o,
                    // Outside a transaction there is no commit to keep to:
                    // such a message is not part of any business change.
                    _ => {
                        tracing::warn!(lsn = %lsn.to_pg_string(), "ignoring a non-transactional outroute message: use pg_logical_emit_message(true, …)");
                        return Ok(None);
                    }
                };
                let row = envelope_event(&content, lsn, at);
                Some(Item::Event(Box::new(captured(row, commit_lsn, at)), None))
            }
            ReplicationEvent::XLogData { data, .. } => {
                if self.input != LogicalInput::Table {
                    return Ok(None);
                }
                match pgoutput::decode(&data).map_err(|e| anyhow!(e))? {
                    pgoutput::Change::Relation(oid, rel) => {
                        let t = &self.table;
                        let (schema, name) = match t.name.split_once('.') {
                            Some((s, n)) => (s.to_string(), n.to_string()),
                            None => ("public".to_string(), t.name.clone()),
                        };
                        let ours = match self.table_oid {
                            Some(table) => oid == table,
                            None => rel.name == name && rel.namespace == schema,
                        };
                        if ours {
                            let shape = RowShape::of(&rel, t);
                            if shape.id.is_none() || shape.payload.is_none() {
                                bail!(
                                    "table `{}` as published lacks the mapped id or payload column",
                                    t.name
                                );
                            }
                            self.shapes.insert(oid, shape);
                        }
                        self.relations.insert(oid, rel);
                        None
                    }
                    pgoutput::Change::Insert(oid, values) => {
                        let (Some(shape), Some((commit_lsn, at))) =
                            (self.shapes.get(&oid), self.open)
                        else {
                            return Ok(None);
                        };
                        let row = shape.row(&self.table, values).validate();
                        Some(Item::Event(Box::new(captured(row, commit_lsn, at)), None))
                    }
                    pgoutput::Change::Other(_) => None,
                }
            }
        })
    }
}

pub(super) fn captured(row: Result<Event, Malformed>, commit_lsn: i64, at: DateTime<Utc>) -> Claim {
    Claim {
        lane: CAPTURE_LANE,
        tid: None,
        has_state: false,
        held: Vec::new(),
        done_legs: Vec::new(),
        epoch: None,
        captured: Some(Captured {
            commit_lsn,
            parked: false,
            committed_at: Some(at),
        }),
        route: None,
        row,
    }
}
