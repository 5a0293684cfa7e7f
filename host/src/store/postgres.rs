//! PostgreSQL store: leases, claims, marks and failure state for any outbox
//! table shape.
//!
//! ## Ordering design: lanes
//! Every aggregate hashes onto one of `relay.lanes` lanes
//! (`hashtext(aggregate_type || '/' || aggregate_id) % lanes`). A lane has
//! at most one live owner, recorded in `outroute_lanes` with a lease that the
//! owner renews every `lease_ttl / 3`. Relays take a fair share of lanes
//! (`ceil(lanes / live relays)`), stop claiming from extra lanes and let
//! their leases lapse, so a new relay picks them up after at most one TTL.
//!
//! Because a lane has one owner, claiming needs no row locks and no writes:
//! a claim is one `SELECT` (measured: row-lease designs that UPDATE lease
//! columns at claim cost an extra write per row). Within a batch the relay
//! keeps per-aggregate order itself.
//!
//! ## Cost: per batch, never per backlog
//! The lane index (`CREATE INDEX … ON t ((<lane expression>), <order>, <id>)
//! WHERE <pending>`; `outroute migrate` builds it for the canonical table,
//! `outroute migrate --table` for an existing one) lets the claim walk each
//! owned lane from its oldest pending row and stop at a full batch: one
//! index descent per lane plus the rows returned, whatever the backlog or
//! history, and whatever the planner statistics (the plan is checked with
//! `EXPLAIN` at start-up; a table without a usable index is claimed by a
//! scan, with a warning naming the `CREATE INDEX`). Marking goes straight to
//! each row by the `ctid` the claim saw, re-checking id, pending state and
//! lane ownership — owner, unexpired lease and the lane's epoch at claim
//! time — in the same statement, so a relay whose lease lapsed (GC pause,
//! network cut) marks nothing, even if the lane came back to it since. A
//! lapsed lane is taken over by the next lease round of another relay
//! (`FOR UPDATE SKIP LOCKED`: it never waits for the old owner; the old
//! owner's sends are cut off by its own lease deadline, see `pipeline.rs`).
//! The ownership check is a plain read: lease renewal never waits behind a
//! mark. Worst case after a lapse is a
//! duplicate publish carrying the same event id, never a loss or a reorder of
//! first deliveries.
//!
//! `marking = queue` replaces the lane index with a narrow list of the
//! pending rows, `outroute_queue` (source, lane, seq), filled by an insert
//! trigger: a claim walks only pending entries and fetches each row by its
//! sequence number, a mark deletes the entry, and no outbox row is ever
//! rewritten (measured: about 40 % less PostgreSQL work per event than the
//! `published_at` stamp, with every row kept). Floors are not needed there.
//!
//! Published rows leave dead entries in the lane index until VACUUM; each
//! lane's claim starts at a *floor* past them (`postgres/floor.rs`: raised
//! only where no row can still appear below it), so a long drain stays as
//! fast at its end as at its start even with autovacuum off.
//!
//! A failing event holds back only its own aggregate: its retry time is
//! stored in `outroute_event_state.blocks_until`, and the claim skips every
//! later event of an aggregate with an earlier blocking state row (an index
//! probe per row walked, made only while the source has any state row at
//! all). A held aggregate's backlog is measured by the floor rounds and
//! then skipped by the claims of its lane (`postgres/floor.rs`).
//!
//! Background work is bounded too: the backlog gauge counts at most
//! [`BACKLOG_EXACT`] rows, and retention runs in one relay at a time.
//!
//! Cost per batch: 1 claim round-trip, 1 mark round-trip, plus one per
//! failed event; lease upkeep is 2–3 statements every `lease_ttl / 3`.

use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{ConnectOptions, Row};

use super::{
    Claim, Cursor, FailedEvent, Failure, FailureKind, Filter, Leases, QuarantinedRoute,
    RelayStatus, Status,
};
use crate::config::{Config, Logical, LogicalInput, Marking, Ordering, TableConfig};
use crate::event::RawRow;

mod floor;
mod logical;
pub use floor::ROUND_INTERVAL as FLOOR_ROUND_INTERVAL;
/// How often a relay removes queue entries whose row was deleted or
/// failed by hand (see [`PgStore::drop_orphans`]).
pub const ORPHAN_SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// A resumed route's waiting events (deferred by its quarantine), due now.
const MAKE_WAITING_DUE: &str = "UPDATE outroute_event_state SET next_attempt_at = now(), blocks_until = now(), updated_at = now() \
     WHERE source = $1 AND (route = $2 OR $2 = ANY(waiting_routes)) AND failed_at IS NULL AND blocks_until > now()";

/// Queue entries looked at per lane by one [`PgStore::drop_orphans`] round.
pub const ORPHAN_WALK: i64 = 64;

/// Rounds per sweep: a sweep walks at most `ORPHAN_ROUNDS × ORPHAN_WALK`
/// entries per lane, then the next one goes on from there, so a deep queue
/// is covered over several sweeps at a bounded cost to the database.
pub const ORPHAN_ROUNDS: usize = 4;

/// What one [`PgStore::drop_orphans`] round did.
#[derive(Debug, Default)]
pub struct OrphanWalk {
    /// Entries deleted.
    pub dropped: u64,
    /// The lanes with entries left after the walk, each with the last
    /// sequence number walked (where the next round starts); a lane not
    /// listed was walked to its end.
    pub more: Vec<(i32, i64)>,
}
pub use logical::{CAPTURE_LANE, CapturedRows, HeldAggregates, SlotCheck};

/// Quote a validated identifier (`schema.table` → `"schema"."table"`).
fn quote(ident: &str) -> String {
    ident
        .split('.')
        .map(|p| format!("\"{}\"", p.replace('"', "\"\"")))
        .collect::<Vec<_>>()
        .join(".")
}

/// Quote a string literal (standard_conforming_strings is on since 9.1).
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The rows still to publish, the lane of a row and the outbox order, as
/// SQL over one alias (`o` in queries, none in index definitions: the
/// planner matches the claim's expressions against the lane index only
/// when both are written the same way).
#[derive(Debug, Clone)]
struct Shape {
    aggregate_type: String,
    aggregate_id: String,
    lane: String,
    pending: String,
    order: String,
    order_desc: String,
}

impl Shape {
    fn new(t: &TableConfig, lanes: u32, alias: &str) -> Self {
        let col = |c: &str| match alias {
            "" => quote(c),
            a => format!("{a}.{}", quote(c)),
        };
        let aggregate_type = match (&t.aggregate_type, &t.aggregate_type_value) {
            (Some(c), _) => format!("{}::text", col(c)),
            (None, Some(v)) => format!("{}::text", literal(v)),
            (None, None) => "''::text".into(),
        };
        let aggregate_id = format!("{}::text", col(&t.aggregate_id));
        let mut pending = match &t.marking {
            Marking::PublishedAt { column } => vec![format!("{} IS NULL", col(column))],
            Marking::Status {
                column, pending, ..
            } => vec![format!("{} = {}", col(column), literal(pending))],
            Marking::Delete | Marking::Queue { .. } => Vec::new(),
        };
        if let Some(f) = &t.failed_at {
            pending.push(format!("{} IS NULL", col(f)));
        }
        let order_col = t.sequence.as_deref().unwrap_or(&t.created_at);
        Shape {
            lane: format!(
                "((hashtext(coalesce({aggregate_type}, '') || '/' || coalesce({aggregate_id}, '')) & 2147483647) % {lanes})"
            ),
            aggregate_type,
            aggregate_id,
            pending: if pending.is_empty() {
                "TRUE".into()
            } else {
                pending.join(" AND ")
            },
            order: format!("{}, {}", col(order_col), col(&t.id)),
            order_desc: format!("{} DESC, {} DESC", col(order_col), col(&t.id)),
        }
    }
}

/// The start of the key of a row without an id (NULL or ''): followed by
/// the row's place in the table (`no-id@(0,4)`), see [`TableSql::id_key`].
pub const NO_ID: &str = "no-id@";

/// True when no event of the source (`$1`) has a state row: uncorrelated,
/// so PostgreSQL evaluates it once per statement (an InitPlan).
const NO_STATE: &str =
    "(SELECT NOT EXISTS (SELECT 1 FROM outroute_event_state ns WHERE ns.source = $1))";

/// [`NO_STATE`] for a table whose rows say they failed (`failed_at`, or a
/// `status` with a failed value): a failed row is no longer pending, so
/// only state rows that can still skip or hold a pending row count —
/// retrying or waiting (`failed_at` NULL) and holding for good (`blocks_until`
/// infinity). Failed-and-skipped and discarded events (they stay for ever)
/// then no longer cost every later claim its per-row probes. The partial
/// index `outroute_event_state_live` answers it in one probe.
const NO_LIVE_STATE: &str = "(SELECT NOT EXISTS (SELECT 1 FROM outroute_event_state ns WHERE ns.source = $1 \
     AND (ns.failed_at IS NULL OR ns.blocks_until = 'infinity')))";

/// The backlog gauge counts pending events exactly up to about this many.
pub const BACKLOG_EXACT: i64 = 1_000;

/// The SQL for one table mapping, generated once at start-up.
#[derive(Debug, Clone)]
pub struct TableSql {
    table: String,
    id: String,
    id_type: String,
    seq: String,
    aggregate_type: String,
    aggregate_id: String,
    /// Pending rows, lane and order over alias `o`.
    pending: String,
    /// What the row itself says about being pending (`pending` without the
    /// queue probe of `marking = queue`; the same for other markings).
    row_pending: String,
    lane: String,
    order: String,
    order_desc: String,
    /// The sequence column over alias `o` (as the lane index has it), when
    /// the table has one: claims start each lane at its floor on it (see
    /// `postgres/floor.rs`).
    floor_col: Option<String>,
    /// The lane of a state row (`outroute_event_state` alias `st`).
    state_lane: String,
    published: String,
    select_cols: String,
    /// The payload column is `json`/`jsonb` (set by `check_table`): rows
    /// are not parsed again to check it.
    payload_is_json: bool,
    /// Mapped columns' types as the catalog names them (set by
    /// `check_table`), for casts to a column's own type.
    column_types: std::collections::HashMap<String, String>,
    /// The id column may hold NULL or '' (set by `check_table`): state rows
    /// then key such a row by its place in the table ([`TableSql::id_key`]).
    id_may_be_missing: bool,
    /// The lane index: its name and `CREATE INDEX` statement (the pending
    /// queue's set-up under `marking = queue`).
    index_name: String,
    index_ddl: String,
    cfg: TableConfig,
}

/// The start of the names outroute gives objects of table `t` (index and
/// function names are per schema and at most 63 bytes).
fn name_base(t: &TableConfig) -> String {
    t.name
        .rsplit('.')
        .next()
        .unwrap_or(&t.name)
        .chars()
        .take(40)
        .collect()
}

/// The pending queue's trigger function of table `t`.
fn queue_function(t: &TableConfig) -> String {
    format!("{}_outroute_enqueue", name_base(t))
}

/// The pending queue's trigger function for table `t` and the trigger that
/// follows producers' updates, as statements that may run again (`migrate
/// --table` refreshes them on a table set up before). The function runs as
/// its owner (`SECURITY DEFINER`): producers' roles need rights on their
/// outbox only. So that nobody can use it to list rows of their own, it
/// refuses any other table, nobody else may call it, and it names
/// outroute's queue by schema (resolved here) with a `search_path` of
/// `pg_catalog` then `pg_temp`.
///
/// A producer that updates a pending row's aggregate or sequence number
/// moves its entry with it (`outroute_requeue`): the row goes out in its new
/// aggregate's lane and order. (Left behind, the entry would point at no row
/// and the event would never be published.)
fn queue_function_ddl(t: &TableConfig, function: &str, seq: &str, lanes: u32) -> String {
    let new = Shape::new(t, lanes, "NEW");
    let old = Shape::new(t, lanes, "OLD");
    let new_seq = seq.replacen("o.", "NEW.", 1);
    let old_seq = seq.replacen("o.", "OLD.", 1);
    // The body goes through format(): `%1$s` is the table's oid, `%2$I`
    // the queue's schema, any other `%` doubled. On a partitioned outbox the
    // trigger fires on the partition a row went to: any partition of the
    // table is the table (`pg_partition_ancestors`, asked only then).
    let body = format!(
        "CREATE OR REPLACE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER \
         SET search_path = pg_catalog, pg_temp AS $outroute$ BEGIN \
         IF TG_RELID <> %1$s AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_ancestors(TG_RELID) a WHERE a.relid = %1$s) \
           THEN RAISE EXCEPTION 'outroute_enqueue lists rows of one outbox table only'; END IF; \
         IF TG_OP = 'UPDATE' THEN \
           UPDATE %2$I.outroute_queue SET lane = {lane}, seq = {new_seq} \
             WHERE source = {src} AND lane = {old_lane} AND seq = {old_seq}; \
           RETURN NULL; \
         END IF; \
         INSERT INTO %2$I.outroute_queue (source, lane, seq) VALUES ({src}, {lane}, {new_seq}); RETURN NULL; END $outroute$",
        f = quote(function).replace('%', "%%"),
        src = literal(&t.name).replace('%', "%%"),
        lane = new.lane.replace('%', "%%"),
        old_lane = old.lane.replace('%', "%%"),
        new_seq = new_seq.replace('%', "%%"),
        old_seq = old_seq.replace('%', "%%"),
    );
    let mut followed: Vec<&str> = t.aggregate_type.iter().map(String::as_str).collect();
    followed.push(&t.aggregate_id);
    if let Some(c) = &t.sequence {
        followed.push(c);
    }
    let changed = followed
        .iter()
        .map(|c| format!("OLD.{c} IS DISTINCT FROM NEW.{c}", c = quote(c)))
        .collect::<Vec<_>>()
        .join(" OR ");
    format!(
        "DO $setup$ BEGIN EXECUTE format($body${body}$body$, {table_lit}::regclass::oid, \
           (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
            WHERE c.oid = 'outroute_queue'::regclass)); END $setup$;\n\
         REVOKE ALL ON FUNCTION {f}() FROM PUBLIC;\n\
         DROP TRIGGER IF EXISTS outroute_requeue ON {table};\n\
         CREATE TRIGGER outroute_requeue AFTER UPDATE OF {cols} ON {table} FOR EACH ROW \
           WHEN ({changed}) EXECUTE FUNCTION {f}();\n",
        f = quote(function),
        table_lit = literal(&quote(&t.name)),
        table = quote(&t.name),
        cols = followed
            .iter()
            .map(|c| quote(c))
            .collect::<Vec<_>>()
            .join(", "),
    )
}

/// The pending queue's set-up for table `t` (`marking = queue`): the
/// trigger function ([`queue_function_ddl`]), the trigger that lists every
/// inserted row, then the rows already pending, in one transaction
/// (producers' inserts wait for it: `CREATE TRIGGER` waits for the inserts
/// in flight, so the backfill sees every row the trigger missed).
fn queue_setup(
    t: &TableConfig,
    function: &str,
    seq: &str,
    o: &Shape,
    published: Option<&str>,
    lanes: u32,
) -> String {
    let mut pending = vec![o.pending.clone()];
    if let Some(c) = published {
        pending.push(format!("o.{} IS NULL", quote(c)));
    }
    format!(
        "{function_ddl}\
         DROP TRIGGER IF EXISTS outroute_enqueue ON {table};\n\
         CREATE TRIGGER outroute_enqueue AFTER INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {f}();\n\
         INSERT INTO outroute_queue (source, lane, seq) SELECT {src}, {lane_o}, {seq} FROM {table} o \
         WHERE {pending} ON CONFLICT DO NOTHING;",
        function_ddl = queue_function_ddl(t, function, seq, lanes),
        f = quote(function),
        src = literal(&t.name),
        table = quote(&t.name),
        lane_o = o.lane,
        pending = pending.join(" AND "),
    )
}

impl TableSql {
    fn new(t: &TableConfig, lanes: u32, id_type: &str) -> Self {
        let col = |c: &str| format!("o.{}", quote(c));
        let seq = match &t.sequence {
            Some(s) => format!("{}::bigint", col(s)),
            None => format!(
                "(extract(epoch from {}::timestamptz) * 1000000)::bigint",
                col(&t.created_at)
            ),
        };
        let q = Shape::new(t, lanes, "o");
        let (aggregate_type, aggregate_id) = (q.aggregate_type.clone(), q.aggregate_id.clone());
        let published = match &t.marking {
            Marking::PublishedAt { column } => format!("{} IS NOT NULL", col(column)),
            Marking::Status { column, sent, .. } => {
                format!("{} = {}", col(column), literal(sent))
            }
            Marking::Delete => "FALSE".into(),
            // Not queued and not failed (`OFFSET 0`: a probe per row, never
            // a join that reads the source's whole queue).
            Marking::Queue { .. } => format!(
                "{} AND NOT EXISTS (SELECT 1 FROM outroute_queue qq WHERE qq.source = {} \
                   AND qq.lane = {} AND qq.seq = {seq} OFFSET 0)",
                q.pending,
                literal(&t.name),
                q.lane
            ),
        };
        let bare = Shape::new(t, lanes, "");
        let opt = |c: &Option<String>, cast: &str| match c {
            Some(c) => format!("{}::{cast}", col(c)),
            None => format!("NULL::{cast}"),
        };
        let select_cols = format!(
            "{id}::text AS id, {seq} AS seq, {aggregate_type} AS aggregate_type, {aggregate_id} AS aggregate_id, \
             {event_type}::text AS event_type, {version} AS event_version, {payload}::text AS payload, \
             {headers} AS headers, {created}::timestamptz AS created_at, {lane} AS lane",
            id = col(&t.id),
            event_type = col(&t.event_type),
            version = opt(&t.event_version, "text"),
            payload = col(&t.payload),
            headers = opt(&t.headers, "text"),
            created = col(&t.created_at),
            lane = q.lane,
        );
        let base = name_base(t);
        let index_name = format!("{base}_outroute_lanes{lanes}");
        let index_ddl = match &t.marking {
            Marking::Queue { column } => {
                queue_setup(t, &queue_function(t), &seq, &q, column.as_deref(), lanes)
            }
            _ => format!(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS {} ON {} (({}), {}){}",
                quote(&index_name),
                quote(&t.name),
                bare.lane,
                bare.order,
                if bare.pending == "TRUE" {
                    String::new()
                } else {
                    format!(" WHERE {}", bare.pending)
                }
            ),
        };
        TableSql {
            table: quote(&t.name),
            id: col(&t.id),
            id_type: id_type.to_string(),
            seq: seq.clone(),
            aggregate_type,
            aggregate_id,
            row_pending: q.pending.clone(),
            pending: match &t.marking {
                Marking::Queue { .. } => format!(
                    "{} AND EXISTS (SELECT 1 FROM outroute_queue qq WHERE qq.source = {} AND qq.lane = {} AND qq.seq = {seq} OFFSET 0)",
                    q.pending,
                    literal(&t.name),
                    q.lane
                ),
                _ => q.pending,
            },
            lane: q.lane,
            order: q.order,
            order_desc: q.order_desc,
            floor_col: t.sequence.as_ref().map(|c| col(c)),
            state_lane: format!(
                "((hashtext(coalesce(st.aggregate_type, '') || '/' || coalesce(st.aggregate_id, '')) & 2147483647) % {lanes})"
            ),
            published,
            select_cols,
            payload_is_json: false,
            id_may_be_missing: false,
            column_types: Default::default(),
            index_name,
            index_ddl,
            cfg: t.clone(),
        }
    }

    /// The columns [`to_claim`] reads, for a plain read of the table
    /// (no claim state): `tid` is the `tid` column's SQL.
    fn row_columns(&self, tid: &str) -> String {
        format!(
            "{}, {tid} AS tid, NULL::int AS state_attempts, NULL::text[] AS held_routes",
            self.select_cols
        )
    }

    /// The key of a row's state rows (`outroute_event_state.event_id`): its
    /// id as text, or, for a row without one (NULL or ''), where it lies in
    /// the table ([`NO_ID`] and its ctid), so that such a row fails alone and the
    /// rows after it flow. A producer that sets the id later gives the row
    /// its real key: it is claimed again and published.
    fn id_key(&self) -> String {
        if self.id_may_be_missing {
            format!(
                "coalesce(nullif({id}::text, ''), '{NO_ID}' || o.ctid::text)",
                id = self.id
            )
        } else {
            format!("{}::text", self.id)
        }
    }

    /// A condition on alias `o`: the row is one of `keys` (SQL for a
    /// `text[]` of state keys, see [`Self::id_key`]): by the id's index, and
    /// for rows without an id by their place, re-checked against the key
    /// (a slot freed since may hold another row by now).
    fn is_one_of(&self, keys: &str) -> String {
        if !self.id_may_be_missing {
            return format!("{} = ANY(({keys})::{}[])", self.id, self.id_type);
        }
        format!(
            "o.ctid = ANY(ARRAY(SELECT x.ctid FROM {table} x WHERE x.{id} = ANY(ARRAY(SELECT k FROM unnest({keys}) k                WHERE k NOT LIKE '{NO_ID}%')::{ty}[])                UNION ALL SELECT substr(k, {from})::tid FROM unnest({keys}) k WHERE k LIKE '{NO_ID}%'))              AND {key} = ANY({keys})",
            table = self.table,
            id = quote(&self.cfg.id),
            ty = self.id_type,
            from = NO_ID.len() + 1,
            key = self.id_key(),
        )
    }

    /// Column `c`'s type (`text` when unknown): checked to be a plain
    /// type name, so it can be cast to.
    fn column_type(&self, c: &str) -> &str {
        self.column_types
            .get(c)
            .map(String::as_str)
            .filter(|t| {
                t.chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || " _(),".contains(ch))
            })
            .unwrap_or("text")
    }

    /// `$n` cast to an array of the id column's type.
    fn ids_param(&self, n: usize) -> String {
        format!("${n}::text[]::{}[]", self.id_type)
    }

    /// Skip rows whose own state says "not now" (failed, or retrying
    /// later) and, under `ordering = "aggregate"`, rows of an aggregate
    /// held by an earlier event. Each is an index probe per row scanned;
    /// `OFFSET 0` keeps them per-row filters (a planner that turned them
    /// into joins could sort the whole lane to restore its order).
    ///
    /// Most of the time no event of the source has a state row at all: one
    /// probe per claim ([`NO_STATE`], evaluated once) then spares every row
    /// its probes (they were most of the pages a claim touched).
    fn state_filter(&self, ordering: Ordering) -> String {
        let no_state = self.no_state();
        let own = format!(
            "AND CASE WHEN {no_state} THEN TRUE ELSE NOT EXISTS (SELECT 1 FROM outroute_event_state s \
               WHERE s.source = $1 AND s.event_id = {id} \
               AND (s.failed_at IS NOT NULL OR s.next_attempt_at > now()) OFFSET 0) END",
            id = self.id_key()
        );
        // Routes are subscriptions: an earlier blocking event holds back
        // only the routes it still waits for (`waiting_routes`, NULL: all).
        // A row is skipped while every route *it* waits for is held: its
        // own `waiting_routes` when it has a state row, else every route
        // of the source (`$4`). A row some route may still take is claimed,
        // and the claim says which routes are held (`held_routes`).
        let hold = match ordering {
            Ordering::Aggregate | Ordering::Strict => format!(
                " AND CASE WHEN {no_state} THEN TRUE ELSE NOT EXISTS (SELECT 1 FROM ({held}) h \
                   WHERE h.held && '{{*}}'::text[] OR h.held @> coalesce((SELECT s.waiting_routes \
                     FROM outroute_event_state s WHERE s.source = $1 AND s.event_id = {id}), $4::text[]) \
                   OFFSET 0) END",
                held = self.held_routes(),
                id = self.id_key()
            ),
            Ordering::None => String::new(),
        };
        format!("{own}{hold}")
    }

    /// The once-per-claim test that spares rows their state probes: see
    /// [`NO_LIVE_STATE`] (rows that say they failed) and [`NO_STATE`].
    fn no_state(&self) -> &'static str {
        let row_says_failed = self.cfg.failed_at.is_some()
            || matches!(
                self.cfg.marking,
                Marking::Status {
                    failed: Some(_),
                    ..
                }
            );
        if row_says_failed {
            NO_LIVE_STATE
        } else {
            NO_STATE
        }
    }

    /// The routes earlier blocking events of a row's aggregate hold (as
    /// one array, `held`; `*`: every route; NULL: none).
    fn held_routes(&self) -> String {
        format!(
            "SELECT array_agg(DISTINCT r) AS held FROM outroute_event_state b \
               CROSS JOIN LATERAL unnest(coalesce(b.waiting_routes, '{{*}}'::text[])) r \
               WHERE b.source = $1 AND b.aggregate_type = {at} AND b.aggregate_id = {ai} AND b.seq <= {seq} \
               AND b.event_id <> {id} AND b.blocks_until > now()",
            at = self.aggregate_type,
            ai = self.aggregate_id,
            seq = self.seq,
            id = self.id_key()
        )
    }

    /// Extra columns every claim returns: where the row is (for a cheap
    /// mark), its attempts so far (NULL: it has no state row) and the
    /// routes held by earlier events of its aggregate (NULL: none).
    fn claim_extras(&self, ordering: Ordering) -> String {
        let no_state = self.no_state();
        let held = match ordering {
            Ordering::None => "NULL::text[]".to_string(),
            _ => format!(
                "CASE WHEN {no_state} THEN NULL ELSE ({}) END",
                self.held_routes()
            ),
        };
        format!(
            "o.ctid::text AS tid, CASE WHEN {no_state} THEN NULL ELSE (SELECT st.attempts FROM outroute_event_state st \
               WHERE st.source = $1 AND st.event_id = {}) END AS state_attempts, {held} AS held_routes",
            self.id_key()
        )
    }

    /// The next pending rows matching `rows` (a condition on the lane), in
    /// outbox order, at most `$3` of them.
    fn next_pending(&self, ordering: Ordering, rows: &str) -> String {
        format!(
            "SELECT {cols}, {extras} FROM {table} o WHERE {rows} AND {pending} {state} ORDER BY {order} LIMIT $3",
            cols = self.select_cols,
            extras = self.claim_extras(ordering),
            table = self.table,
            pending = self.pending,
            state = self.state_filter(ordering),
            order = self.order,
        )
    }

    /// The claim with the lane index: each owned lane's index is walked
    /// from its floor (`$5`, see `postgres/floor.rs`) to its oldest pending
    /// row and on, lane after lane (the first lane changes every claim),
    /// and the walk stops at `limit` rows. Cost: one index descent per lane
    /// plus the rows returned (and rows skipped as held), whatever the
    /// backlog, the history or the entries published rows left behind.
    fn claim_by_lane(&self, ordering: Ordering, skips: bool) -> String {
        let rows = match &self.floor_col {
            Some(seq) if skips => format!(
                "{} = l.lane AND {seq} >= l.lo AND {seq} < coalesce(l.hi, {})",
                self.lane,
                i64::MAX
            ),
            Some(seq) => format!("{} = l.lane AND {seq} >= l.lo", self.lane),
            None => format!("{} = l.lane", self.lane),
        };
        format!(
            "SELECT c.* FROM {} CROSS JOIN LATERAL ({}) c ORDER BY l.n LIMIT $3",
            self.segments(skips),
            self.next_pending(ordering, &rows)
        )
    }

    /// The stretches of the owned lanes a claim walks, in order, as rows
    /// `l(lane, n, lo, hi)` (`hi` excluded, NULL: no end), from
    /// [`floor::Starts`] (`$2` lanes, `$5` starts, `$6` parts, `$7`–`$9`
    /// the skip: holder, end, fingerprint; see `postgres/floor.rs`): a lane
    /// from its floor on, or, while its skip still holds, from the floor
    /// to the holder and from the skip's end on.
    /// Without `skips` (no lane has one, the usual case): one stretch per
    /// lane from its floor, `$2` and `$5` only.
    fn segments(&self, skips: bool) -> String {
        if !skips {
            return "unnest($2::int[], $5::bigint[]) WITH ORDINALITY AS l(lane, lo, n)".into();
        }
        format!(
            "(SELECT l.lane, l.n, l.lo, CASE WHEN l.part = 0 AND g.skips THEN l.skip_from + 1 END AS hi \
               FROM unnest($2::int[], $5::bigint[], $6::int[], $7::bigint[], $8::bigint[], $9::text[]) \
                 WITH ORDINALITY AS l(lane, lo, part, skip_from, skip_to, skip_fp, n) \
               CROSS JOIN LATERAL (SELECT CASE WHEN l.skip_to IS NULL THEN FALSE ELSE {holds} END AS skips) g \
               WHERE l.part = 0 OR g.skips) l",
            holds = self.skip_holds()
        )
    }

    /// Does lane `l`'s skip still hold: its holder still holds every route
    /// of the source (`$4`), and the other live state rows in the range are
    /// those its round saw?
    fn skip_holds(&self) -> String {
        format!(
            "(EXISTS (SELECT 1 FROM outroute_event_state st WHERE st.source = $1 AND st.seq = l.skip_from \
               AND {state_lane} = l.lane AND st.discarded_at IS NULL AND st.blocks_until > now() \
               AND (st.waiting_routes IS NULL OR st.waiting_routes @> $4::text[])) \
             AND {fp} = l.skip_fp)",
            state_lane = self.state_lane,
            fp = self.skip_fingerprint("l.skip_from", "l.skip_to", "l.lane"),
        )
    }

    /// What can change in a skipped range `(lo, hi)` of `lane`: the live
    /// state rows in it that keep a row from being claimed now (held,
    /// failed, retry not due), by count, sequence numbers and routes held.
    /// Any of them published, retried, discarded or due changes it.
    fn skip_fingerprint(&self, lo: &str, hi: &str, lane: &str) -> String {
        format!(
            "(SELECT count(*)::text || ':' || coalesce(sum(st.seq), 0)::text || ':' \
               || coalesce(sum(hashtext(coalesce(array_to_string(st.waiting_routes, ','), '*'))), 0)::text \
             FROM outroute_event_state st WHERE st.source = $1 AND st.seq > {lo} AND st.seq < {hi} \
               AND {state_lane} = {lane} AND st.discarded_at IS NULL \
               AND (st.blocks_until > now() OR st.failed_at IS NOT NULL OR st.next_attempt_at > now()))",
            state_lane = self.state_lane,
        )
    }

    /// The claim under `marking = queue`: each owned lane's queue entries
    /// in order, each row fetched by its sequence number (a primary-key
    /// probe in a LATERAL, so no plan can scan the table), the walk going
    /// on past entries that cannot go now (a held aggregate, a retry not
    /// yet due, a row deleted while pending) until the batch is full.
    /// Cost: the entries walked plus the rows returned; published entries
    /// are gone. The lane returned is the entry's, which the mark deletes
    /// (the row's own lane only differs when a producer changed its
    /// aggregate after the insert). The `tid` returned is the entry's, so
    /// the mark goes straight to it.
    fn claim_by_queue(&self, ordering: Ordering, skips: bool) -> String {
        format!(
            "SELECT c.* FROM {segments} \
             CROSS JOIN LATERAL (SELECT r.* FROM outroute_queue qq \
               CROSS JOIN LATERAL (SELECT {cols}, {extras} FROM {table} o \
                 WHERE {seqcol} = qq.seq AND {row_pending} {state} OFFSET 0) r \
               WHERE qq.source = {src} AND qq.lane = l.lane AND qq.seq >= l.lo{upto} \
               ORDER BY qq.seq LIMIT $3) c ORDER BY l.n LIMIT $3",
            segments = self.segments(skips),
            upto = if skips {
                format!(" AND qq.seq < coalesce(l.hi, {})", i64::MAX)
            } else {
                String::new()
            },
            cols =
                self.select_cols
                    .replacen(&format!("{} AS lane", self.lane), "qq.lane AS lane", 1),
            extras = self.claim_extras(ordering).replacen(
                "o.ctid::text AS tid",
                "qq.ctid::text AS tid",
                1
            ),
            src = literal(&self.cfg.name),
            table = self.table,
            seqcol = self.seq,
            state = self.state_filter(ordering),
            row_pending = self.row_pending,
        )
    }

    /// One floor round (see `postgres/floor.rs`), from one snapshot: its
    /// xmin and xmax, and per lane of `$2` (floors `$3`, sweep `$4`) the
    /// lowest pending sequence at or above the floor, the lowest sequence
    /// of an event with a live state row, and on sweeps the lowest pending
    /// one below the floor. `None` for tables without a sequence column.
    fn floor_round(&self, ordering: Ordering) -> Option<String> {
        let seq = self.floor_col.as_ref()?;
        Some(self.floor_round_with(
            |cmp| {
                format!(
                    "(SELECT {seq} FROM {table} o WHERE {lane} = l.lane AND {pending} AND {seq} {cmp} l.floor \
                       ORDER BY {seq} LIMIT 1)",
                    table = self.table,
                    lane = self.lane,
                    pending = self.pending,
                )
            },
            |ok| {
                format!(
                    "SELECT {seqv} AS s{ok} FROM {table} o WHERE {lane} = l.lane AND {pending} \
                       AND {seq} > h.walk_from ORDER BY {order} LIMIT {walk} * CASE WHEN l.cand_to IS NULL THEN 1 ELSE 2 END",
                    seqv = self.seq,
                    ok = if ok {
                        format!(", (TRUE {}) AS ok", self.round_state_filter(ordering))
                    } else {
                        String::new()
                    },
                    table = self.table,
                    lane = self.lane,
                    pending = self.pending,
                    order = self.order,
                    walk = floor::SKIP_WALK,
                )
            },
        ))
    }

    /// [`Self::floor_round`] under `marking = queue`: the lowest queued
    /// sequence at or above (on sweeps: below) each lane's floor. The
    /// entry is written in the producer's transaction, so it becomes
    /// visible exactly when the row does, and the floors' rules hold as
    /// they are.
    fn floor_round_queue(&self, ordering: Ordering) -> Option<String> {
        self.floor_col.as_ref()?;
        let src = literal(&self.cfg.name);
        Some(self.floor_round_with(
            |cmp| {
                format!(
                    "(SELECT qq.seq FROM outroute_queue qq WHERE qq.source = {src} AND qq.lane = l.lane \
                       AND qq.seq {cmp} l.floor ORDER BY qq.seq LIMIT 1)"
                )
            },
            |ok| {
                format!(
                    "SELECT qq.seq AS s{ok} FROM outroute_queue qq WHERE qq.source = {src} \
                       AND qq.lane = l.lane AND qq.seq > h.walk_from ORDER BY qq.seq \
                       LIMIT {walk} * CASE WHEN l.cand_to IS NULL THEN 1 ELSE 2 END",
                    ok = if ok {
                        format!(
                            ", EXISTS (SELECT 1 FROM {table} o WHERE {seqcol} = qq.seq AND {row_pending} {state} \
                               OFFSET 0) AS ok",
                            table = self.table,
                            seqcol = self.seq,
                            row_pending = self.row_pending,
                            state = self.round_state_filter(ordering),
                        )
                    } else {
                        String::new()
                    },
                    walk = floor::SKIP_WALK,
                )
            },
        ))
    }

    /// The claim's state filter as a round runs it (the routes are `$8`).
    fn round_state_filter(&self, ordering: Ordering) -> String {
        self.state_filter(ordering)
            .replace("$4::text[]", "$8::text[]")
    }

    /// A floor round whose per-lane walk is `walk(">=")` (the first
    /// pending at or above the floor) and `walk("<")` (below it), and, for
    /// a lane with a holder, whose skip walk is `skip_walk(true)` (the
    /// rows after `h.walk_from`, with `ok`: a claim could take it) and
    /// `skip_walk(false)` (the same rows' sequence numbers only).
    fn floor_round_with(
        &self,
        walk: impl Fn(&str) -> String,
        skip_walk: impl Fn(bool) -> String,
    ) -> String {
        format!(
            "WITH st AS MATERIALIZED (SELECT {state_lane} AS lane, min(st.seq) AS seq FROM outroute_event_state st \
                 WHERE st.source = $1 AND st.discarded_at IS NULL GROUP BY 1), \
             hold AS MATERIALIZED (SELECT {state_lane} AS lane, min(st.seq) AS seq FROM outroute_event_state st \
                 WHERE st.source = $1 AND st.discarded_at IS NULL \
                   AND (st.failed_at IS NULL OR st.blocks_until = 'infinity') GROUP BY 1) \
             SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin, \
               pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax, \
               {first}::bigint AS first, (SELECT st.seq FROM st WHERE st.lane = l.lane) AS state, \
               CASE WHEN l.sweep THEN {below}::bigint END AS below, \
               h.holder, k.resume, \
               CASE WHEN l.skip_from = h.holder THEN {fp_now} END AS fp_now, \
               CASE WHEN l.cand_to IS NOT NULL AND k.resume IS NOT NULL THEN {fp_candidate} END AS fp_candidate \
             FROM unnest($2::int[], $3::bigint[], $4::bool[], $5::bigint[], $6::bigint[], $7::bigint[]) \
               WITH ORDINALITY AS l(lane, floor, sweep, skip_from, skip_to, cand_to, n) \
             LEFT JOIN LATERAL (SELECT hold.seq AS holder, \
                 CASE WHEN l.skip_from = hold.seq THEN l.skip_to - 1 ELSE hold.seq END AS walk_from \
               FROM hold WHERE hold.lane = l.lane) h ON TRUE \
             LEFT JOIN LATERAL (SELECT CASE WHEN h.walk_from IS NULL THEN NULL::bigint ELSE \
                 coalesce((SELECT w.s FROM ({walk_ok}) w WHERE w.ok LIMIT 1), \
                   (SELECT max(w.s) FROM ({walk_seqs}) w) + 1) END AS resume) k ON TRUE \
             ORDER BY l.n",
            state_lane = self.state_lane,
            first = walk(">="),
            below = walk("<"),
            walk_ok = skip_walk(true),
            walk_seqs = skip_walk(false),
            fp_now = self.skip_fingerprint("l.skip_from", "l.skip_to", "l.lane"),
            fp_candidate =
                self.skip_fingerprint("h.holder", "least(k.resume, l.cand_to)", "l.lane"),
        )
    }

    /// The claim without the lane index: one scan of every pending row
    /// (computing its lane), then a sort. Correct, but O(backlog).
    fn claim_by_scan(&self, ordering: Ordering) -> String {
        self.next_pending(ordering, &format!("{} = ANY($2)", self.lane))
    }
}

/// A pooled connection idle longer than this is pinged before use
/// (HikariCP's "alive bypass window" is the same idea, at 500 ms too).
const IDLE_BEFORE_PING: Duration = Duration::from_millis(500);

/// A connection given back within this long of a statement the relay gave
/// up on ([`PgStore::bounded`]) is pinged with this deadline before it
/// rejoins the pool, and dropped if the ping does not answer in time.
const ABANDONED_CHECK: Duration = Duration::from_secs(2);

/// When the relay last gave up on a statement (see [`PgStore::bounded`]).
#[derive(Debug, Default)]
struct Abandoned(std::sync::Mutex<Option<std::time::Instant>>);

impl Abandoned {
    fn now(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
    }

    fn recent(&self) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|at| at.elapsed() < ABANDONED_CHECK)
    }
}

pub struct PgStore {
    pool: PgPool,
    /// `store.statement_timeout`: see [`PgStore::bounded`].
    statement_timeout: Duration,
    abandoned: std::sync::Arc<Abandoned>,
    /// The source's config key (`store` or `sources.<name>`), for errors.
    key: String,
    source: String,
    relay_id: String,
    lanes: u32,
    lease_ttl: Duration,
    ordering: Ordering,
    batch_size: u32,
    /// `relay.max_batch_bytes`: a claim stops reading rows once their
    /// payloads reach it (see [`PgStore::claim`]).
    max_batch_bytes: u64,
    /// The most rows the next claim asks for: after a claim that reached
    /// `max_batch_bytes`, one more than it took; doubled back after each
    /// claim that did not.
    claim_rows: std::sync::atomic::AtomicU32,
    cfg: TableConfig,
    sql: Option<TableSql>,
    /// The claim statement: by lane index, or by scan when the table has
    /// no usable lane index (chosen in `check_table`).
    claim_sql: String,
    /// The claim statement for when a lane has a skip (see
    /// `postgres/floor.rs`): the same, walking each lane in two stretches.
    claim_skip_sql: String,
    /// Set when the claim cannot use a lane index: the statement that
    /// would make it cheap.
    missing_index: Option<String>,
    /// Where each lane's claim starts (lane-index claims of tables with a
    /// sequence column; see `postgres/floor.rs`).
    floors: std::sync::Mutex<floor::Floors>,
    /// The names of the routes that read this source (the claim's `$4`:
    /// what an event with no state row may still be waiting for), set by
    /// the relay serving it; empty until then, which holds an aggregate
    /// on every route while an earlier event of it blocks.
    routes: std::sync::RwLock<Vec<String>>,
    /// The floor round statement, when the claim uses floors.
    floor_sql: Option<String>,
    /// Why the claim uses no floors although the table has a sequence
    /// column (`config check --store` says it).
    floors_off: Option<String>,
    /// `capture = "logical"`: the slot and publication read (see
    /// `postgres/logical.rs`); leases are then the one capture lease.
    logical: Option<Logical>,
    /// Logical table input: the sequence column has a unique index, so
    /// captured rows can be deleted by runs of numbers (else by id: a run
    /// could take an unread or failed row sharing a number).
    seq_unique: bool,
    /// Queue marking's retention walks the table by sequence number from
    /// here (`i64::MIN`: the bottom), so rows it must keep (failed, or
    /// still pending) are stepped over once per pass, not on every round.
    purge_from: std::sync::atomic::AtomicI64,
}

/// The source's name from its config key (`store` → `default`,
/// `sources.<name>` → `<name>`): the `source` label of its metrics.
fn source_name(key: &str) -> &str {
    key.strip_prefix("sources.")
        .unwrap_or(crate::config::DEFAULT_SOURCE)
}

/// The URL's options with `store.password` and `store.tls` applied.
pub(crate) fn connect_options(
    key: &str,
    sc: &crate::config::StoreConfig,
) -> Result<PgConnectOptions> {
    use crate::config::PgTlsMode as M;
    use sqlx::postgres::PgSslMode;
    let mut opts = sc
        .url
        .parse::<PgConnectOptions>()
        .map_err(|e| anyhow!("{key}.url: {e}"))?;
    if let Some(p) = &sc.password {
        opts = opts.password(p.expose());
    }
    if let Some(t) = &sc.tls {
        opts = opts.ssl_mode(match t.mode {
            M::Disable => PgSslMode::Disable,
            M::Prefer => PgSslMode::Prefer,
            M::Require => PgSslMode::Require,
            M::VerifyCa => PgSslMode::VerifyCa,
            M::VerifyFull => PgSslMode::VerifyFull,
        });
        if let Some(ca) = &t.ca_file {
            opts = opts.ssl_root_cert(ca);
        }
        if let (Some(cert), Some(key)) = (&t.cert_file, &t.key_file) {
            opts = opts.ssl_client_cert(cert).ssl_client_key(key);
        }
    }
    Ok(opts)
}

/// A failed first connection, said so an operator knows which setting to
/// look at (the password itself is never shown).
fn connect_error(key: &str, sc: &crate::config::StoreConfig, e: sqlx::Error) -> anyhow::Error {
    let url = crate::config::redact_url(&sc.url);
    let tls_problem = matches!(e, sqlx::Error::Tls(_))
        || e.to_string().contains("certificate")
        || e.to_string().contains("UnknownIssuer");
    let hint = match &e {
        _ if tls_problem => match sc.tls.as_ref().and_then(|t| t.ca_file.as_ref()) {
            Some(ca) => format!(
                " (TLS: the server's certificate is not trusted by {key}.tls.ca_file {} or is not issued for this host)",
                ca.display()
            ),
            None => format!(
                " (TLS: the server's certificate is not trusted by the system's roots; set {key}.tls.ca_file)"
            ),
        },
        sqlx::Error::Database(d) if d.code().as_deref() == Some("28P01") => {
            format!(
                " (wrong password, or not the server meant: check {key}.password / {key}.password_file, and the host and port)"
            )
        }
        sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("53300" | "53400")) => {
            format!(
                " (the server is at its connection limit, max_connections: this source opens up to \
                 {key}.max_connections = {} connections; the source waits and retries. Lower \
                 {key}.max_connections or relay.concurrency, or raise the server's max_connections)",
                sc.max_connections.max(2)
            )
        }
        sqlx::Error::Database(d) if d.code().as_deref() == Some("28000") => {
            format!(
                " (the server's pg_hba.conf refuses this role, database or connection type: TLS may be required, see {key}.tls)"
            )
        }
        _ => String::new(),
    };
    anyhow!("{key}: cannot connect to {url}: {e}{hint}")
}

impl PgStore {
    /// Connect to the source `sc` (`key`: its config key, for errors).
    pub async fn connect(
        config: &Config,
        key: &str,
        sc: &crate::config::StoreConfig,
        relay_id: &str,
    ) -> Result<Self> {
        let opts = connect_options(key, sc)?
            .application_name("outroute")
            // The claim must walk the lane index in order. A planner that
            // knows the table's row count but has no column statistics (an
            // index build records the first, only ANALYZE the second) guesses
            // a few rows per lane and prefers a bitmap scan plus sort, which
            // reads the whole lane. Both only cost more here; nothing is
            // forbidden.
            .options([("enable_bitmapscan", "off"), ("enable_sort", "off")])
            .log_statements(tracing::log::LevelFilter::Trace)
            .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(2));
        let abandoned = std::sync::Arc::new(Abandoned::default());
        let pool = match PgPoolOptions::new()
            .max_connections(sc.max_connections.max(2))
            // sqlx pings every connection it hands out (a round trip
            // before each claim and each mark). A connection used within
            // the last half second has just proven itself (sqlx also pings
            // it when it comes back); only one idle longer is pinged, so a
            // connection that died with a server restart is still replaced
            // before use. One the server closes inside the window (a
            // restart) fails its next statement once, as a restart
            // mid-statement does (a claim is retried, an unmarked batch
            // goes out again). One cut silently inside the window (a
            // network partition) hangs that statement, as one cut
            // mid-statement always could, until `store.statement_timeout`
            // gives it up (`bounded`). Measured
            // (`scripts/bench --only latency`, 1,000 events/s to Kafka,
            // alternated): claims over 2 ms 1.05–1.49 % → 0.50–0.84 %,
            // relay 0.13–0.14 → 0.12–0.13 cores.
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > IDLE_BEFORE_PING {
                        use sqlx::Connection;
                        conn.ping().await?;
                    }
                    Ok(true)
                })
            })
            // sqlx pings a connection given back, with no deadline: one
            // whose statement `bounded` gave up on (the server does not
            // answer) would hang there for good, holding its place in the
            // pool. Right after such a statement, connections given back
            // are pinged here first, with a deadline, and dropped when it
            // passes; otherwise this costs nothing.
            .after_release({
                let abandoned = abandoned.clone();
                move |conn, _| {
                    let check = abandoned.recent();
                    Box::pin(async move {
                        if check {
                            use sqlx::Connection;
                            match tokio::time::timeout(ABANDONED_CHECK, conn.ping()).await {
                                Ok(r) => r?,
                                Err(_) => {
                                    return Err(sqlx::Error::Io(std::io::Error::new(
                                        std::io::ErrorKind::TimedOut,
                                        "no answer to a ping after a statement was given up",
                                    )));
                                }
                            }
                        }
                        Ok(true)
                    })
                }
            })
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(opts.clone())
            .await
        {
            Ok(pool) => pool,
            // The pool only says it timed out; one direct attempt says why
            // (connection refused, no such host, …).
            Err(sqlx::Error::PoolTimedOut) => {
                use sqlx::Connection;
                let why = match tokio::time::timeout(
                    Duration::from_secs(5),
                    sqlx::PgConnection::connect_with(&opts),
                )
                .await
                {
                    Ok(Err(e)) => e,
                    _ => sqlx::Error::PoolTimedOut,
                };
                return Err(connect_error(key, sc, why));
            }
            Err(e) => return Err(connect_error(key, sc, e)),
        };
        let logical = sc.logical(source_name(key));
        Ok(PgStore {
            pool,
            statement_timeout: sc.statement_timeout,
            abandoned,
            key: key.to_string(),
            // The key of this source's coordination rows: the table, or for
            // tableless capture the message prefix.
            source: match &logical {
                Some(l) if l.input == LogicalInput::Messages => {
                    format!("messages:{}", l.message_prefix)
                }
                _ => sc.table().name,
            },
            logical,
            relay_id: relay_id.to_string(),
            lanes: sc.lanes.unwrap_or(config.relay.lanes),
            lease_ttl: config.relay.lease_ttl,
            ordering: config.relay.ordering,
            batch_size: config.relay.batch_size,
            max_batch_bytes: config.relay.max_batch_bytes,
            claim_rows: std::sync::atomic::AtomicU32::new(u32::MAX),
            cfg: sc.table(),
            sql: None,
            claim_sql: String::new(),
            claim_skip_sql: String::new(),
            missing_index: None,
            floors: Default::default(),
            routes: Default::default(),
            floor_sql: None,
            floors_off: None,
            seq_unique: false,
            purge_from: std::sync::atomic::AtomicI64::new(i64::MIN),
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// How long a lane lease lasts without renewal (`relay.lease_ttl`).
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// How long a statement may go unanswered (`store.statement_timeout`).
    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout
    }

    /// Run one of the relay's statements (`what` names it in the error)
    /// under `store.statement_timeout`. Past it the statement is given up:
    /// its connection goes back to the pool, is pinged with a deadline (see
    /// `after_release` in [`PgStore::connect`]) and dropped when the server
    /// does not answer, and the caller retries on another connection.
    /// Giving up is safe wherever the relay runs a statement: nothing is
    /// marked, recorded or confirmed unless its statement returned.
    pub async fn bounded<T>(
        &self,
        what: &str,
        statement: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        self.bounded_by(self.statement_timeout, what, statement)
            .await
    }

    /// [`PgStore::bounded`] with a shorter deadline (`limit`, at most
    /// `store.statement_timeout`).
    pub async fn bounded_by<T>(
        &self,
        limit: Duration,
        what: &str,
        statement: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let limit = limit.min(self.statement_timeout);
        // Pinned here, so a given-up statement (and its connection) is
        // dropped on return, after `abandoned` is set: its release sees it.
        let mut statement = std::pin::pin!(statement);
        match tokio::time::timeout(limit, statement.as_mut()).await {
            Ok(r) => r,
            Err(_) => {
                self.abandoned.now();
                metrics::counter!(crate::metrics::STATEMENTS_ABANDONED, "source" => source_name(&self.key).to_string())
                    .increment(1);
                bail!(
                    "{what}: the database did not answer within {} ({}.statement_timeout); gave the statement up, retrying on another connection",
                    humantime::format_duration(limit),
                    self.key
                )
            }
        }
    }

    fn sql(&self) -> Result<&TableSql> {
        self.sql
            .as_ref()
            .ok_or_else(|| anyhow!("store used before check_table"))
    }

    pub async fn migrate(&self, outbox: bool) -> Result<()> {
        // Two migration sets share `_sqlx_migrations`; each ignores the other's versions.
        let mut c = sqlx::migrate!("../migrations/postgres/coordination");
        c.set_ignore_missing(true);
        c.run(&self.pool)
            .await
            .context("applying coordination migrations")?;
        if outbox {
            let mut o = sqlx::migrate!("../migrations/postgres/outbox");
            o.set_ignore_missing(true);
            o.run(&self.pool)
                .await
                .context("applying outbox migrations")?;
        }
        Ok(())
    }

    /// Look up every mapped column; refuse to start on the first missing
    /// one, naming the config key.
    pub async fn check_table(&mut self) -> Result<()> {
        if let Some(l) = &self.logical {
            self.check_capture().await?;
            if l.input == LogicalInput::Messages {
                // No table: the canonical shape only names the state rows' columns.
                self.sql = Some(TableSql::new(&self.cfg, self.lanes, "uuid"));
                return Ok(());
            }
        }
        let t = &self.cfg;
        let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
            .bind(quote(&t.name))
            .fetch_one(&self.pool)
            .await?;
        if exists.is_none() {
            bail!(
                "{}.table.name: table `{}` does not exist (run `outroute migrate` for the canonical table)",
                self.key,
                t.name
            );
        }
        let mut cols = t.columns();
        if let Marking::PublishedAt { column } | Marking::Status { column, .. } = &t.marking {
            cols.push(("marking.column", column));
        }
        // Every mapped column's type in one round trip.
        let names: Vec<&str> = cols.iter().map(|(_, c)| c.as_str()).collect();
        let types: std::collections::HashMap<String, (String, bool)> =
            sqlx::query_as::<_, (String, String, bool)>(
                "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull FROM pg_attribute a \
                 WHERE a.attrelid = to_regclass($1) AND a.attname::text = ANY($2::text[]) AND NOT a.attisdropped AND a.attnum > 0",
            )
            .bind(quote(&t.name))
            .bind(&names)
            .fetch_all(&self.pool)
            .await?
            .into_iter()
            .map(|(name, ty, not_null)| (name, (ty, not_null)))
            .collect();
        let mut id_type = String::new();
        let mut id_may_be_missing = false;
        let mut payload_is_json = false;
        for (key, col) in cols {
            match types
                .get(col.as_str())
                .map(|(ty, not_null)| (ty, *not_null))
            {
                None => bail!(
                    "{}.table.{key}: column `{col}` not found in table `{}`",
                    self.key,
                    t.name
                ),
                Some((ty, not_null)) if key == "id" => {
                    id_type = ty.clone();
                    // Text ids may be empty, nullable ones NULL: such rows
                    // go by their place in the table (see `TableSql::id_key`).
                    id_may_be_missing = !not_null
                        || ["text", "character", "character varying"]
                            .iter()
                            .any(|t| ty == t || ty.starts_with(&format!("{t}(")));
                }
                Some((ty, _)) if key == "payload" => {
                    payload_is_json = ty == "json" || ty == "jsonb";
                    if ty == "jsonb" {
                        tracing::info!(
                            table = %t.name,
                            "column `{col}` is jsonb: PostgreSQL re-serialises every payload it hands \
                             out; as `json` it passes the producer's bytes on as written, with less work \
                             per event (README \"Payload type\")"
                        );
                    }
                }
                Some(_) => {}
            }
        }
        // The full type (`character(36)`, `character varying(64)`) is cast
        // to, so ids compare exactly; it comes from the catalog, but check it.
        let base = id_type.trim().to_string();
        if !base
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || " _(),".contains(c))
        {
            bail!(
                "{}.table.id: unsupported id column type `{id_type}`",
                self.key
            );
        }
        if t.sequence.is_none() && self.ordering != Ordering::None {
            tracing::warn!(
                table = %t.name,
                "{}.table.sequence is unset: events are ordered by (created_at, id), so events of one aggregate \
                 written with the same timestamp (one transaction using now()) go out in id order. \
                 `outroute migrate --table --add-sequence` adds a sequence column that keeps insert order",
                self.key
            );
        }
        let mut sql = TableSql::new(t, self.lanes, &base);
        sql.payload_is_json = payload_is_json;
        sql.id_may_be_missing = id_may_be_missing;
        sql.column_types = types.into_iter().map(|(c, (ty, _))| (c, ty)).collect();
        if let Some(seq) = &t.sequence
            && self.logical.is_none()
            && let Some(why) = self.floors_unsafe(seq).await?
        {
            if why == "may be NULL"
                && let Marking::Queue { .. } = &t.marking
            {
                // The trigger would fail the producer's insert of a row
                // without a number.
                bail!(
                    "{}.table.marking: style `queue` lists rows by `{seq}`, which {why}; \
                     make it NOT NULL or use `published_at`",
                    self.key
                );
            }
            let off = format!(
                "{}.table.sequence `{seq}` {why}: claims walk each lane from its first entry \
                 (slower after many events were published, until VACUUM)",
                self.key
            );
            tracing::warn!(table = %t.name, "{off}");
            self.floors_off = Some(off);
            sql.floor_col = None;
        }
        self.refuse_leftover_queue().await?;
        if self.logical.is_some() {
            // Streamed, never claimed: no lane index, no lane rows.
            self.seq_unique = match &t.sequence {
                Some(seq) => self.unique_column(seq).await?,
                None => false,
            };
            self.sql = Some(sql);
            return Ok(());
        }
        if let Marking::Queue { .. } = &t.marking {
            // The queue replaces the lane index; without its trigger new
            // rows would never be listed (`topology::open_store` refuses).
            let seq = t.sequence.as_deref().unwrap_or_default();
            if !self.unique_column(seq).await? {
                bail!(
                    "{}.table.marking: style `queue` lists events by their sequence number, but \
                     `{}`.`{seq}` has no unique index; add one or use `published_at`",
                    self.key,
                    t.name
                );
            }
            let trigger = self.enqueue_trigger().await?;
            if trigger == Some(false) {
                bail!(
                    "{}.table.marking: the pending queue's trigger `outroute_enqueue` on `{}` is disabled: \
                     rows inserted meanwhile are not listed, so they are never published and count as \
                     published. ALTER TABLE {} ENABLE TRIGGER outroute_enqueue, then list the rows inserted \
                     while it was off (INSERT INTO outroute_queue, as `outroute migrate` does)",
                    self.key,
                    t.name,
                    quote(&t.name)
                );
            }
            if trigger.is_some() {
                // The trigger computes lanes itself: with another count than
                // the relays', rows would land in lanes nobody reads right.
                let body: Option<String> =
                    sqlx::query_scalar("SELECT prosrc FROM pg_proc WHERE oid = to_regproc($1)")
                        .bind(quote(&queue_function(t)))
                        .fetch_optional(&self.pool)
                        .await?;
                if let Some(body) = body
                    && !body.contains(&format!("% {})", self.lanes))
                {
                    bail!(
                        "relay.lanes: the pending queue's trigger on `{}` lists rows into another number of \
                         lanes than {}; every relay of a table must use the lane count it was set up with",
                        t.name,
                        self.lanes
                    );
                }
            }
            if trigger.is_some() && self.named_trigger("outroute_requeue").await?.is_none() {
                tracing::warn!(
                    table = %t.name,
                    "{}.table.marking: the pending queue of `{}` was set up by an older outroute: a producer \
                     that updates a pending row's aggregate or sequence number leaves its queue entry behind \
                     and the event is never published. Run `outroute migrate --table` (it adds the trigger \
                     `outroute_requeue` that follows such updates)",
                    self.key,
                    t.name
                );
            }
            self.missing_index = trigger.is_none().then(|| sql.index_ddl.clone());
            self.claim_sql = sql.claim_by_queue(self.ordering, false);
            self.claim_skip_sql = sql.claim_by_queue(self.ordering, true);
            // Deleted entries stay in the queue's index until VACUUM, as
            // marked rows do in a lane index: claims start at the floors.
            self.floor_sql = sql.floor_round_queue(self.ordering);
            self.sql = Some(sql);
            return self.ensure_lane_rows().await;
        }
        self.missing_index = if self.lane_index_usable(&sql).await? {
            None
        } else {
            Some(sql.index_ddl.clone())
        };
        (self.claim_sql, self.floor_sql) = match self.missing_index {
            None => (
                sql.claim_by_lane(self.ordering, false),
                sql.floor_round(self.ordering),
            ),
            Some(_) => (sql.claim_by_scan(self.ordering), None),
        };
        self.claim_skip_sql = sql.claim_by_lane(self.ordering, true);
        self.sql = Some(sql);
        self.ensure_lane_rows().await
    }

    /// Lane indexes (`<table>_outroute_lanes<N>`) on the table, named as
    /// `DROP INDEX` takes them: under the pending queue nothing reads them,
    /// but producers still pay an index insert per event (left from the
    /// `published_at` marking).
    pub async fn lane_indexes(&self) -> Result<Vec<String>> {
        let s = self.sql()?;
        let prefix = s.index_name.trim_end_matches(|c: char| c.is_ascii_digit());
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             WHERE i.indrelid = to_regclass($1) AND left(c.relname, length($2)) = $2 ORDER BY 1",
        )
        .bind(&s.table)
        .bind(prefix)
        .fetch_all(&self.pool)
        .await?;
        Ok(names.iter().map(|n| self.qualified(n)).collect())
    }

    /// An object `name` in the table's schema, quoted (indexes live there).
    fn qualified(&self, name: &str) -> String {
        match self.cfg.name.rsplit_once('.') {
            Some((schema, _)) => format!("{}.{}", quote(schema), quote(name)),
            None => quote(name),
        }
    }

    /// Refuse a table that still has the pending queue's trigger under
    /// another marking or log-based capture: it would keep listing rows
    /// nobody drains, and rows published through the queue still have
    /// `published_at` NULL (they would go out again).
    pub async fn refuse_leftover_queue(&self) -> Result<()> {
        let t = &self.cfg;
        if matches!(t.marking, Marking::Queue { .. }) || self.enqueue_trigger().await?.is_none() {
            return Ok(());
        }
        let now = match &self.logical {
            Some(_) => {
                "this source now reads the write-ahead log (`capture = \"logical\"`)".to_string()
            }
            None => format!("this source marks by `{}`", t.marking.style()),
        };
        bail!(
            "{key}.table.marking: `{name}` still has the pending queue's trigger `outroute_enqueue`, \
             but {now}. Rows published through the queue were never stamped and would be published \
             again. Stop the relays, mark the rows not listed in `outroute_queue` and not failed as \
             published in this style's terms ({how}), then DROP TRIGGER outroute_enqueue ON {name}; \
             DROP TRIGGER IF EXISTS outroute_requeue ON {name}; DROP FUNCTION {f}(); DELETE FROM outroute_queue WHERE source = '{name}' \
             (examples/outbox-published-at.toml shows it for `published_at`)",
            key = self.key,
            name = t.name,
            f = quote(&queue_function(t)),
            how = match &t.marking {
                Marking::PublishedAt { column } => format!("set `{column}`"),
                Marking::Status { column, sent, .. } => format!("set `{column}` to '{sent}'"),
                Marking::Delete => "delete them".into(),
                Marking::Queue { .. } => String::new(),
            },
        );
    }

    /// The pending queue's insert trigger on the table: `None` when absent,
    /// else whether it is enabled.
    async fn enqueue_trigger(&self) -> Result<Option<bool>> {
        self.named_trigger("outroute_enqueue").await
    }

    /// Trigger `name` on the table: enabled, disabled, or absent (`None`).
    async fn named_trigger(&self, name: &str) -> Result<Option<bool>> {
        Ok(sqlx::query_scalar(
            "SELECT tgenabled <> 'D' FROM pg_trigger WHERE tgrelid = to_regclass($1) \
               AND tgname = $2 AND NOT tgisinternal",
        )
        .bind(quote(&self.cfg.name))
        .bind(name)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Lane rows for this table; a changed lane count would break ordering.
    async fn ensure_lane_rows(&self) -> Result<()> {
        let existing: i64 =
            // (the capture lease's row, lane -1, is not a lane)
            sqlx::query_scalar("SELECT count(*) FROM outroute_lanes WHERE source = $1 AND lane >= 0")
                .bind(&self.source)
                .fetch_one(&self.pool)
                .await?;
        if existing == 0 {
            sqlx::query(
                "INSERT INTO outroute_lanes (source, lane) SELECT $1, g FROM generate_series(0, $2 - 1) g \
                 ON CONFLICT DO NOTHING",
            )
            .bind(&self.source)
            .bind(self.lanes as i32)
            .execute(&self.pool)
            .await?;
        } else if existing != self.lanes as i64 {
            bail!(
                "relay.lanes: table `{}` is partitioned into {existing} lanes, config says {}; \
                 every relay of a table must use the same lane count",
                self.source,
                self.lanes
            );
        }
        Ok(())
    }

    /// Why claim floors cannot be used with this sequence column, if they
    /// cannot: it may be NULL (such rows would never be at or above a
    /// floor), or its sequence hands out numbers in cached blocks (a later
    /// insert may get a lower number). A column filled by the application
    /// cannot be checked: the docs say it must come from the database.
    async fn floors_unsafe(&self, column: &str) -> Result<Option<&'static str>> {
        let (not_null, cache): (bool, Option<i64>) = sqlx::query_as(
            "SELECT a.attnotnull, \
               (SELECT s.seqcache FROM pg_sequence s \
                 WHERE s.seqrelid = pg_get_serial_sequence($1, $2)::regclass) \
             FROM pg_attribute a WHERE a.attrelid = to_regclass($1) AND a.attname = $2",
        )
        .bind(quote(&self.cfg.name))
        .bind(column)
        .fetch_one(&self.pool)
        .await
        .context("checking the sequence column")?;
        Ok(if !not_null {
            Some("may be NULL")
        } else if cache.is_some_and(|c| c > 1) {
            Some("comes from a sequence with CACHE > 1")
        } else {
            None
        })
    }

    /// Does a unique index of the table have exactly this column as its key
    /// (the primary key of the canonical table's `seq`)?
    async fn unique_column(&self, column: &str) -> Result<bool> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_index i \
               JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
               WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indisvalid AND i.indnkeyatts = 1 \
                 AND i.indpred IS NULL AND i.indexprs IS NULL AND a.attname = $2)",
        )
        .bind(quote(&self.cfg.name))
        .bind(column)
        .fetch_one(&self.pool)
        .await
        .context("checking whether the sequence column is unique")
    }

    /// Does the lane-index claim plan walk an index of the outbox table
    /// (rather than scanning and sorting it)? Asked of the planner itself,
    /// so an equivalent index under another name counts too, and so does
    /// a table that was never analysed.
    async fn lane_index_usable(&self, sql: &TableSql) -> Result<bool> {
        let claim = sql.claim_by_lane(self.ordering, false);
        let all: Vec<i32> = (0..self.lanes as i32).collect();
        let bottom = floor::Starts::bottom(&all);
        let plan = self
            .explain(&claim, &all, Some(&bottom), self.batch_size, "")
            .await?;
        // Every read of the outbox must be an index scan *on the lane*: an
        // index that merely has the order (the primary key on `seq`) would
        // be walked in order, filtering out other lanes' rows and history.
        let mut reads = Vec::new();
        nodes_of(&plan, "o", &mut reads);
        Ok(!reads.is_empty()
            && reads.iter().all(|n| {
                n.get("Node Type")
                    .and_then(|t| t.as_str())
                    .is_some_and(|t| t.starts_with("Index"))
                    && n.get("Index Cond")
                        .and_then(|c| c.as_str())
                        .is_some_and(|c| c.contains("hashtext("))
            }))
    }

    /// `EXPLAIN ({opts}FORMAT JSON)` of a claim statement (`opts`: "", "ANALYZE, ", …).
    async fn explain(
        &self,
        claim: &str,
        lanes: &[i32],
        starts: Option<&floor::Starts>,
        limit: u32,
        opts: &str,
    ) -> Result<serde_json::Value> {
        let q = format!("EXPLAIN ({opts}FORMAT JSON) {claim}");
        let row = self
            .bind_claim(sqlx::query(&q), lanes, starts, limit)
            .fetch_one(&self.pool)
            .await
            .context("planning the claim")?;
        Ok(row.try_get(0)?)
    }

    /// A claim statement's arguments (`$1`–`$9`, see [`TableSql::segments`]):
    /// with `starts`, their stretches (`$1`–`$5` when no lane has a skip);
    /// without (a claim by scan), the lanes.
    fn bind_claim<'q>(
        &self,
        q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        lanes: &'q [i32],
        starts: Option<&'q floor::Starts>,
        limit: u32,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        let q = q
            .bind(self.source.clone())
            .bind(starts.map_or(lanes, |f| &f.lanes[..]))
            .bind(limit as i64)
            .bind(self.routes());
        match starts {
            Some(f) if f.any_skip() => q
                .bind(&f.from)
                .bind(&f.part)
                .bind(&f.skip_from)
                .bind(&f.skip_to)
                .bind(&f.skip_fingerprint),
            Some(f) => q.bind(&f.from),
            None => q,
        }
    }

    /// The claim statement for these starts: with skips only when a lane
    /// has one (the usual claim stays the plain walk from the floors).
    fn claim_for(&self, starts: Option<&floor::Starts>) -> &str {
        match starts {
            Some(f) if f.any_skip() => &self.claim_skip_sql,
            _ => &self.claim_sql,
        }
    }

    /// Run the claim under `EXPLAIN ANALYZE` and return, for every plan
    /// node that reads the outbox table, its type and the rows it produced
    /// over all loops: what a claim costs, for tests and diagnosis.
    pub async fn claim_cost(&self, lanes: &[i32], limit: u32) -> Result<Vec<(String, f64)>> {
        let plan = self.explain_claim(lanes, limit, "ANALYZE, ").await?;
        Ok(scans_of(&plan, "o"))
    }

    /// Run the claim under `EXPLAIN ANALYZE`: how many per-row probes of
    /// `outroute_event_state` it made (the loops of its own-state, attempts
    /// and hold subplans; the once-per-claim test is not counted) (tests and
    /// diagnosis).
    pub async fn claim_state_probes(&self, lanes: &[i32], limit: u32) -> Result<f64> {
        let plan = self.explain_claim(lanes, limit, "ANALYZE, ").await?;
        let mut nodes = Vec::new();
        for alias in ["s", "st", "b"] {
            nodes_of(&plan, alias, &mut nodes);
        }
        Ok(nodes
            .iter()
            .map(|m| {
                m.get("Actual Loops")
                    .and_then(|v| v.as_f64())
                    .unwrap_or(0.0)
            })
            .sum())
    }

    /// `EXPLAIN` of this relay's claim of `lanes`, from their current floors.
    async fn explain_claim(
        &self,
        lanes: &[i32],
        limit: u32,
        opts: &str,
    ) -> Result<serde_json::Value> {
        let floors = self.current_floors(lanes);
        self.explain(
            self.claim_for(floors.as_ref()),
            lanes,
            floors.as_ref(),
            limit,
            opts,
        )
        .await
    }

    /// Run the claim under `EXPLAIN (ANALYZE, BUFFERS)` and return the
    /// buffers (pages) its walk of the lanes touched, dead index entries
    /// and all: the lane index and the outbox rows it leads to, state
    /// probes included; under the pending queue, the queue's index (the
    /// rows are then fetched one probe each, whatever the walk cost).
    pub async fn claim_pages(&self, lanes: &[i32], limit: u32) -> Result<f64> {
        let plan = self
            .explain_claim(lanes, limit, "ANALYZE, BUFFERS, ")
            .await?;
        let mut nodes = Vec::new();
        nodes_of(&plan, "qq", &mut nodes);
        if nodes.is_empty() {
            nodes_of(&plan, "o", &mut nodes);
        }
        let num = |m: &serde_json::Map<String, serde_json::Value>, k: &str| {
            m.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0)
        };
        Ok(nodes
            .iter()
            .map(|m| num(m, "Shared Hit Blocks") + num(m, "Shared Read Blocks"))
            .sum())
    }

    /// Why claims start each lane from its first entry instead of a floor,
    /// when the table has a sequence column that floors cannot rely on.
    pub fn floors_off(&self) -> Option<&str> {
        self.floors_off.as_deref()
    }

    /// The `CREATE INDEX` the claim needs, when the table lacks it.
    pub fn missing_index(&self) -> Option<&str> {
        self.missing_index.as_deref()
    }

    /// `marking = queue`: pending rows are listed in `outroute_queue`,
    /// whose trigger takes the place of the lane index.
    pub fn queue_marking(&self) -> bool {
        matches!(self.cfg.marking, Marking::Queue { .. })
    }

    /// Under `marking = queue`: walk the next [`ORPHAN_WALK`] entries of
    /// each of `lanes` after the sequence number given for it in `after`
    /// (`i64::MIN`: from the lowest) and delete those whose row is
    /// gone (a pending row deleted by hand) or says it is not pending (its
    /// `failed_at` set by hand). Claims step over such an entry, but every
    /// claim that walks past it pays for it until it is removed. The entry
    /// and its row are written in one transaction, so an entry is never
    /// seen before its row; a relay that fails an event for good deletes
    /// its entry itself (`failed retry` queues it again).
    pub async fn drop_orphans(&self, lanes: &[i32], after: &[i64]) -> Result<OrphanWalk> {
        if !self.queue_marking() || lanes.is_empty() {
            return Ok(OrphanWalk::default());
        }
        let rows: Vec<(i32, i64, i64, i64)> = sqlx::query_as(&self.orphan_sql()?)
            .bind(lanes)
            .bind(after)
            .fetch_all(&self.pool)
            .await
            .context("removing orphaned queue entries")?;
        let mut walk = OrphanWalk::default();
        for (lane, last, walked, dropped) in rows {
            walk.dropped += dropped.max(0) as u64;
            if walked >= ORPHAN_WALK {
                walk.more.push((lane, last));
            }
        }
        Ok(walk)
    }

    /// The orphan walk: per lane (`$1`, from `$2`) its next entries in
    /// order, each with whether its row is gone or not pending, then the
    /// delete of those; returns per lane the last sequence walked, the
    /// entries walked and the entries deleted.
    ///
    /// The row probe sits inside the per-lane walk (a LATERAL kept apart by
    /// `OFFSET 0`), as in the claim, so that sorting a lane is never the
    /// cheap-looking plan: with it outside, the same statement run from
    /// psql on a never-analysed queue of 400,000 entries read each lane
    /// whole through a bitmap scan and sorted it to keep 64 entries (258 ms
    /// a round instead of 10). The relay's own connections turn bitmap
    /// scans and sorts off (see `connect`), which hid that; the shape must
    /// not depend on it (a pooler may drop those settings). The delete goes
    /// by ctid alone (a TID scan; with the source beside it, a planner
    /// without statistics may read the source's whole queue). Entries are never updated, so a ctid seen by the
    /// statement's snapshot names that entry (or one deleted since, which
    /// the delete then skips).
    fn orphan_sql(&self) -> Result<String> {
        let s = self.sql()?;
        Ok(format!(
            "WITH walk AS MATERIALIZED ( \
               SELECT e.lane, e.seq, e.tid, e.orphan FROM unnest($1::int[], $2::bigint[]) AS l(lane, after) \
               CROSS JOIN LATERAL (SELECT qq.lane, qq.seq, qq.ctid AS tid, r.orphan FROM outroute_queue qq \
                 CROSS JOIN LATERAL (SELECT NOT EXISTS (SELECT 1 FROM {table} o \
                   WHERE {seqcol} = qq.seq AND {row_pending}) AS orphan OFFSET 0) r \
                 WHERE qq.source = {src} AND qq.lane = l.lane AND qq.seq > l.after \
                 ORDER BY qq.seq LIMIT {ORPHAN_WALK}) e), \
             gone AS (DELETE FROM outroute_queue \
               WHERE ctid = ANY(ARRAY(SELECT w.tid FROM walk w WHERE w.orphan)) RETURNING lane) \
             SELECT w.lane, max(w.seq)::bigint, count(*)::bigint, \
               (SELECT count(*) FROM gone g WHERE g.lane = w.lane)::bigint \
             FROM walk w GROUP BY w.lane",
            src = literal(&self.cfg.name),
            table = s.table,
            seqcol = s.seq,
            row_pending = s.row_pending,
        ))
    }

    /// Run one orphan round under `EXPLAIN ANALYZE`, rolled back: type
    /// and rows produced of every plan node that reads the queue (the walk
    /// as `qq`, the delete as `outroute_queue`), for tests and diagnosis.
    pub async fn orphan_cost(&self, lanes: &[i32], after: &[i64]) -> Result<Vec<(String, f64)>> {
        let q = format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", self.orphan_sql()?);
        let mut tx = self.pool.begin().await?;
        let plan: serde_json::Value = sqlx::query_scalar(&q)
            .bind(lanes)
            .bind(after)
            .fetch_one(&mut *tx)
            .await
            .context("planning the orphan walk")?;
        tx.rollback().await?;
        let mut scans = scans_of(&plan, "qq");
        scans.extend(scans_of(&plan, "outroute_queue"));
        Ok(scans)
    }

    /// Create the lane index (`outroute migrate`, `migrate --table`):
    /// `CREATE INDEX CONCURRENTLY`, so producers keep writing; an invalid
    /// leftover of an interrupted build is dropped first. Returns the
    /// statement run, or `None` when a usable index already exists. Under
    /// `marking = queue`: the queue's trigger and backfill instead.
    /// Under `marking = queue` with the queue set up: run the trigger
    /// function's and the update trigger's statements again (a table set up
    /// by an older outroute gets today's: partitions, updates followed).
    /// Returns the statements run; `None` when there is nothing to refresh.
    pub async fn refresh_queue_function(&self) -> Result<Option<String>> {
        if !self.queue_marking() || self.missing_index.is_some() || self.logical.is_some() {
            return Ok(None);
        }
        let t = &self.cfg;
        let seq = self.sql()?.seq.clone();
        let ddl = queue_function_ddl(t, &queue_function(t), &seq, self.lanes);
        sqlx::raw_sql(&ddl)
            .execute(&self.pool)
            .await
            .with_context(|| format!("refreshing the pending queue's trigger function: {ddl}"))?;
        Ok(Some(ddl))
    }

    pub async fn create_lane_index(&mut self) -> Result<Option<String>> {
        let Some(ddl) = self.missing_index.clone() else {
            return Ok(None);
        };
        let partitioned: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass($1) AND relkind = 'p')",
        )
        .bind(quote(&self.cfg.name))
        .fetch_one(&self.pool)
        .await?;
        if partitioned && !self.queue_marking() {
            // PostgreSQL builds no index on a partitioned table concurrently.
            bail!(
                "{}.table: `{}` is partitioned, and PostgreSQL cannot build the lane index on it without \
                 blocking producers' writes. Use `marking = {{ style = \"queue\" }}` (no lane index; the \
                 queue's trigger lists rows of every partition), or build the index on each partition \
                 yourself: {ddl}",
                self.key,
                self.cfg.name
            );
        }
        if self.queue_marking() {
            let f = queue_function(&self.cfg);
            let earlier: bool = sqlx::query_scalar("SELECT to_regproc($1) IS NOT NULL")
                .bind(quote(&f))
                .fetch_one(&self.pool)
                .await?;
            if earlier {
                // Set up before, trigger dropped since: listing every row
                // without `published_at` again would re-publish what went
                // through the queue, and rows inserted meanwhile were missed.
                bail!(
                    "{}.table: the pending queue of `{}` was set up before (function `{f}` exists) but its \
                     trigger `outroute_enqueue` is gone. Setting it up again would list every row without \
                     `published_at`, including those already published through the queue. Re-create the \
                     trigger (CREATE TRIGGER outroute_enqueue AFTER INSERT ON {} FOR EACH ROW EXECUTE \
                     FUNCTION {}()) and list the rows inserted while it was gone yourself, or finish \
                     switching to another marking (DROP FUNCTION {}())",
                    self.key,
                    self.cfg.name,
                    quote(&self.cfg.name),
                    quote(&f),
                    quote(&f),
                );
            }
            sqlx::raw_sql(&ddl)
                .execute(&self.pool)
                .await
                .with_context(|| format!("setting up the pending queue: {ddl}"))?;
            self.check_table().await?;
            return Ok(Some(ddl));
        }
        let s = self.sql()?;
        let name = s.index_name.clone();
        let invalid: Option<bool> = sqlx::query_scalar(
            "SELECT NOT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             WHERE i.indrelid = to_regclass($1) AND c.relname = $2",
        )
        .bind(&s.table)
        .bind(&name)
        .fetch_optional(&self.pool)
        .await?;
        if invalid == Some(true) {
            sqlx::query(&format!(
                "DROP INDEX CONCURRENTLY IF EXISTS {}",
                self.qualified(&name)
            ))
            .execute(&self.pool)
            .await
            .with_context(|| format!("dropping the invalid index `{name}`"))?;
        }
        sqlx::query(&ddl)
            .execute(&self.pool)
            .await
            .with_context(|| format!("creating the lane index: {ddl}"))?;
        self.check_table().await?;
        if let Some(still) = &self.missing_index {
            bail!(
                "created the lane index, but the planner still does not use it for the claim: {still}"
            );
        }
        Ok(Some(ddl))
    }

    /// Add the identity column `outroute_seq` to the mapped table (for
    /// tables ordered by a timestamp). Returns false if it exists already.
    pub async fn add_sequence(&self) -> Result<bool> {
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) \
               AND attname = 'outroute_seq' AND NOT attisdropped)",
        )
        .bind(&self.cfg.name)
        .fetch_one(&self.pool)
        .await?;
        if exists {
            return Ok(false);
        }
        sqlx::query(&format!(
            "ALTER TABLE {} ADD COLUMN outroute_seq bigint GENERATED BY DEFAULT AS IDENTITY",
            quote(&self.cfg.name)
        ))
        .execute(&self.pool)
        .await
        .with_context(|| format!("adding outroute_seq to {}", self.cfg.name))?;
        Ok(true)
    }

    /// Heartbeat this relay, forget relays silent for 10 TTLs, and count
    /// the live ones (lane shares, `status`).
    pub(super) async fn heartbeat(&self) -> Result<i64> {
        let ttl = self.lease_ttl.as_secs_f64();
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO outroute_relays (source, relay_id, hostname, pid) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (source, relay_id) DO UPDATE SET heartbeat_at = now()",
        )
        .bind(&self.source)
        .bind(&self.relay_id)
        .bind(
            hostname::get()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_default(),
        )
        .bind(std::process::id() as i32)
        .execute(&mut *tx)
        .await?;
        // Forget relays that stopped heartbeating long ago.
        sqlx::query("DELETE FROM outroute_relays WHERE source = $1 AND heartbeat_at < now() - make_interval(secs => $2 * 10)")
            .bind(&self.source)
            .bind(ttl)
            .execute(&mut *tx)
            .await?;
        let relays: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outroute_relays WHERE source = $1 AND heartbeat_at > now() - make_interval(secs => $2)",
        )
        .bind(&self.source)
        .bind(ttl)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(relays)
    }

    /// Renew and take lanes (never the capture lease's row, lane -1, a
    /// source that streamed the log before may have left).
    pub async fn lease_round(&self) -> Result<Leases> {
        if self.logical.is_some() {
            return self.capture_lease().await;
        }
        let ttl = self.lease_ttl.as_secs_f64();
        let relays = self.heartbeat().await?;
        let relays_alive = relays.max(1);
        let fair = (self.lanes as i64 + relays_alive - 1) / relays_alive;

        // Renew what we hold (lanes already lapsed are lost).
        let mut held: Vec<(i32, i64)> = sqlx::query_as(
            "UPDATE outroute_lanes SET lease_until = now() + make_interval(secs => $3) \
             WHERE source = $1 AND owner = $2 AND lease_until > now() AND lane >= 0 RETURNING lane, epoch",
        )
        .bind(&self.source)
        .bind(&self.relay_id)
        .bind(ttl)
        .fetch_all(&self.pool)
        .await?;
        held.sort_unstable();
        let mut acquired = 0;
        if (held.len() as i64) < fair {
            let want = fair - held.len() as i64;
            let got: Vec<(i32, i64)> = sqlx::query_as(
                "UPDATE outroute_lanes l SET owner = $2, lease_until = now() + make_interval(secs => $3), epoch = l.epoch + 1 \
                 FROM (SELECT lane FROM outroute_lanes WHERE source = $1 AND lane >= 0 \
                       AND (owner IS NULL OR lease_until <= now()) ORDER BY lane LIMIT $4 FOR UPDATE SKIP LOCKED) free \
                 WHERE l.source = $1 AND l.lane = free.lane RETURNING l.lane, l.epoch",
            )
            .bind(&self.source)
            .bind(&self.relay_id)
            .bind(ttl)
            .bind(want)
            .fetch_all(&self.pool)
            .await?;
            acquired = got.len();
            held.extend(got);
            held.sort_unstable();
        } else if (held.len() as i64) > fair {
            // Over our share: stop claiming from the extra lanes now and let
            // their leases lapse so another relay can take them after one TTL
            // (in-flight batches finish well within it).
            let extra: Vec<i32> = held
                .split_off(fair as usize)
                .into_iter()
                .map(|(lane, _)| lane)
                .collect();
            tracing::info!(lanes = ?extra, "releasing lanes over the fair share");
            sqlx::query("UPDATE outroute_lanes SET lease_until = now() + make_interval(secs => $3) WHERE source = $1 AND owner = $2 AND lane = ANY($4) AND lease_until > now() + make_interval(secs => $3)")
                .bind(&self.source)
                .bind(&self.relay_id)
                .bind(ttl / 3.0)
                .bind(&extra)
                .execute(&self.pool)
                .await?;
        }
        let (lanes, epochs): (Vec<i32>, Vec<i64>) = held.into_iter().unzip();
        // A lane taken over by another relay starts from the bottom if it
        // comes back (its floor is still valid, but costs nothing to redo).
        self.floors_mut().forget_except(&lanes);
        Ok(Leases {
            lanes,
            epochs,
            acquired,
            relays,
        })
    }

    pub async fn release_all(&self) -> Result<()> {
        sqlx::query("UPDATE outroute_lanes SET owner = NULL, lease_until = '-infinity' WHERE source = $1 AND owner = $2")
            .bind(&self.source)
            .bind(&self.relay_id)
            .execute(&self.pool)
            .await?;
        sqlx::query("DELETE FROM outroute_relays WHERE source = $1 AND relay_id = $2")
            .bind(&self.source)
            .bind(&self.relay_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn claim(&self, lanes: &[i32], limit: u32) -> Result<Vec<Claim>> {
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        let starts = self.current_floors(lanes);
        let json = self.sql()?.payload_is_json;
        // Bounded in bytes as well as rows: rows are read as they come and
        // the claim stops at the one whose payload reaches
        // `relay.max_batch_bytes` (the rest of the answer is read and
        // dropped by the connection; the next claims ask for only as many
        // rows as fitted, growing back after claims that fit whole).
        use std::sync::atomic::Ordering::Relaxed;
        let asked = limit.min(self.claim_rows.load(Relaxed)).max(1);
        let mut claims: Vec<Claim> = Vec::new();
        let mut bytes = 0u64;
        {
            let mut rows = self
                .bind_claim(
                    sqlx::query(self.claim_for(starts.as_ref())),
                    lanes,
                    starts.as_ref(),
                    asked,
                )
                .fetch(&self.pool);
            while let Some(r) = rows.try_next().await.context("claiming events")? {
                let c = to_claim(&r, json)?;
                bytes += c.bytes();
                claims.push(c);
                if bytes >= self.max_batch_bytes {
                    break;
                }
            }
        }
        let rows = if bytes >= self.max_batch_bytes {
            claims.len() as u32 + 1
        } else if claims.len() as u32 >= asked && asked < limit {
            asked.saturating_mul(2)
        } else {
            u32::MAX
        };
        self.claim_rows.store(rows, Relaxed);
        if !claims.is_empty() {
            self.floors_mut()
                .saw(claims.iter().map(|c| (c.lane, c.sequence())));
        }
        // Retried events only (rare): which fan-out legs already went.
        let retried: Vec<&str> = claims
            .iter()
            .filter(|c| c.has_state)
            .map(|c| c.id())
            .collect();
        if !retried.is_empty() {
            let legs: Vec<(String, Vec<String>)> = sqlx::query_as(
                "SELECT event_id, done_legs FROM outroute_event_state \
                 WHERE source = $1 AND event_id = ANY($2) AND cardinality(done_legs) > 0",
            )
            .bind(&self.source)
            .bind(&retried)
            .fetch_all(&self.pool)
            .await
            .context("reading acknowledged fan-out legs")?;
            if !legs.is_empty() {
                let legs: std::collections::HashMap<String, Vec<String>> =
                    legs.into_iter().collect();
                for c in claims.iter_mut() {
                    if let Some(l) = legs.get(c.id()) {
                        c.done_legs = l.clone();
                    }
                }
            }
        }
        Ok(claims)
    }

    /// Name the routes that read this source (see [`PgStore::routes`]).
    pub fn set_routes(&self, names: Vec<String>) {
        // A row a skip passes as held may be taken by a new route.
        self.floors_mut().forget_skips();
        *self.routes.write().unwrap_or_else(|e| e.into_inner()) = names;
    }

    fn routes(&self) -> Vec<String> {
        self.routes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn floors_mut(&self) -> std::sync::MutexGuard<'_, floor::Floors> {
        // A poisoned lock only means a panic elsewhere mid-update; floors
        // are re-checked by every round and sweep.
        self.floors.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The floors and skips of these lanes, when the claim statement takes
    /// them (`$5`–`$8`); `None` for a claim by scan.
    fn current_floors(&self, lanes: &[i32]) -> Option<floor::Starts> {
        if self.missing_index.is_some() {
            return None;
        }
        Some(match self.floor_sql {
            Some(_) => self.floors_mut().starts(lanes),
            None => floor::Starts::bottom(lanes),
        })
    }

    /// The skip a lane's claims take now (see `postgres/floor.rs`): the
    /// holder's sequence number and the end (tests, diagnosis).
    pub fn claim_skip(&self, lane: i32) -> Option<(i64, i64)> {
        self.floors_mut().skip(lane).map(|k| (k.from, k.to))
    }

    /// Run a floor round for those of these lanes that are due one (see
    /// `postgres/floor.rs`); the relay calls it every
    /// [`FLOOR_ROUND_INTERVAL`] beside its claims, so a claim is always one
    /// statement. Floors only save work: a failed round is logged and
    /// claims go on from the floors they have.
    pub async fn raise_floors(&self, lanes: &[i32]) {
        let Some(sql) = &self.floor_sql else { return };
        // `seen` is read here, before the round's statement (see floor.rs).
        let (
            floors,
            floor::Due {
                lanes,
                sweep,
                seen,
                skip_from,
                skip_to,
                candidate_to,
            },
        ) = {
            let f = self.floors_mut();
            match f.due(lanes, std::time::Instant::now()) {
                Some(due) => (f.of(&due.lanes), due),
                None => return,
            }
        };
        let lanes = &lanes[..];
        // Per lane: xmin, xmax, first, state, below, holder, resume and
        // the two fingerprints (see `floor_round_with`).
        type Row = (
            i64,
            i64,
            Option<i64>,
            Option<i64>,
            Option<i64>,
            Option<i64>,
            Option<i64>,
            Option<String>,
            Option<String>,
        );
        let rows: Result<Vec<Row>, _> = sqlx::query_as(sql)
            .bind(&self.source)
            .bind(lanes)
            .bind(&floors)
            .bind(&sweep)
            .bind(&skip_from)
            .bind(&skip_to)
            .bind(&candidate_to)
            .bind(self.routes())
            .fetch_all(&self.pool)
            .await;
        let rows = match rows {
            Ok(r) if r.len() == lanes.len() => r,
            Ok(r) => {
                tracing::warn!(
                    lanes = lanes.len(),
                    rows = r.len(),
                    "claim floor round: unexpected row count"
                );
                return;
            }
            Err(e) => {
                tracing::warn!("claim floor round failed (claims start lower): {e:#}");
                return;
            }
        };
        let round = floor::Round {
            seen,
            xmin: rows.first().map_or(0, |r| r.0),
            xmax: rows.first().map_or(0, |r| r.1),
            first: rows.iter().map(|r| r.2).collect(),
            state: rows.iter().map(|r| r.3).collect(),
            below: rows.iter().map(|r| r.4).collect(),
            swept: sweep,
            holder: rows.iter().map(|r| r.5).collect(),
            resume: rows.iter().map(|r| r.6).collect(),
            fingerprint_now: rows.iter().map(|r| r.7.clone()).collect(),
            fingerprint_candidate: rows.iter().map(|r| r.8.clone()).collect(),
        };
        let lowered = self
            .floors_mut()
            .apply(lanes, &round, std::time::Instant::now());
        for (lane, seq) in lowered {
            metrics::counter!(crate::metrics::FLOOR_LOWERED, "source" => source_name(&self.key).to_string())
                .increment(1);
            tracing::warn!(
                lane,
                seq,
                "a pending row turned up below the lane's claim floor (a transaction that took its \
                 sequence number long before it committed): the lane is walked from it again"
            );
        }
    }

    /// Look below every floor on the next [`Self::raise_floors`] instead of
    /// waiting for the sweep interval.
    pub fn sweep_floors_soon(&self) {
        self.floors_mut().sweep_soon(std::time::Instant::now());
    }

    /// Mark these claimed rows published. Each row is found by where the
    /// claim saw it (`ctid`: a direct heap fetch) and re-checked by id,
    /// pending state and lane ownership, so the cost is per row marked
    /// whatever the table's size or statistics. A row that moved since the
    /// claim (a producer updated it) is not marked: it is claimed again and
    /// re-published with the same id. The lease check is a plain read:
    /// renewing a lease never waits for a mark.
    pub async fn mark_published(&self, claims: &[&Claim]) -> Result<u64> {
        if claims.is_empty() {
            return Ok(0);
        }
        let args = self.mark_args(claims)?;
        let q = self.mark_sql(!args.with_state.is_empty())?;
        let marked: Vec<String> = args
            .bind(sqlx::query_scalar(&q))
            .fetch_all(&self.pool)
            .await
            .context("marking events published")?;
        Ok(marked.len() as u64)
    }

    /// The mark's parameters for these claims (see [`Self::mark_sql`]).
    fn mark_args<'c>(&'c self, claims: &[&'c Claim]) -> Result<MarkArgs<'c>> {
        let queue = matches!(self.sql()?.cfg.marking, Marking::Queue { .. });
        let (tids, ids) = if queue {
            // One entry per claim, aligned with lanes and sequences. A claim
            // without a ctid (none comes from the queue's claim) gets one
            // that matches no entry: it is not marked, and is claimed again.
            claims
                .iter()
                .map(|c| (c.tid.as_deref().unwrap_or("(0,0)"), c.id()))
                .unzip()
        } else {
            tids_and_ids(claims)
        };
        Ok(MarkArgs {
            source: &self.source,
            relay_id: &self.relay_id,
            ids,
            with_state: claims
                .iter()
                .filter(|c| c.has_state)
                .map(|c| c.id())
                .collect(),
            tids,
            epochs: claims.iter().map(|c| c.epoch).collect(),
            queue: queue.then(|| {
                (
                    claims.iter().map(|c| c.lane).collect(),
                    claims.iter().map(|c| c.sequence()).collect(),
                )
            }),
        })
    }

    /// The mark statement; parameters: $1 source, $2 relay id, $3 ids,
    /// $4 ids with a state row, $5 ctids, $6 lane epochs at claim time
    /// (NULL: owner and expiry only).
    fn mark_sql(&self, clear_state: bool) -> Result<String> {
        let s = self.sql()?;
        let rows = "unnest($5::text[]::tid[], $3::text[], $6::bigint[]) AS m(tid, id, epoch)";
        let change = match &s.cfg.marking {
            Marking::PublishedAt { column } => {
                format!(
                    "UPDATE {} o SET {} = now() FROM {rows}",
                    s.table,
                    quote(column)
                )
            }
            Marking::Status { column, sent, .. } => {
                format!(
                    "UPDATE {} o SET {} = {} FROM {rows}",
                    s.table,
                    quote(column),
                    literal(sent)
                )
            }
            Marking::Delete => format!("DELETE FROM {} o USING {rows}", s.table),
            // Marked by its own statement below.
            Marking::Queue { .. } => String::new(),
        };
        let clear = if clear_state {
            ", cleared AS (DELETE FROM outroute_event_state st WHERE st.source = $1 \
               AND st.event_id = ANY($4::text[]) AND st.event_id IN (SELECT id FROM marked))"
        } else {
            ""
        };
        if let Marking::Queue { .. } = &s.cfg.marking {
            // Each queue entry looked up by the ctid its claim saw ($5)
            // and taken only if that slot still holds the same entry
            // (source, lane and sequence: a slot VACUUM freed may hold
            // another one by now) and the lease check passes; then
            // deleted by ctid. A TID fetch per entry instead of an index
            // descent: measured ~1.4 µs of PostgreSQL per event less.
            // Both are correlated probes inside `ARRAY(…)` (`OFFSET 0`
            // keeps the lease check one), never a join: given the real
            // array, a planner without statistics would rather hash the
            // source's whole queue. Returns the ids of the events marked.
            return Ok(format!(
                "WITH gone AS (DELETE FROM outroute_queue WHERE ctid = ANY(ARRAY( \
                   SELECT (SELECT qq.ctid FROM outroute_queue qq WHERE qq.ctid = m.tid \
                     AND qq.source = $1 AND qq.lane = m.lane AND qq.seq = m.seq) \
                   FROM unnest($5::text[]::tid[], $7::int[], $8::bigint[], $6::bigint[]) AS m(tid, lane, seq, epoch) \
                   WHERE EXISTS (SELECT 1 FROM outroute_lanes l WHERE l.source = $1 AND l.lane = m.lane \
                     AND l.owner = $2 AND l.lease_until > now() AND (m.epoch IS NULL OR l.epoch = m.epoch) OFFSET 0))) \
                 RETURNING lane, seq), \
                 marked AS (SELECT m.id FROM unnest($7::int[], $8::bigint[], $3::text[]) AS m(lane, seq, id) \
                   WHERE (m.lane, m.seq) IN (SELECT lane, seq FROM gone)){clear} \
                 SELECT id FROM marked"
            ));
        }
        // Each (ctid, id) pair is one TID fetch. The ctid must be the only
        // condition an index could serve: the rest sits inside a CASE, which
        // the planner cannot match to an index. Otherwise, with no
        // statistics, it may take the small-looking lane index for the id
        // (its last column) or for the pending predicate and walk every
        // pending row. The lease check is a per-row probe of the row's own
        // lane row (`OFFSET 0` keeps it one).
        let change = format!("{change} WHERE o.ctid = m.tid AND");
        Ok(format!(
            "WITH marked AS ({change} \
               CASE WHEN {id}::text = m.id AND {pending} \
                 THEN EXISTS (SELECT 1 FROM outroute_lanes l WHERE l.source = $1 AND l.lane = {lane} \
                   AND l.owner = $2 AND l.lease_until > now() \
                   AND (m.epoch IS NULL OR l.epoch = m.epoch) OFFSET 0) \
                 ELSE FALSE END \
               RETURNING {id}::text AS id){clear} \
             SELECT id FROM marked",
            id = s.id,
            pending = s.row_pending,
            lane = s.lane,
        ))
    }

    /// Run the mark of these claims under `EXPLAIN ANALYZE` and roll it
    /// back: type and rows read of every plan node that reads the outbox
    /// table (under queue marking: the queue) (for tests and diagnosis).
    pub async fn mark_cost(&self, claims: &[&Claim]) -> Result<Vec<(String, f64)>> {
        let mut args = self.mark_args(claims)?;
        args.with_state.clear();
        let q = self.mark_sql(false)?;
        let mut tx = self.pool.begin().await?;
        let plan: serde_json::Value = args
            .bind(sqlx::query_scalar(&format!(
                "EXPLAIN (ANALYZE, FORMAT JSON) {q}"
            )))
            .fetch_one(&mut *tx)
            .await
            .context("planning the mark")?;
        tx.rollback().await?;
        Ok(if args.queue.is_some() {
            // The delete's own scan and the per-entry probe.
            let mut scans = scans_of(&plan, "outroute_queue");
            scans.extend(scans_of(&plan, "qq"));
            scans
        } else {
            scans_of(&plan, "o")
        })
    }

    pub async fn record_failures(&self, failures: &[Failure]) -> Result<u64> {
        self.record_failures_as(failures, true).await
    }

    /// [`PgStore::record_failures`]; `alias`: a streamed event whose id
    /// another waiting or failed event of the source already has is
    /// recorded under an id of its own (see below).
    async fn record_failures_as(&self, failures: &[Failure], alias: bool) -> Result<u64> {
        let s = self.sql()?;
        let mut recorded = 0;
        for f in failures {
            // blocks_until: the retry time, 'infinity' (failed, policy block)
            // or '-infinity' (failed, policy skip).
            let (delay, blocks, failed) = match f.kind {
                FailureKind::Retry { delay } => (delay.as_secs_f64(), "retry", false),
                FailureKind::Failed { hold: true } => (0.0, "hold", true),
                FailureKind::Failed { hold: false } => (0.0, "none", true),
            };
            let next = "now() + make_interval(secs => $10)";
            let blocks_sql = format!(
                "CASE $8 WHEN 'hold' THEN 'infinity'::timestamptz WHEN 'none' THEN '-infinity'::timestamptz ELSE {next} END"
            );
            // The lease check locks the lane row (`FOR SHARE`): a hand-over
            // of the lane waits for this record to commit, so the new owner's
            // claims see it, and a record that waited for a hand-over is
            // re-checked against the new owner and records nothing. (A plain
            // read let a hold that began before expiry commit after the new
            // owner published the event: its aggregate blocked for good.)
            // A renewal waits for it too: one statement, rarely run.
            // A streamed event that already has a state row is a re-read
            // after a crash: the row is further along (maybe failed or
            // discarded by an operator) and stays as it is.
            let conflict = if f.parked.is_some() {
                // (a no-op update, so it counts as recorded: only a lost lease
                // records nothing)
                // Only the same event at the same stream position is a re-read; another
                // event under a taken id records nothing, so its batch is not
                // confirmed (loud, never a silent loss).
                // (a row published from the table before streaming began
                // and streamed again is recorded at the slot's start: an
                // earlier position)
                "DO UPDATE SET updated_at = st.updated_at \
                   WHERE st.commit_lsn <= EXCLUDED.commit_lsn AND st.seq = EXCLUDED.seq"
                    .to_string()
            } else {
                "DO UPDATE SET attempts = EXCLUDED.attempts, \
                   next_attempt_at = EXCLUDED.next_attempt_at, blocks_until = EXCLUDED.blocks_until, \
                   last_error = EXCLUDED.last_error, route = EXCLUDED.route, plugin = EXCLUDED.plugin, \
                   plugin_version = EXCLUDED.plugin_version, failed_at = EXCLUDED.failed_at, \
                   discarded_at = NULL, updated_at = now(), done_legs = EXCLUDED.done_legs, \
                   waiting_routes = EXCLUDED.waiting_routes, \
                   event = COALESCE(EXCLUDED.event, st.event), commit_lsn = COALESCE(EXCLUDED.commit_lsn, st.commit_lsn)"
                    .to_string()
            };
            let insert = format!(
                "INSERT INTO outroute_event_state AS st (source, event_id, aggregate_type, aggregate_id, seq, event_type, \
                   attempts, next_attempt_at, blocks_until, last_error, route, plugin, plugin_version, failed_at, done_legs, \
                   event, commit_lsn, waiting_routes) \
                 SELECT $1, $3, $4, $5, $6, $7, $9, {next}, {blocks_sql}, $11, $12, $13, $14, CASE WHEN $15 THEN now() END, $17, \
                   $18::text::jsonb, $19, $21 \
                 WHERE EXISTS (SELECT 1 FROM outroute_lanes WHERE source = $1 AND owner = $2 AND lane = $16 AND lease_until > now() \
                   AND ($20::bigint IS NULL OR epoch = $20) FOR SHARE) \
                 ON CONFLICT (source, event_id) {conflict}"
            );
            // Failed for good in lease mode: in the same statement (one
            // round trip, nothing half done after a crash) the row's own
            // failed marker is set and, under `marking = queue`, its entry
            // leaves the pending queue (`failed retry` puts it back). A
            // queued row off the queue without its marker would count as
            // published.
            let mut q = format!("WITH recorded AS ({insert} RETURNING 1)");
            if self.logical.is_none() && f.parked.is_none() {
                if failed && matches!(s.cfg.marking, Marking::Queue { .. }) {
                    q.push_str(
                        ", off AS (DELETE FROM outroute_queue WHERE source = $1 AND lane = $16 AND seq = $6 \
                           AND EXISTS (SELECT 1 FROM recorded))",
                    );
                }
                // The table's own attempts / last_error / failed columns, in
                // the same statement. Values are cast to the column's own
                // type, which cuts a reason too long for a `varchar(n)`.
                let mut sets = Vec::new();
                if let Some(c) = &s.cfg.attempts {
                    sets.push(format!("{} = $9::{}", quote(c), s.column_type(c)));
                }
                if let Some(c) = &s.cfg.last_error {
                    sets.push(format!("{} = $11::{}", quote(c), s.column_type(c)));
                }
                if failed {
                    if let Some(c) = &s.cfg.failed_at {
                        sets.push(format!("{} = now()", quote(c)));
                    }
                    if let Marking::Status {
                        column,
                        failed: Some(v),
                        ..
                    } = &s.cfg.marking
                    {
                        sets.push(format!(
                            "{} = {}::{}",
                            quote(column),
                            literal(v),
                            s.column_type(column)
                        ));
                    }
                }
                if !sets.is_empty() {
                    // Under the queue the sequence number is unique: found
                    // by it (on a partitioned outbox, usually the key).
                    let by_seq = if matches!(s.cfg.marking, Marking::Queue { .. }) {
                        format!("{} = $6 AND ", s.seq)
                    } else {
                        String::new()
                    };
                    q.push_str(&format!(
                        ", mirrored AS (UPDATE {table} o SET {sets} WHERE {by_seq}{row} AND EXISTS (SELECT 1 FROM recorded))",
                        table = s.table,
                        sets = sets.join(", "),
                        row = s.is_one_of("ARRAY[$3::text]"),
                    ));
                }
            }
            q.push_str(" SELECT count(*) FROM recorded");
            let (commit_lsn, event) = match &f.parked {
                Some((lsn, ev)) => (Some(*lsn), Some(serde_json::to_string(ev)?)),
                None => (None, None),
            };
            let done: i64 = sqlx::query_scalar(&q)
                .bind(&self.source)
                .bind(&self.relay_id)
                .bind(&f.id)
                .bind(&f.aggregate_type)
                .bind(&f.aggregate_id)
                .bind(f.sequence)
                .bind(&f.event_type)
                .bind(blocks)
                .bind(f.attempts as i32)
                .bind(delay)
                .bind(&f.reason)
                .bind(&f.route)
                .bind(&f.plugin)
                .bind(&f.plugin_version)
                .bind(failed)
                .bind(f.lane)
                .bind(&f.done_legs)
                .bind(event)
                .bind(commit_lsn)
                .bind(f.epoch)
                .bind(&f.waiting_routes)
                .fetch_one(&self.pool)
                .await
                .context("recording a failed attempt")?;
            if done == 0 {
                // A streamed event whose id is taken by another event of
                // the source that still waits or failed (a table without a
                // unique id, ids reused, NULLs): recorded, failed, under an
                // id of its own (`<id>@<commit lsn>/<seq>`, the id it goes
                // by from now on), so that it fails alone and the stream
                // moves on. (Recording nothing would leave the batch
                // unconfirmed, and the stream would restart at it forever.)
                // Nothing is recorded when the capture lease is lost.
                if alias && let Some((lsn, _)) = &f.parked {
                    let own = format!("{}@{lsn}/{}", f.id, f.sequence);
                    let mut taken = f.clone();
                    taken.reason = format!(
                        "id `{}` is taken by another event of this source that waits or failed (ids must be unique \
                         per source): this event is kept as `{own}`; {}",
                        f.id, f.reason
                    );
                    taken.id = own;
                    taken.kind = FailureKind::Failed { hold: false };
                    recorded +=
                        Box::pin(self.record_failures_as(std::slice::from_ref(&taken), false))
                            .await?;
                }
                continue; // fenced: the lane is no longer ours
            }
            recorded += 1;
            if self.logical.is_some() {
                continue; // the table row is not the record of a captured event
            }
        }
        Ok(recorded)
    }

    /// Pending events (not failed) and the age of the oldest, without
    /// work that grows with the backlog: each lane's index is walked for
    /// at most `BACKLOG_EXACT / lanes` rows, so the count is exact up to
    /// about [`BACKLOG_EXACT`]. Past that it is estimated from the span of
    /// pending sequence numbers (tables with a sequence column), or stays
    /// the lower bound counted. Without a lane index: the same bound, by scan.
    pub async fn backlog(&self) -> Result<(i64, Option<f64>)> {
        if self.logical.is_some() {
            return self.parked_backlog().await;
        }
        let s = self.sql()?;
        if let Marking::Queue { .. } = &s.cfg.marking {
            return self.queue_backlog(s).await;
        }
        let per_lane = (BACKLOG_EXACT / self.lanes as i64).max(2);
        let created = format!("o.{}::timestamptz", quote(&s.cfg.created_at));
        let not_failed = format!(
            "NOT EXISTS (SELECT 1 FROM outroute_event_state st WHERE st.source = $1 \
               AND st.event_id = {} AND st.failed_at IS NOT NULL OFFSET 0)",
            s.id_key()
        );
        let q = if self.missing_index.is_some() {
            format!(
                "SELECT count(*)::bigint, count(*) >= {cap}, min(x.created), min(x.seq) FROM \
                 (SELECT {created} AS created, {seq} AS seq FROM {table} o WHERE {pending} AND {not_failed} LIMIT {cap}) x",
                cap = BACKLOG_EXACT,
                seq = s.seq,
                table = s.table,
                pending = s.pending,
            )
        } else {
            format!(
                "SELECT sum(c.n)::bigint, bool_or(c.n >= {per_lane}), min(c.created), min(c.seq) \
                 FROM generate_series(0, {last}) l(lane) CROSS JOIN LATERAL \
                   (SELECT count(*) AS n, min(x.created) AS created, min(x.seq) AS seq FROM \
                     (SELECT {created} AS created, {seq} AS seq FROM {table} o \
                      WHERE {lane} = l.lane AND {pending} AND {not_failed} ORDER BY {order} LIMIT {per_lane}) x) c",
                last = self.lanes - 1,
                seq = s.seq,
                table = s.table,
                lane = s.lane,
                pending = s.pending,
                order = s.order,
            )
        };
        let row = sqlx::query(&q)
            .bind(&self.source)
            .fetch_one(&self.pool)
            .await?;
        let counted: Option<i64> = row.try_get(0)?;
        let saturated: Option<bool> = row.try_get(1)?;
        let oldest: Option<chrono::DateTime<chrono::Utc>> = row.try_get(2)?;
        let first_seq: Option<i64> = row.try_get(3)?;
        let mut n = counted.unwrap_or(0);
        if saturated == Some(true)
            && self.missing_index.is_none()
            && s.cfg.sequence.is_some()
            && let Some(first) = first_seq
        {
            // The newest pending row of each lane (index walked backwards).
            let q = format!(
                "SELECT max(c.seq) FROM generate_series(0, {last}) l(lane) CROSS JOIN LATERAL \
                   (SELECT {seq} AS seq FROM {table} o WHERE {lane} = l.lane AND {pending} \
                    ORDER BY {desc} LIMIT 1) c",
                last = self.lanes - 1,
                seq = s.seq,
                table = s.table,
                lane = s.lane,
                pending = s.pending,
                desc = s.order_desc,
            );
            let last: Option<i64> = sqlx::query_scalar(&q).fetch_one(&self.pool).await?;
            if let Some(last) = last {
                n = n.max(last - first + 1);
            }
        }
        let age = oldest.map(|t| (chrono::Utc::now() - t).num_milliseconds().max(0) as f64 / 1e3);
        Ok((n, age))
    }

    /// The backlog gauge under `marking = queue`: queue entries counted up
    /// to [`BACKLOG_EXACT`], past that estimated from the span of queued
    /// sequence numbers; the oldest entry's age from its row. One probe per
    /// lane at each end of its queue.
    async fn queue_backlog(&self, s: &TableSql) -> Result<(i64, Option<f64>)> {
        // Per lane, as for a lane index: at most `per_lane` entries counted
        // (a walk of the queue's key, never a scan of its heap, whose front
        // holds the entries published since the last VACUUM), the first
        // entry's row for its age, the last entry for the span estimate.
        let per_lane = (BACKLOG_EXACT / self.lanes as i64).max(2);
        let q = format!(
            "SELECT sum(c.n)::bigint, bool_or(c.n >= {per_lane}), min(c.seq), max(z.seq), \
               min((SELECT o.{created}::timestamptz FROM {table} o WHERE {seq} = c.seq)) \
             FROM generate_series(0, {last}) l(lane) \
             CROSS JOIN LATERAL (SELECT count(*) AS n, min(k.seq) AS seq FROM \
               (SELECT qq.seq FROM outroute_queue qq WHERE qq.source = $1 AND qq.lane = l.lane \
                ORDER BY qq.seq LIMIT {per_lane}) k) c \
             CROSS JOIN LATERAL (SELECT max(y.seq) AS seq FROM (SELECT qq.seq FROM outroute_queue qq \
               WHERE qq.source = $1 AND qq.lane = l.lane ORDER BY qq.seq DESC LIMIT 1) y) z",
            last = self.lanes - 1,
            created = quote(&s.cfg.created_at),
            table = s.table,
            seq = s.seq,
        );
        type Row = (
            Option<i64>,
            Option<bool>,
            Option<i64>,
            Option<i64>,
            Option<DateTime<Utc>>,
        );
        let (counted, saturated, first, last, oldest): Row = sqlx::query_as(&q)
            .bind(&self.source)
            .fetch_one(&self.pool)
            .await?;
        let mut n = counted.unwrap_or(0);
        if saturated == Some(true)
            && let (Some(first), Some(last)) = (first, last)
        {
            n = n.max(last - first + 1);
        }
        let age = oldest.map(|t| (Utc::now() - t).num_milliseconds().max(0) as f64 / 1e3);
        Ok((n, age))
    }

    pub async fn status(&self) -> Result<Status> {
        if self.logical.is_some() {
            return self.logical_status().await;
        }
        let s = self.sql()?;
        let (_, oldest) = self.backlog().await?;
        let counts = sqlx::query(
            "SELECT count(*) FILTER (WHERE failed_at IS NULL), count(*) FILTER (WHERE failed_at IS NOT NULL AND discarded_at IS NULL) \
             FROM outroute_event_state WHERE source = $1",
        )
        .bind(&self.source)
        .fetch_one(&self.pool)
        .await?;
        // An operator's question, answered exactly (this reads every pending
        // row, unlike the relay's bounded gauge); failed rows that stay
        // pending in a table with nowhere to mark them are not backlog.
        let not_failed = format!(
            "NOT EXISTS (SELECT 1 FROM outroute_event_state st WHERE st.source = $1 \
               AND st.event_id = {} AND st.failed_at IS NOT NULL)",
            s.id_key()
        );
        let by_type_q = match &s.cfg.marking {
            // The queue lists exactly the pending rows: read those.
            Marking::Queue { .. } => format!(
                "SELECT x.at, count(*) FROM outroute_queue qq CROSS JOIN LATERAL \
                   (SELECT {at} AS at FROM {table} o WHERE {seq} = qq.seq AND {row} AND {not_failed}) x \
                 WHERE qq.source = $1 GROUP BY 1 ORDER BY 2 DESC",
                at = s.aggregate_type,
                table = s.table,
                seq = s.seq,
                row = s.row_pending,
            ),
            _ => format!(
                "SELECT {at}, count(*) FROM {table} o WHERE {pending} AND {not_failed} \
                 GROUP BY 1 ORDER BY 2 DESC",
                at = s.aggregate_type,
                table = s.table,
                pending = s.pending,
            ),
        };
        let mut by_type = sqlx::query(&by_type_q)
            .bind(&self.source)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|r| {
                Ok((
                    r.try_get::<Option<String>, _>(0)?.unwrap_or_default(),
                    r.try_get::<i64, _>(1)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let backlog = by_type.iter().map(|(_, n)| n).sum();
        by_type.truncate(50);
        let relays = self.live_relays().await?;
        let events_without_messages = self.events_without_messages().await?;
        Ok(Status {
            table: self.source.clone(),
            backlog,
            oldest_pending_age_seconds: oldest,
            retrying: counts.try_get(0)?,
            failed: counts.try_get(1)?,
            backlog_by_aggregate_type: by_type,
            events_without_messages,
            quarantined_routes: self.quarantined_routes().await?,
            relays,
            slot: None,
        })
    }

    /// Live relays of this source with the lanes they hold (for `status`).
    pub(super) async fn live_relays(&self) -> Result<Vec<RelayStatus>> {
        sqlx::query(
            "SELECT r.relay_id, r.hostname, r.pid, extract(epoch from now() - r.heartbeat_at)::float8, \
               COALESCE(array_agg(l.lane ORDER BY l.lane) FILTER (WHERE l.lane IS NOT NULL), '{}') \
             FROM outroute_relays r LEFT JOIN outroute_lanes l ON l.source = r.source AND l.owner = r.relay_id AND l.lease_until > now() \
             WHERE r.source = $1 AND r.heartbeat_at > now() - make_interval(secs => $2) GROUP BY 1, 2, 3, 4 ORDER BY 1",
        )
        .bind(&self.source)
        .bind(self.lease_ttl.as_secs_f64())
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| {
            Ok(RelayStatus {
                relay_id: r.try_get(0)?,
                hostname: r.try_get(1)?,
                pid: r.try_get(2)?,
                heartbeat_age_seconds: r.try_get(3)?,
                lanes: r.try_get(4)?,
            })
        })
        .collect::<Result<Vec<_>>>()
    }

    /// Per route, events published without messages (for `status`).
    pub(super) async fn events_without_messages(&self) -> Result<Vec<(String, i64)>> {
        Ok(sqlx::query_as(
            "SELECT route, events_without_messages FROM outroute_route_counts \
             WHERE source = $1 AND events_without_messages > 0 ORDER BY route",
        )
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?)
    }

    pub async fn quarantine_route(&self, route: &str, reason: &str) -> Result<()> {
        sqlx::query(
            "INSERT INTO outroute_route_counts AS c (source, route, quarantined_since, quarantine_reason) \
             VALUES ($1, $2, now(), $3) \
             ON CONFLICT (source, route) DO UPDATE SET quarantined_since = COALESCE(c.quarantined_since, now()), \
               quarantine_reason = EXCLUDED.quarantine_reason, updated_at = now()",
        )
        .bind(&self.source)
        .bind(route)
        .bind(reason)
        .execute(&self.pool)
        .await
        .context("recording a route quarantine")?;
        Ok(())
    }

    pub async fn resume_route(&self, route: &str) -> Result<(bool, u64)> {
        let mut tx = self.pool.begin().await?;
        let was = sqlx::query(
            "UPDATE outroute_route_counts SET quarantined_since = NULL, quarantine_reason = NULL, updated_at = now() \
             WHERE source = $1 AND route = $2 AND quarantined_since IS NOT NULL",
        )
        .bind(&self.source)
        .bind(route)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let due = sqlx::query(MAKE_WAITING_DUE)
            .bind(&self.source)
            .bind(route)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok((was > 0, due))
    }

    pub async fn make_waiting_due(&self, route: &str) -> Result<u64> {
        Ok(sqlx::query(MAKE_WAITING_DUE)
            .bind(&self.source)
            .bind(route)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    pub async fn quarantined_routes(&self) -> Result<Vec<QuarantinedRoute>> {
        let rows: Vec<(String, DateTime<Utc>, Option<String>)> = sqlx::query_as(
            "SELECT route, quarantined_since, quarantine_reason FROM outroute_route_counts \
             WHERE source = $1 AND quarantined_since IS NOT NULL ORDER BY route",
        )
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(route, since, reason)| QuarantinedRoute {
                route,
                since,
                reason: reason.unwrap_or_default(),
            })
            .collect())
    }

    pub async fn count_without_messages(&self, by_route: &[(String, u64)]) -> Result<()> {
        let (routes, counts): (Vec<&str>, Vec<i64>) = by_route
            .iter()
            .map(|(r, n)| (r.as_str(), *n as i64))
            .unzip();
        sqlx::query(
            "INSERT INTO outroute_route_counts AS c (source, route, events_without_messages) \
             SELECT $1, r, n FROM unnest($2::text[], $3::bigint[]) AS u(r, n) \
             ON CONFLICT (source, route) DO UPDATE SET \
               events_without_messages = c.events_without_messages + EXCLUDED.events_without_messages, \
               updated_at = now()",
        )
        .bind(&self.source)
        .bind(&routes)
        .bind(&counts)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// WHERE clause over `outroute_event_state st` for a failed-event
    /// filter; parameters $1..$6 are bound by [`Self::bind_failed`].
    fn failed_where(f: &Filter) -> String {
        let discarded = if f.include_discarded {
            ""
        } else {
            " AND st.discarded_at IS NULL"
        };
        format!(
            "st.source = $1 AND st.failed_at IS NOT NULL{discarded} \
             AND ($2::text[] IS NULL OR st.event_id = ANY($2)) AND ($3::text IS NULL OR st.route = $3) \
             AND ($4::text IS NULL OR st.event_type = $4) AND ($5::text IS NULL OR st.aggregate_type = $5) \
             AND ($6::text IS NULL OR st.aggregate_id = $6)"
        )
    }

    fn bind_failed<'q>(
        &'q self,
        q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        f: &'q Filter,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        q.bind(&self.source)
            .bind(if f.ids.is_empty() { None } else { Some(&f.ids) })
            .bind(&f.route)
            .bind(&f.event_type)
            .bind(&f.aggregate_type)
            .bind(&f.aggregate_id)
    }

    pub async fn failed_list(&self, f: &Filter) -> Result<Vec<FailedEvent>> {
        let q = format!(
            "SELECT event_id, aggregate_type, aggregate_id, event_type, seq, attempts, last_error, route, plugin, plugin_version, \
               first_error_at, failed_at, discarded_at, blocks_until = 'infinity' AS holds, event -> 'row' \
             FROM outroute_event_state st WHERE {} ORDER BY seq LIMIT {}",
            Self::failed_where(f),
            f.limit.unwrap_or(1000)
        );
        let rows = self
            .bind_failed(sqlx::query(&q), f)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(FailedEvent {
                    id: r.try_get(0)?,
                    aggregate_type: r.try_get(1)?,
                    aggregate_id: r.try_get(2)?,
                    event_type: r.try_get(3)?,
                    seq: r.try_get(4)?,
                    attempts: r.try_get(5)?,
                    reason: r.try_get(6)?,
                    route: r.try_get(7)?,
                    plugin: r.try_get(8)?,
                    plugin_version: r.try_get(9)?,
                    first_error_at: r.try_get(10)?,
                    failed_at: r.try_get(11)?,
                    discarded_at: r.try_get(12)?,
                    holds_aggregate: r.try_get(13)?,
                    row: r.try_get(14)?,
                })
            })
            .collect()
    }

    pub async fn failed_retry(&self, f: &Filter) -> Result<u64> {
        let s = self.sql()?;
        let queue = matches!(s.cfg.marking, Marking::Queue { .. }) && self.logical.is_none();
        let mut tx = self.pool.begin().await?;
        // Under `marking = queue` a retried event is put back by queuing its
        // row again: one whose row is gone (purged, deleted by hand) cannot
        // be. It stays failed and is named, never counted as put back.
        let gone: Vec<String> = if queue {
            let q = format!(
                "SELECT st.event_id FROM outroute_event_state st WHERE {} \
                 AND NOT EXISTS (SELECT 1 FROM {table} o WHERE {row})",
                Self::failed_where(f),
                table = s.table,
                row = s.is_one_of("ARRAY[st.event_id]"),
            );
            self.bind_failed(sqlx::query(&q), f)
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| r.try_get(0))
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        let q = format!(
            "UPDATE outroute_event_state st SET failed_at = NULL, discarded_at = NULL, attempts = 0, \
               next_attempt_at = now(), blocks_until = '-infinity', updated_at = now() \
             WHERE {} AND st.event_id <> ALL($7::text[]) RETURNING event_id",
            Self::failed_where(f)
        );
        let ids: Vec<String> = self
            .bind_failed(sqlx::query(&q), f)
            .bind(&gone)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()?;
        if queue && !ids.is_empty() {
            let q = format!(
                "INSERT INTO outroute_queue (source, lane, seq) SELECT $1, {lane}, {seq} FROM {table} o \
                 WHERE {row} ON CONFLICT DO NOTHING",
                lane = s.lane,
                seq = s.seq,
                table = s.table,
                row = s.is_one_of("$2::text[]"),
            );
            sqlx::query(&q)
                .bind(&self.source)
                .bind(&ids)
                .execute(&mut *tx)
                .await?;
        }
        // Undo the table's own failed marker so the row is pending again.
        let mut sets = Vec::new();
        if let Some(c) = &s.cfg.failed_at {
            sets.push(format!("{} = NULL", quote(c)));
        }
        if let Marking::Status {
            column,
            pending,
            failed: Some(_),
            ..
        } = &s.cfg.marking
        {
            sets.push(format!("{} = {}", quote(column), literal(pending)));
        }
        if !sets.is_empty() && !ids.is_empty() && self.logical.is_none() {
            let q = format!(
                "UPDATE {} o SET {} WHERE {}",
                s.table,
                sets.join(", "),
                s.is_one_of("$1::text[]")
            );
            sqlx::query(&q).bind(&ids).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        if !gone.is_empty() {
            bail!(
                "{} event(s) put back in line; {} could not be: their rows are no longer in `{}` \
                 (purged or deleted): {} (`outroute failed discard --id …` records that they are given up)",
                ids.len(),
                gone.len(),
                s.cfg.name,
                gone.join(", ")
            );
        }
        Ok(ids.len() as u64)
    }

    /// See [`crate::store::Store::failed_edit`]: `set` holds (field, value)
    /// pairs of the kept row; the id is not one of them (the record goes by
    /// it). Fields: aggregate_type, aggregate_id, event_type, event_version,
    /// payload, headers.
    pub async fn failed_edit(&self, id: &str, set: &[(String, String)]) -> Result<()> {
        const FIELDS: [&str; 6] = [
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "event_version",
            "payload",
            "headers",
        ];
        let mut tx = self.pool.begin().await?;
        let kept: Option<Option<bool>> = sqlx::query_scalar(
            "SELECT (event ? 'row') FROM outroute_event_state WHERE source = $1 AND event_id = $2 FOR UPDATE",
        )
        .bind(&self.source)
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        match kept {
            None => bail!("no failed event with id {id}"),
            Some(Some(true)) => {}
            Some(_) => bail!(
                "event {id} has no row kept in its failure record (only rows parked by log-based capture \
                 that could not become an event do); edit the outbox row itself, then `outroute failed retry`"
            ),
        }
        for (field, value) in set {
            if !FIELDS.contains(&field.as_str()) {
                bail!(
                    "`{field}` is not a field of the kept row that can be edited; one of: {}",
                    FIELDS.join(", ")
                );
            }
            sqlx::query(
                "UPDATE outroute_event_state SET event = jsonb_set(event, ARRAY['row', $3], to_jsonb($4::text)), \
                   updated_at = now() WHERE source = $1 AND event_id = $2",
            )
            .bind(&self.source)
            .bind(id)
            .bind(field)
            .bind(value)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub async fn failed_discard(&self, f: &Filter) -> Result<u64> {
        let q = format!(
            "UPDATE outroute_event_state st SET discarded_at = now(), blocks_until = '-infinity', updated_at = now() \
             WHERE {}",
            Self::failed_where(f)
        );
        Ok(self
            .bind_failed(sqlx::query(&q), f)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    fn published_where(&self, s: &TableSql) -> String {
        format!(
            "{published} AND ($1::timestamptz IS NULL OR o.{created}::timestamptz >= $1) \
             AND ($2::timestamptz IS NULL OR o.{created}::timestamptz < $2) \
             AND ($3::text IS NULL OR {at} = $3) AND ($4::text IS NULL OR {ai} = $4) \
             AND ($5::text IS NULL OR o.{et}::text = $5)",
            published = s.published,
            created = quote(&s.cfg.created_at),
            at = s.aggregate_type,
            ai = s.aggregate_id,
            et = quote(&s.cfg.event_type),
        )
    }

    /// A page of published events in outbox order after `cursor`, or
    /// (`newest`) in reverse order before it.
    pub async fn published_page(
        &self,
        f: &Filter,
        cursor: Option<&Cursor>,
        limit: i64,
        newest: bool,
    ) -> Result<Vec<Claim>> {
        let s = self.sql()?;
        if matches!(s.cfg.marking, Marking::Delete) {
            bail!("marking style `delete` keeps no published events (nothing to replay or try)");
        }
        let (cmp, dir, start) = if newest {
            ("<", " DESC", i64::MAX)
        } else {
            (">", "", i64::MIN)
        };
        // Ids compare as text on both sides, so the cursor works for any id type.
        let q = format!(
            "SELECT {cols} FROM {table} o WHERE {w} \
               AND ({seq} {cmp} $6 OR ({seq} = $6 AND {id}::text {cmp} $8)) ORDER BY {seq}{dir}, {id}::text{dir} LIMIT $7",
            cols = s.row_columns("NULL::text"),
            table = s.table,
            w = self.published_where(s),
            seq = s.seq,
            id = s.id,
        );
        let rows = sqlx::query(&q)
            .bind(f.since)
            .bind(f.until)
            .bind(&f.aggregate_type)
            .bind(&f.aggregate_id)
            .bind(&f.event_type)
            .bind(cursor.map(|c| c.seq).unwrap_or(start))
            .bind(limit)
            .bind(cursor.map(|c| c.id.as_str()).unwrap_or(""))
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| to_claim(r, s.payload_is_json))
            .collect()
    }

    pub async fn published_count(&self, f: &Filter) -> Result<i64> {
        let s = self.sql()?;
        if matches!(s.cfg.marking, Marking::Delete) {
            return Ok(0);
        }
        let q = format!(
            "SELECT count(*) FROM {} o WHERE {}",
            s.table,
            self.published_where(s)
        );
        Ok(sqlx::query_scalar(&q)
            .bind(f.since)
            .bind(f.until)
            .bind(&f.aggregate_type)
            .bind(&f.aggregate_id)
            .bind(&f.event_type)
            .fetch_one(&self.pool)
            .await?)
    }

    pub async fn purge_published(&self, older_than: Duration, batch: i64) -> Result<super::Purged> {
        let s = self.sql()?;
        let age = match &s.cfg.marking {
            Marking::PublishedAt { column } => format!("o.{}", quote(column)),
            Marking::Status { .. } => format!("o.{}::timestamptz", quote(&s.cfg.created_at)),
            Marking::Delete => return Ok(super::Purged::default()),
            Marking::Queue { .. } => format!("o.{}::timestamptz", quote(&s.cfg.created_at)),
        };
        // Small batches by ctid: short transactions, no long locks. One
        // relay at a time: the others skip the round while it holds the
        // table's purge lock (a transaction-level advisory lock).
        let mut tx = self.pool.begin().await?;
        let ours: bool = sqlx::query_scalar(
            "SELECT pg_try_advisory_xact_lock(hashtext('outroute purge'), hashtext($1))",
        )
        .bind(&self.source)
        .fetch_one(&mut *tx)
        .await?;
        if !ours {
            return Ok(super::Purged::default());
        }
        let purged = match &s.cfg.marking {
            // Nothing is stamped: walk `batch` rows by sequence number (its
            // unique index) from where the last round stopped, delete the
            // published ones past the window and step over the rest (failed
            // or still pending rows stay until they are published or
            // handled). A published row still inside the window means the
            // rows after it are younger: the next round starts again from
            // the bottom, as does one that reaches the end of the table.
            Marking::Queue { .. } => {
                let q = format!(
                    "WITH w AS MATERIALIZED (SELECT o.ctid AS t, {seq} AS seq, ({published}) AS done, \
                       {age} < now() - make_interval(secs => $1) AS old \
                       FROM (SELECT ctid, * FROM {table} x WHERE {seq_x} > $3 ORDER BY {seq_x} LIMIT $2) o), \
                     gone AS (DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT t FROM w WHERE done AND old)) RETURNING 1) \
                     SELECT (SELECT count(*) FROM gone)::bigint, (SELECT count(*) FROM w)::bigint, \
                       (SELECT max(seq) FROM w)::bigint, coalesce((SELECT bool_or(done AND NOT old) FROM w), false)",
                    table = s.table,
                    seq = s.seq,
                    seq_x = s.seq.replacen("o.", "x.", 1),
                    published = s.published,
                );
                let from = self.purge_from.load(std::sync::atomic::Ordering::Relaxed);
                let (deleted, walked, last, young): (i64, i64, Option<i64>, bool) =
                    sqlx::query_as(&q)
                        .bind(older_than.as_secs_f64())
                        .bind(batch)
                        .bind(from)
                        .fetch_one(&mut *tx)
                        .await?;
                let more = walked >= batch && !young;
                let next = match last {
                    Some(seq) if more => seq,
                    _ => i64::MIN,
                };
                self.purge_from
                    .store(next, std::sync::atomic::Ordering::Relaxed);
                super::Purged {
                    deleted: deleted.max(0) as u64,
                    more,
                }
            }
            _ => {
                let q = format!(
                    "DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT o.ctid FROM {table} o WHERE {published} \
                       AND {age} < now() - make_interval(secs => $1) LIMIT $2))",
                    table = s.table,
                    published = s.published,
                );
                let deleted = sqlx::query(&q)
                    .bind(older_than.as_secs_f64())
                    .bind(batch)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                super::Purged {
                    deleted,
                    more: deleted >= batch as u64,
                }
            }
        };
        tx.commit().await?;
        Ok(purged)
    }

    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }
}

/// The mark statement's parameters, in order ($1 … $8).
struct MarkArgs<'c> {
    source: &'c str,
    relay_id: &'c str,
    ids: Vec<&'c str>,
    with_state: Vec<&'c str>,
    tids: Vec<&'c str>,
    epochs: Vec<Option<i64>>,
    /// Under queue marking: each claim's lane and sequence.
    queue: Option<(Vec<i32>, Vec<i64>)>,
}

impl<'c> MarkArgs<'c> {
    fn bind<'q, O>(
        &'q self,
        q: sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        let q = q
            .bind(self.source)
            .bind(self.relay_id)
            .bind(&self.ids)
            .bind(&self.with_state)
            .bind(&self.tids)
            .bind(&self.epochs);
        match &self.queue {
            Some((lanes, seqs)) => q.bind(lanes).bind(seqs),
            None => q,
        }
    }
}

/// The (ctid, id) pairs the mark looks up, as two parallel arrays.
fn tids_and_ids<'c>(claims: &[&'c Claim]) -> (Vec<&'c str>, Vec<&'c str>) {
    claims
        .iter()
        .filter_map(|c| Some((c.tid.as_deref()?, c.id())))
        .unzip()
}

/// Every plan node that reads the relation aliased `alias`.
fn nodes_of<'p>(
    v: &'p serde_json::Value,
    alias: &str,
    out: &mut Vec<&'p serde_json::Map<String, serde_json::Value>>,
) {
    match v {
        serde_json::Value::Object(m) => {
            if m.get("Alias").and_then(|a| a.as_str()) == Some(alias) {
                out.push(m);
            }
            m.values().for_each(|c| nodes_of(c, alias, out));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|c| nodes_of(c, alias, out)),
        _ => {}
    }
}

/// Type and rows produced (over all loops, as `EXPLAIN ANALYZE` counts
/// them; 0 without ANALYZE) of every plan node that reads the relation
/// aliased `alias`, in an `EXPLAIN (FORMAT JSON)` result.
fn scans_of(plan: &serde_json::Value, alias: &str) -> Vec<(String, f64)> {
    let mut nodes = Vec::new();
    nodes_of(plan, alias, &mut nodes);
    nodes
        .into_iter()
        .filter_map(|m| {
            let num = |k: &str| m.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
            let t = m.get("Node Type")?.as_str()?.to_string();
            Some((
                t,
                (num("Actual Rows") + num("Rows Removed by Filter")) * num("Actual Loops"),
            ))
        })
        .collect()
}

/// Positions of the columns every claim statement returns: `select_cols`,
/// then `tid`, `state_attempts` and `held_routes` (read by position: a
/// lookup by name hashes the name, thirteen times per row).
mod col {
    pub const ID: usize = 0;
    pub const SEQ: usize = 1;
    pub const AGGREGATE_TYPE: usize = 2;
    pub const AGGREGATE_ID: usize = 3;
    pub const EVENT_TYPE: usize = 4;
    pub const EVENT_VERSION: usize = 5;
    pub const PAYLOAD: usize = 6;
    pub const HEADERS: usize = 7;
    pub const CREATED_AT: usize = 8;
    pub const LANE: usize = 9;
    pub const TID: usize = 10;
    pub const STATE_ATTEMPTS: usize = 11;
    pub const HELD_ROUTES: usize = 12;
    /// The names, in order (checked against the SQL in a unit test).
    #[cfg(test)]
    pub const NAMES: [&str; 13] = [
        "id",
        "seq",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "event_version",
        "payload",
        "headers",
        "created_at",
        "lane",
        "tid",
        "state_attempts",
        "held_routes",
    ];
}

/// A claim statement's row as a claim. `payload_is_json`: the payload
/// column is `json`/`jsonb` (not parsed again).
///
/// Read unchecked: the statement casts every column to the type read here
/// (`::text`, `::bigint`, `::timestamptz`, the lane and attempts `int`), so
/// sqlx's per-value type-compatibility check — most of the cost of reading
/// a row, measured — proves nothing; a value of another type still fails
/// to decode, as an error.
fn to_claim(r: &PgRow, payload_is_json: bool) -> Result<Claim> {
    let id: Option<String> = r.try_get_unchecked(col::ID)?;
    let tid: Option<String> = r.try_get_unchecked(col::TID)?;
    let lane: i32 = r.try_get_unchecked(col::LANE)?;
    let state_attempts: Option<i32> = r.try_get_unchecked(col::STATE_ATTEMPTS)?;
    let read = |id: String| -> Result<RawRow, sqlx::Error> {
        Ok(RawRow {
            id,
            sequence: r.try_get_unchecked(col::SEQ)?,
            aggregate_type: r.try_get_unchecked(col::AGGREGATE_TYPE)?,
            aggregate_id: r.try_get_unchecked(col::AGGREGATE_ID)?,
            event_type: r.try_get_unchecked(col::EVENT_TYPE)?,
            event_version: r.try_get_unchecked(col::EVENT_VERSION)?,
            payload: r.try_get_unchecked(col::PAYLOAD)?,
            headers: r.try_get_unchecked(col::HEADERS)?,
            created_at: r.try_get_unchecked(col::CREATED_AT)?,
            attempts: state_attempts.unwrap_or(0),
            payload_is_json,
        })
    };
    // A row that cannot even be read fails on its own, with the reason;
    // one without an id goes by its place in the table (`TableSql::id_key`).
    let row = match id.filter(|id| !id.is_empty()) {
        None => {
            let key = format!("{NO_ID}{}", tid.as_deref().unwrap_or("?"));
            let mut m = super::unreadable(r, key.clone(), sqlx::Error::RowNotFound);
            m.reason = format!(
                "id is NULL or empty: the row is kept as `{key}` (its place in the table) until its id is set"
            );
            Err(m)
        }
        Some(id) => match read(id.clone()) {
            Ok(raw) => raw.validate(),
            Err(e) => Err(super::unreadable(r, id, e)),
        },
    };
    Ok(Claim {
        lane,
        tid,
        held: r
            .try_get_unchecked::<Option<Vec<String>>, _>(col::HELD_ROUTES)?
            .unwrap_or_default(),
        has_state: state_attempts.is_some(),
        done_legs: Vec::new(),
        epoch: None,
        captured: None,
        route: None,
        row,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_columns_come_in_the_order_to_claim_reads_them() {
        let s = TableSql::new(&TableConfig::canonical(), 16, "uuid");
        let queued = TableSql::new(
            &TableConfig {
                marking: Marking::Queue { column: None },
                ..TableConfig::canonical()
            },
            16,
            "uuid",
        );
        let by_queue = queued.claim_by_queue(Ordering::Aggregate, true);
        // The mark deletes the entry the claim walked: its lane, not the row's.
        assert!(by_queue.contains("qq.lane AS lane"), "{by_queue}");
        for sql in [
            format!("{}, {}", s.select_cols, s.claim_extras(Ordering::Aggregate)),
            s.claim_by_lane(Ordering::Aggregate, true),
            s.claim_by_lane(Ordering::Aggregate, false),
            by_queue,
        ] {
            let mut at = 0;
            for name in col::NAMES {
                let alias = format!(" AS {name}");
                let found = sql[at..]
                    .find(&alias)
                    .unwrap_or_else(|| panic!("`{alias}` missing or out of order in {sql}"));
                at += found + alias.len();
            }
        }
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote("app.outbox"), "\"app\".\"outbox\"");
        assert_eq!(literal("it's"), "'it''s'");
    }

    #[test]
    fn legacy_status_table_sql() {
        let t = TableConfig {
            name: "t_outbox".into(),
            id: "event_id".into(),
            sequence: None,
            aggregate_type: Some("aggregate_type".into()),
            aggregate_type_value: None,
            aggregate_id: "aggregate_id".into(),
            event_type: "event_type".into(),
            event_version: None,
            payload: "payload".into(),
            headers: None,
            created_at: "create_time".into(),
            attempts: Some("retry_count".into()),
            last_error: None,
            failed_at: None,
            marking: Marking::Status {
                column: "status".into(),
                pending: "PENDING".into(),
                sent: "SENT".into(),
                failed: None,
            },
        };
        let s = TableSql::new(&t, 16, "character varying");
        assert_eq!(s.pending, "o.\"status\" = 'PENDING'");
        assert!(s.seq.contains("extract(epoch from o.\"create_time\""));
        assert!(s.lane.ends_with("% 16)"));
        assert_eq!(s.ids_param(3), "$3::text[]::character varying[]");
        // The claim orders by the raw columns, and the index is written
        // with the same expressions, unqualified, over the same rows.
        assert_eq!(s.order, "o.\"create_time\", o.\"event_id\"");
        assert_eq!(
            s.index_ddl,
            format!(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"t_outbox_outroute_lanes16\" ON \"t_outbox\" \
                 (({}), \"create_time\", \"event_id\") WHERE \"status\" = 'PENDING'",
                s.lane.replace("o.", "")
            )
        );
    }
}
