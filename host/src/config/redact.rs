//! Redaction: every URL a log line, error or command shows passes through
//! here, so a password, token or secret query parameter never prints.

/// A URL with its secrets replaced by `****`, for every error message, log
/// line and command output that shows one: the password of the userinfo;
/// for brokers (not PostgreSQL, whose user name is no secret) a userinfo
/// without `:` too, which is how a NATS token is given (`nats://TOKEN@host`);
/// and the value of every query parameter named like a secret
/// (`password`, `passwd`, `pwd`, `token`, `secret`, `key`, `sslpassword`…).
pub fn redact_url(url: &str) -> String {
    let Some(s) = url.find("://") else {
        return url.to_string();
    };
    let scheme = &url[..s];
    let rest = &url[s + 3..];
    // The authority ends at the first `/`, `?` or `#`; the userinfo at its
    // last `@`.
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(auth_end);
    let authority = match authority.rfind('@') {
        Some(at) => {
            let (creds, host) = authority.split_at(at);
            match creds.find(':') {
                Some(c) => format!("{}:****{host}", &creds[..c]),
                None if scheme.starts_with("postgres") => authority.to_string(),
                None => format!("****{host}"),
            }
        }
        None => authority.to_string(),
    };
    let tail = match tail.split_once('?') {
        None => tail.to_string(),
        Some((path, query)) => {
            let (query, fragment) = match query.split_once('#') {
                Some((q, f)) => (q, format!("#{f}")),
                None => (query, String::new()),
            };
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if secret_name(k) => format!("{k}=****"),
                    _ => pair.to_string(),
                })
                .collect();
            format!("{path}?{}{fragment}", query.join("&"))
        }
    };
    format!("{scheme}://{authority}{tail}")
}

/// `text` (a client library's error, say) with every secret of `url` —
/// what [`redact_url`] hides — replaced by `****`, wherever it appears.
pub fn scrub(text: &str, url: &str) -> String {
    let mut out = text.replace(url, &redact_url(url));
    for secret in url_secrets(url) {
        // Shorter ones would blank unrelated text; they are in the URL only.
        if secret.len() >= 3 {
            out = out.replace(secret, "****");
        }
    }
    out
}

/// The secrets `url` carries, as [`redact_url`] finds them.
fn url_secrets(url: &str) -> Vec<&str> {
    let Some(s) = url.find("://") else {
        return Vec::new();
    };
    let rest = &url[s + 3..];
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let mut out = Vec::new();
    if let Some(at) = rest[..auth_end].rfind('@') {
        match rest[..at].split_once(':') {
            Some((_, password)) => out.push(password),
            None if !url.starts_with("postgres") => out.push(&rest[..at]),
            None => {}
        }
    }
    if let Some((_, query)) = rest[auth_end..].split_once('?') {
        let query = query.split('#').next().unwrap_or(query);
        for pair in query.split('&') {
            if let Some((k, v)) = pair.split_once('=')
                && secret_name(k)
            {
                out.push(v);
            }
        }
    }
    out
}

/// A query parameter or setting name that holds a secret.
fn secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "pass",
        "pwd",
        "token",
        "secret",
        "key",
        "credential",
        "auth",
    ]
    .iter()
    .any(|w| n.contains(w))
}
