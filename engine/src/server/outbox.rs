//! One HTTP request's events on their way from the engine loop to its handler.
//!
//! A reader that keeps up gets one event per token: one stream chunk per token, each timed
//! as it was generated. Once a choice has [`MERGE_AFTER`] events queued — its client
//! stopped reading the stream — its further tokens merge into its last queued event, as
//! vLLM's output collector merges whenever its reader lags. What such a request holds then
//! grows with its text (and the logprobs it asked for), not by an event per token; the
//! engine never waits for a reader. The count is per choice, so a wide request (`n` = 64)
//! whose step sends one event to each choice at once is not merged for that.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::engine_loop::StreamEvent;

/// A choice's events queued before its further tokens merge: a reader this far behind is
/// not keeping up.
pub const MERGE_AFTER: usize = 64;

struct Queue {
    events: VecDeque<StreamEvent>,
    /// Token events queued, by choice.
    queued: Vec<usize>,
    /// Live [`Outbox`]es: at none, the reader has seen everything it will.
    senders: usize,
    /// The [`Inbox`] is alive.
    reader: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Woken on each event and when the last sender goes.
    ready: Notify,
}

/// The engine loop's end: cloned for each sequence of the request.
pub struct Outbox(Arc<Shared>);

/// The handler's end.
pub struct Inbox(Arc<Shared>);

/// The reader has gone: the client went away.
#[derive(Debug, PartialEq)]
pub struct Gone;

/// A request's two ends.
pub fn outbox() -> (Outbox, Inbox) {
    let shared = Arc::new(Shared {
        queue: Mutex::new(Queue {
            events: VecDeque::new(),
            queued: Vec::new(),
            senders: 1,
            reader: true,
        }),
        ready: Notify::new(),
    });
    (Outbox(shared.clone()), Inbox(shared))
}

impl Outbox {
    /// Queue an event, merging a token into its choice's last queued event once that choice
    /// has [`MERGE_AFTER`] queued. Never blocks on the reader.
    pub fn send(&self, event: StreamEvent) -> Result<(), Gone> {
        let mut q = self.0.queue.lock().unwrap();
        if !q.reader {
            return Err(Gone);
        }
        let event = match q.merge(event) {
            Some(unmerged) => unmerged,
            None => return Ok(()),
        };
        if let StreamEvent::Token { index, .. } = event {
            if q.queued.len() <= index {
                q.queued.resize(index + 1, 0);
            }
            q.queued[index] += 1;
        }
        q.events.push_back(event);
        drop(q);
        self.0.ready.notify_one();
        Ok(())
    }
}

impl Queue {
    /// Merge a token into the last queued event of its choice if the choice has
    /// [`MERGE_AFTER`] queued (and that event has not ended it); otherwise hand it back.
    fn merge(&mut self, event: StreamEvent) -> Option<StreamEvent> {
        let StreamEvent::Token { index, .. } = event else {
            return Some(event);
        };
        if self.queued.get(index).copied().unwrap_or(0) < MERGE_AFTER {
            return Some(event);
        }
        let last = self
            .events
            .iter_mut()
            .rev()
            .find(|e| matches!(e, StreamEvent::Token { index: i, .. } if *i == index))
            .expect("a choice with events queued has a last one");
        last.absorb(event)
    }

    fn pop(&mut self) -> Option<StreamEvent> {
        let event = self.events.pop_front()?;
        if let StreamEvent::Token { index, .. } = event {
            self.queued[index] -= 1;
        }
        Some(event)
    }
}

impl Clone for Outbox {
    fn clone(&self) -> Self {
        self.0.queue.lock().unwrap().senders += 1;
        Outbox(self.0.clone())
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        let mut q = self.0.queue.lock().unwrap();
        q.senders -= 1;
        if q.senders == 0 {
            drop(q);
            self.0.ready.notify_one();
        }
    }
}

impl Inbox {
    /// The next event, or `None` once every sender has gone and all was read.
    pub async fn recv(&mut self) -> Option<StreamEvent> {
        loop {
            {
                let mut q = self.0.queue.lock().unwrap();
                if let Some(e) = q.pop() {
                    return Some(e);
                }
                if q.senders == 0 {
                    return None;
                }
            }
            // A wake between the check and here leaves a permit: this returns at once.
            self.0.ready.notified().await;
        }
    }

    /// The next event already queued, without waiting.
    #[cfg(test)]
    pub fn try_recv(&mut self) -> Option<StreamEvent> {
        self.0.queue.lock().unwrap().pop()
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        let mut q = self.0.queue.lock().unwrap();
        q.reader = false;
        q.events.clear();
        q.queued.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::super::engine_loop::SampledLogprob;
    use super::*;
    use crate::runtime::engine_core::TokenLogprob;

    fn token(index: usize, text: &str, id: u32) -> StreamEvent {
        StreamEvent::Token {
            index,
            text: text.into(),
            token_ids: vec![id],
            logprobs: vec![SampledLogprob {
                logprob: TokenLogprob {
                    token: id,
                    logprob: -(id as f32),
                    top: vec![(id, -(id as f32))],
                    rank: None,
                },
                chars: text.chars().count(),
            }],
            finish: None,
            prompt_logprobs: None,
            stop_reason: None,
        }
    }

    fn drain(inbox: &mut Inbox) -> Vec<StreamEvent> {
        std::iter::from_fn(|| inbox.try_recv()).collect()
    }

    /// A reader that keeps up gets every token as its own event.
    #[test]
    fn a_reader_that_keeps_up_gets_one_event_per_token() {
        let (tx, mut rx) = outbox();
        for i in 0..3 * MERGE_AFTER as u32 {
            tx.send(token(0, "a", i)).unwrap();
            assert_eq!(rx.try_recv(), Some(token(0, "a", i)));
        }
    }

    /// Behind by `MERGE_AFTER`, a choice's tokens merge into its last queued event: nothing
    /// is lost, order within a choice is kept, and the queue stops growing.
    #[test]
    fn a_reader_far_behind_gets_its_tokens_merged_without_loss() {
        let (tx, mut rx) = outbox();
        let mut want = [String::new(), String::new()];
        let total = 10_000u32;
        for i in 0..total {
            let index = (i % 2) as usize;
            let piece = format!("<{i}>");
            want[index].push_str(&piece);
            tx.send(token(index, &piece, i)).unwrap();
        }
        tx.send(StreamEvent::Error(
            crate::runtime::engine_core::RequestFailure::server("end"),
        ))
        .unwrap();
        let events = drain(&mut rx);
        let kept = 2 * MERGE_AFTER;
        assert_eq!(events.len(), kept + 1, "merged, then the error after");
        let mut got = [String::new(), String::new()];
        let mut ids = [Vec::new(), Vec::new()];
        let mut counted = 0;
        for e in &events[..kept] {
            let StreamEvent::Token {
                index,
                text,
                token_ids,
                logprobs,
                ..
            } = e
            else {
                panic!("{e:?}")
            };
            got[*index].push_str(text);
            // The merged ids are the merged logprobs' tokens, in order.
            let named: Vec<u32> = logprobs.iter().map(|l| l.logprob.token).collect();
            assert_eq!(token_ids, &named);
            let chars: usize = logprobs.iter().map(|l| l.chars).sum();
            assert_eq!(chars, text.chars().count());
            counted += token_ids.len();
            ids[*index].extend(logprobs.iter().map(|l| l.logprob.token));
        }
        assert_eq!(got, want);
        assert_eq!(counted, total as usize);
        for (index, ids) in ids.iter().enumerate() {
            let want: Vec<u32> = (0..total).filter(|i| (i % 2) as usize == index).collect();
            assert_eq!(ids, &want);
        }
        assert!(matches!(events[kept], StreamEvent::Error(_)));
    }

    /// The count is per choice: a hundred choices each a few tokens behind are not merged.
    #[test]
    fn a_wide_request_a_few_steps_behind_is_not_merged() {
        let (tx, mut rx) = outbox();
        for step in 0..3 {
            for index in 0..100 {
                tx.send(token(index, "x", step)).unwrap();
            }
        }
        let events = drain(&mut rx);
        assert_eq!(events.len(), 300);
        assert!(events
            .iter()
            .all(|e| matches!(e, StreamEvent::Token { token_ids, .. } if token_ids.len() == 1)));
    }

    /// A choice's last token merges like any other, carrying the end; nothing merges
    /// into an event that has ended its choice.
    #[test]
    fn a_choice_ends_with_its_merged_event() {
        let (tx, mut rx) = outbox();
        for i in 0..MERGE_AFTER as u32 {
            tx.send(token(1, "b", i)).unwrap();
        }
        let finish = super::super::engine_loop::Finish {
            reason: infer_core::FinishReason::Length,
            prompt_tokens: 1,
            completion_tokens: MERGE_AFTER + 1,
            cached_tokens: 0,
            reasoning_tokens: 0,
        };
        let mut last = token(1, "end", 99);
        if let StreamEvent::Token { finish: f, .. } = &mut last {
            *f = Some(finish);
        }
        tx.send(last).unwrap();
        tx.send(token(1, "after", 100)).unwrap();
        let events = drain(&mut rx);
        assert_eq!(events.len(), MERGE_AFTER + 1);
        match &events[MERGE_AFTER - 1] {
            StreamEvent::Token {
                text,
                token_ids,
                finish: f,
                ..
            } => assert_eq!(
                (text.as_str(), token_ids.as_slice(), *f),
                (
                    "bend",
                    [MERGE_AFTER as u32 - 1, 99].as_slice(),
                    Some(finish)
                )
            ),
            e => panic!("{e:?}"),
        }
        assert_eq!(events[MERGE_AFTER], token(1, "after", 100));
    }

    /// The reader sees the end once every sender is gone, after what they queued; a sender
    /// learns that the reader has gone.
    #[tokio::test]
    async fn the_ends_see_each_other_go() {
        let (tx, mut rx) = outbox();
        let other = tx.clone();
        let reader = tokio::spawn(async move {
            let mut n = 0;
            while rx.recv().await.is_some() {
                n += 1;
            }
            n
        });
        tx.send(token(0, "a", 1)).unwrap();
        drop(tx);
        other.send(token(1, "b", 2)).unwrap();
        drop(other);
        assert_eq!(reader.await.unwrap(), 2);

        let (tx, rx) = outbox();
        drop(rx);
        assert_eq!(tx.send(token(0, "a", 1)), Err(Gone));
    }
}
