//! PostgreSQL store: leases, claims, marks and failure state for any outbox
//! table shape.
//!
//! ## Files
//! This file holds the connection, the table's SQL (generated once per
//! table shape: [`TableSql`]) and the design; the work is split by concern:
//! `postgres/schema.rs` (migrations and start-up checks, lane index),
//! `postgres/claim.rs` (leases, claims, floor rounds, orphan sweep),
//! `postgres/mark.rs` (marks and failure records), `postgres/operator.rs`
//! (status, backlog, quarantine records, failed events, replay pages,
//! retention), `postgres/cost.rs` (`EXPLAIN` costs), `postgres/floor.rs`
//! (claim floors) and `postgres/logical.rs` (log capture's store side).
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

mod claim;
mod cost;
mod floor;
mod logical;
mod mark;
mod operator;
mod schema;
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

    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }
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
