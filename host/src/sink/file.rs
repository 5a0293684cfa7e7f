//! File sink: JSON lines, one message per line with its headers — for
//! development, the embedded quickstart and recording what a plugin does.
//! A message counts as acknowledged once its line is written and flushed.

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use anyhow::{Context, Result};
use serde_json::json;

use super::{Outgoing, PublishError};
use crate::config::FileSinkConfig;

pub struct FileSink {
    name: String,
    out: Mutex<Box<dyn Write + Send>>,
}

impl FileSink {
    pub fn build(name: &str, c: &FileSinkConfig, base_dir: &Path) -> Result<Self> {
        let out: Box<dyn Write + Send> = if c.path == "-" {
            Box::new(std::io::stdout())
        } else {
            let path = base_dir.join(&c.path);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("sinks.{name}.path: creating {}", dir.display()))?;
            }
            Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .with_context(|| {
                        format!("sinks.{name}.path: cannot open {}", path.display())
                    })?,
            )
        };
        Ok(FileSink {
            name: name.to_string(),
            out: Mutex::new(out),
        })
    }

    /// Write one line; written and flushed is acknowledged.
    pub fn send(&self, m: Outgoing<'_>) -> Result<(), PublishError> {
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
        });
        let mut out = self.out.lock().map_err(|_| {
            PublishError::Retryable(format!("file sink `{}` is poisoned", self.name))
        })?;
        writeln!(out, "{line}")
            .and_then(|_| out.flush())
            .map_err(|e| PublishError::Retryable(format!("file sink `{}`: {e}", self.name)))
    }

    pub fn flush(&self) {
        if let Ok(mut o) = self.out.lock() {
            let _ = o.flush();
        }
    }
}
