//! One table mapping's SQL on MySQL/MariaDB, generated once at start-up:
//! the canonical `outbox` table and an existing table mapped onto it (the
//! seed articles' Spring `t_outbox`: varchar id, TEXT payload, status
//! `PENDING`/`SENT`, `create_time`) alike. The claim, the mark and the
//! operator commands read their columns, predicates and order from here
//! and never name a column themselves.
//!
//! ## What a mapped table must have
//! * An id that is `NOT NULL` and unique on its own (a `PRIMARY KEY` or a
//!   `UNIQUE` index on that column alone): marks address rows by it, so a
//!   duplicate would mark another event published. `check` refuses a table
//!   without one, naming the fix.
//! * An order: the `sequence` column, or `created_at` with the id breaking
//!   ties. A `DATETIME` filled by `NOW()` has whole seconds, so events of
//!   one aggregate written in the same second have no order but their ids'
//!   (see the MySQL guide: `migrate --table --add-sequence`).
//!
//! ## Values from config
//! Table and column names pass `check_identifier` and are quoted with
//! backticks; constants (status values, `aggregate_type_value`) are SQL
//! literals, refused by validation if they hold a quote or a backslash
//! (`sql_mode` decides what a backslash means, so none is let through).

use crate::config::{Marking, TableConfig};

use super::PENDING;

/// A config name as a quoted identifier (`a.b` → `` `a`.`b` ``).
pub(super) fn quote(name: &str) -> String {
    name.split('.')
        .map(|p| format!("`{p}`"))
        .collect::<Vec<_>>()
        .join(".")
}

/// A constant from config as a SQL string literal. Validation refuses
/// values with a quote or backslash; any left are dropped here all the
/// same, so nothing from config can end a literal.
pub(super) fn literal(v: &str) -> String {
    let clean: String = v.chars().filter(|c| !matches!(c, '\'' | '\\')).collect();
    format!("'{clean}'")
}

/// How marks and failure records address a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowKey {
    /// The canonical table's `seq`, its primary key.
    Seq,
    /// The mapped id column (checked unique and NOT NULL at start-up).
    Id,
}

/// The SQL of one table mapping (see the module header). Expressions are
/// over the alias `o` unless named `_bare`.
#[derive(Debug, Clone)]
pub(super) struct TableSql {
    pub cfg: TableConfig,
    /// The canonical table (`outroute migrate` created it): pending rows
    /// have the `published_at` sentinel, rows are addressed by `seq`.
    pub canonical: bool,
    /// The table's name, quoted.
    pub table: String,
    /// The table's schema (`DATABASE()` when unqualified) and bare name,
    /// as the catalog (`information_schema`) has them.
    pub schema: Option<String>,
    pub bare_name: String,
    /// The columns a claim and a replay page read, with the names
    /// `to_claim` expects. Short text is read through `CAST(… AS CHAR)`
    /// (a binary collation makes the driver see bytes); payload and headers
    /// as the bytes they are, checked as UTF-8 by the relay.
    pub cols: String,
    /// The order key as a number: the sequence, or `created_at` in µs.
    pub seq: String,
    /// Rows are ordered by a sequence column alone (else by `created_at`
    /// and the id).
    pub by_seq: bool,
    pub order: String,
    /// Every aggregate's lane, over `o` and over the bare columns (the
    /// virtual column's definition: the two must agree).
    pub lane: String,
    pub lane_bare: String,
    /// The row is not published yet (what a mark requires).
    pub unpublished: String,
    /// Pending: not published and not failed (what a claim walks).
    pub pending: String,
    /// Published (replay and retention); `None` under `delete`.
    pub published: Option<String>,
    /// `published` over the bare columns (a single-table `DELETE`).
    pub published_bare: Option<String>,
    /// The id, and the id and aggregate as `utf8mb4_bin` text: compared
    /// with outroute's own tables byte for byte (and through their
    /// indexes) whatever the mapped table's collation.
    pub id: String,
    pub id_bin: String,
    pub aggregate_type_bin: String,
    /// The aggregate type as text to read (a `_bin` collation would make
    /// the driver see bytes).
    pub aggregate_type_text: String,
    pub aggregate_id_bin: String,
    pub event_type_bin: String,
    pub created_at: String,
    pub key: RowKey,
    /// The lane index's columns after the lane column: the pending
    /// predicate's columns, then the order.
    pub index_tail: String,
}

impl TableSql {
    pub fn new(cfg: &TableConfig, lanes: u32) -> Self {
        let canonical = *cfg == TableConfig::canonical();
        let col = |c: &str| format!("o.{}", quote(c));
        let (schema, bare_name) = match cfg.name.split_once('.') {
            Some((s, n)) => (Some(s.to_string()), n.to_string()),
            None => (None, cfg.name.clone()),
        };
        let text = |c: &str| format!("CAST({} AS CHAR)", col(c));
        let bin =
            |e: String| format!("(CAST({e} AS CHAR CHARACTER SET utf8mb4) COLLATE utf8mb4_bin)");
        let (aggregate_type, aggregate_type_bare) =
            match (&cfg.aggregate_type, &cfg.aggregate_type_value) {
                (Some(c), _) => (col(c), quote(c)),
                (None, Some(v)) => (literal(v), literal(v)),
                (None, None) => ("''".to_string(), "''".to_string()),
            };
        let lane_of = |t: &str, a: &str| {
            format!("(CRC32(CONCAT(COALESCE({t}, ''), ':', COALESCE({a}, ''))) % {lanes})")
        };
        let seq = match &cfg.sequence {
            Some(s) if canonical => col(s),
            // Whatever integer type the producers chose (an unsigned
            // AUTO_INCREMENT too) reads as a signed 64-bit number.
            Some(s) => format!("CAST({} AS SIGNED)", col(s)),
            None => format!(
                "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {})",
                col(&cfg.created_at)
            ),
        };
        let order = match &cfg.sequence {
            Some(s) => col(s),
            None => format!("{}, {}", col(&cfg.created_at), col(&cfg.id)),
        };
        let (unpublished, published, mut index_tail) = marking(cfg, canonical, &col);
        let published_bare = marking(cfg, canonical, &quote).1;
        let mut pending = unpublished.clone();
        if let Some(f) = &cfg.failed_at {
            pending = format!("{pending} AND {} IS NULL", col(f));
            index_tail.push(quote(f));
        }
        match &cfg.sequence {
            Some(s) => index_tail.push(quote(s)),
            None => {
                index_tail.push(quote(&cfg.created_at));
                index_tail.push(quote(&cfg.id));
            }
        }
        let event_version = cfg
            .event_version
            .as_deref()
            .map_or("NULL".to_string(), text);
        let headers = cfg.headers.as_deref().map_or("NULL".to_string(), col);
        let cols = format!(
            "{seq} AS seq, {id} AS id, CAST({aggregate_type} AS CHAR) AS aggregate_type, \
             {aggregate_id} AS aggregate_id, {event_type} AS event_type, {event_version} AS event_version, \
             {payload} AS payload, {headers} AS headers, {created_at} AS created_at",
            id = text(&cfg.id),
            aggregate_id = text(&cfg.aggregate_id),
            event_type = text(&cfg.event_type),
            payload = col(&cfg.payload),
            created_at = col(&cfg.created_at),
        );
        TableSql {
            canonical,
            table: quote(&cfg.name),
            schema,
            bare_name,
            cols,
            seq,
            by_seq: cfg.sequence.is_some(),
            order,
            lane: lane_of(&aggregate_type, &col(&cfg.aggregate_id)),
            lane_bare: lane_of(&aggregate_type_bare, &quote(&cfg.aggregate_id)),
            unpublished,
            pending,
            published,
            published_bare,
            id: col(&cfg.id),
            id_bin: bin(col(&cfg.id)),
            aggregate_type_text: format!("CAST({aggregate_type} AS CHAR)"),
            aggregate_type_bin: bin(aggregate_type),
            aggregate_id_bin: bin(col(&cfg.aggregate_id)),
            event_type_bin: bin(col(&cfg.event_type)),
            created_at: col(&cfg.created_at),
            key: if canonical { RowKey::Seq } else { RowKey::Id },
            index_tail: index_tail.join(", "),
            cfg: cfg.clone(),
        }
    }

    /// The row-key column over `o` (see [`RowKey`]).
    pub fn key_col(&self) -> String {
        match self.key {
            RowKey::Seq => "o.`seq`".into(),
            RowKey::Id => self.id.clone(),
        }
    }

    /// An event of the same aggregate (state row `b`) that may come
    /// before the row `o`: by sequence; by `created_at`, where an event of
    /// the same instant counts as earlier (the id's order under the
    /// column's collation is not known here: holding a tie back waits,
    /// publishing it could reorder).
    pub fn before(&self) -> String {
        if self.by_seq {
            format!("b.seq < {}", self.seq)
        } else {
            format!(
                "b.seq <= {s} AND b.event_id <> {id}",
                s = self.seq,
                id = self.id_bin
            )
        }
    }

    /// The sequence column over `o`, as the lane index holds it (`None`:
    /// the table is ordered by `created_at`).
    pub fn seq_column(&self) -> Option<String> {
        self.cfg
            .sequence
            .as_deref()
            .map(|s| format!("o.{}", quote(s)))
    }

    /// After the last row a lane walk returned (continuing the walk):
    /// parameters seq, or created_at, created_at, id.
    pub fn after(&self) -> String {
        match &self.cfg.sequence {
            Some(s) => format!("o.{} > ?", quote(s)),
            None => format!(
                "({c} > ? OR ({c} = ? AND {id} > ?))",
                c = self.created_at,
                id = self.id
            ),
        }
    }
}

/// The marking's "not published" and "published" predicates (columns as
/// `col` writes them) and its columns in the lane index.
fn marking(
    cfg: &TableConfig,
    canonical: bool,
    col: &dyn Fn(&str) -> String,
) -> (String, Option<String>, Vec<String>) {
    match (&cfg.marking, canonical) {
        (Marking::PublishedAt { column }, true) => (
            format!("{} = {PENDING}", col(column)),
            Some(format!("{} > {PENDING}", col(column))),
            vec![quote(column)],
        ),
        (Marking::PublishedAt { column }, false) => (
            format!("{} IS NULL", col(column)),
            Some(format!("{} IS NOT NULL", col(column))),
            vec![quote(column)],
        ),
        (
            Marking::Status {
                column,
                pending,
                sent,
                ..
            },
            _,
        ) => (
            format!("{} = {}", col(column), literal(pending)),
            Some(format!("{} = {}", col(column), literal(sent))),
            vec![quote(column)],
        ),
        // `queue` is refused by validation (it needs triggers); `delete`
        // leaves nothing published behind: every row is pending.
        (Marking::Delete | Marking::Queue { .. }, _) => ("TRUE".into(), None, Vec::new()),
    }
}
