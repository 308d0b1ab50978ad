//! The outbox's values: events to enqueue, rows and their states, stats, a claimed batch and what settling it did.

use std::collections::BTreeMap;

use oncely_core::MessageId;

use crate::OutboxStore;

/// An event to publish, written with [`OutboxStore::enqueue`] in the transaction of the
/// business change it announces.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxEvent {
    /// The message's identity; derive it with [`MessageId::derive`] when the event comes
    /// from an idempotent operation.
    pub message_id: MessageId,
    /// Destination: AMQP routing key, NATS subject, SQL-transport topic (e.g. `orders`).
    pub topic: String,
    /// The ordering unit, usually the aggregate id: events with one partition key are
    /// published in order.
    pub partition_key: String,
    /// Event type, e.g. `order.created`.
    pub event_type: String,
    /// Body bytes (the order service sends JSON).
    pub payload: Vec<u8>,
    /// Extra headers: `correlation-id`, `idempotency-key`, `traceparent` (W3C Trace
    /// Context), …
    pub headers: BTreeMap<String, String>,
}

impl OutboxEvent {
    /// An event without extra headers.
    pub fn new(
        message_id: MessageId,
        topic: impl Into<String>,
        partition_key: impl Into<String>,
        event_type: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            message_id,
            topic: topic.into(),
            partition_key: partition_key.into(),
            event_type: event_type.into(),
            payload: payload.into(),
            headers: BTreeMap::new(),
        }
    }

    /// Adds (or replaces) a header.
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }
}

oncely_core::stored_words! {
    /// State of an outbox row.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[non_exhaustive]
    pub enum OutboxState {
        /// Waiting to be published (possibly leased by a relay, possibly in backoff).
        Pending => "pending",
        /// Confirmed by the broker.
        Published => "published",
        /// Gave up after the attempt limit; `oncely outbox dead requeue` puts it back.
        Dead => "dead",
    }
}

/// A stored outbox row.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OutboxRow {
    /// Row id (monotonic at insert; *not* commit order, so never used as a cursor).
    pub id: i64,
    /// The event.
    pub event: OutboxEvent,
    /// Insert time (the business transaction's time), Unix ms.
    pub created_at: i64,
    /// Earliest next publish attempt, Unix ms.
    pub available_at: i64,
    /// Failed publish attempts so far.
    pub attempts: u32,
    /// The last publish error, if any.
    pub last_error: Option<String>,
    /// State.
    pub state: OutboxState,
    /// When the broker confirmed it, Unix ms.
    pub published_at: Option<i64>,
}

/// Depth and health of the outbox, for `oncely outbox stats` and the relay's gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Rows in state `pending`.
    pub pending: u64,
    /// `created_at` of the oldest pending row, Unix ms.
    pub oldest_pending_created_at: Option<i64>,
    /// Rows in state `dead`.
    pub dead: u64,
}

impl OutboxStats {
    /// Age of the oldest pending row at `now_ms`, in milliseconds (0 when none is pending).
    pub fn oldest_pending_age_ms(&self, now_ms: i64) -> i64 {
        self.oldest_pending_created_at
            .map_or(0, |t| now_ms.saturating_sub(t).max(0))
    }
}

/// What [`OutboxStore::reschedule`] did with a failed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rescheduled {
    /// Back to `pending`, available again from the `retry_at_ms` given.
    Retry,
    /// The attempt limit is reached: the row is `dead`.
    Dead,
    /// This relay no longer holds the row (its lease ran out and another relay took it);
    /// nothing was changed.
    NotHeld,
}

impl Rescheduled {
    /// From the `state` a reschedule statement returned (`None`: no row matched).
    pub(crate) fn from_state(state: Option<&str>) -> Self {
        match state {
            None => Self::NotHeld,
            Some("dead") => Self::Dead,
            Some(_) => Self::Retry,
        }
    }
}

/// Which dead rows [`OutboxStore::requeue_dead`] puts back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequeueTarget {
    /// One row by id.
    Id(i64),
    /// Every dead row.
    All,
}

/// Rows held by [`OutboxStore::claim_batch`] until they are settled.
#[derive(Debug)]
pub struct ClaimedBatch {
    pub(crate) rows: Vec<OutboxRow>,
    pub(crate) hold: Hold,
}

pub(crate) enum Hold {
    /// Nothing was claimed (PostgreSQL's held claim found no row).
    Nothing,
    /// PostgreSQL: deleted, and so locked, by this open transaction; `keep`: record the
    /// published rows in `oncely_outbox_published`.
    #[cfg(feature = "postgres")]
    Locked {
        tx: Box<sqlx::Transaction<'static, sqlx::Postgres>>,
        keep: bool,
    },
    /// SQLite, MySQL: leased to `owner`.
    Leased { store: OutboxStore, owner: String },
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Nothing => f.write_str("Nothing"),
            #[cfg(feature = "postgres")]
            Self::Locked { keep, .. } => f.debug_struct("Locked").field("keep", keep).finish(),
            Self::Leased { owner, .. } => f.debug_struct("Leased").field("owner", owner).finish(),
        }
    }
}

/// A failed publish to record with [`ClaimedBatch::settle`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PublishFailure {
    /// The row.
    pub id: i64,
    /// The error, stored as `last_error` (cut to 2,000 characters).
    pub error: String,
    /// Earliest next attempt, Unix ms (the caller applies backoff with jitter).
    pub retry_at_ms: i64,
    /// The publish cannot succeed as the message is (it exceeds the broker's size limit):
    /// the row goes `dead` at once, this attempt counted, instead of holding its
    /// partition back through every backoff up to the attempt limit.
    pub permanent: bool,
}

impl PublishFailure {
    /// A failure of row `id` with `error`, to be retried from `retry_at_ms` (Unix ms).
    pub fn new(id: i64, error: impl Into<String>, retry_at_ms: i64) -> Self {
        Self {
            id,
            error: error.into(),
            retry_at_ms,
            permanent: false,
        }
    }

    /// Marks the failure permanent ([`PublishFailure::permanent`]).
    #[must_use]
    pub fn permanent(mut self) -> Self {
        self.permanent = true;
        self
    }
}

/// What a batch's publish came to, for [`ClaimedBatch::settle`]'s PostgreSQL half: the
/// `published` row ids (at `published_at_ms`, Unix ms), the `failures`, and the attempt limit.
#[cfg(feature = "postgres")]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Outcome<'a> {
    pub(crate) published: &'a [i64],
    pub(crate) published_at_ms: i64,
    pub(crate) failures: &'a [PublishFailure],
    pub(crate) max_attempts: u32,
}

/// What [`ClaimedBatch::settle`] recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settled {
    /// Rows marked published (fewer than asked when a SQLite lease ran out and another
    /// relay took the row over).
    pub published: u64,
    /// Each failure's outcome, in the order given.
    pub failures: Vec<(i64, Rescheduled)>,
}
