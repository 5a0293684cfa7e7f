//! The parked queue: events that could not go on when the stream brought
//! them (retrying, failed under `block`, deferred, or behind one of those in
//! their aggregate), kept in `outroute_event_state` with the event itself.
//! Per aggregate the queue is ordered by (commit LSN, sequence); only its
//! head is ever retried, and the aggregate is released once it is empty.

use super::*;

/// The parked events that still hold their aggregate: waiting, retrying,
/// or failed under the `block` policy (not discarded, not failed under `skip`).
pub(super) const HOLDING: &str = "source = $1 AND event IS NOT NULL AND discarded_at IS NULL \
     AND NOT (failed_at IS NOT NULL AND blocks_until < 'infinity')";

impl PgStore {
    /// The aggregates with parked events, each with the routes they wait
    /// for (`*`: every route): the stream's later events of the aggregate
    /// wait behind them on those routes, and go on the others.
    pub async fn held_aggregates(&self) -> Result<HeldAggregates> {
        let rows: Vec<(String, String, Vec<String>)> = sqlx::query_as(&format!(
            "SELECT aggregate_type, aggregate_id, array_agg(DISTINCT r) FROM outroute_event_state \
               CROSS JOIN LATERAL unnest(coalesce(waiting_routes, '{{*}}'::text[])) r \
             WHERE {HOLDING} GROUP BY aggregate_type, aggregate_id"
        ))
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|(t, i, r)| ((t, i), r)).collect())
    }

    /// The parked events whose turn came: for each aggregate whose queue
    /// head is due (not failed, retry time reached), the head and the due
    /// events right behind it, in (commit LSN, sequence) order; at most
    /// `limit` in all, oldest heads first, and no more than the one that
    /// reaches `relay.max_batch_bytes`. A long queue drains at batch
    /// speed; the pipeline keeps the order within the batch.
    pub async fn parked_heads(
        &self,
        aggregates: &HeldAggregates,
        limit: u32,
    ) -> Result<Vec<Claim>> {
        let (types, ids): (Vec<&str>, Vec<&str>) = aggregates
            .keys()
            .map(|(t, i)| (t.as_str(), i.as_str()))
            .unzip();
        let q = format!(
            "WITH heads AS ( \
               SELECT DISTINCT ON (aggregate_type, aggregate_id) aggregate_type, aggregate_id, commit_lsn, seq, \
                 failed_at, next_attempt_at \
               FROM outroute_event_state WHERE {HOLDING} \
                 AND (aggregate_type, aggregate_id) IN (SELECT * FROM unnest($3::text[], $4::text[])) \
               ORDER BY aggregate_type, aggregate_id, commit_lsn, seq), \
             due AS (SELECT * FROM heads WHERE failed_at IS NULL AND next_attempt_at <= now() \
               ORDER BY commit_lsn, seq LIMIT $2) \
             SELECT q.event_id, q.event::text, q.commit_lsn, q.attempts, q.done_legs, q.ready, \
               d.aggregate_type, d.aggregate_id, q.seq \
             FROM due d CROSS JOIN LATERAL ( \
               SELECT s.event_id, s.event, s.commit_lsn, s.seq, s.attempts, s.done_legs, \
                 (s.failed_at IS NULL AND s.next_attempt_at <= now()) AS ready \
               FROM outroute_event_state s WHERE s.source = $1 AND s.event IS NOT NULL AND s.discarded_at IS NULL \
                 AND NOT (s.failed_at IS NOT NULL AND s.blocks_until < 'infinity') \
                 AND s.aggregate_type = d.aggregate_type AND s.aggregate_id = d.aggregate_id \
               ORDER BY s.commit_lsn, s.seq LIMIT $2) q \
             ORDER BY d.commit_lsn, d.seq, d.aggregate_type, d.aggregate_id, q.commit_lsn, q.seq"
        );
        let mut rows = sqlx::query(&q)
            .bind(&self.source)
            .bind(limit as i64)
            .bind(&types)
            .bind(&ids)
            .fetch(&self.pool);
        let mut claims = Vec::new();
        let mut bytes = 0u64;
        // Per aggregate, the due prefix of its queue.
        let mut stopped: HashSet<(String, String)> = HashSet::new();
        while let Some(r) = rows.try_next().await.context("reading parked events")? {
            if claims.len() >= limit as usize || bytes >= self.max_batch_bytes {
                break;
            }
            let aggregate: (String, String) = (r.try_get(6)?, r.try_get(7)?);
            let ready: bool = r.try_get(5)?;
            if stopped.contains(&aggregate) {
                continue;
            }
            if !ready {
                stopped.insert(aggregate);
                continue;
            }
            let id: String = r.try_get(0)?;
            let text: String = r.try_get(1)?;
            let commit_lsn: Option<i64> = r.try_get(2)?;
            let attempts: i32 = r.try_get(3)?;
            let done_legs: Vec<String> = r.try_get(4)?;
            // A record that cannot be read fails that event alone, with
            // the reason (its aggregate waits, as for any failed event).
            let row = match serde_json::from_str::<ParkedEvent>(&text) {
                Ok(parked) => parked.into_row(id, attempts.max(0) as u32),
                Err(e) => Err(crate::event::Malformed {
                    id,
                    sequence: r.try_get(8)?,
                    aggregate_type: aggregate.0,
                    aggregate_id: aggregate.1,
                    event_type: String::new(),
                    reason: format!("its parked record cannot be read: {e}"),
                    raw: None,
                }),
            };
            let claim = Claim {
                lane: CAPTURE_LANE,
                tid: None,
                has_state: true,
                held: Vec::new(),
                done_legs,
                epoch: None,
                captured: Some(Captured {
                    commit_lsn: commit_lsn.unwrap_or(0),
                    parked: true,
                    committed_at: None,
                }),
                route: None,
                row,
            };
            bytes += claim.bytes();
            claims.push(claim);
        }
        Ok(claims)
    }

    /// Parked events published: their state rows go, fenced by the capture
    /// lease epoch they were read under.
    pub async fn unpark(&self, claims: &[&Claim]) -> Result<u64> {
        let ids: Vec<&str> = claims.iter().map(|c| c.id()).collect();
        let Some(epoch) = claims.iter().find_map(|c| c.epoch) else {
            return Ok(0);
        };
        let n = sqlx::query(
            "DELETE FROM outroute_event_state WHERE source = $1 AND event_id = ANY($2) \
               AND EXISTS (SELECT 1 FROM outroute_lanes WHERE source = $1 AND lane = $3 AND owner = $4 \
                           AND epoch = $5 AND lease_until > now())",
        )
        .bind(&self.source)
        .bind(&ids)
        .bind(CAPTURE_LANE)
        .bind(&self.relay_id)
        .bind(epoch)
        .execute(&self.pool)
        .await
        .context("removing published parked events")?
        .rows_affected();
        Ok(n)
    }

    /// Backlog of a logical source: parked events not failed, and the age
    /// of the oldest (the stream's own backlog is the slot lag).
    pub(crate) async fn parked_backlog(&self) -> Result<(i64, Option<f64>)> {
        let (n, oldest): (i64, Option<f64>) = sqlx::query_as(&format!(
            "SELECT count(*), extract(epoch from now() - min((event->>'created_at')::timestamptz))::float8 \
             FROM outroute_event_state WHERE {HOLDING} AND failed_at IS NULL"
        ))
        .bind(&self.source)
        .fetch_one(&self.pool)
        .await?;
        Ok((n, oldest))
    }
}
