//! A process's messages from its client, waiting for its guest: bounded in
//! number (`max_pending_messages`) and in bytes (`max_pending_bytes`), each
//! message charged its length plus a fixed overhead, so neither many small
//! messages nor a few large ones grow the worker's memory past what the
//! config states. A leaf.
//!
//! Invariant: the pending byte count is the sum of the charges of the
//! messages in the channel; a refused message is charged nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

/// What the worker keeps for one message beyond its bytes.
pub const MESSAGE_OVERHEAD_BYTES: usize = 64;

/// The client's end: one per process.
#[derive(Debug)]
pub struct InboxSender {
    tx: mpsc::Sender<String>,
    pending_bytes: Arc<AtomicUsize>,
    max_bytes: usize,
}

/// The guest's end.
#[derive(Debug)]
pub struct InboxReceiver {
    rx: mpsc::Receiver<String>,
    pending_bytes: Arc<AtomicUsize>,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum InboxError {
    #[error("{0} messages wait already ([runtime.inferlets] max_pending_messages)")]
    TooMany(usize),
    #[error(
        "{waiting} bytes of messages wait and this one has {adding}, past \
         [runtime.inferlets] max_pending_bytes = {max}"
    )]
    TooLarge {
        waiting: usize,
        adding: usize,
        max: usize,
    },
    #[error("the process takes no more messages")]
    Closed,
}

/// A new inbox of at most `max_messages` messages and `max_bytes` bytes.
pub fn inbox(max_messages: usize, max_bytes: usize) -> (InboxSender, InboxReceiver) {
    let (tx, rx) = mpsc::channel(max_messages.max(1));
    let pending_bytes = Arc::<AtomicUsize>::default();
    (
        InboxSender {
            tx,
            pending_bytes: pending_bytes.clone(),
            max_bytes,
        },
        InboxReceiver { rx, pending_bytes },
    )
}

fn charge(message: &str) -> usize {
    message.len() + MESSAGE_OVERHEAD_BYTES
}

impl InboxSender {
    /// Queue `message`, or say which bound it would pass.
    pub fn try_send(&self, message: String) -> Result<(), InboxError> {
        let adding = charge(&message);
        self.pending_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |waiting| {
                (waiting + adding <= self.max_bytes).then_some(waiting + adding)
            })
            .map_err(|waiting| InboxError::TooLarge {
                waiting,
                adding,
                max: self.max_bytes,
            })?;
        self.tx.try_send(message).map_err(|e| {
            self.pending_bytes.fetch_sub(adding, Ordering::AcqRel);
            match e {
                mpsc::error::TrySendError::Full(_) => InboxError::TooMany(self.tx.max_capacity()),
                mpsc::error::TrySendError::Closed(_) => InboxError::Closed,
            }
        })
    }
}

impl InboxReceiver {
    /// The next message; None once every sender is gone.
    pub async fn recv(&mut self) -> Option<String> {
        let message = self.rx.recv().await?;
        Some(self.taken(message))
    }

    /// The next message if one waits.
    pub fn try_recv(&mut self) -> Option<String> {
        let message = self.rx.try_recv().ok()?;
        Some(self.taken(message))
    }

    fn taken(&self, message: String) -> String {
        self.pending_bytes
            .fetch_sub(charge(&message), Ordering::AcqRel);
        message
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEN: usize = 10 + MESSAGE_OVERHEAD_BYTES;

    #[tokio::test]
    async fn bytes_are_bounded_and_freed_on_receipt() {
        let (tx, mut rx) = inbox(100, 3 * TEN);
        let ten = || "x".repeat(10);
        for _ in 0..3 {
            tx.try_send(ten()).unwrap();
        }
        let err = tx.try_send(String::new()).unwrap_err();
        assert!(err.to_string().contains("max_pending_bytes"), "{err}");
        assert_eq!(rx.try_recv().as_deref(), Some("xxxxxxxxxx"));
        tx.try_send(ten()).unwrap();
        assert_eq!(rx.recv().await.map(|m| m.len()), Some(10));
        assert_eq!(
            tx.pending_bytes.load(Ordering::Relaxed),
            2 * TEN,
            "a refused message is charged nothing"
        );
    }

    #[test]
    fn the_number_is_bounded_and_a_refusal_charges_nothing() {
        let (tx, _rx) = inbox(2, 100 * TEN);
        tx.try_send(String::new()).unwrap();
        tx.try_send(String::new()).unwrap();
        assert_eq!(tx.try_send(String::new()), Err(InboxError::TooMany(2)));
        assert_eq!(
            tx.pending_bytes.load(Ordering::Relaxed),
            2 * MESSAGE_OVERHEAD_BYTES
        );
    }
}
