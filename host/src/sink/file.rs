//! File sink: JSON lines, one message per line with its headers — for
//! development, the embedded quickstart and recording what a plugin does.
//! A message counts as acknowledged once its line is written and the file
//! fsynced (`fdatasync`); one sync covers every line written before it, so
//! a batch costs one sync, not one per message. Standard output (`path =
//! "-"`) is only flushed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use serde_json::json;
use tokio::sync::Semaphore;

use super::{Ack, Outgoing, Permit, PublishError, Sink};
use crate::config::FileSinkConfig;

pub struct FileSink {
    name: String,
    /// `None` once a write or sync failed: after a failed fsync, Linux
    /// reports the error once and a later sync "succeeds" without the lost
    /// pages, so nothing written after that is ever acknowledged.
    out: Arc<Mutex<Option<Output>>>,
    /// Lines written so far, and lines known to be on disk.
    written: Arc<AtomicU64>,
    synced: Arc<AtomicU64>,
}

enum Output {
    Stdout,
    File(BufWriter<File>),
}

impl Output {
    /// One `write` of the whole line, newline included.
    fn write_line(&mut self, line: &str) -> std::io::Result<()> {
        match self {
            Output::Stdout => {
                let mut o = std::io::stdout().lock();
                o.write_all(line.as_bytes())?;
                o.flush()
            }
            Output::File(f) => f.write_all(line.as_bytes()),
        }
    }

    fn sync(&mut self) -> std::io::Result<()> {
        match self {
            Output::Stdout => Ok(()),
            Output::File(f) => {
                f.flush()?;
                f.get_ref().sync_data()
            }
        }
    }
}

/// `outroute config check --sinks`: where the sink writes. Opens nothing
/// (a FIFO would block, or end its reader's input): an existing path must
/// not be a directory or read-only, and a missing one needs a directory
/// nearest above it for `run` to create it in.
pub fn check(name: &str, c: &FileSinkConfig, base_dir: &Path) -> Result<String> {
    if c.path == "-" {
        return Ok(format!("sinks.{name}: writes to standard output"));
    }
    let path = base_dir.join(&c.path);
    let key = format!("sinks.{name}.path");
    match std::fs::metadata(&path) {
        Ok(m) if m.is_dir() => anyhow::bail!("{key}: {} is a directory", path.display()),
        Ok(m) if m.permissions().readonly() => {
            anyhow::bail!("{key}: {} is read-only", path.display())
        }
        Ok(_) => Ok(format!("sinks.{name}: appends to {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let above = path
                .ancestors()
                .skip(1)
                .find(|a| a.exists())
                .unwrap_or(Path::new("/"));
            if !above.is_dir() {
                anyhow::bail!(
                    "{key}: cannot create {}: {} is not a directory",
                    path.display(),
                    above.display()
                );
            }
            Ok(format!(
                "sinks.{name}: {} does not exist yet; `run` creates it",
                path.display()
            ))
        }
        Err(e) => Err(anyhow::anyhow!(
            "{key}: cannot look at {}: {e}",
            path.display()
        )),
    }
}

impl FileSink {
    pub fn build(name: &str, c: &FileSinkConfig, base_dir: &Path) -> Result<Self> {
        let out = if c.path == "-" {
            Output::Stdout
        } else {
            let path = base_dir.join(&c.path);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("sinks.{name}.path: creating {}", dir.display()))?;
            }
            Output::File(BufWriter::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .with_context(|| {
                        format!("sinks.{name}.path: cannot open {}", path.display())
                    })?,
            ))
        };
        Ok(FileSink {
            name: name.to_string(),
            out: Arc::new(Mutex::new(Some(out))),
            written: Arc::new(AtomicU64::new(0)),
            synced: Arc::new(AtomicU64::new(0)),
        })
    }

    fn poisoned(&self) -> PublishError {
        PublishError::Retryable(format!("file sink `{}` is poisoned", self.name))
    }
}

#[async_trait::async_trait]
impl Sink for FileSink {
    fn in_flight(&self) -> Option<&Arc<Semaphore>> {
        None
    }

    /// Write one line; the acknowledgement waits for the sync.
    async fn send(&self, m: Outgoing<'_>, _permit: Permit) -> Result<Ack, PublishError> {
        let payload = match serde_json::from_slice::<serde_json::Value>(m.payload) {
            Ok(v) => v,
            Err(_) => json!(String::from_utf8_lossy(m.payload)),
        };
        let headers: serde_json::Map<String, serde_json::Value> = m
            .headers
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let line = json!({
            "sink": self.name,
            "topic": m.topic,
            "key": m.key.map(|k| String::from_utf8_lossy(k).into_owned()),
            "partition": m.partition,
            "headers": headers,
            "payload": payload,
        })
        .to_string()
            + "\n";
        let seq = {
            let mut guard = self.out.lock().map_err(|_| self.poisoned())?;
            let out = guard.as_mut().ok_or_else(|| broken(&self.name))?;
            if let Err(e) = out.write_line(&line) {
                *guard = None;
                return Err(PublishError::Unavailable(format!(
                    "file sink `{}`: {e}; no longer written (restart the relay)",
                    self.name
                )));
            }
            self.written.fetch_add(1, Ordering::AcqRel) + 1
        };
        let (out, written, synced, name) = (
            self.out.clone(),
            self.written.clone(),
            self.synced.clone(),
            self.name.clone(),
        );
        Ok(Ack::new(async move {
            if synced.load(Ordering::Acquire) >= seq {
                return Ok(());
            }
            let done = tokio::task::spawn_blocking(move || {
                let mut guard = out.lock().map_err(|_| {
                    PublishError::Retryable(format!("file sink `{name}` is poisoned"))
                })?;
                if synced.load(Ordering::Acquire) >= seq {
                    return Ok(());
                }
                let file = guard.as_mut().ok_or_else(|| broken(&name))?;
                let upto = written.load(Ordering::Acquire);
                if let Err(e) = file.sync() {
                    *guard = None;
                    return Err(PublishError::Unavailable(format!(
                        "file sink `{name}`: fsync: {e}; no longer written (restart the relay)"
                    )));
                }
                synced.fetch_max(upto, Ordering::AcqRel);
                Ok(())
            })
            .await;
            done.unwrap_or_else(|e| Err(PublishError::Retryable(format!("file sink sync: {e}"))))
        }))
    }

    /// Not after a write or fsync error (`/readyz` says so).
    async fn connected(&self) -> bool {
        self.out.lock().map(|o| o.is_some()).unwrap_or(false)
    }

    async fn flush(&self) {
        if let Ok(mut o) = self.out.lock()
            && let Some(o) = o.as_mut()
        {
            let _ = o.sync();
        }
    }
}

fn broken(name: &str) -> PublishError {
    PublishError::Unavailable(format!(
        "file sink `{name}` stopped after a write or fsync error (restart the relay)"
    ))
}
