//! Crash points for the fault-injection suite. Compiled in only with the
//! `failpoints` cargo feature; a release build has none of this.
//!
//! `OUTROUTE_FAILPOINT=<name>` aborts the process (no destructors, no
//! flush — like `kill -9`) the `OUTROUTE_FAILPOINT_HIT`-th time (default 1)
//! the relay passes that point. With `OUTROUTE_FAILPOINT_ACTION=stop` the
//! process stops itself (SIGSTOP, like a long GC pause or a frozen VM) and
//! carries on where it was when it gets SIGCONT. Points, in the order an
//! event meets them: `after-claim`, `mid-publish` (after the batch's first
//! event was handed to its sinks), `before-ack`, `after-ack`, `mid-mark`.

#[cfg(feature = "failpoints")]
mod imp {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    static CONFIG: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);

    fn config() -> &'static Option<(String, u64)> {
        CONFIG.get_or_init(|| {
            let name = std::env::var("OUTROUTE_FAILPOINT").ok()?;
            let hit = std::env::var("OUTROUTE_FAILPOINT_HIT")
                .ok()
                .and_then(|h| h.parse().ok())
                .unwrap_or(1);
            Some((name, hit))
        })
    }

    pub fn armed(name: &str) -> bool {
        matches!(config(), Some((n, _)) if n == name)
    }

    pub fn hit(name: &str) {
        if let Some((n, at)) = config()
            && n == name
        {
            let hits = HITS.fetch_add(1, Ordering::SeqCst) + 1;
            if hits < *at {
                return;
            }
            if std::env::var("OUTROUTE_FAILPOINT_ACTION").as_deref() == Ok("stop") {
                if hits > *at {
                    return; // stops once
                }
                eprintln!("outroute: failpoint `{name}` reached, stopping (SIGSTOP)");
                // SAFETY: raise(3) on our own process; it resumes on SIGCONT.
                unsafe {
                    libc::raise(libc::SIGSTOP);
                }
                eprintln!("outroute: failpoint `{name}`: resumed");
                return;
            }
            eprintln!("outroute: failpoint `{name}` reached, aborting");
            std::process::abort();
        }
    }
}

#[cfg(not(feature = "failpoints"))]
mod imp {
    #[inline(always)]
    pub fn armed(_: &str) -> bool {
        false
    }
    #[inline(always)]
    pub fn hit(_: &str) {}
}

pub use imp::{armed, hit};
