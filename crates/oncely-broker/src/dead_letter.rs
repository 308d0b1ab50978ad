//! Inbox dead letters, listed and requeued the same way on every broker.
//!
//! # Design
//!
//! A consumer group's dead letters stay where its subscriber put them (SQL transport:
//! `oncely_deliveries` rows in state `dead`; RabbitMQ: queue `<prefix>.<group>.dead`; NATS:
//! stream `ONCELY_DLQ`, subjects `oncely.dlq.<group>.<subject>`; Kafka: topic
//! `<topic>.dlq.<group>`). [`DeadLetters`] reads them there — no copy, no second store —
//! and [`DeadLetters::requeue`] sends one (or all) back **to that group only**, attempts
//! reset:
//!
//! - SQL transport: one `UPDATE` puts the row back to `pending` (atomic).
//! - RabbitMQ: a copy is published with confirm through the default exchange straight to
//!   the group's queue `<prefix>.<group>`, then the dead copy is acknowledged (removed).
//! - NATS: a copy is published (PubAck awaited) to the message's original subject with its
//!   original headers and `x-oncely-requeued-for: <group>`; every other group's subscriber
//!   acknowledges and skips such a copy unseen, so only `<group>` handles it. Then the DLQ
//!   message is deleted from the DLQ stream.
//! - Kafka: the record is produced to the group's retry topic `<topic>.retry.<group>` with
//!   `x-oncely-not-before` = now (only that group reads it), then a marker record keyed by
//!   the dead letter's partition and offset goes to `<topic>.dlq.<group>.requeued`; a list
//!   leaves out every dead letter with a marker. (A committed offset cannot say "this one
//!   is done" for a record in the middle of a partition; a marker can.)
//!
//! Always requeue first, then remove: a process that dies between the two leaves the dead
//! letter listed *and* the message back in the group's queue. Requeued again, it is a
//! duplicate, which the group's inbox recognises by its message id. The other order could
//! lose the message.
//!
//! Positions ([`DeadLetterPosition`]) order a group's dead letters; [`DeadLetters::list`]
//! returns those after a given position, so a list pages with the last position it
//! returned. On RabbitMQ the position is the letter's index in the dead queue at the time
//! of the list (a queue has no stable offsets); requeues before a page move the later ones.

use std::fmt;
use std::str::FromStr;

use oncely_core::MessageId;

use crate::{BoxFuture, SubscribeError};

/// Bytes of a payload a [`DeadLetter`] previews.
pub const PREVIEW_BYTES: usize = 256;

/// Header on a NATS requeued copy naming the one consumer group that handles it (the
/// others acknowledge and skip it).
pub const REQUEUED_FOR: &str = "x-oncely-requeued-for";

/// Where a dead letter sits in its broker: orders a group's dead letters for paging
/// ([`DeadLetters::list`]'s `after`). Text form (`Display` / `FromStr`): `sql:<row id>`,
/// `amqp:<index>`, `nats:<stream sequence>`, `kafka:<topic>:<partition>:<offset>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DeadLetterPosition {
    /// SQL transport: the row id in `oncely_deliveries`.
    Sql(i64),
    /// RabbitMQ: the 0-based index in the group's dead queue when it was listed.
    Amqp(u64),
    /// NATS: the sequence in the DLQ stream.
    Nats(u64),
    /// Kafka: the dead-letter topic, partition and offset.
    Kafka {
        /// The dead-letter topic (`<topic>.dlq.<group>`).
        topic: String,
        /// Partition.
        partition: i32,
        /// Offset.
        offset: i64,
    },
}

impl fmt::Display for DeadLetterPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sql(id) => write!(f, "sql:{id}"),
            Self::Amqp(i) => write!(f, "amqp:{i}"),
            Self::Nats(seq) => write!(f, "nats:{seq}"),
            Self::Kafka {
                topic,
                partition,
                offset,
            } => write!(f, "kafka:{topic}:{partition}:{offset}"),
        }
    }
}

/// A text that is not a [`DeadLetterPosition`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a dead-letter position: {0:?} (sql:N, amqp:N, nats:N, kafka:TOPIC:P:N)")]
pub struct BadPosition(pub String);

impl FromStr for DeadLetterPosition {
    type Err = BadPosition;

    fn from_str(s: &str) -> Result<Self, BadPosition> {
        let bad = || BadPosition(s.to_owned());
        let (kind, rest) = s.split_once(':').ok_or_else(bad)?;
        match kind {
            "sql" => rest.parse().map(Self::Sql).map_err(|_| bad()),
            "amqp" => rest.parse().map(Self::Amqp).map_err(|_| bad()),
            "nats" => rest.parse().map(Self::Nats).map_err(|_| bad()),
            "kafka" => {
                let mut parts = rest.rsplitn(3, ':');
                let offset = parts.next().and_then(|o| o.parse().ok()).ok_or_else(bad)?;
                let partition = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
                let topic = parts.next().filter(|t| !t.is_empty()).ok_or_else(bad)?;
                Ok(Self::Kafka {
                    topic: topic.to_owned(),
                    partition,
                    offset,
                })
            }
            _ => Err(bad()),
        }
    }
}

/// One dead letter of a consumer group, as every broker reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Where it sits ([`DeadLetterPosition`]).
    pub position: DeadLetterPosition,
    /// The message id; `None` for a message that had none (undecodable, dead-lettered at
    /// once).
    pub message_id: Option<MessageId>,
    /// The topic it was first published to.
    pub topic: String,
    /// The consumer group that dead-lettered it.
    pub group: String,
    /// Event type (empty when the message did not say).
    pub event_type: String,
    /// Failed handler runs.
    pub attempts: u32,
    /// The last handler error.
    pub last_error: Option<String>,
    /// When it was dead-lettered, Unix ms (0 when the broker does not say).
    pub dead_at_ms: i64,
    /// Payload size, bytes.
    pub payload_size: usize,
    /// The first [`PREVIEW_BYTES`] bytes of the payload, as UTF-8 (invalid bytes replaced).
    pub payload_preview: String,
}

/// Which dead letters of a group [`DeadLetters::requeue`] sends back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeue {
    /// Every dead letter of this message id (one, unless it went dead more than once).
    Message(MessageId),
    /// All of the group's dead letters.
    All,
}

impl Requeue {
    /// Whether a dead letter of message `id` is selected.
    pub fn selects(&self, id: Option<&MessageId>) -> bool {
        match self {
            Self::All => true,
            Self::Message(want) => id == Some(want),
        }
    }
}

/// Dead letters could not be listed or requeued: the failures of a subscriber
/// ([`SubscribeError`]) — the broker is unreachable or did not answer in time (a requeue
/// that fails so may have requeued some letters; those are gone from the list), it refused
/// (missing queue or stream, declaration mismatch, …), or the SQL transport's database
/// failed.
pub type DeadLetterError = SubscribeError;

/// A broker's inbox dead letters: list a consumer group's, requeue them to that group.
/// Object-safe (boxed futures), so an operator console holds an `Arc<dyn DeadLetters>`
/// built from configuration whatever the broker. See the module docs for what each broker
/// does and why requeue-then-remove.
pub trait DeadLetters: Send + Sync + fmt::Debug {
    /// `sql`, `rabbitmq`, `nats`, `kafka`.
    fn broker(&self) -> &'static str;

    /// Up to `limit` dead letters of consumer group `group`, oldest first (in
    /// [`DeadLetterPosition`] order), after position `after` when given.
    ///
    /// # Errors
    /// [`DeadLetterError`] when the broker or the database fails.
    fn list<'a>(
        &'a self,
        group: &'a str,
        limit: u32,
        after: Option<&'a DeadLetterPosition>,
    ) -> BoxFuture<'a, Result<Vec<DeadLetter>, DeadLetterError>>;

    /// Sends the selected dead letters of `group` back to that group's consumer only, ready
    /// now, attempts reset, and removes them from the dead letters (requeue first, then
    /// remove). Returns how many were requeued (0: none selected).
    ///
    /// # Errors
    /// [`DeadLetterError`] when the broker or the database fails; letters requeued before
    /// the failure stay requeued.
    fn requeue<'a>(
        &'a self,
        group: &'a str,
        which: Requeue,
    ) -> BoxFuture<'a, Result<u64, DeadLetterError>>;

    /// Releases the connection (the next call reconnects). The default does nothing.
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// A page of [`DeadLetters::list`].
pub(crate) type Page = Result<Vec<DeadLetter>, DeadLetterError>;

/// Implements [`DeadLetters`] for a broker's reader `$ty`, named `$broker`, by its
/// inherent `async fn page(&self, group, limit, after)` and
/// `async fn requeue_selected(&self, group, which)`; further trait items (`close`) follow in
/// the braces.
macro_rules! dead_letters_impl {
    ($ty:ty, $broker:literal { $($items:tt)* }) => {
        impl $crate::DeadLetters for $ty {
            fn broker(&self) -> &'static str {
                $broker
            }

            fn list<'a>(
                &'a self,
                group: &'a str,
                limit: u32,
                after: Option<&'a $crate::DeadLetterPosition>,
            ) -> $crate::BoxFuture<'a, Result<Vec<$crate::DeadLetter>, $crate::DeadLetterError>>
            {
                Box::pin(self.page(group, limit, after))
            }

            fn requeue<'a>(
                &'a self,
                group: &'a str,
                which: $crate::Requeue,
            ) -> $crate::BoxFuture<'a, Result<u64, $crate::DeadLetterError>> {
                Box::pin(self.requeue_selected(group, which))
            }

            $($items)*
        }
    };
}
pub(crate) use dead_letters_impl;

/// [`PREVIEW_BYTES`] of `payload` as lossy UTF-8.
pub(crate) fn preview(payload: &[u8]) -> String {
    String::from_utf8_lossy(&payload[..payload.len().min(PREVIEW_BYTES)]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::DeadLetterPosition;

    #[test]
    fn positions_round_trip_through_their_text_form() {
        for p in [
            DeadLetterPosition::Sql(42),
            DeadLetterPosition::Amqp(0),
            DeadLetterPosition::Nats(7),
            DeadLetterPosition::Kafka {
                topic: "orders.dlq.billing".to_owned(),
                partition: 2,
                offset: 17,
            },
        ] {
            assert_eq!(p.to_string().parse::<DeadLetterPosition>(), Ok(p));
        }
        assert!("kafka::1:2".parse::<DeadLetterPosition>().is_err());
        assert!("sql:x".parse::<DeadLetterPosition>().is_err());
        assert!("42".parse::<DeadLetterPosition>().is_err());
    }
}
