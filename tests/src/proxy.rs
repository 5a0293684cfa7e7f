//! A TCP fault proxy between the relay and a real broker or database: it
//! forwards bytes both ways and, on command, cuts every connection after
//! some bytes, delays, black-holes (stops forwarding, connections stay
//! open), refuses (closes every connection and every new one) or strands
//! the connections open now (they forward nothing, ever, and stay open;
//! new ones work: a partition that dropped one path, or a failover that
//! left the old address dark). The peer is real; only the network between
//! is made to misbehave.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the network does right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything.
    None,
    /// Close every connection once this many more bytes went through.
    CutAfter(u64),
    /// Hold every chunk this long before forwarding it.
    Delay(Duration),
    /// Forward nothing (the bytes wait, as over a partition); connections stay open.
    BlackHole,
    /// Close every connection, and every new one at once.
    Refuse,
}

/// A running proxy; dropping it stops accepting.
pub struct FaultProxy {
    /// `127.0.0.1:port` to point the client at.
    pub addr: String,
    fault: Arc<watch::Sender<Fault>>,
    /// Bytes forwarded so far (both directions, all connections).
    forwarded: Arc<AtomicU64>,
    /// Bumped to close every open connection.
    kill: Arc<watch::Sender<u64>>,
    /// Bumped to strand every open connection (see [`FaultProxy::strand`]).
    strand: Arc<watch::Sender<u64>>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listen on `listen` (e.g. "127.0.0.1:0") and forward to `upstream`.
    pub async fn start(listen: &str, upstream: &str) -> Result<FaultProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?.to_string();
        let (fault, fault_rx) = watch::channel(Fault::None);
        let (kill, kill_rx) = watch::channel(0u64);
        let (strand, strand_rx) = watch::channel(0u64);
        let (fault, kill, strand) = (Arc::new(fault), Arc::new(kill), Arc::new(strand));
        let forwarded = Arc::new(AtomicU64::new(0));
        let upstream = upstream.to_string();
        let fwd = forwarded.clone();
        let (fault_tx, kill_tx) = (fault.clone(), kill.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                if *fault_rx.borrow() == Fault::Refuse {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let born = *strand_rx.borrow();
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                for (r, w) in [
                    (
                        Box::new(cr) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                        Box::new(sw) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                    ),
                    (Box::new(sr), Box::new(cw)),
                ] {
                    let pipe = Pipe {
                        fault: fault_rx.clone(),
                        kill: kill_rx.clone(),
                        strand: strand_rx.clone(),
                        born,
                        forwarded: fwd.clone(),
                        cut: (fault_tx.clone(), kill_tx.clone()),
                    };
                    tokio::spawn(pipe.pump(r, w));
                }
            }
        });
        Ok(FaultProxy {
            addr,
            fault,
            forwarded,
            kill,
            strand,
            accept,
        })
    }

    /// Change what the network does. `Refuse` and `CutAfter` act on the
    /// connections open now.
    pub fn set(&self, f: Fault) {
        match f {
            Fault::Refuse => {
                let _ = self.fault.send(f);
                self.kill.send_modify(|g| *g += 1);
            }
            Fault::CutAfter(n) => {
                let _ = self
                    .fault
                    .send(Fault::CutAfter(self.forwarded.load(Ordering::SeqCst) + n));
            }
            f => {
                let _ = self.fault.send(f);
            }
        }
    }

    /// Close every open connection now (a partition that ended in timeouts).
    pub fn cut_all(&self) {
        self.kill.send_modify(|g| *g += 1);
    }

    /// Strand every connection open now: from here on it forwards nothing
    /// and is never closed (no FIN, no RST: the peers wait for good).
    /// Connections opened later are forwarded as usual.
    pub fn strand(&self) {
        self.strand.send_modify(|g| *g += 1);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.kill.send_modify(|g| *g += 1);
    }
}

/// One direction of one connection.
struct Pipe {
    fault: watch::Receiver<Fault>,
    kill: watch::Receiver<u64>,
    strand: watch::Receiver<u64>,
    /// The strand generation when the connection was accepted.
    born: u64,
    forwarded: Arc<AtomicU64>,
    /// To end a cut: back to no fault, every connection closed.
    cut: (Arc<watch::Sender<Fault>>, Arc<watch::Sender<u64>>),
}

impl Pipe {
    /// Copy until either side closes, the proxy kills the connection, or a
    /// cut is due.
    async fn pump(
        mut self,
        mut r: Box<dyn tokio::io::AsyncRead + Send + Unpin>,
        mut w: Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
    ) {
        let mut buf = vec![0u8; 64 * 1024];
        self.kill.mark_unchanged();
        loop {
            if *self.strand.borrow_and_update() > self.born {
                // Stranded: forward nothing until the proxy goes away.
                let _ = self.kill.changed().await;
                return;
            }
            // Black hole: read nothing until the fault changes or we are killed.
            while *self.fault.borrow_and_update() == Fault::BlackHole {
                tokio::select! {
                    _ = self.kill.changed() => return,
                    r = self.fault.changed() => if r.is_err() { return },
                }
            }
            let n = tokio::select! {
                _ = self.kill.changed() => return,
                _ = self.strand.changed() => continue,
                n = r.read(&mut buf) => match n {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                },
            };
            // A chunk read as the black hole began waits with the rest
            // (forwarded, it would slip one message and its answer through).
            while *self.fault.borrow_and_update() == Fault::BlackHole {
                tokio::select! {
                    _ = self.kill.changed() => return,
                    r = self.fault.changed() => if r.is_err() { return },
                }
            }
            let current = *self.fault.borrow();
            match current {
                Fault::Delay(d) => tokio::time::sleep(d).await,
                Fault::CutAfter(at) => {
                    let done = self.forwarded.load(Ordering::SeqCst);
                    if done + n as u64 >= at {
                        // Forward up to the cut, then close every connection.
                        let before = (at.saturating_sub(done) as usize).min(n);
                        let _ = w.write_all(&buf[..before]).await;
                        self.forwarded.fetch_add(before as u64, Ordering::SeqCst);
                        self.cut.0.send_if_modified(|f| {
                            let due = *f == current;
                            if due {
                                *f = Fault::None;
                            }
                            due
                        });
                        self.cut.1.send_modify(|g| *g += 1);
                        return;
                    }
                }
                Fault::Refuse => return,
                Fault::None | Fault::BlackHole => {}
            }
            if w.write_all(&buf[..n]).await.is_err() {
                return;
            }
            self.forwarded.fetch_add(n as u64, Ordering::SeqCst);
        }
    }
}

/// xorshift64*: enough randomness for fault schedules, reproducible by seed.
pub struct Rng(u64);

impl Rng {
    pub fn from_env() -> Rng {
        let seed = std::env::var("OUTROUTE_FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(42)
                    | 1
            });
        println!("fault seed: {seed} (OUTROUTE_FAULT_SEED={seed} replays it)");
        Rng(seed)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Run `n` random faults through `proxy`, each held 10–250 ms, with 0–150 ms
/// of normal network between them. Returns how many of each kind ran.
pub async fn inject(proxy: &FaultProxy, rng: &mut Rng, n: usize) -> [usize; 4] {
    let mut kinds = [0usize; 4];
    for _ in 0..n {
        let k = rng.below(4) as usize;
        kinds[k] += 1;
        let fault = match k {
            0 => Fault::CutAfter(rng.below(20_000)),
            1 => Fault::Delay(Duration::from_millis(1 + rng.below(100))),
            2 => Fault::BlackHole,
            _ => Fault::Refuse,
        };
        proxy.set(fault);
        tokio::time::sleep(Duration::from_millis(10 + rng.below(240))).await;
        if fault == Fault::BlackHole && rng.below(2) == 0 {
            // The partition ends the way long ones do: connections time out.
            proxy.cut_all();
        }
        proxy.set(Fault::None);
        tokio::time::sleep(Duration::from_millis(rng.below(150))).await;
    }
    kinds
}
