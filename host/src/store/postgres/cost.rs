//! What a claim, a mark or an orphan sweep costs the database, read from
//! `EXPLAIN (ANALYZE)`: for the tests and the benchmark that hold those costs
//! to the batch, and for the start-up check of the lane index's plan.

use super::*;

impl PgStore {
    /// `EXPLAIN ({opts}FORMAT JSON)` of a claim statement (`opts`: "", "ANALYZE, ", …).
    pub(super) async fn explain(
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
    pub(super) async fn explain_claim(
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
}

/// Every plan node that reads the relation aliased `alias`.
pub(super) fn nodes_of<'p>(
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
pub(super) fn scans_of(plan: &serde_json::Value, alias: &str) -> Vec<(String, f64)> {
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
