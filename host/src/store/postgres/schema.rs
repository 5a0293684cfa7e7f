//! The outbox table's schema, as the relay needs it: migrations, the checks
//! made at start (columns, keys, the queue trigger, whether claim floors are
//! safe), the lane index and its plan, `migrate --table` and
//! `--add-sequence`. Never claims or marks.

use super::cost::nodes_of;
use super::*;

impl PgStore {
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
                             per event (guide: \"Table shapes and payload types\")"
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
                self.wakes = body.as_deref().is_some_and(|b| b.contains("outroute_wake"));
                if !self.wakes {
                    tracing::info!(
                        table = %t.name,
                        "the pending queue's trigger on `{}` was set up by an older outroute: an idle source \
                         keeps polling instead of sleeping until its next insert. Run `outroute migrate` \
                         (or `migrate --table`) to bring the trigger up to date",
                        t.name
                    );
                }
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
    pub(super) fn qualified(&self, name: &str) -> String {
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
    pub(super) async fn enqueue_trigger(&self) -> Result<Option<bool>> {
        self.named_trigger("outroute_enqueue").await
    }

    /// Trigger `name` on the table: enabled, disabled, or absent (`None`).
    pub(super) async fn named_trigger(&self, name: &str) -> Result<Option<bool>> {
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
    pub(super) async fn ensure_lane_rows(&self) -> Result<()> {
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
    pub(super) async fn floors_unsafe(&self, column: &str) -> Result<Option<&'static str>> {
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
    pub(super) async fn unique_column(&self, column: &str) -> Result<bool> {
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
    pub(super) async fn lane_index_usable(&self, sql: &TableSql) -> Result<bool> {
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
}
