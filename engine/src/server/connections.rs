//! The open connections, and which one gives way when there are too many.
//!
//! At most `max` connections are open, and, when set, at most `per_address` from one IP
//! address (off by default: behind a router every request comes from one address). A
//! connection over a limit takes the place of the open connection idle the longest — one
//! with no request in progress: still to send its first request, or between requests of a
//! keep-alive — of its own address when its address is over its limit. Only when every
//! open connection is in the middle of a request is the new one refused (503). A flood of
//! idle sockets thus costs the others nothing: before, 1,024 of them answered every other
//! client 503 for the 10 s header deadline, again and again. nginx frees its idle
//! keep-alive connections the same way when it runs short (`ngx_drain_connections`).
//!
//! A reaped connection is closed gracefully: one whose request has just begun finishes it
//! first.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::sync::Notify;

pub(super) struct Connections {
    max: usize,
    per_address: Option<usize>,
    state: Mutex<Registry>,
    /// Signalled when the last connection closes.
    all_closed: Notify,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    /// Those counted against the limits.
    open: HashMap<u64, Open>,
    by_address: HashMap<IpAddr, usize>,
    /// Connections whose task still runs, counted or reaped.
    live: usize,
}

struct Open {
    address: IpAddr,
    /// Requests in progress (HTTP/1: at most one).
    busy: usize,
    idle_since: Instant,
    close: Arc<Notify>,
}

impl Registry {
    fn forget(&mut self, id: u64) -> Option<Open> {
        let conn = self.open.remove(&id)?;
        if let Some(n) = self.by_address.get_mut(&conn.address) {
            *n -= 1;
            if *n == 0 {
                self.by_address.remove(&conn.address);
            }
        }
        Some(conn)
    }
}

/// Why a connection was refused.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    TooMany,
    TooManyFromAddress,
}

impl Refusal {
    pub fn message(&self) -> &'static str {
        match self {
            Refusal::TooMany => "too many open connections",
            Refusal::TooManyFromAddress => "too many open connections from this address",
        }
    }
}

impl Connections {
    pub fn new(max: usize, per_address: Option<usize>) -> Arc<Connections> {
        Arc::new(Connections {
            max,
            per_address,
            state: Mutex::default(),
            all_closed: Notify::new(),
        })
    }

    /// Count a new connection from `address`, reaping an idle one if a limit is reached.
    pub fn admit(self: &Arc<Self>, address: IpAddr, now: Instant) -> Result<Ticket, Refusal> {
        let mut r = self.state.lock().unwrap();
        let over_address = self
            .per_address
            .is_some_and(|m| r.by_address.get(&address).copied().unwrap_or(0) >= m);
        if over_address || r.open.len() >= self.max {
            let idlest = r
                .open
                .iter()
                .filter(|(_, c)| c.busy == 0 && (!over_address || c.address == address))
                .min_by_key(|(&id, c)| (c.idle_since, id))
                .map(|(&id, _)| id);
            let Some(id) = idlest else {
                return Err(if over_address {
                    Refusal::TooManyFromAddress
                } else {
                    Refusal::TooMany
                });
            };
            let reaped = r.forget(id).expect("listed");
            // A stored permit: the connection's task sees it whenever it next looks.
            reaped.close.notify_one();
        }
        let id = r.next_id;
        r.next_id += 1;
        let close = Arc::new(Notify::new());
        r.open.insert(
            id,
            Open {
                address,
                busy: 0,
                idle_since: now,
                close: close.clone(),
            },
        );
        *r.by_address.entry(address).or_default() += 1;
        r.live += 1;
        Ok(Ticket {
            id,
            connections: self.clone(),
            close,
        })
    }

    /// Close every connection, each after the request it is serving.
    pub fn close_all(&self) {
        let r = self.state.lock().unwrap();
        for conn in r.open.values() {
            conn.close.notify_one();
        }
    }

    /// Resolves when no connection is left.
    pub async fn all_closed(&self) {
        loop {
            let notified = self.all_closed.notified();
            if self.state.lock().unwrap().live == 0 {
                return;
            }
            notified.await;
        }
    }

    fn set_busy(&self, id: u64, busy: bool) {
        let mut r = self.state.lock().unwrap();
        if let Some(c) = r.open.get_mut(&id) {
            if busy {
                c.busy += 1;
            } else {
                c.busy -= 1;
                if c.busy == 0 {
                    c.idle_since = Instant::now();
                }
            }
        }
    }

    #[cfg(test)]
    fn open(&self) -> usize {
        self.state.lock().unwrap().open.len()
    }
}

/// An admitted connection: counted until dropped (its task's end).
pub(super) struct Ticket {
    id: u64,
    connections: Arc<Connections>,
    /// Notified when the connection is to close: reaped, or the server shutting down.
    pub close: Arc<Notify>,
}

impl Ticket {
    /// Marks the connection busy until the returned guard is dropped (attach it to the
    /// response body: the request is over when its body is sent or dropped).
    pub fn busy(&self) -> Busy {
        self.connections.set_busy(self.id, true);
        Busy {
            id: self.id,
            connections: self.connections.clone(),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut r = self.connections.state.lock().unwrap();
        r.forget(self.id);
        r.live -= 1;
        if r.live == 0 {
            self.connections.all_closed.notify_waiters();
        }
    }
}

pub(super) struct Busy {
    id: u64,
    connections: Arc<Connections>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.connections.set_busy(self.id, false);
    }
}

/// A response body that keeps its connection busy until it is sent or dropped.
pub(super) struct BusyBody {
    inner: axum::body::Body,
    /// Held for its drop.
    _busy: Busy,
}

impl BusyBody {
    pub fn new(inner: axum::body::Body, busy: Busy) -> BusyBody {
        BusyBody { inner, _busy: busy }
    }
}

impl http_body::Body for BusyBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn the_longest_idle_gives_way_and_busy_ones_never_do() {
        let c = Connections::new(3, None);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let a = c.admit(ip(1), at(0)).unwrap();
        let b = c.admit(ip(2), at(1)).unwrap();
        let d = c.admit(ip(3), at(2)).unwrap();
        let _busy_a = a.busy();
        // Full: b (idle the longest, a being busy) is reaped for e.
        let e = c.admit(ip(4), at(3)).unwrap();
        assert_eq!(c.open(), 3);
        assert!(notified(&b.close), "b told to close");
        assert!(!notified(&d.close) && !notified(&a.close));
        // Every open one busy: refused.
        let _busy_d = d.busy();
        let busy_e = e.busy();
        assert_eq!(c.admit(ip(5), at(4)).err(), Some(Refusal::TooMany));
        drop(b); // its task ends: nothing changes, it was no longer counted
        assert_eq!(c.open(), 3);
        drop(busy_e); // e idle again: reaped next
        let _f = c.admit(ip(6), at(5)).unwrap();
        assert!(notified(&e.close));
    }

    #[test]
    fn an_address_over_its_limit_reaps_its_own_idle_connection_or_is_refused() {
        let c = Connections::new(100, Some(2));
        let t0 = Instant::now();
        let other = c.admit(ip(9), t0).unwrap(); // idle the longest, another address
        let a1 = c.admit(ip(1), t0 + Duration::from_millis(1)).unwrap();
        let a2 = c.admit(ip(1), t0 + Duration::from_millis(2)).unwrap();
        let a3 = c.admit(ip(1), t0 + Duration::from_millis(3)).unwrap();
        assert!(notified(&a1.close), "its own longest idle");
        assert!(!notified(&other.close) && !notified(&a2.close));
        let _b2 = a2.busy();
        let _b3 = a3.busy();
        assert_eq!(c.admit(ip(1), t0).err(), Some(Refusal::TooManyFromAddress));
        assert!(
            c.admit(ip(2), t0).is_ok(),
            "other addresses are not limited by it"
        );
    }

    #[tokio::test]
    async fn all_closed_waits_for_every_task() {
        let c = Connections::new(4, None);
        let a = c.admit(ip(1), Instant::now()).unwrap();
        let b = c.admit(ip(1), Instant::now()).unwrap();
        c.close_all();
        assert!(notified(&a.close) && notified(&b.close));
        let waiter = tokio::spawn({
            let c = c.clone();
            async move { c.all_closed().await }
        });
        drop(a);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        drop(b);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("resolves once the last closes")
            .unwrap();
    }

    /// Whether `n` holds a permit (taking it).
    fn notified(n: &Notify) -> bool {
        use std::future::Future;
        let fut = n.notified();
        let mut fut = std::pin::pin!(fut);
        let waker = std::task::Waker::noop();
        fut.as_mut()
            .poll(&mut Context::from_waker(waker))
            .is_ready()
    }
}
