//! The backlog gauge: how many events wait and how old the oldest is,
//! counted with work bounded by the number of lanes (never by the backlog),
//! on the pool or on a sleeping source's LISTEN connection.

use super::*;

impl PgStore {
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
        let mut conn = self.pool.acquire().await?;
        self.backlog_on(&mut *conn).await
    }

    /// [`PgStore::backlog`] of a lease-mode source on `conn` (a sleeping
    /// source's LISTEN connection, or one from the pool).
    pub async fn backlog_on<C>(&self, conn: &mut C) -> Result<(i64, Option<f64>)>
    where
        for<'e> &'e mut C: sqlx::PgExecutor<'e>,
    {
        let s = self.sql()?;
        if let Marking::Queue { .. } = &s.cfg.marking {
            return self.queue_backlog(s, conn).await;
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
            .fetch_one(&mut *conn)
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
            let last: Option<i64> = sqlx::query_scalar(&q).fetch_one(&mut *conn).await?;
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
    async fn queue_backlog<C>(&self, s: &TableSql, conn: &mut C) -> Result<(i64, Option<f64>)>
    where
        for<'e> &'e mut C: sqlx::PgExecutor<'e>,
    {
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
            .fetch_one(&mut *conn)
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
}
