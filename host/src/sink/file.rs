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
    out: Arc<Mutex<Output>>,
    /// Lines written so far, and lines known to be on disk.
    written: Arc<AtomicU64>,
    synced: Arc<AtomicU64>,
}

enum Output {
    Stdout,
    File(BufWriter<File>),
}

impl Output {
    fn write_line(&mut self, line: &str) -> std::io::Result<()> {
        match self {
            Output::Stdout => {
                let mut o = std::io::stdout().lock();
                writeln!(o, "{line}")?;
                o.flush()
            }
            Output::File(f) => writeln!(f, "{line}"),
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
            out: Arc::new(Mutex::new(out)),
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
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        let line = json!({
            "sink": self.name,
            "topic": m.topic,
            "key": m.key.map(|k| String::from_utf8_lossy(k).into_owned()),
            "partition": m.partition,
            "headers": headers,
            "payload": payload,
        })
        .to_string();
        let seq = {
            let mut out = self.out.lock().map_err(|_| self.poisoned())?;
            out.write_line(&line)
                .map_err(|e| PublishError::Retryable(format!("file sink `{}`: {e}", self.name)))?;
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
                let mut out = out.lock().map_err(|_| {
                    PublishError::Retryable(format!("file sink `{name}` is poisoned"))
                })?;
                if synced.load(Ordering::Acquire) >= seq {
                    return Ok(());
                }
                let upto = written.load(Ordering::Acquire);
                out.sync().map_err(|e| {
                    PublishError::Retryable(format!("file sink `{name}`: fsync: {e}"))
                })?;
                synced.fetch_max(upto, Ordering::AcqRel);
                Ok(())
            })
            .await;
            done.unwrap_or_else(|e| Err(PublishError::Retryable(format!("file sink sync: {e}"))))
        }))
    }

    async fn connected(&self) -> bool {
        true
    }

    async fn flush(&self) {
        if let Ok(mut o) = self.out.lock() {
            let _ = o.sync();
        }
    }
}
