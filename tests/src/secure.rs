//! Real servers configured the way production ones are, for the
//! secured-connection tests: a private certificate authority (openssl), a
//! nats-server with TLS and accounts, a token-protected nats-server, tansu
//! behind stunnel (tansu 0.6 cannot serve TLS itself), and the TLS-only
//! PostgreSQL cluster from `scripts/pg-tls`. Every process is stopped when
//! its handle is dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::{eventually, free_addr, workspace};

/// A certificate authority and what it signed, in `dir`: `ca.crt`,
/// `server.{crt,key}` (for 127.0.0.1 and localhost), `client.{crt,key}`, and
/// `other-ca.crt`, an authority nobody trusts.
pub struct Pki {
    pub dir: PathBuf,
}

fn openssl(args: &[&str], dir: &Path) -> Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("running openssl")?;
    if !out.status.success() {
        bail!(
            "openssl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

impl Pki {
    pub fn new(dir: &Path) -> Result<Pki> {
        std::fs::create_dir_all(dir)?;
        let ca = |name: &str| -> Result<()> {
            openssl(
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "30",
                    "-subj",
                    &format!("/CN=outroute {name}"),
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.crt"),
                ],
                dir,
            )
        };
        ca("ca")?;
        ca("other-ca")?;
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )?;
        std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n")?;
        for (who, cn) in [("server", "127.0.0.1"), ("client", "outroute-relay")] {
            openssl(
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-subj",
                    &format!("/CN={cn}"),
                    "-keyout",
                    &format!("{who}.key"),
                    "-out",
                    &format!("{who}.csr"),
                ],
                dir,
            )?;
            openssl(
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{who}.csr"),
                    "-CA",
                    "ca.crt",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "30",
                    "-extfile",
                    &format!("{who}.ext"),
                    "-out",
                    &format!("{who}.crt"),
                ],
                dir,
            )?;
        }
        Ok(Pki {
            dir: dir.to_path_buf(),
        })
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }
}

/// A child process killed on drop.
pub struct Daemon {
    child: Child,
    pub addr: String,
    log: PathBuf,
}

impl Daemon {
    async fn spawn(mut cmd: Command, addr: String, log: PathBuf, what: &str) -> Result<Daemon> {
        let file = std::fs::File::create(&log)?;
        let child = cmd
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let d = Daemon { child, addr, log };
        let up = eventually(Duration::from_secs(10), || async {
            tokio::net::TcpStream::connect(&d.addr).await.is_ok()
        })
        .await;
        if !up {
            bail!("{what} did not come up on {}: {}", d.addr, d.log_text());
        }
        Ok(d)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// nats-server with JetStream and `config` (the part after `listen` and
/// `jetstream`: tls, accounts, authorization).
pub async fn nats_server(dir: &Path, config: &str) -> Result<Daemon> {
    let store = dir.join(format!("js-{}", crate::tag()));
    nats_server_with(
        dir,
        &format!(
            "jetstream {{ store_dir: \"{}\" }}\n{config}",
            store.display()
        ),
    )
    .await
}

/// nats-server with exactly `config` after `listen`.
pub async fn nats_server_with(dir: &Path, config: &str) -> Result<Daemon> {
    let addr = free_addr();
    let file = dir.join(format!("nats-{}.conf", crate::tag()));
    std::fs::write(&file, format!("listen: {addr}\n{config}\n"))?;
    let mut cmd = Command::new("nats-server");
    cmd.arg("-c").arg(&file);
    Daemon::spawn(cmd, addr, dir.join("nats.log"), "nats-server").await
}

/// stunnel terminating TLS (server certificate from `pki`, client
/// certificates required) on a free port and forwarding to `target`.
pub async fn stunnel(pki: &Pki, target: &str, accept: &str) -> Result<Daemon> {
    let file = pki.dir.join(format!("stunnel-{}.conf", crate::tag()));
    std::fs::write(
        &file,
        format!(
            "foreground = yes\npid =\n[kafka]\naccept = {accept}\nconnect = {target}\ncert = {}\nkey = {}\nCAfile = {}\nverifyChain = yes\nrequireCert = yes\n",
            pki.path("server.crt"),
            pki.path("server.key"),
            pki.path("ca.crt"),
        ),
    )?;
    let mut cmd = Command::new("stunnel");
    cmd.arg(&file);
    Daemon::spawn(
        cmd,
        accept.to_string(),
        pki.dir.join("stunnel.log"),
        "stunnel",
    )
    .await
}

/// The TLS-only, scram-sha-256 PostgreSQL cluster (`scripts/pg-tls`):
/// its address, the role's password and the CA that signs its certificate.
pub struct PgTls {
    pub port: u16,
    pub user: &'static str,
    pub password: &'static str,
    pub ca: PathBuf,
}

pub fn pg_tls() -> Result<PgTls> {
    let out = Command::new(workspace().join("scripts/pg-tls"))
        .output()
        .context("running scripts/pg-tls")?;
    if !out.status.success() {
        bail!("scripts/pg-tls: {}", String::from_utf8_lossy(&out.stderr));
    }
    let ca = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !ca.is_file() {
        bail!("scripts/pg-tls printed {ca:?}, which is not a file");
    }
    Ok(PgTls {
        port: 5433,
        user: "outroute_tls",
        password: "outroute-tls-secret",
        ca,
    })
}

/// A NATS JWT (`nats`: the claims' `nats` object) signed by `issuer`.
pub fn nats_jwt(
    issuer: &nkeys::KeyPair,
    subject: &str,
    name: &str,
    nats: serde_json::Value,
) -> Result<String> {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = serde_json::json!({
        "jti": crate::tag().to_uppercase(),
        "iat": chrono::Utc::now().timestamp(),
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let signing = format!("{header}.{}", b64.encode(claims.to_string()));
    let signature = issuer
        .sign(signing.as_bytes())
        .map_err(|e| anyhow::anyhow!("signing a JWT: {e}"))?;
    Ok(format!("{signing}.{}", b64.encode(signature)))
}

/// An operator-mode nats-server (JWT accounts, as `nsc` sets them up) and
/// a `.creds` file for a user of its one account.
pub async fn nats_operator(dir: &Path) -> Result<(Daemon, PathBuf)> {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let unlimited = serde_json::json!({"subs": -1, "data": -1, "payload": -1});
    let op = nats_jwt(
        &operator,
        &operator.public_key(),
        "outroute-test",
        serde_json::json!({"type": "operator", "version": 2}),
    )?;
    let acct = nats_jwt(
        &operator,
        &account.public_key(),
        "APP",
        serde_json::json!({"type": "account", "version": 2, "limits": {
            "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
            "wildcards": true, "conn": -1, "leaf": -1}}),
    )?;
    let mut claims = serde_json::json!({"type": "user", "version": 2, "pub": {}, "sub": {}});
    if let (Some(c), Some(u)) = (claims.as_object_mut(), unlimited.as_object()) {
        c.extend(u.clone());
    }
    let usr = nats_jwt(&account, &user.public_key(), "relay", claims)?;
    let seed = user.seed().map_err(|e| anyhow::anyhow!("{e}"))?;
    let creds = dir.join("relay.creds");
    std::fs::write(
        &creds,
        format!(
            "-----BEGIN NATS USER JWT-----\n{usr}\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        ),
    )?;
    let server = nats_server_with(
        dir,
        &format!(
            "operator: \"{op}\"\nresolver: MEMORY\nresolver_preload: {{ {}: \"{acct}\" }}\n",
            account.public_key()
        ),
    )
    .await?;
    Ok((server, creds))
}
