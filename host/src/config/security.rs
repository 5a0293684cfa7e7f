//! Secured connections: TLS and credentials for the store (PostgreSQL) and
//! the sinks (Kafka, NATS), and the secrets they need.
//!
//! A secret is given inline, by an `OUTROUTE_…` environment variable (which
//! overrides any key, e.g. `OUTROUTE_SINKS__EVENTS__SASL__PASSWORD`), or read
//! from the matching `*_file` key — the way container platforms mount
//! secrets. It is held as a [`Secret`]: its `Debug` and serialised forms are
//! `***`, so no log line, error message or `config` output shows it.
//!
//! [`resolve`] runs when the config loads: it makes every certificate and key
//! path absolute (relative paths are relative to the config file) and checks
//! it is readable, and reads every `*_file` secret — so a missing file, or a
//! secret given twice, refuses to start naming its key instead of failing at
//! the first connection.

use std::fmt;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{Config, SinkConfig};

/// A password, token or key seed. Shown as `***` everywhere.
#[derive(Clone, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The secret itself: only for handing to a client library.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("***")
    }
}

/// A secret is read as text whatever it looks like: an environment
/// variable `12345678` reaches serde as a number (figment parses it), and
/// refusing it would print it in the error. Only its kind is ever named.
impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl serde::de::Visitor<'_> for Text {
            type Value = Secret;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a secret (text)")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Secret, E> {
                Ok(Secret(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_i128<E: serde::de::Error>(self, v: i128) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_u128<E: serde::de::Error>(self, v: u128) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
        }
        d.deserialize_any(Text)
    }
}

/// TLS to a broker (Kafka, NATS). An empty table (`tls = {}`) means TLS
/// verified against the system's root certificates.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file of the certificate authorities that sign the server's
    /// certificate. Unset: the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for servers that require one (mutual TLS).
    /// Needs `key_file`.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file` (unencrypted).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Kafka only: accept any certificate, for any host name (a test
    /// cluster with self-signed certificates). The one way to turn those
    /// checks off (the librdkafka options that do it are refused): an
    /// explicit opt-in, warned about by `config check` and at every start.
    #[serde(default)]
    pub insecure_skip_verify: bool,
}

/// How strictly the store's connection uses TLS (PostgreSQL's `sslmode`).
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum PgTlsMode {
    /// Never TLS.
    Disable,
    /// TLS if the server offers it, without checking its certificate.
    Prefer,
    /// TLS always, without checking the certificate.
    Require,
    /// TLS, certificate signed by a trusted authority (`ca_file`).
    VerifyCa,
    /// TLS, trusted certificate issued for the host in `store.url`.
    #[default]
    VerifyFull,
}

/// TLS to PostgreSQL.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PgTlsConfig {
    /// `sslmode`; a `[store.tls]` table means `verify-full` unless set.
    #[serde(default)]
    pub mode: PgTlsMode,
    /// PEM file of the authorities that sign the server's certificate.
    /// Unset: the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate (for `cert` authentication). Needs `key_file`.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

/// SASL mechanisms librdkafka implements itself (GSSAPI/Kerberos is not built).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub enum SaslMechanism {
    #[serde(rename = "plain")]
    Plain,
    #[serde(rename = "scram-sha-256")]
    ScramSha256,
    #[serde(rename = "scram-sha-512")]
    ScramSha512,
}

impl SaslMechanism {
    /// librdkafka's `sasl.mechanism` value.
    pub fn librdkafka(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// SASL authentication to Kafka. Without `tls` the credentials cross the
/// network unencrypted (`sasl_plaintext`; PLAIN sends the password itself).
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KafkaSaslConfig {
    /// `plain`, `scram-sha-256` or `scram-sha-512`.
    pub mechanism: SaslMechanism,
    /// The SASL user name.
    pub username: String,
    /// The password (or `password_file`).
    #[serde(default)]
    pub password: Option<Secret>,
    /// File holding the password.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
}

/// How the NATS sink authenticates: exactly one of user + password, token,
/// NKey seed, or a `.creds` file (JWT + NKey, for operator-mode servers).
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NatsAuthConfig {
    /// User name (with `password`).
    #[serde(default)]
    pub user: Option<String>,
    /// The user's password (or `password_file`).
    #[serde(default)]
    pub password: Option<Secret>,
    /// File holding the password.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// An authorization token (or `token_file`).
    #[serde(default)]
    pub token: Option<Secret>,
    /// File holding the token.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// The user's NKey seed (`SU…`; or `nkey_seed_file`).
    #[serde(default)]
    pub nkey_seed: Option<Secret>,
    /// File holding the NKey seed.
    #[serde(default)]
    pub nkey_seed_file: Option<PathBuf>,
    /// A `.creds` file (user JWT and NKey seed, as `nsc` writes it).
    #[serde(default)]
    pub creds_file: Option<PathBuf>,
}

/// Make certificate paths absolute and readable, read `*_file` secrets.
/// Returns `(key, reason)` problems.
pub fn resolve(config: &mut Config, base: &Path) -> Vec<(String, String)> {
    let mut p = Vec::new();
    secret(
        &mut config.http.token,
        &config.http.token_file,
        "http.token",
        base,
        &mut p,
    );
    if let Some(console) = &mut config.http.console {
        for (name, t) in &mut console.tokens {
            let key = format!("http.console.tokens.{name}.token");
            secret(&mut t.token, &t.token_file, &key, base, &mut p);
        }
    }
    let shorthand = config.store_shorthand;
    for (name, s) in &mut config.sources {
        let key = if shorthand {
            "store".to_string()
        } else {
            format!("sources.{name}")
        };
        secret(
            &mut s.password,
            &s.password_file,
            &format!("{key}.password"),
            base,
            &mut p,
        );
        if let Some(t) = &mut s.tls {
            tls_files(
                [&mut t.ca_file, &mut t.cert_file, &mut t.key_file],
                &format!("{key}.tls"),
                base,
                &mut p,
            );
        }
    }
    for (name, sink) in &mut config.sinks {
        let tls = match sink {
            SinkConfig::Kafka(k) => {
                if let Some(sasl) = &mut k.sasl {
                    let key = format!("sinks.{name}.sasl.password");
                    secret(&mut sasl.password, &sasl.password_file, &key, base, &mut p);
                    if sasl.password.is_none() {
                        p.push((key, "SASL needs a password (or password_file)".into()));
                    }
                }
                &mut k.tls
            }
            SinkConfig::Nats(n) => {
                if let Some(a) = &mut n.auth {
                    let k = |f: &str| format!("sinks.{name}.auth.{f}");
                    secret(
                        &mut a.password,
                        &a.password_file,
                        &k("password"),
                        base,
                        &mut p,
                    );
                    secret(&mut a.token, &a.token_file, &k("token"), base, &mut p);
                    secret(
                        &mut a.nkey_seed,
                        &a.nkey_seed_file,
                        &k("nkey_seed"),
                        base,
                        &mut p,
                    );
                    file(&mut a.creds_file, &k("creds_file"), base, &mut p);
                    let ways = [
                        a.user.is_some() || a.password.is_some(),
                        a.token.is_some(),
                        a.nkey_seed.is_some(),
                        a.creds_file.is_some(),
                    ];
                    match ways.iter().filter(|w| **w).count() {
                        1 => {}
                        0 => p.push((
                            format!("sinks.{name}.auth"),
                            "set one of user + password, token, nkey_seed or creds_file".into(),
                        )),
                        _ => p.push((
                            format!("sinks.{name}.auth"),
                            "set only one of user + password, token, nkey_seed or creds_file"
                                .into(),
                        )),
                    }
                    if a.user.is_some() != a.password.is_some() {
                        p.push((
                            format!("sinks.{name}.auth"),
                            "user and password go together".into(),
                        ));
                    }
                    if let Some(seed) = &a.nkey_seed
                        && !seed.expose().starts_with("SU")
                    {
                        p.push((
                            k("nkey_seed"),
                            "is not a user NKey seed (it starts with `SU`)".into(),
                        ));
                    }
                }
                &mut n.tls
            }
            SinkConfig::File(_) => continue,
        };
        if let Some(t) = tls {
            tls_files(
                [&mut t.ca_file, &mut t.cert_file, &mut t.key_file],
                &format!("sinks.{name}.tls"),
                base,
                &mut p,
            );
        }
    }
    p
}

/// `key` given inline or in `key_file` (read now), never both.
fn secret(
    value: &mut Option<Secret>,
    from: &Option<PathBuf>,
    key: &str,
    base: &Path,
    p: &mut Vec<(String, String)>,
) {
    let Some(f) = from else { return };
    if value.is_some() {
        p.push((
            key.to_string(),
            format!("both `{key}` and `{key}_file` are set; keep one"),
        ));
        return;
    }
    let path = absolute(f, base);
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let s = s.trim_end_matches(['\n', '\r']);
            if s.is_empty() {
                p.push((
                    format!("{key}_file"),
                    format!("{} is empty", path.display()),
                ));
            } else {
                *value = Some(Secret(s.to_string()));
            }
        }
        Err(e) => p.push((
            format!("{key}_file"),
            format!("cannot read {}: {e}", path.display()),
        )),
    }
}

/// The `[ca_file, cert_file, key_file]` of a `tls` table at `key`: each
/// made absolute and readable; a certificate needs its key.
fn tls_files(
    [ca, cert, key_file]: [&mut Option<PathBuf>; 3],
    key: &str,
    base: &Path,
    p: &mut Vec<(String, String)>,
) {
    file(ca, &format!("{key}.ca_file"), base, p);
    file(cert, &format!("{key}.cert_file"), base, p);
    file(key_file, &format!("{key}.key_file"), base, p);
    if cert.is_some() != key_file.is_some() {
        p.push((key.to_string(), "cert_file and key_file go together".into()));
    }
}

/// A certificate/key path made absolute; it must be a readable file.
fn file(path: &mut Option<PathBuf>, key: &str, base: &Path, p: &mut Vec<(String, String)>) {
    let Some(f) = path else { return };
    let abs = absolute(f, base);
    if let Err(e) = std::fs::File::open(&abs) {
        p.push((
            key.to_string(),
            format!("cannot read {}: {e}", abs.display()),
        ));
    }
    *path = Some(abs);
}

fn absolute(p: &Path, base: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// Is `host` this machine (a connection to it never crosses a network)?
fn loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The host of `url` (`scheme://[user@]host[:port]/…`).
fn url_host(url: &str) -> Option<String> {
    url::Url::parse(url)
        .ok()
        .and_then(|u| u.host_str().map(str::to_string))
}

/// Connections that would cross a network without a verified certificate:
/// one warning each, for `config check` and the log at start. PostgreSQL
/// without `tls` (or with `prefer`/`require`, which check nothing), and
/// plaintext brokers, on an address that is not loopback.
pub fn transport_warnings(config: &Config) -> Vec<String> {
    use crate::config::PgTlsMode as M;
    let mut out = Vec::new();
    let shorthand = config.store_shorthand;
    for (name, s) in &config.sources {
        let key = if shorthand {
            "store".to_string()
        } else {
            format!("sources.{name}")
        };
        let Some(host) = url_host(&s.url).filter(|h| !loopback(h)) else {
            continue;
        };
        let url_mode = s
            .url
            .split_once('?')
            .and_then(|(_, q)| q.split('&').find_map(|p| p.strip_prefix("sslmode=")));
        let verified = match &s.tls {
            Some(t) => matches!(t.mode, M::VerifyCa | M::VerifyFull),
            None => matches!(url_mode, Some("verify-ca" | "verify-full")),
        };
        if !verified {
            out.push(format!(
                "{key}: the connection to {host} does not verify the server's certificate \
                 (passwords and events can be read or changed on the way): set {key}.tls = {{ mode = \"verify-full\" }}"
            ));
        }
    }
    for (name, sink) in &config.sinks {
        match sink {
            SinkConfig::Kafka(k) if k.tls.as_ref().is_some_and(|t| t.insecure_skip_verify) => {
                out.push(format!(
                    "sinks.{name}.tls.insecure_skip_verify: the brokers' certificates and host names are not checked \
                     (anyone on the way can read or change messages{}): remove it outside a test cluster",
                    if k.sasl.is_some() {
                        " and take the SASL credentials"
                    } else {
                        ""
                    }
                ));
            }
            SinkConfig::Kafka(k) if k.tls.is_none() => {
                if let Some(host) = k
                    .brokers
                    .split(',')
                    .map(|b| b.trim().rsplit_once(':').map_or(b.trim(), |(h, _)| h))
                    .find(|h| !h.is_empty() && !loopback(h))
                {
                    out.push(format!(
                        "sinks.{name}: brokers such as {host} are reached in plaintext{}: set sinks.{name}.tls",
                        if k.sasl.is_some() {
                            ", SASL credentials included"
                        } else {
                            ""
                        }
                    ));
                }
            }
            SinkConfig::Nats(n) if n.tls.is_none() && !n.url.starts_with("tls://") => {
                if let Some(host) = url_host(&n.url).filter(|h| !loopback(h)) {
                    out.push(format!(
                        "sinks.{name}: the NATS server {host} is reached in plaintext: set sinks.{name}.tls"
                    ));
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?}"), "***");
        assert_eq!(serde_json::to_string(&s).unwrap_or_default(), "\"***\"");
        let parsed: Secret = serde_json::from_str("\"hunter2\"").unwrap_or_default();
        assert_eq!(parsed.expose(), "hunter2");
        // What figment makes of `OUTROUTE_…=12345678`: a number, taken as text.
        let parsed: Secret = serde_json::from_str("12345678").unwrap_or_default();
        assert_eq!(parsed.expose(), "12345678");
        let parsed: Secret = serde_json::from_str("true").unwrap_or_default();
        assert_eq!(parsed.expose(), "true");
    }

    #[test]
    fn unverified_connections_beyond_this_machine_are_named() {
        let config: Config = toml::from_str(
            r#"
            [sources.local]
            url = "postgres://u@127.0.0.1/db"
            [sources.remote]
            url = "postgres://u@orders-db/db"
            [sources.prefer]
            url = "postgres://u@orders-db/db"
            tls = { mode = "prefer" }
            [sources.verified]
            url = "postgres://u@orders-db/db?sslmode=verify-full"
            [sinks.k]
            kind = "kafka"
            brokers = "localhost:9092,kafka-2:9092"
            [sinks.kl]
            kind = "kafka"
            brokers = "127.0.0.1:9092"
            [sinks.n]
            kind = "nats"
            url = "nats://nats.internal:4222"
            [sinks.nt]
            kind = "nats"
            url = "tls://nats.internal:4222"
            [sinks.kinsecure]
            kind = "kafka"
            brokers = "127.0.0.1:9093"
            tls = { insecure_skip_verify = true }
            "#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let w = transport_warnings(&config).join("\n");
        for named in [
            "sources.remote",
            "sources.prefer",
            "sinks.k: brokers such as kafka-2",
            "sinks.n:",
            // Even on loopback: the opt-in is always said out loud.
            "sinks.kinsecure.tls.insecure_skip_verify: the brokers' certificates and host names are not checked",
        ] {
            assert!(w.contains(named), "{named}: {w}");
        }
        for quiet in ["sources.local", "sources.verified", "sinks.kl", "sinks.nt"] {
            assert!(!w.contains(quiet), "{quiet}: {w}");
        }
    }
}
