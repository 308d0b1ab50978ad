//! The SQL transport's tables, written once: `oncely_queue` (one row per published
//! message, `UNIQUE(message_id)`), `oncely_subscriptions` (consumer group × topic) and
//! `oncely_deliveries` (one row per subscribed group and message, filled by a trigger in
//! the publishing transaction). The statements each backend spells its own way live in
//! `sqlite/queue.rs`, `postgres/queue.rs` and `mysql/queue.rs` behind [`QueueBackend`].

use std::collections::BTreeMap;
use std::time::Duration;

use oncely_core::MessageId;

use crate::backend::with_store;
use crate::driver::Store;
use crate::{on_pool, on_writer, query, sql_text, Database, StoreError, Tx};

/// One message to put on the queue ([`QueueStore::enqueue`]).
#[derive(Debug, Clone, Copy)]
pub struct NewQueueMessage<'a> {
    /// Topic.
    pub topic: &'a str,
    /// The message id (`UNIQUE`: a second copy is dropped while the first is queued).
    pub message_id: &'a MessageId,
    /// Partition key.
    pub partition_key: &'a str,
    /// Event type.
    pub event_type: &'a str,
    /// Every header, as delivered.
    pub headers: &'a BTreeMap<String, String>,
    /// Body.
    pub payload: &'a [u8],
}

/// A message as the queue holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueMessage {
    /// The message id.
    pub message_id: MessageId,
    /// Topic.
    pub topic: String,
    /// Partition key.
    pub partition_key: String,
    /// Event type.
    pub event_type: String,
    /// Headers.
    pub headers: BTreeMap<String, String>,
    /// Body.
    pub payload: Vec<u8>,
    /// When it was queued, Unix ms.
    pub enqueued_at: i64,
}

/// A queue row taken off the queue ([`QueueStore::take`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TakenMessage {
    /// Row id in `oncely_queue` (insert order within the topic).
    pub queue_id: i64,
    /// The message.
    pub message: QueueMessage,
}

/// One delivery leased to a consumer group ([`QueueStore::claim`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimedDelivery {
    /// Row id in `oncely_deliveries` (claim order within the group).
    pub delivery_id: i64,
    /// Failed attempts before this delivery (a lease that ran out does not count).
    pub attempts: u32,
    /// The lease it was claimed under; [`QueueStore::retry`] and [`QueueStore::dead`] act
    /// only while it is still the row's.
    pub lease_token: String,
    /// The message.
    pub message: QueueMessage,
}

/// A delivery not yet acknowledged (an acknowledged one is deleted), as an operator lists
/// it ([`QueueStore::partition_deliveries`]).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
#[non_exhaustive]
pub struct DeliverySummary {
    /// The consumer group.
    pub consumer: String,
    /// The message id.
    pub message_id: String,
    /// Event type.
    pub event_type: String,
    /// The stored state word (`pending`, `dead`).
    pub state: String,
    /// Failed attempts.
    pub attempts: i32,
    /// The last handler error.
    pub last_error: Option<String>,
}

/// A delivery parked in state `dead` ([`QueueStore::dead_deliveries`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadQueueDelivery {
    /// Row id in `oncely_deliveries` (dead-letter order within the group's rows).
    pub delivery_id: i64,
    /// The message id.
    pub message_id: MessageId,
    /// The topic it was published to.
    pub topic: String,
    /// Event type.
    pub event_type: String,
    /// Failed attempts.
    pub attempts: u32,
    /// The last handler error.
    pub last_error: Option<String>,
    /// When it went dead, Unix ms.
    pub dead_at: i64,
    /// Payload size, bytes.
    pub payload_size: u64,
    /// The payload's first [`DEAD_PREVIEW_BYTES`] bytes.
    pub payload_preview: Vec<u8>,
}

/// Bytes of the payload [`QueueStore::dead_deliveries_after`] returns
/// ([`DeadQueueDelivery::payload_preview`]).
pub const DEAD_PREVIEW_BYTES: usize = 256;

/// A dead `oncely_deliveries` row as [`QueueStore::dead_deliveries_after`] selects it.
#[derive(sqlx::FromRow)]
struct DeadRow {
    id: i64,
    message_id: String,
    topic: String,
    event_type: String,
    attempts: i32,
    last_error: Option<String>,
    available_at: i64,
    payload_size: i64,
    preview: Vec<u8>,
}

/// A `oncely_queue` row as every backend's statements return it.
#[derive(sqlx::FromRow)]
pub(crate) struct QueueRow {
    pub(crate) id: i64,
    topic: String,
    message_id: String,
    partition_key: String,
    event_type: String,
    headers: String,
    payload: Vec<u8>,
    enqueued_at: i64,
}

/// A `oncely_deliveries` row as every backend's claim returns it (`id` is the delivery
/// row's).
#[derive(sqlx::FromRow)]
pub(crate) struct DeliveryRow {
    #[sqlx(flatten)]
    pub(crate) row: QueueRow,
    attempts: i32,
}

/// A claim of [`QueueBackend::claim`]: up to `max` ready deliveries of `consumer` (pending,
/// `available_at <= now`, not leased or lease over), leased under `token` until `until`
/// (Unix ms).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeliveryClaim<'a> {
    pub(crate) consumer: &'a str,
    pub(crate) max: i64,
    pub(crate) token: &'a str,
    pub(crate) until: i64,
    pub(crate) now: i64,
}

/// The queue statements a backend spells its own way (in `sqlite/`, `postgres/`, `mysql/`
/// `queue.rs`): SQLite's `RETURNING` on the single writer; PostgreSQL's `SKIP LOCKED` CTEs
/// under pinned plans; MySQL's lock, write, read back. Statements whose text is the same
/// everywhere stay in [`QueueStore`].
pub(crate) trait QueueBackend: Store {
    /// Deletes and returns up to `max` of the oldest rows of `topic`; concurrent takers
    /// never get the same row.
    async fn take(&self, topic: &str, max: i64) -> Result<Vec<QueueRow>, StoreError>;

    /// Leases up to `claim.max` ready deliveries of its consumer (see [`DeliveryClaim`]),
    /// oldest first; concurrent claimers never hold the same delivery at once.
    async fn claim(&self, claim: DeliveryClaim<'_>) -> Result<Vec<DeliveryRow>, StoreError>;

    /// Deletes up to `batch` queue rows enqueued before `before_ms` on subscribed topics.
    async fn collect_fanned_out(&self, before_ms: i64, batch: i64) -> Result<u64, StoreError>;

    /// Inserts the subscription of `consumer` to `topic` unless it exists; when it inserted
    /// it, copies [`BACKLOG`] into the group's deliveries in the same transaction, with
    /// publishing held back from before the insert to the commit (no publish commits in
    /// between). Returns whether the subscription is new.
    async fn subscribe(&self, consumer: &str, topic: &str) -> Result<bool, StoreError>;
}

/// A new consumer group's backlog (`$1` the group, `$2` the topic): every message of the
/// topic still in `oncely_queue`, copied into `oncely_deliveries` in queue order, ready
/// now. Each backend adds its own "skip a row the group has already" spelling.
pub(crate) const BACKLOG: &str = "INSERT INTO oncely_deliveries (consumer, message_id, topic, \
     partition_key, event_type, headers, payload, enqueued_at, available_at) \
     SELECT $1, message_id, topic, partition_key, event_type, headers, payload, enqueued_at, \
     enqueued_at FROM oncely_queue WHERE topic = $2 ORDER BY id";

/// Subscribes `consumer` to `topic` in `tx`, which holds publishing back from its start to
/// its commit (see [`QueueBackend::subscribe`]; SQLite: the writer's `BEGIN IMMEDIATE`,
/// PostgreSQL: `LOCK TABLE oncely_queue IN SHARE MODE`): the subscription unless it
/// exists, and when it is new the group's [`BACKLOG`]; then commits. Whether the
/// subscription is new.
pub(crate) async fn subscribe_in(
    mut tx: Tx,
    consumer: &str,
    topic: &str,
) -> Result<bool, StoreError> {
    let subscription = query("INSERT INTO oncely_subscriptions (consumer, topic) VALUES ($1, $2)")
        .bind(consumer)
        .bind(topic);
    let new = tx
        .insert_ignoring_duplicate(subscription, "(consumer, topic)")
        .await?;
    if new {
        let backlog = query(BACKLOG).bind(consumer).bind(topic);
        tx.insert_ignoring_duplicate(backlog, "(consumer, message_id)")
            .await?;
    }
    tx.commit().await?;
    Ok(new)
}

/// The SQL transport's queue over [`Database`]: enqueue with fan-out to the subscribed
/// consumer groups, take, subscribe, claim with a lease, settle (ack, retry, dead), dead
/// deliveries and their requeue, and the collection of fanned-out queue rows.
#[derive(Debug, Clone)]
pub struct QueueStore {
    db: Database,
}

impl QueueStore {
    /// The queue in `db` (tables created by [`Database::migrate`]).
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    /// The database.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Queues `batch` in one transaction, each at the same time (`now_ms`); a message whose
    /// id is queued already is dropped. The trigger copies each into `oncely_deliveries` for
    /// every consumer group subscribed to its topic, in the same transaction.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; nothing is queued then.
    pub async fn enqueue(&self, batch: &[NewQueueMessage<'_>]) -> Result<(), StoreError> {
        let mut tx = self.db.begin().await?;
        let now = oncely_core::now_ms();
        for m in batch {
            let headers =
                serde_json::to_string(m.headers).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            // A copy whose message id is queued already is dropped (MySQL: its failed
            // statement leaves no fan-out behind), and the transaction goes on.
            tx.insert_ignoring_duplicate(
                query(
                    "INSERT INTO oncely_queue (topic, message_id, partition_key, event_type, \
                     headers, payload, enqueued_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                )
                .bind(m.topic)
                .bind(m.message_id.to_string())
                .bind(m.partition_key)
                .bind(m.event_type)
                .bind(headers)
                .bind(m.payload)
                .bind(now),
                "(message_id)",
            )
            .await?;
        }
        tx.commit().await
    }

    /// Deletes and returns up to `max` (at least 1) of the oldest messages of `topic`, in
    /// queue order. Concurrent takers never get the same message (PostgreSQL, MySQL: `FOR
    /// UPDATE SKIP LOCKED`; SQLite: the single writer).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt; nothing is taken then.
    pub async fn take(&self, topic: &str, max: u32) -> Result<Vec<TakenMessage>, StoreError> {
        let max = i64::from(max.max(1));
        let mut rows = with_store!(&self.db, |s| s.take(topic, max).await)?;
        // Queue order (MySQL reads the taken rows back in no particular order).
        rows.sort_by_key(|r| r.id);
        rows.into_iter()
            .map(|r| {
                Ok(TakenMessage {
                    queue_id: r.id,
                    message: r.decode("queue")?,
                })
            })
            .collect()
    }

    /// Subscribes consumer group `consumer` to `topic` (idempotent): every message queued on
    /// `topic` from now on is delivered to it. A group new to the topic also gets the
    /// topic's messages still in the queue (all of them if no group was subscribed to it,
    /// else those younger than the consumers' queue retention), copied in the transaction
    /// that adds the subscription; that transaction waits for the publishes in flight (any
    /// topic) and holds new ones back until it commits, for as long as the copy takes
    /// (PostgreSQL: `LOCK TABLE oncely_queue IN SHARE MODE`; MySQL: `LOCK TABLES`, which
    /// needs that privilege; SQLite: the single writer), so each message reaches the group
    /// once. Only a group new to the topic takes that lock. Returns `true` when the group
    /// is new to the topic.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails (a lock wait past the lock timeout included);
    /// nothing changed then.
    pub async fn subscribe(&self, consumer: &str, topic: &str) -> Result<bool, StoreError> {
        // Most calls find the group subscribed (a consumer restarting): answered without
        // locking out the publishers. The insert below decides, under its primary key.
        let known: i64 = on_pool!(&self.db, |p| {
            sqlx::query_scalar(&sql_text(
                p,
                "SELECT COUNT(*) FROM oncely_subscriptions WHERE consumer = $1 AND topic = $2",
            ))
            .bind(consumer)
            .bind(topic)
            .fetch_one(p)
            .await
        })?;
        if known > 0 {
            return Ok(false);
        }
        with_store!(&self.db, |s| s.subscribe(consumer, topic).await)
    }

    /// Leases up to `max` (at least 1) ready deliveries of `consumer` (pending, due, not
    /// leased), oldest first, for `lease` (after which an unacknowledged delivery is claimed
    /// again), under a new lease token.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn claim(
        &self,
        consumer: &str,
        max: u32,
        lease: Duration,
    ) -> Result<Vec<ClaimedDelivery>, StoreError> {
        let now = oncely_core::now_ms();
        let token = uuid::Uuid::new_v4().simple().to_string();
        let claim = DeliveryClaim {
            consumer,
            max: i64::from(max.max(1)),
            token: &token,
            until: oncely_core::ms_after(now, lease),
            now,
        };
        let mut rows = with_store!(&self.db, |s| s.claim(claim).await)?;
        rows.sort_by_key(|r| r.row.id);
        rows.into_iter()
            .map(|r| {
                Ok(ClaimedDelivery {
                    delivery_id: r.row.id,
                    attempts: u32::try_from(r.attempts).unwrap_or(0),
                    lease_token: token.clone(),
                    message: r.row.decode("delivery")?,
                })
            })
            .collect()
    }

    /// Acknowledges delivery `delivery_id`: deletes it (whoever holds its lease now — the
    /// consumer committed its effect). Returns `false` when it was gone already.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn ack(&self, delivery_id: i64) -> Result<bool, StoreError> {
        let n = on_writer!(&self.db, |p| {
            sqlx::query(&sql_text(p, "DELETE FROM oncely_deliveries WHERE id = $1"))
                .bind(delivery_id)
                .execute(p)
                .await
                .map(|r| r.rows_affected())
        })?;
        Ok(n == 1)
    }

    /// Counts a failed attempt of delivery `delivery_id` and makes it ready again after
    /// `delay` (for its consumer group only), recording `error`. Returns `false` when
    /// `lease_token` is no longer the row's lease and nothing changed.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn retry(
        &self,
        delivery_id: i64,
        lease_token: &str,
        delay: Duration,
        error: &str,
    ) -> Result<bool, StoreError> {
        let at = oncely_core::ms_after(oncely_core::now_ms(), delay);
        self.settle(
            "UPDATE oncely_deliveries SET attempts = attempts + 1, last_error = $1, \
             available_at = $2, lease_token = NULL, locked_until = NULL \
             WHERE id = $3 AND lease_token = $4",
            delivery_id,
            lease_token,
            error,
            at,
        )
        .await
    }

    /// Counts a failed attempt of delivery `delivery_id` and parks it in state `dead` with
    /// `error`; it is not delivered again. Returns `false` when `lease_token` is no longer
    /// the row's lease.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn dead(
        &self,
        delivery_id: i64,
        lease_token: &str,
        error: &str,
    ) -> Result<bool, StoreError> {
        self.settle(
            "UPDATE oncely_deliveries SET attempts = attempts + 1, last_error = $1, \
             state = 'dead', available_at = $2, lease_token = NULL, locked_until = NULL \
             WHERE id = $3 AND lease_token = $4",
            delivery_id,
            lease_token,
            error,
            oncely_core::now_ms(),
        )
        .await
    }

    async fn settle(
        &self,
        sql: &str,
        delivery_id: i64,
        lease_token: &str,
        error: &str,
        at: i64,
    ) -> Result<bool, StoreError> {
        // Placeholders in text order, so the binds line up on MySQL's positional `?` too.
        let n = on_writer!(&self.db, |p| {
            sqlx::query(&sql_text(p, sql))
                .bind(error)
                .bind(at)
                .bind(delivery_id)
                .bind(lease_token)
                .execute(p)
                .await
                .map(|r| r.rows_affected())
        })?;
        Ok(n == 1)
    }

    /// Up to `limit` dead deliveries of `consumer`, oldest first.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn dead_deliveries(
        &self,
        consumer: &str,
        limit: u32,
    ) -> Result<Vec<DeadQueueDelivery>, StoreError> {
        self.dead_deliveries_after(consumer, None, limit).await
    }

    /// The deliveries of partition `partition_key`'s messages to every consumer group not
    /// yet acknowledged, in row-id order — for operators following one aggregate's events.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn partition_deliveries(
        &self,
        partition_key: &str,
    ) -> Result<Vec<DeliverySummary>, StoreError> {
        let text: Vec<_> = [
            "consumer",
            "message_id",
            "event_type",
            "state",
            "last_error",
        ]
        .iter()
        .map(|c| self.db.backend().text_column(c).into_owned())
        .collect();
        self.db
            .fetch_all(
                query(format!(
                    "SELECT {}, attempts FROM oncely_deliveries WHERE partition_key = $1 \
                     ORDER BY id",
                    text.join(", ")
                ))
                .bind(partition_key),
            )
            .await
    }

    /// Up to `limit` dead deliveries of `consumer` whose row id is above `after` (all with
    /// `None`), in row-id order: one page of the group's dead letters.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn dead_deliveries_after(
        &self,
        consumer: &str,
        after: Option<i64>,
        limit: u32,
    ) -> Result<Vec<DeadQueueDelivery>, StoreError> {
        // `LENGTH(payload) + $1` with a 64-bit zero: PostgreSQL's LENGTH is a 32-bit
        // integer, MySQL's and SQLite's 64-bit; the sum is 64-bit everywhere. SUBSTR on a
        // binary value counts bytes on every backend.
        // `topic` is binary-collated on MySQL (read as text through `text_column`).
        let sql = format!(
            "SELECT id, message_id, {}, event_type, attempts, last_error, available_at, \
             LENGTH(payload) + $1 AS payload_size, SUBSTR(payload, 1, 256) AS preview \
             FROM oncely_deliveries \
             WHERE consumer = $2 AND state = 'dead' AND id > $3 ORDER BY id LIMIT $4",
            self.db.backend().text_column("topic")
        );
        let rows: Vec<DeadRow> = on_pool!(&self.db, |p| {
            sqlx::query_as(&sql_text(p, &sql))
                .bind(0_i64)
                .bind(consumer)
                .bind(after.unwrap_or(i64::MIN))
                .bind(i64::from(limit))
                .fetch_all(p)
                .await
        })?;
        rows.into_iter()
            .map(|r| {
                Ok(DeadQueueDelivery {
                    delivery_id: r.id,
                    message_id: MessageId::parse(&r.message_id)
                        .map_err(|e| StoreError::Corrupt(e.to_string()))?,
                    topic: r.topic,
                    event_type: r.event_type,
                    attempts: u32::try_from(r.attempts).unwrap_or(0),
                    last_error: r.last_error,
                    dead_at: r.available_at,
                    payload_size: u64::try_from(r.payload_size).unwrap_or(0),
                    payload_preview: r.preview,
                })
            })
            .collect()
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
        // Placeholders in text order, so the same binds serve MySQL's positional `?`.
        let sql = if id.is_some() {
            "UPDATE oncely_deliveries SET state = 'pending', attempts = 0, available_at = $1, \
             lease_token = NULL, locked_until = NULL \
             WHERE consumer = $2 AND state = 'dead' AND message_id = $3"
        } else {
            "UPDATE oncely_deliveries SET state = 'pending', attempts = 0, available_at = $1, \
             lease_token = NULL, locked_until = NULL \
             WHERE consumer = $2 AND state = 'dead'"
        };
        let id = id.map(ToString::to_string);
        let now = oncely_core::now_ms();
        let n = on_writer!(&self.db, |p| {
            let sql = sql_text(p, sql);
            let mut q = sqlx::query(&sql).bind(now).bind(consumer);
            if let Some(id) = &id {
                q = q.bind(id);
            }
            q.execute(p).await.map(|r| r.rows_affected())
        })?;
        Ok(n)
    }

    /// Deletes up to `batch` (at least 1) queue rows enqueued before `before_ms` (Unix ms)
    /// on topics that have a subscribed consumer group, returning how many went. Their
    /// copies live in `oncely_deliveries`; the queue row only keeps a republished copy (same
    /// message id) from being fanned out again while it exists, so `before_ms` must leave a
    /// window shorter than the consumers' inbox retention. Rows of topics nobody subscribed
    /// to stay for [`QueueStore::take`].
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn collect_fanned_out(&self, before_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let batch = i64::from(batch.max(1));
        with_store!(&self.db, |s| s.collect_fanned_out(before_ms, batch).await)
    }
}

impl QueueRow {
    fn decode(self, what: &str) -> Result<QueueMessage, StoreError> {
        Ok(QueueMessage {
            message_id: MessageId::parse(&self.message_id)
                .map_err(|e| StoreError::Corrupt(e.to_string()))?,
            topic: self.topic,
            partition_key: self.partition_key,
            event_type: self.event_type,
            headers: serde_json::from_str(&self.headers)
                .map_err(|e| StoreError::Corrupt(format!("{what} headers: {e}")))?,
            payload: self.payload,
            enqueued_at: self.enqueued_at,
        })
    }
}
