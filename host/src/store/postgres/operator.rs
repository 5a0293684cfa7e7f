//! What operators and the background tasks read and change beside the
//! event path: `status`, route quarantine records,
//! `failed list/retry/edit/discard`, `replay`'s pages and retention.

use super::*;

impl PgStore {
    /// Failed events now (not discarded), per route (`-`: none took it).
    pub async fn failed_by_route(&self) -> Result<Vec<(String, i64)>> {
        Ok(sqlx::query_as(
            "SELECT COALESCE(route, '-'), count(*) FROM outroute_event_state \
             WHERE source = $1 AND failed_at IS NOT NULL AND discarded_at IS NULL GROUP BY 1 ORDER BY 1",
        )
        .bind(&self.source)
        .fetch_all(&self.pool)
        .await?)
    }

    /// When each of `ids` first failed (those never failed are left out).
    pub async fn first_errors(&self, ids: &[String]) -> Result<Vec<(String, DateTime<Utc>)>> {
        Ok(sqlx::query_as(
            "SELECT event_id, first_error_at FROM outroute_event_state WHERE source = $1 AND event_id = ANY($2)",
        )
        .bind(&self.source)
        .bind(ids)
        .fetch_all(&self.pool)
        .await?)
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
        let relay_connections = Some(self.relay_connections().await?);
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
            relay_connections,
            slot: None,
            binlog: None,
        })
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
        self.quarantined_routes_on(&self.pool).await
    }

    /// [`PgStore::quarantined_routes`] on `conn` (a sleeping source's
    /// LISTEN connection, or the pool).
    pub async fn quarantined_routes_on<'c>(
        &self,
        conn: impl sqlx::PgExecutor<'c>,
    ) -> Result<Vec<QuarantinedRoute>> {
        let rows: Vec<(String, DateTime<Utc>, Option<String>)> = sqlx::query_as(
            "SELECT route, quarantined_since, quarantine_reason FROM outroute_route_counts \
             WHERE source = $1 AND quarantined_since IS NOT NULL ORDER BY route",
        )
        .bind(&self.source)
        .fetch_all(conn)
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
    pub(super) fn failed_where(f: &Filter) -> String {
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

    pub(super) fn bind_failed<'q>(
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
        // A relay sleeping on this source (`postgres/wake.rs`) hears of
        // the events put back at this commit.
        sqlx::query("SELECT pg_notify('outroute_wake', $1)")
            .bind(&self.source)
            .execute(&mut *tx)
            .await?;
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
        let discarded = self
            .bind_failed(sqlx::query(&q), f)
            .execute(&self.pool)
            .await?
            .rows_affected();
        if discarded > 0 {
            // The aggregates they held are released: a sleeping relay
            // (`postgres/wake.rs`) claims their later events now.
            self.notify_wake().await?;
        }
        Ok(discarded)
    }

    pub(super) fn published_where(&self, s: &TableSql) -> String {
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

    pub async fn purge_published(
        &self,
        older_than: Duration,
        batch: i64,
    ) -> Result<crate::store::Purged> {
        let s = self.sql()?;
        let age = match &s.cfg.marking {
            Marking::PublishedAt { column } => format!("o.{}", quote(column)),
            Marking::Status { .. } => format!("o.{}::timestamptz", quote(&s.cfg.created_at)),
            Marking::Delete => return Ok(crate::store::Purged::default()),
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
            return Ok(crate::store::Purged::default());
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
                crate::store::Purged {
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
                crate::store::Purged {
                    deleted,
                    more: deleted >= batch as u64,
                }
            }
        };
        tx.commit().await?;
        Ok(purged)
    }

    /// The row of event `id` as the table holds it now, and whether it
    /// is marked published (`None`: no such row — gone, or never there).
    pub async fn event_row(&self, id: &str) -> Result<Option<(Claim, bool)>> {
        let s = self.sql()?;
        let q = format!(
            "SELECT {cols}, ({published}) AS is_published FROM {table} o WHERE {id}::text = $1 LIMIT 1",
            cols = s.row_columns("NULL::text"),
            published = s.published,
            table = s.table,
            id = s.id,
        );
        let row = sqlx::query(&q).bind(id).fetch_optional(&self.pool).await?;
        row.map(|r| Ok((to_claim(&r, s.payload_is_json)?, r.try_get("is_published")?)))
            .transpose()
    }

    /// Append one console action to the audit log.
    pub async fn audit(&self, a: &AuditEntry) -> Result<()> {
        sqlx::query(
            "INSERT INTO outroute_audit (at, source, who, action, subject, outcome) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(a.at)
        .bind(&a.source)
        .bind(&a.who)
        .bind(&a.action)
        .bind(&a.subject)
        .bind(&a.outcome)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Source `source`'s latest `limit` audit entries, newest first.
    pub async fn audit_recent(&self, source: &str, limit: i64) -> Result<Vec<AuditEntry>> {
        let rows: Vec<(DateTime<Utc>, String, String, String, String, String)> = sqlx::query_as(
            "SELECT at, source, who, action, subject, outcome FROM outroute_audit \
             WHERE source = $1 ORDER BY at DESC, id DESC LIMIT $2",
        )
        .bind(source)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(AuditEntry::from_row).collect())
    }
}
