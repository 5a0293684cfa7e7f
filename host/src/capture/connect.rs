//! Connecting to the slot: the replication connection's settings (host,
//! user, password, and TLS as the source's query pool resolved it) and
//! starting the stream at the confirmed position, ending a frozen earlier
//! session that PostgreSQL still holds the slot for.

use super::*;

/// The replication connection of `sc`: the URL's host, port, user and
/// database, the source's password. Timestamps come in ISO, UTC.
pub fn replication_config(
    key: &str,
    sc: &StoreConfig,
    l: &Logical,
    relay_id: &str,
) -> Result<ReplicationConfig> {
    let url = url::Url::parse(&sc.url).map_err(|e| anyhow!("{key}.url: {e}"))?;
    let decode = |s: &str| {
        url::form_urlencoded::parse(format!("x={s}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default()
    };
    let host = url
        .host_str()
        .map(|h| h.trim_matches(['[', ']']).to_string())
        .unwrap_or_else(|| "localhost".into());
    let user = match url.username() {
        "" => std::env::var("USER").unwrap_or_else(|_| "postgres".into()),
        u => decode(u),
    };
    let password = match (&sc.password, url.password()) {
        (Some(p), _) => p.expose().to_string(),
        (None, Some(p)) => decode(p),
        (None, None) => String::new(),
    };
    let database = url.path().trim_start_matches('/').to_string();
    let database = if database.is_empty() {
        user.clone()
    } else {
        decode(&database)
    };
    let tls = replication_tls(key, sc, &url, &host)?;
    Ok(ReplicationConfig::new(
        host,
        user,
        password,
        database,
        l.slot.clone(),
        l.publication.clone(),
    )
    .with_port(url.port().unwrap_or(5432))
    .with_options("-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601")
    .with_application_name(format!("outroute {relay_id}"))
    .with_status_interval(Duration::from_millis(100))
    .with_wakeup_interval(Duration::from_secs(1))
    .with_buffer_size(READ_AHEAD)
    .with_tls(tls))
}

/// TLS of the replication connection, as the source's queries have it:
/// the mode the query pool resolved (`[store.tls]`, the URL's `sslmode` or
/// its aliases, `PGSSLMODE`; unset is `prefer`: TLS when the server offers
/// it), and the files from `[store.tls]`, else the URL (`sslrootcert`,
/// `sslcert`, `sslkey` or sqlx's aliases), else `PGSSLROOTCERT`,
/// `PGSSLCERT`, `PGSSLKEY`.
pub(super) fn replication_tls(
    key: &str,
    sc: &StoreConfig,
    url: &url::Url,
    host: &str,
) -> Result<TlsConfig> {
    use sqlx::postgres::PgSslMode;
    let file = |names: &[&str], env: &str| {
        names
            .iter()
            .find_map(|n| {
                url.query_pairs()
                    .find(|(k, _)| k == n)
                    .map(|(_, v)| v.into_owned())
            })
            .or_else(|| std::env::var(env).ok())
            .map(std::path::PathBuf::from)
    };
    let mode = match crate::store::postgres::connect_options(key, sc)?.get_ssl_mode() {
        PgSslMode::Disable => SslMode::Disable,
        PgSslMode::Allow | PgSslMode::Prefer => SslMode::Prefer,
        PgSslMode::Require => SslMode::Require,
        PgSslMode::VerifyCa => SslMode::VerifyCa,
        PgSslMode::VerifyFull => SslMode::VerifyFull,
    };
    let t = sc.tls.as_ref();
    let ca = t
        .and_then(|t| t.ca_file.clone())
        .or_else(|| file(&["sslrootcert", "ssl-root-cert", "ssl-ca"], "PGSSLROOTCERT"));
    let (cert, client_key) = match t.and_then(|t| t.cert_file.clone().zip(t.key_file.clone())) {
        Some((c, k)) => (Some(c), Some(k)),
        None => (
            file(&["sslcert", "ssl-cert"], "PGSSLCERT"),
            file(&["sslkey", "ssl-key"], "PGSSLKEY"),
        ),
    };
    if cert.is_some() != client_key.is_some() {
        bail!("{key}: a client certificate needs both the certificate and its key");
    }
    Ok(TlsConfig {
        mode,
        ca_pem_path: ca,
        // An IP host is verified against the certificate's IP addresses
        // (as libpq does); the crate wants it named to allow that.
        sni_hostname: host
            .parse::<std::net::IpAddr>()
            .is_ok()
            .then(|| host.to_string()),
        client_cert_pem_path: cert,
        client_key_pem_path: client_key,
    })
}

impl Relay {
    /// Connect to the slot, ending a previous owner's session that still
    /// holds it (this relay has the lease, so that owner is fenced).
    pub(super) async fn connect_slot(
        &self,
        pg: &PgStore,
        l: &Logical,
    ) -> Result<ReplicationClient> {
        let cfg = replication_config(&self.store_key, &self.store_config, l, &self.relay_id)?;
        let mut last = None;
        for attempt in 0..20 {
            let mut client = ReplicationClient::connect(cfg.clone()).await.map_err(|e| {
                anyhow!(
                    "{}.logical.slot `{}`: connecting: {e}",
                    self.store_key,
                    l.slot
                )
            })?;
            match client.wait_started().await {
                Ok(()) => return Ok(client),
                Err(e) => {
                    let text = e.to_string();
                    if text.contains("is active for PID") || text.contains("55006") {
                        if attempt == 0 || attempt % 5 == 4 {
                            tracing::info!(slot = %l.slot, "the slot is still held by a previous owner's session: ending it");
                        }
                        let _ = pg
                            .bounded("taking over the slot", pg.take_over_slot())
                            .await;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        last = Some(text);
                        continue;
                    }
                    return Err(anyhow!(
                        "{}.logical.slot `{}`: starting replication: {text}",
                        self.store_key,
                        l.slot
                    ));
                }
            }
        }
        Err(anyhow!(
            "{}.logical.slot `{}`: still held by another session: {}",
            self.store_key,
            l.slot,
            last.unwrap_or_default()
        ))
    }
}
