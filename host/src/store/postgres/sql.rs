//! The SQL of one outbox table, generated once per table shape from its
//! `[store.table]` mapping ([`TableSql`]): how a row is read and validated,
//! the lane expression, the claim statements (by lane index, by pending
//! queue, by scan), the floor rounds and the queue trigger. Text only: it
//! runs nothing (the files beside it do).
//!
//! One concern, one file: the text of one table's statements, generated
//! together because they share its column list, lane expression and
//! predicates.

use super::*;

/// Quote a validated identifier (`schema.table` → `"schema"."table"`).
pub(super) fn quote(ident: &str) -> String {
    ident
        .split('.')
        .map(|p| format!("\"{}\"", p.replace('"', "\"\"")))
        .collect::<Vec<_>>()
        .join(".")
}

/// Quote a string literal (standard_conforming_strings is on since 9.1).
pub(super) fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The rows still to publish, the lane of a row and the outbox order, as
/// SQL over one alias (`o` in queries, none in index definitions: the
/// planner matches the claim's expressions against the lane index only
/// when both are written the same way).
#[derive(Debug, Clone)]
pub(super) struct Shape {
    pub(super) aggregate_type: String,
    pub(super) aggregate_id: String,
    pub(super) lane: String,
    pub(super) pending: String,
    pub(super) order: String,
    pub(super) order_desc: String,
}

impl Shape {
    pub(super) fn new(t: &TableConfig, lanes: u32, alias: &str) -> Self {
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
pub(super) const NO_STATE: &str =
    "(SELECT NOT EXISTS (SELECT 1 FROM outroute_event_state ns WHERE ns.source = $1))";

/// [`NO_STATE`] for a table whose rows say they failed (`failed_at`, or a
/// `status` with a failed value): a failed row is no longer pending, so
/// only state rows that can still skip or hold a pending row count —
/// retrying or waiting (`failed_at` NULL) and holding for good (`blocks_until`
/// infinity). Failed-and-skipped and discarded events (they stay for ever)
/// then no longer cost every later claim its per-row probes. The partial
/// index `outroute_event_state_live` answers it in one probe.
pub(super) const NO_LIVE_STATE: &str = "(SELECT NOT EXISTS (SELECT 1 FROM outroute_event_state ns WHERE ns.source = $1 \
     AND (ns.failed_at IS NULL OR ns.blocks_until = 'infinity')))";

/// The backlog gauge counts pending events exactly up to about this many.
pub const BACKLOG_EXACT: i64 = 1_000;

/// The SQL for one table mapping, generated once at start-up.
#[derive(Debug, Clone)]
pub(super) struct TableSql {
    pub(super) table: String,
    pub(super) id: String,
    pub(super) id_type: String,
    pub(super) seq: String,
    pub(super) aggregate_type: String,
    pub(super) aggregate_id: String,
    /// Pending rows, lane and order over alias `o`.
    pub(super) pending: String,
    /// What the row itself says about being pending (`pending` without the
    /// queue probe of `marking = queue`; the same for other markings).
    pub(super) row_pending: String,
    pub(super) lane: String,
    pub(super) order: String,
    pub(super) order_desc: String,
    /// The sequence column over alias `o` (as the lane index has it), when
    /// the table has one: claims start each lane at its floor on it (see
    /// `postgres/floor.rs`).
    pub(super) floor_col: Option<String>,
    /// The lane of a state row (`outroute_event_state` alias `st`).
    pub(super) state_lane: String,
    pub(super) published: String,
    pub(super) select_cols: String,
    /// The payload column is `json`/`jsonb` (set by `check_table`): rows
    /// are not parsed again to check it.
    pub(super) payload_is_json: bool,
    /// Mapped columns' types as the catalog names them (set by
    /// `check_table`), for casts to a column's own type.
    pub(super) column_types: std::collections::HashMap<String, String>,
    /// The id column may hold NULL or '' (set by `check_table`): state rows
    /// then key such a row by its place in the table ([`TableSql::id_key`]).
    pub(super) id_may_be_missing: bool,
    /// The lane index: its name and `CREATE INDEX` statement (the pending
    /// queue's set-up under `marking = queue`).
    pub(super) index_name: String,
    pub(super) index_ddl: String,
    pub(super) cfg: TableConfig,
}

/// The start of the names outroute gives objects of table `t` (index and
/// function names are per schema and at most 63 bytes).
pub(super) fn name_base(t: &TableConfig) -> String {
    t.name
        .rsplit('.')
        .next()
        .unwrap_or(&t.name)
        .chars()
        .take(40)
        .collect()
}

/// The pending queue's trigger function of table `t`.
pub(super) fn queue_function(t: &TableConfig) -> String {
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
///
/// While one of the table's relays sleeps (`outroute_wake`, see
/// `postgres/wake.rs`), an insert also sends `pg_notify('outroute_wake',
/// <table>)`: one notification on the idle→busy edge, none while the relays
/// are awake (a notification serialises commits, so busy producers must not
/// pay one each).
pub(super) fn queue_function_ddl(t: &TableConfig, function: &str, seq: &str, lanes: u32) -> String {
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
         INSERT INTO %2$I.outroute_queue (source, lane, seq) VALUES ({src}, {lane}, {new_seq}); \
         IF EXISTS (SELECT 1 FROM %2$I.outroute_wake w WHERE w.source = {src} AND w.asleep \
             AND w.since > now() - interval '2 minutes') \
           THEN PERFORM pg_notify('outroute_wake', {src}); END IF; \
         RETURN NULL; END $outroute$",
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
pub(super) fn queue_setup(
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
    pub(super) fn new(t: &TableConfig, lanes: u32, id_type: &str) -> Self {
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
    pub(super) fn row_columns(&self, tid: &str) -> String {
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
    pub(super) fn id_key(&self) -> String {
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
    pub(super) fn is_one_of(&self, keys: &str) -> String {
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
    pub(super) fn column_type(&self, c: &str) -> &str {
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
    pub(super) fn ids_param(&self, n: usize) -> String {
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
    pub(super) fn state_filter(&self, ordering: Ordering) -> String {
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
    pub(super) fn no_state(&self) -> &'static str {
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
    pub(super) fn held_routes(&self) -> String {
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
    pub(super) fn claim_extras(&self, ordering: Ordering) -> String {
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
    pub(super) fn next_pending(&self, ordering: Ordering, rows: &str) -> String {
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
    pub(super) fn claim_by_lane(&self, ordering: Ordering, skips: bool) -> String {
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
    pub(super) fn segments(&self, skips: bool) -> String {
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
    pub(super) fn skip_holds(&self) -> String {
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
    pub(super) fn skip_fingerprint(&self, lo: &str, hi: &str, lane: &str) -> String {
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
    pub(super) fn claim_by_queue(&self, ordering: Ordering, skips: bool) -> String {
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
    pub(super) fn floor_round(&self, ordering: Ordering) -> Option<String> {
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
    pub(super) fn floor_round_queue(&self, ordering: Ordering) -> Option<String> {
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
    pub(super) fn round_state_filter(&self, ordering: Ordering) -> String {
        self.state_filter(ordering)
            .replace("$4::text[]", "$8::text[]")
    }

    /// A floor round whose per-lane walk is `walk(">=")` (the first
    /// pending at or above the floor) and `walk("<")` (below it), and, for
    /// a lane with a holder, whose skip walk is `skip_walk(true)` (the
    /// rows after `h.walk_from`, with `ok`: a claim could take it) and
    /// `skip_walk(false)` (the same rows' sequence numbers only).
    pub(super) fn floor_round_with(
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
    pub(super) fn claim_by_scan(&self, ordering: Ordering) -> String {
        self.next_pending(ordering, &format!("{} = ANY($2)", self.lane))
    }
}
