//! Whether the engine can still compute. Set once, when a step finds the device lost (a
//! sticky CUDA error: `runtime::backend::DeviceLost`): from then on `/health` answers 503
//! with the reason, new requests are refused with 503, and `serve` stops and exits with the
//! reason instead of failing every request that comes.

use std::sync::OnceLock;

use tokio::sync::Notify;

#[derive(Default)]
pub struct Health {
    lost: OnceLock<String>,
    notify: Notify,
}

impl Health {
    /// The device is lost for `why` (the first reason is kept).
    pub fn lose(&self, why: String) {
        let _ = self.lost.set(why);
        // A stored permit: a waiter that starts later still wakes.
        self.notify.notify_one();
    }

    /// Why the device is lost, if it is.
    pub fn lost(&self) -> Option<&str> {
        self.lost.get().map(String::as_str)
    }

    /// Resolves once the device is lost.
    pub async fn wait_lost(&self) {
        while self.lost().is_none() {
            self.notify.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_lost_device_is_reported_once_and_wakes_a_late_waiter() {
        let h = Health::default();
        assert!(h.lost().is_none());
        h.lose("illegal address".into());
        h.lose("a later error".into());
        assert_eq!(h.lost(), Some("illegal address"));
        tokio::time::timeout(std::time::Duration::from_secs(5), h.wait_lost())
            .await
            .expect("the waiter wakes");
    }
}
