//! How long to wait before trying again: every retry delay in the relay
//! (plugins, brokers, databases, sources that cannot start yet) goes
//! through [`jitter`], so relays and workers that failed together do not
//! retry together.

use std::time::Duration;

/// Between 50% and 100% of `d` ("equal jitter"), so retries spread out.
pub fn jitter(d: Duration) -> Duration {
    use rand::Rng;
    let f: f64 = rand::rng().random_range(0.5..=1.0);
    d.mul_f64(f)
}
