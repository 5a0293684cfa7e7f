//! What a plugin instance may reach and how much of it: the state behind
//! each instance's wasmtime `Store`.
//!
//! * **CPU budget.** Each call gets a budget of *thread CPU time* (the time
//!   the thread running the guest actually ran, so a loaded host does not
//!   eat it), checked at every epoch tick, plus a wall-clock cap of
//!   [`WALL_FACTOR`]× the budget for a host too starved to run it at all.
//! * **Nothing blocks.** Time does not pass for a plugin: its clocks are
//!   frozen at the Unix epoch and every clock wait (`subscribe-duration`,
//!   `subscribe-instant`, so `sleep` and `poll` timeouts) is ready at once.
//!   A plugin that "sleeps" in a loop is just a loop, and its budget stops
//!   it.
//! * **Memory.** One cap over all linear memories and tables of an instance
//!   together, and caps on how many of each it may create.
//! * **Logs.** `host.log` lines and bytes are counted per call (limit per
//!   event × events in the call); stderr is a ring buffer of its last bytes
//!   that never fails a write, quoted in failure reasons.
//! * **Counters.** `host.count` (contract 0.1.1) adds to a named counter:
//!   names are checked (`a-z0-9_`, at most [`MAX_COUNTERS`] per instance, so
//!   a plugin cannot blow up the metrics' series) and the increments of a
//!   call are held in [`CallState::counts`] until the call succeeds.
//! * **Randomness.** `wasi:random` is granted (std-built guests seed their
//!   hash maps from it) but deterministic: the same bytes for every
//!   instance, so routing stays a pure function of the event — replay,
//!   `plugin test` and shadow runs see the same answers as the live run.
//!   Plugins must not use it for secrets.
//!
//! When a limit stops a call, [`CallState::breach`] says which, so the
//! failure reason names it and the route's quarantine counts it.

use std::collections::{BTreeSet, VecDeque};
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::runtime::Ticking;
use wasmtime::component::{Linker, Resource, ResourceTable};
use wasmtime::{ResourceLimiter, StoreContextMut, UpdateDeadline};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{DynPollable, OutputStream, Pollable, StreamError};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings;
use super::bindings::outroute::router::host::{Host, Level};

/// Epoch tick. CPU budgets are checked (and rounded up) to whole ticks.
/// 10 ms, not 1: while events arrive the ticker runs without pause, and at
/// 1,000 events/s its thousand wake-ups a second were ~6 % of the relay's
/// CPU (`docs/src/performance.md`); a budget (50 ms by default, 20 ms in the
/// examples) is still checked several times over.
pub const TICK: Duration = Duration::from_millis(10);

/// A call is stopped at this many times its CPU budget in wall time.
pub const WALL_FACTOR: u32 = 10;

/// Bytes of guest stderr kept (the last ones).
const STDERR_KEEP: usize = 4096;

/// Bytes a table element is counted as against the memory cap.
const TABLE_ELEMENT_BYTES: usize = 16;

/// A limit a plugin call broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// `routes[].cpu_budget` (thread CPU time).
    CpuBudget,
    /// `WALL_FACTOR` × the budget in wall time.
    WallClock,
    /// `routes[].memory_mib`, or the count of memories/tables/instances.
    Memory,
    /// `routes[].max_log_lines_per_event` / `max_log_bytes_per_event`.
    Log,
    /// `routes[].max_messages_per_event`.
    MessagesPerEvent,
    /// `routes[].max_bytes_per_event`.
    BytesPerEvent,
}

impl Limit {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::CpuBudget => "cpu_budget",
            Limit::WallClock => "wall_clock",
            Limit::Memory => "memory",
            Limit::Log => "log",
            Limit::MessagesPerEvent => "messages_per_event",
            Limit::BytesPerEvent => "bytes_per_event",
        }
    }

    /// Limits whose breach costs time: after one, the route's remaining
    /// events in the batch are left for the next batch.
    pub fn costs_time(self) -> bool {
        matches!(self, Limit::CpuBudget | Limit::WallClock)
    }
}

/// Per-instance limits, fixed for the route.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub memory_bytes: usize,
    pub log_lines_per_event: u32,
    pub log_bytes_per_event: u64,
}

/// What the current call may still use and what it broke.
#[derive(Debug)]
pub struct CallState {
    cpu_start: Duration,
    cpu_budget: Duration,
    wall_until: Instant,
    log_lines_left: u64,
    log_bytes_left: u64,
    /// The limit that stopped the call, if one did.
    pub breach: Option<Limit>,
    /// `host.count` increments made during the call, by name; the plugin
    /// keeps them only if the call succeeds.
    pub counts: Vec<(String, u64)>,
    /// The event of a one-event call (`route`), which tags its log lines;
    /// `None` for batch calls and set-up.
    pub event_id: Option<String>,
}

impl CallState {
    fn idle() -> Self {
        CallState {
            cpu_start: Duration::ZERO,
            cpu_budget: Duration::MAX,
            wall_until: Instant::now() + Duration::from_secs(3600),
            log_lines_left: u64::MAX,
            log_bytes_left: u64::MAX,
            breach: None,
            counts: Vec::new(),
            event_id: None,
        }
    }
}

/// The state of one plugin instance's store.
pub struct HostState {
    plugin: String,
    caps: Caps,
    pub limiter: Limiter,
    pub call: CallState,
    wasi: WasiCtx,
    table: ResourceTable,
    pub stderr: StderrRing,
    /// The counter names this instance has used (`host.count`).
    counter_names: BTreeSet<String>,
    /// The epoch ticker, told when a call begins.
    ticking: Arc<Ticking>,
}

impl HostState {
    pub fn new(plugin: &str, caps: Caps, ticking: Arc<Ticking>) -> Self {
        let stderr = StderrRing::default();
        // A fixed stream: see the module header on randomness.
        let seed: Vec<u8> = (0u8..=255).map(|b| b.wrapping_mul(167) ^ 0x5a).collect();
        let wasi = wasmtime_wasi::WasiCtxBuilder::new()
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .wall_clock(FrozenClock)
            .monotonic_clock(FrozenClock)
            .secure_random(wasmtime_wasi::random::Deterministic::new(seed.clone()))
            .insecure_random(wasmtime_wasi::random::Deterministic::new(seed))
            .insecure_random_seed(0x6f75_7472_6f75_7465)
            .build();
        HostState {
            plugin: plugin.to_string(),
            caps,
            limiter: Limiter::new(caps.memory_bytes),
            call: CallState::idle(),
            wasi,
            table: ResourceTable::new(),
            stderr,
            counter_names: BTreeSet::new(),
            ticking,
        }
    }

    /// Label this instance's log lines with `plugin` (the name `describe`
    /// gave, once it is known).
    pub fn rename(&mut self, plugin: &str) {
        plugin.clone_into(&mut self.plugin);
    }

    /// Start a call routing `events` events under `cpu_budget` in total;
    /// returns the epoch deadline (ticks) to set.
    pub fn begin_call(&mut self, cpu_budget: Duration, events: usize) -> u64 {
        let events = events.max(1) as u64;
        self.call = CallState {
            cpu_start: thread_cpu(),
            cpu_budget,
            wall_until: Instant::now() + cpu_budget.saturating_mul(WALL_FACTOR),
            log_lines_left: (self.caps.log_lines_per_event as u64).saturating_mul(events),
            log_bytes_left: self.caps.log_bytes_per_event.saturating_mul(events),
            breach: None,
            counts: Vec::new(),
            event_id: None,
        };
        self.limiter.breach = None;
        self.stderr.clear();
        self.ticking
            .call_begins(cpu_budget.saturating_mul(WALL_FACTOR));
        ticks(cpu_budget)
    }

    /// The limit the last call broke, if any.
    pub fn breach(&self) -> Option<Limit> {
        self.call.breach.or(self.limiter.breach)
    }

    /// Thread CPU time the current call has used.
    pub fn cpu_used(&self) -> Duration {
        thread_cpu().saturating_sub(self.call.cpu_start)
    }

    /// Called by wasmtime when the epoch deadline is reached: stop the
    /// guest if it used its CPU budget or its wall-clock cap, otherwise let
    /// it run until the budget could next be used up.
    pub fn on_deadline(mut cx: StoreContextMut<'_, HostState>) -> wasmtime::Result<UpdateDeadline> {
        let call = &mut cx.data_mut().call;
        let used = thread_cpu().saturating_sub(call.cpu_start);
        if used >= call.cpu_budget {
            call.breach = Some(Limit::CpuBudget);
            return Err(wasmtime::Trap::Interrupt.into());
        }
        if Instant::now() >= call.wall_until {
            call.breach = Some(Limit::WallClock);
            return Err(wasmtime::Trap::Interrupt.into());
        }
        Ok(UpdateDeadline::Continue(ticks(call.cpu_budget - used)))
    }
}

/// Whole ticks covering `d` (at least one).
pub fn ticks(d: Duration) -> u64 {
    (d.as_micros().div_ceil(TICK.as_micros()) as u64).max(1)
}

/// CPU time used by the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID is
    // supported on every Linux and macOS the relay runs on.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl bindings::outroute::router::types::Host for HostState {}

impl Host for HostState {
    fn log(&mut self, level: Level, message: String) -> wasmtime::Result<()> {
        let bytes = message.len() as u64;
        let call = &mut self.call;
        if call.log_lines_left == 0 || call.log_bytes_left < bytes {
            call.breach = Some(Limit::Log);
            return Err(wasmtime::Error::msg(format!(
                "wrote more than {} log lines or {} log bytes for one event (routes[].max_log_lines_per_event, routes[].max_log_bytes_per_event)",
                self.caps.log_lines_per_event, self.caps.log_bytes_per_event
            )));
        }
        call.log_lines_left -= 1;
        call.log_bytes_left -= bytes;
        let message: String = message.chars().take(4096).collect();
        let plugin = self.plugin.as_str();
        // Recorded for one-event calls only (a batch call or set-up has no
        // one event).
        let event_id = call.event_id.as_deref();
        match level {
            Level::Trace => tracing::trace!(plugin, event_id, "{message}"),
            Level::Debug => tracing::debug!(plugin, event_id, "{message}"),
            Level::Info => tracing::info!(plugin, event_id, "{message}"),
            Level::Warn => tracing::warn!(plugin, event_id, "{message}"),
            Level::Error => tracing::error!(plugin, event_id, "{message}"),
        }
        Ok(())
    }

    fn count(&mut self, name: String, delta: u64) -> wasmtime::Result<()> {
        let well_formed = !name.is_empty()
            && name.len() <= MAX_COUNTER_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !well_formed {
            let shown: String = name.chars().take(80).collect();
            return Err(wasmtime::Error::msg(format!(
                "count: counter name `{shown}` is not 1-{MAX_COUNTER_NAME} characters of a-z, 0-9 and _"
            )));
        }
        if !self.counter_names.contains(&name) {
            if self.counter_names.len() >= MAX_COUNTERS {
                return Err(wasmtime::Error::msg(format!(
                    "count: `{name}` would be counter name number {}; a plugin may use at most {MAX_COUNTERS}",
                    MAX_COUNTERS + 1
                )));
            }
            self.counter_names.insert(name.clone());
        }
        let counts = &mut self.call.counts;
        match counts.iter_mut().find(|(n, _)| *n == name) {
            Some((_, total)) => *total = total.saturating_add(delta),
            None => counts.push((name, delta)),
        }
        Ok(())
    }
}

/// At most this many distinct `host.count` names per plugin (each is a
/// metrics series).
pub const MAX_COUNTERS: usize = 32;
/// The longest `host.count` name.
const MAX_COUNTER_NAME: usize = 64;

/// Caps all memories and tables of one instance together.
#[derive(Debug)]
pub struct Limiter {
    cap: usize,
    /// Bytes of memories and tables the instance holds now.
    pub used: usize,
    pub breach: Option<Limit>,
}

impl Limiter {
    fn new(cap: usize) -> Self {
        Limiter {
            cap,
            used: 0,
            breach: None,
        }
    }

    fn grow(&mut self, current: usize, desired: usize, what: &str) -> wasmtime::Result<bool> {
        let total = self.used.saturating_sub(current).saturating_add(desired);
        if total > self.cap {
            self.breach = Some(Limit::Memory);
            return Err(wasmtime::Error::msg(format!(
                "exceeded its memory cap of {} MiB (all memories and tables together; growing a {what} to {} KiB)",
                self.cap >> 20,
                desired >> 10
            )));
        }
        self.used = total;
        Ok(true)
    }
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.grow(current, desired, "memory")
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.grow(
            current.saturating_mul(TABLE_ELEMENT_BYTES),
            desired.saturating_mul(TABLE_ELEMENT_BYTES),
            "table",
        )
    }

    fn instances(&self) -> usize {
        32
    }
    fn tables(&self) -> usize {
        64
    }
    fn memories(&self) -> usize {
        8
    }
}

/// The only clock a plugin sees: stopped at the Unix epoch.
struct FrozenClock;

impl wasmtime_wasi::HostWallClock for FrozenClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl wasmtime_wasi::HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

/// A clock wait that is over at once: time does not pass for plugins.
struct Elapsed;

#[async_trait::async_trait]
impl Pollable for Elapsed {
    async fn ready(&mut self) {}
}

/// Replace WASI's clock waits (which would block the host thread for the
/// whole duration, out of reach of the CPU budget) with waits that are
/// over at once.
pub fn add_clock_waits(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    fn elapsed(
        mut cx: StoreContextMut<'_, HostState>,
    ) -> wasmtime::Result<(Resource<DynPollable>,)> {
        let table = &mut cx.data_mut().table;
        let r = table.push(Elapsed)?;
        Ok((wasmtime_wasi::p2::subscribe(table, r)?,))
    }
    linker.allow_shadowing(true);
    let mut clock = linker.instance("wasi:clocks/monotonic-clock@0.2.12")?;
    clock.func_wrap("subscribe-duration", |cx, (_,): (u64,)| elapsed(cx))?;
    clock.func_wrap("subscribe-instant", |cx, (_,): (u64,)| elapsed(cx))?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Guest stderr: the last [`STDERR_KEEP`] bytes; a write never fails.
#[derive(Clone, Default)]
pub struct StderrRing(Arc<Mutex<VecDeque<u8>>>);

impl StderrRing {
    fn push(&self, bytes: &[u8]) {
        if let Ok(mut buf) = self.0.lock() {
            let skip = bytes.len().saturating_sub(STDERR_KEEP);
            buf.extend(&bytes[skip..]);
            let excess = buf.len().saturating_sub(STDERR_KEEP);
            buf.drain(..excess);
        }
    }

    /// The bytes kept, oldest first.
    pub fn contents(&self) -> Vec<u8> {
        self.0
            .lock()
            .map(|b| b.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Forget what was written (a new call starts).
    pub fn clear(&self) {
        if let Ok(mut b) = self.0.lock() {
            b.clear();
        }
    }
}

impl IsTerminal for StderrRing {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for StderrRing {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

impl OutputStream for StderrRing {
    fn write(&mut self, bytes: bytes::Bytes) -> Result<(), StreamError> {
        self.push(&bytes);
        Ok(())
    }
    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }
    fn check_write(&mut self) -> Result<usize, StreamError> {
        Ok(64 << 10)
    }
}

#[async_trait::async_trait]
impl Pollable for StderrRing {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for StderrRing {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_keeps_the_last_bytes_and_never_fails() {
        let mut ring = StderrRing::default();
        for i in 0..10_000u32 {
            OutputStream::write(&mut ring, bytes::Bytes::from(format!("line {i}\n"))).unwrap();
        }
        let kept = String::from_utf8(ring.contents()).unwrap();
        assert_eq!(kept.len(), STDERR_KEEP);
        assert!(kept.ends_with("line 9999\n"), "{kept}");
        ring.push(&vec![b'x'; 3 * STDERR_KEEP]);
        assert_eq!(ring.contents(), vec![b'x'; STDERR_KEEP]);
    }

    #[test]
    fn the_memory_cap_covers_memories_and_tables_together() {
        let mut l = Limiter::new(1 << 20);
        assert!(l.memory_growing(0, 512 << 10, None).unwrap());
        assert!(l.memory_growing(0, 256 << 10, None).unwrap());
        // A table of 20k elements (320 KiB) would pass 1 MiB together.
        let e = l.table_growing(0, 20_000, None).unwrap_err();
        assert!(format!("{e}").contains("memory cap of 1 MiB"), "{e}");
        assert_eq!(l.breach, Some(Limit::Memory));
        assert!(l.table_growing(0, 1_000, None).unwrap());
        assert_eq!(l.used, (768 << 10) + 16_000);
    }

    #[test]
    fn thread_cpu_time_does_not_count_sleep() {
        let before = thread_cpu();
        std::thread::sleep(Duration::from_millis(50));
        assert!(thread_cpu() - before < Duration::from_millis(20));
        // Work advances it (however long a loaded machine takes to give
        // this thread 20 ms of CPU).
        let start = Instant::now();
        let mut x = 0u64;
        while thread_cpu() - before < Duration::from_millis(20)
            && start.elapsed() < Duration::from_secs(10)
        {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert!(thread_cpu() - before >= Duration::from_millis(20));
    }
}
