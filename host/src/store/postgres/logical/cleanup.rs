//! Cleanup: captured rows that were handled (published or parked) are
//! deleted by their sequence numbers (or ids, when the sequence has no
//! unique index of its own), at most [`CLEANUP_CHUNK`] per statement, before
//! the slot is confirmed past them. A row not yet handled is never deleted.

use super::*;

/// Most captured rows one cleanup statement deletes (at ~10 µs an index
/// probe, well within any `statement_timeout`).
pub const CLEANUP_CHUNK: usize = 5_000;

/// The table rows of handled captured events, for the cleanup: their
/// sequence numbers, and their ids when the sequence column is not known
/// to be unique ([`PgStore::deletes_by_id`]).
#[derive(Debug, Default)]
pub struct CapturedRows {
    pub seqs: Vec<i64>,
    pub ids: Vec<String>,
}

impl CapturedRows {
    /// Add one handled event's row.
    pub fn push(&mut self, seq: i64, id: Option<&str>) {
        self.seqs.push(seq);
        // (An empty id — a malformed row's NULL — names no row, and would
        // fail the whole statement's cast to the id column's type.)
        if let Some(id) = id.filter(|id| !id.is_empty()) {
            self.ids.push(id.to_string());
        }
    }

    pub fn append(&mut self, mut other: CapturedRows) {
        self.seqs.append(&mut other.seqs);
        self.ids.append(&mut other.ids);
    }

    /// (Every id comes with its row's sequence number.)
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}
impl PgStore {
    /// Delete the rows of handled captured events, a statement per
    /// [`CLEANUP_CHUNK`] rows, each under `store.statement_timeout`: by
    /// their sequence numbers (one index probe each, exactly the rows
    /// handled), or by id when the sequence column is not unique (a number
    /// would also take an unread or lease-mode failed row sharing it).
    ///
    /// (It used to delete runs of consecutive numbers, a statement per run:
    /// with producers committing concurrently runs are a few rows long, and
    /// the round trips cost the relay 15 % of its CPU in a drain. And it
    /// used to be one statement, however many rows: one producer transaction
    /// of a million rows then never finished within the timeout, and the
    /// stream re-published that transaction over and over.)
    pub async fn delete_captured(&self, rows: &CapturedRows) -> Result<u64> {
        let mut deleted = 0;
        if self.seq_unique {
            for seqs in rows.seqs.chunks(CLEANUP_CHUNK) {
                deleted += self
                    .bounded("deleting captured rows", self.delete_chunk(seqs, &[]))
                    .await?;
            }
        } else {
            for ids in rows.ids.chunks(CLEANUP_CHUNK) {
                deleted += self
                    .bounded("deleting captured rows", self.delete_chunk(&[], ids))
                    .await?;
            }
        }
        Ok(deleted)
    }

    /// One statement of [`PgStore::delete_captured`]: `seqs` or `ids`.
    pub(super) async fn delete_chunk(&self, seqs: &[i64], ids: &[String]) -> Result<u64> {
        let Some(seq) = self.cleanup_column() else {
            return Ok(0);
        };
        if seqs.is_empty() && ids.is_empty() {
            return Ok(0);
        }
        let sql = if self.seq_unique {
            format!(
                "DELETE FROM {} WHERE {} = ANY($1::int8[])",
                quote(&self.cfg.name),
                quote(seq)
            )
        } else {
            let s = self.sql()?;
            format!(
                "DELETE FROM {} o WHERE {} = ANY({})",
                s.table,
                s.id,
                s.ids_param(1)
            )
        };
        let q = sqlx::query(&sql);
        let q = if self.seq_unique {
            q.bind(seqs)
        } else {
            q.bind(ids)
        };
        Ok(q.execute(&self.pool)
            .await
            .context("deleting captured rows")?
            .rows_affected())
    }

    /// Whether [`CapturedRows`] must carry ids: the sequence column is not
    /// known to be unique.
    pub fn deletes_by_id(&self) -> bool {
        !self.seq_unique && self.cleanup_column().is_some()
    }

    /// The sequence column, when captured rows are cleaned up at all
    /// (table input, `cleanup = "delete"`, a sequence column mapped).
    pub(super) fn cleanup_column(&self) -> Option<&str> {
        let l = self.logical.as_ref()?;
        (l.cleanup == Cleanup::Delete && l.input == LogicalInput::Table)
            .then_some(self.cfg.sequence.as_deref())
            .flatten()
    }
}
