//! How long the server's request path has been busy: a request is in it from its handler's
//! start until it is handed to the engine (parsing, validation, tokenising). On a machine
//! of few cores that work shares the cores with the engine's step, and a step it overlaps
//! runs slower; the step log records this clock at each step's start so that `engine
//! profile` can tell the steps an arrival overlapped from the ones none did.

use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Seconds during which at least one request was in the path (overlapping requests count
/// once: it is the time the path was busy, not the sum of the requests' times).
#[derive(Debug)]
pub struct RequestPath {
    state: Mutex<PathState>,
}

#[derive(Debug)]
struct PathState {
    in_path: usize,
    /// When the path last went from empty to busy.
    busy_since: Instant,
    /// Busy seconds before `busy_since`.
    busy_before_s: f64,
}

impl Default for RequestPath {
    fn default() -> Self {
        RequestPath {
            state: Mutex::new(PathState {
                in_path: 0,
                busy_since: Instant::now(),
                busy_before_s: 0.0,
            }),
        }
    }
}

impl RequestPath {
    /// A request enters the path; it leaves when the returned guard is dropped.
    pub fn enter(self: &Arc<Self>) -> InPath {
        self.enter_at(Instant::now());
        InPath { path: self.clone() }
    }

    /// Busy seconds up to `at` (the clock is monotonic in `at`).
    pub fn busy_s(&self, at: Instant) -> f64 {
        let s = self.state.lock().unwrap();
        if s.in_path > 0 {
            s.busy_before_s + at.saturating_duration_since(s.busy_since).as_secs_f64()
        } else {
            s.busy_before_s
        }
    }

    fn enter_at(&self, at: Instant) {
        let mut s = self.state.lock().unwrap();
        if s.in_path == 0 {
            s.busy_since = at;
        }
        s.in_path += 1;
    }

    fn leave_at(&self, at: Instant) {
        let mut s = self.state.lock().unwrap();
        s.in_path -= 1;
        if s.in_path == 0 {
            s.busy_before_s += at.saturating_duration_since(s.busy_since).as_secs_f64();
        }
    }
}

/// A request in the path (see [`RequestPath::enter`]).
pub struct InPath {
    path: Arc<RequestPath>,
}

impl Drop for InPath {
    fn drop(&mut self) {
        self.path.leave_at(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn overlapping_requests_count_once_and_idle_time_not_at_all() {
        let path = RequestPath::default();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let busy_ms = |ms: u64| (path.busy_s(at(ms)) * 1e3).round() as u64;
        path.enter_at(at(10));
        assert_eq!(busy_ms(10), 0);
        assert_eq!(busy_ms(14), 4, "busy while a request is in it");
        path.enter_at(at(12)); // a second request overlaps the first
        path.leave_at(at(15));
        path.leave_at(at(20));
        assert_eq!(busy_ms(20), 10, "10..20 ms, once");
        assert_eq!(busy_ms(50), 10, "nothing while empty");
        path.enter_at(at(50));
        path.leave_at(at(53));
        assert_eq!(busy_ms(60), 13);
    }

    #[test]
    fn a_guard_leaves_when_dropped() {
        let path = Arc::new(RequestPath::default());
        let guard = path.enter();
        std::thread::sleep(Duration::from_millis(2));
        let during = path.busy_s(Instant::now());
        assert!(during > 0.0, "busy while the guard lives");
        drop(guard);
        let after = path.busy_s(Instant::now());
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(
            path.busy_s(Instant::now()),
            after,
            "the clock stops once it is empty"
        );
    }
}
