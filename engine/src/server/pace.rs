//! Pacing of the cheap endpoints (`/health`, `/metrics`, the model list, what routers
//! read): together they are answered at most `per_second` times a second after a burst,
//! each answer beyond that waiting its turn (first come, first answered), never refused.
//!
//! An answer costs little, but a client that asks again as soon as it is answered costs a
//! core: measured here, sixteen such connections got 120,000 `/health` answers a second and
//! stretched a stream's inter-token latency 12×, and a `/metrics` flood 3×. Health checks
//! and scrapes come a few times a second; a pace of a thousand leaves them unaffected and
//! bounds what a flood can take. (The same rule as nginx's `limit_req` with `delay`: the
//! generic cell rate algorithm, its state one instant.)

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

pub(super) struct Pacer {
    /// Between two answers at the pace.
    interval: Duration,
    /// How far ahead of the pace a burst may run.
    burst: Duration,
    /// When the answer after the last one is due at the pace ("theoretical arrival time").
    due: Mutex<Option<Instant>>,
}

impl Pacer {
    pub fn new(per_second: u32, burst: u32) -> Pacer {
        let interval = Duration::from_secs(1) / per_second.max(1);
        Pacer {
            interval,
            burst: interval * burst,
            due: Mutex::new(None),
        }
    }

    /// How long an answer asked for at `now` waits.
    fn wait(&self, now: Instant) -> Duration {
        let mut due = self.due.lock().unwrap();
        let at = due.map_or(now, |d| d.max(now));
        *due = Some(at + self.interval);
        at.saturating_duration_since(now + self.burst)
    }
}

/// The middleware: waits for the request's turn, then answers it.
pub(super) async fn paced(State(pacer): State<Arc<Pacer>>, req: Request, next: Next) -> Response {
    let wait = pacer.wait(Instant::now());
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_goes_at_once_then_answers_keep_the_pace() {
        let p = Pacer::new(1000, 4);
        let t0 = Instant::now();
        let waits: Vec<Duration> = (0..8).map(|_| p.wait(t0)).collect();
        let ms = |n: u64| Duration::from_millis(n);
        assert_eq!(waits, [0, 0, 0, 0, 0, 1, 2, 3].map(ms));
        // Time passing pays the debt back: 10 ms later a burst is allowed again.
        let later = t0 + ms(18);
        assert_eq!(p.wait(later), Duration::ZERO);
        // At the pace exactly, nobody waits.
        let p = Pacer::new(100, 0);
        for i in 0..50 {
            assert_eq!(p.wait(t0 + ms(10 * i)), Duration::ZERO);
        }
        assert_eq!(p.wait(t0 + ms(495)), ms(5), "early by 5 ms: waits 5 ms");
    }
}
