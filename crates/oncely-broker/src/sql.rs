use oncely_core::MessageId;
use oncely_sql::{Database, NewQueueMessage, QueueMessage, QueueStore, StoreError};

use std::time::Duration;

use crate::dead_letter::{dead_letters_impl, preview, Page};
use crate::{
    BoxFuture, Cause, DeadLetter, DeadLetterError, DeadLetterPosition, DeliveryPosition, Incoming,
    Message, PublishError, Publisher, ReceivedMessage, Requeue, SubscribeError, Subscriber,
};

/// The SQL transport: the embedded default broker, a queue table (`oncely_queue`, created
/// by [`Database::migrate`]) in the same database as the outbox, so `oncely serve` works
/// with no broker at all.
///
/// A batch is inserted in one transaction; success means it committed. `UNIQUE(message_id)`
/// drops a republished copy while the first is still queued.
///
/// Two ways to consume:
/// - **Consumer groups** (at least once): [`SqlTransport::subscribe`] registers a consumer
///   for a topic; every message queued afterwards is copied (by a trigger, in the publishing
///   transaction) into table `oncely_deliveries`, one row per subscribed consumer, so each
///   group gets every message; a new group also gets the topic's messages still queued.
///   [`SqlTransport::claim`] leases ready deliveries of one consumer, [`SqlTransport::ack`]
///   deletes one, [`SqlTransport::nack`] reschedules it after a delay (only for that
///   consumer), [`SqlTransport::dead`] parks it with its last error. A delivery whose lease
///   runs out unacknowledged is claimed again.
/// - [`SqlTransport::receive`] takes (deletes) queue rows: at most once towards the
///   consumer process; kept for tools and tests that read the raw queue.
#[derive(Debug, Clone)]
pub struct SqlTransport {
    queue: QueueStore,
    max_message_bytes: usize,
}

/// One leased delivery of a message to one consumer group ([`SqlTransport::claim`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivery {
    /// Row id in `oncely_deliveries`.
    pub delivery_id: i64,
    /// The consumer group it is delivered to.
    pub consumer: String,
    /// Failed attempts before this delivery (0 on the first delivery; a lease that ran out
    /// does not count as a failure).
    pub attempts: u32,
    /// The lease this delivery was claimed under; [`SqlTransport::nack`] and
    /// [`SqlTransport::dead`] only act while it is still the row's lease.
    pub lease_token: String,
    /// The message (its position is [`DeliveryPosition::SqlDelivery`], the delivery row id).
    pub message: ReceivedMessage,
}

/// A delivery parked in state `dead` ([`SqlTransport::dead_deliveries`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadDelivery {
    /// The message id.
    pub id: MessageId,
    /// Failed attempts.
    pub attempts: u32,
    /// The last handler error.
    pub last_error: Option<String>,
}

impl Delivery {
    fn handle(&self) -> SqlHandle {
        SqlHandle {
            delivery_id: self.delivery_id,
            lease_token: self.lease_token.clone(),
        }
    }
}

/// The settling token of an SQL-transport delivery ([`SqlSubscriber`]): the delivery row and
/// the lease it was claimed under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlHandle {
    /// Row id in `oncely_deliveries`.
    pub delivery_id: i64,
    /// The claim's lease token; retry and dead act only while it is still the row's.
    pub lease_token: String,
}

impl SqlTransport {
    /// A transport on `db` that refuses payloads over `max_message_bytes` bytes
    /// (default in the binary: 1 MiB).
    pub fn new(db: Database, max_message_bytes: usize) -> Self {
        Self {
            queue: QueueStore::new(db),
            max_message_bytes,
        }
    }

    async fn insert_batch(&self, batch: &[Message]) -> Vec<Result<(), PublishError>> {
        let mut results: Vec<Result<(), PublishError>> = batch
            .iter()
            .map(|m| {
                if m.payload.len() > self.max_message_bytes {
                    Err(PublishError::too_large(
                        m.payload.len(),
                        self.max_message_bytes,
                    ))
                } else {
                    Ok(())
                }
            })
            .collect();
        let headers: Vec<_> = batch.iter().map(Message::all_headers).collect();
        let rows: Vec<NewQueueMessage<'_>> = batch
            .iter()
            .zip(&headers)
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|((m, headers), _)| NewQueueMessage {
                topic: &m.topic,
                message_id: &m.id,
                partition_key: &m.partition_key,
                event_type: &m.event_type,
                headers,
                payload: &m.payload,
            })
            .collect();
        if let Err(e) = self.queue.enqueue(&rows).await {
            let unavailable = e.is_unavailable();
            let cause = Cause::new(e);
            for r in &mut results {
                if r.is_ok() {
                    *r = Err(if unavailable {
                        PublishError::unavailable(cause.clone())
                    } else {
                        PublishError::rejected(cause.clone())
                    });
                }
            }
        }
        results
    }

    /// Takes (deletes and returns) up to `max` of the oldest messages of `topic`, in queue
    /// order. Concurrent consumers never receive the same message (PostgreSQL, MySQL: `FOR
    /// UPDATE SKIP LOCKED`; SQLite: the single writer).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt; nothing is taken then.
    pub async fn receive(&self, topic: &str, max: u32) -> Result<Vec<ReceivedMessage>, StoreError> {
        Ok(self
            .queue
            .take(topic, max)
            .await?
            .into_iter()
            .map(|t| received(DeliveryPosition::SqlQueue(t.queue_id), t.message))
            .collect())
    }

    /// Subscribes consumer group `consumer` to `topic` (idempotent): every message queued on
    /// `topic` from now on is delivered to it, and a group new to the topic also gets the
    /// topic's messages still in the queue, each once ([`QueueStore::subscribe`]). Call it
    /// before a new group's consumer first runs to give the group everything from then on,
    /// whatever the queue retention. Returns `true` when the group is new to the topic.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; nothing changed then.
    pub async fn subscribe(&self, consumer: &str, topic: &str) -> Result<bool, StoreError> {
        self.queue.subscribe(consumer, topic).await
    }

    /// Leases up to `max` ready deliveries of `consumer` (pending, due, not leased), oldest
    /// first, for `lease` (after which an unacknowledged delivery is claimed again).
    /// Concurrent claimers never hold the same delivery at once (PostgreSQL: `FOR UPDATE
    /// SKIP LOCKED` in a materialised CTE; MySQL: `FOR UPDATE SKIP LOCKED`; SQLite: the
    /// single writer).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn claim(
        &self,
        consumer: &str,
        max: u32,
        lease: Duration,
    ) -> Result<Vec<Delivery>, StoreError> {
        Ok(self
            .queue
            .claim(consumer, max, lease)
            .await?
            .into_iter()
            .map(|d| Delivery {
                delivery_id: d.delivery_id,
                consumer: consumer.to_owned(),
                attempts: d.attempts,
                lease_token: d.lease_token,
                message: received(DeliveryPosition::SqlDelivery(d.delivery_id), d.message),
            })
            .collect())
    }

    /// Acknowledges a delivery: deletes it (whoever holds its lease now — the consumer
    /// committed its effect, so no copy is needed any more). Returns `false` when it was
    /// gone already.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the delivery then comes back after its
    /// lease and the consumer's inbox recognises it.
    pub async fn ack(&self, delivery: &Delivery) -> Result<bool, StoreError> {
        self.queue.ack(delivery.delivery_id).await
    }

    /// Counts a failed attempt and makes the delivery ready again after `delay` (for its
    /// consumer only), recording `error`. Returns `false` when the lease was lost (another
    /// claimer holds it now) and nothing changed.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the delivery then comes back after its lease.
    pub async fn nack(
        &self,
        delivery: &Delivery,
        delay: Duration,
        error: &str,
    ) -> Result<bool, StoreError> {
        self.queue
            .retry(delivery.delivery_id, &delivery.lease_token, delay, error)
            .await
    }

    /// Counts a failed attempt and parks the delivery in state `dead` with `error`; it is
    /// not delivered again. Returns `false` when the lease was lost.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the delivery then comes back after its lease.
    pub async fn dead(&self, delivery: &Delivery, error: &str) -> Result<bool, StoreError> {
        self.queue
            .dead(delivery.delivery_id, &delivery.lease_token, error)
            .await
    }

    /// Up to `limit` dead deliveries of `consumer`, oldest first.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn dead_deliveries(
        &self,
        consumer: &str,
        limit: u32,
    ) -> Result<Vec<DeadDelivery>, StoreError> {
        Ok(self
            .queue
            .dead_deliveries(consumer, limit)
            .await?
            .into_iter()
            .map(|d| DeadDelivery {
                id: d.message_id,
                attempts: d.attempts,
                last_error: d.last_error,
            })
            .collect())
    }

    /// Puts dead deliveries of `consumer` back to pending, ready now, attempts reset (last
    /// error kept until the next failure): the one of message `id`, or all with `None`.
    /// Returns how many.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn requeue_dead(
        &self,
        consumer: &str,
        id: Option<&MessageId>,
    ) -> Result<u64, StoreError> {
        self.queue.requeue_dead(consumer, id).await
    }

    /// Deletes up to `batch` queue rows enqueued before `before_ms` (Unix ms) on topics
    /// that have a subscribed consumer group, returning how many went. Their copies live in
    /// `oncely_deliveries`; the queue row only keeps a republished copy (same message id)
    /// from being fanned out again while it exists, so `before_ms` must leave a window
    /// shorter than the consumers' inbox retention (a copy fanned out again after it is
    /// recognised by the inbox). Rows of topics nobody subscribed to stay for
    /// [`SqlTransport::receive`].
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn collect_fanned_out(&self, before_ms: i64, batch: u32) -> Result<u64, StoreError> {
        self.queue.collect_fanned_out(before_ms, batch).await
    }
}

fn received(position: DeliveryPosition, m: QueueMessage) -> ReceivedMessage {
    ReceivedMessage {
        position,
        id: m.message_id,
        topic: m.topic,
        partition_key: m.partition_key,
        event_type: m.event_type,
        headers: m.headers,
        payload: m.payload,
        enqueued_at: m.enqueued_at,
    }
}

impl Publisher for SqlTransport {
    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
        Box::pin(self.insert_batch(batch))
    }

    fn name(&self) -> &'static str {
        "sql"
    }
}

/// [`Subscriber`] for one consumer group on the SQL transport: [`SqlTransport::subscribe`],
/// leased claims ([`SqlTransport::claim`]), ack deletes the delivery row, retry reschedules
/// it for this group only (`available_at`), dead parks it in state `dead` with the error
/// (`oncely inbox dead list|requeue`). An unacknowledged delivery is claimed again after
/// [`SqlSubscriber::lease`]. Rows do not fail to decode (the relay wrote them), so
/// [`Incoming::message`] is always `Ok`.
#[derive(Debug, Clone)]
pub struct SqlSubscriber {
    transport: SqlTransport,
    consumer: String,
    topic: String,
    lease: Duration,
}

impl SqlSubscriber {
    /// Consumer group `consumer` of `topic` on `transport`, claiming with a `lease` that
    /// must exceed the handler's longest run (default in the binary: 30 s).
    pub fn new(
        transport: SqlTransport,
        consumer: impl Into<String>,
        topic: impl Into<String>,
        lease: Duration,
    ) -> Self {
        Self {
            transport,
            consumer: consumer.into(),
            topic: topic.into(),
            lease,
        }
    }

    /// The lease on a claimed delivery.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The transport.
    pub fn transport(&self) -> &SqlTransport {
        &self.transport
    }
}

impl Subscriber for SqlSubscriber {
    type Handle = SqlHandle;

    fn broker(&self) -> &'static str {
        "sql"
    }

    fn consumer(&self) -> &str {
        &self.consumer
    }

    async fn subscribe(&self) -> Result<(), SubscribeError> {
        self.transport
            .subscribe(&self.consumer, &self.topic)
            .await?;
        Ok(())
    }

    async fn receive(
        &self,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Incoming<SqlHandle>>, SubscribeError> {
        let claimed = self
            .transport
            .claim(&self.consumer, max, self.lease)
            .await?;
        if claimed.is_empty() {
            // Polling transport: the wait is the idle interval.
            tokio::time::sleep(wait).await;
        }
        Ok(claimed
            .into_iter()
            .map(|d| {
                let handle = d.handle();
                Incoming::new(Ok(d.message), d.attempts, handle)
            })
            .collect())
    }

    async fn ack<'a>(&'a self, delivery: &'a Incoming<SqlHandle>) -> Result<(), SubscribeError> {
        self.transport
            .queue
            .ack(delivery.handle.delivery_id)
            .await?;
        Ok(())
    }

    async fn retry<'a>(
        &'a self,
        delivery: &'a Incoming<SqlHandle>,
        delay: Duration,
        error: &'a str,
    ) -> Result<(), SubscribeError> {
        // `false`: the lease was lost and another claimer holds the delivery now; it
        // settles it.
        let h = &delivery.handle;
        self.transport
            .queue
            .retry(h.delivery_id, &h.lease_token, delay, error)
            .await?;
        Ok(())
    }

    async fn dead<'a>(
        &'a self,
        delivery: &'a Incoming<SqlHandle>,
        error: &'a str,
    ) -> Result<(), SubscribeError> {
        let h = &delivery.handle;
        self.transport
            .queue
            .dead(h.delivery_id, &h.lease_token, error)
            .await?;
        Ok(())
    }

    async fn collect(&self, before_ms: i64, batch: u32) -> Result<u64, SubscribeError> {
        Ok(self.transport.collect_fanned_out(before_ms, batch).await?)
    }
}

/// [`DeadLetters`] of the SQL transport: a group's `oncely_deliveries` rows in state
/// `dead` ([`QueueStore::dead_deliveries_after`]), requeued by one `UPDATE` back to
/// `pending` for that group only, ready now, attempts reset
/// ([`QueueStore::requeue_dead`]). Positions are [`DeadLetterPosition::Sql`] row ids.
#[derive(Debug, Clone)]
pub struct SqlDeadLetters {
    queue: QueueStore,
}

impl SqlDeadLetters {
    /// The dead letters of the SQL transport in `db`.
    pub fn new(db: Database) -> Self {
        Self {
            queue: QueueStore::new(db),
        }
    }

    async fn page(&self, group: &str, limit: u32, after: Option<&DeadLetterPosition>) -> Page {
        let after = match after {
            None => None,
            Some(DeadLetterPosition::Sql(id)) => Some(*id),
            Some(other) => {
                return Err(DeadLetterError::rejected(format!(
                    "position {other} is not an SQL-transport position"
                )))
            }
        };
        Ok(self
            .queue
            .dead_deliveries_after(group, after, limit)
            .await?
            .into_iter()
            .map(|d| DeadLetter {
                position: DeadLetterPosition::Sql(d.delivery_id),
                message_id: Some(d.message_id),
                topic: d.topic,
                group: group.to_owned(),
                event_type: d.event_type,
                attempts: d.attempts,
                last_error: d.last_error,
                dead_at_ms: d.dead_at,
                payload_size: usize::try_from(d.payload_size).unwrap_or(usize::MAX),
                payload_preview: preview(&d.payload_preview),
            })
            .collect())
    }

    async fn requeue_selected(&self, group: &str, which: Requeue) -> Result<u64, DeadLetterError> {
        let id = match &which {
            Requeue::Message(id) => Some(id),
            Requeue::All => None,
        };
        Ok(self.queue.requeue_dead(group, id).await?)
    }
}

dead_letters_impl!(SqlDeadLetters, "sql" {});
