use std::collections::BTreeMap;

use oncely_core::MessageId;
use oncely_sql::{on_tx, on_writer, sql_text, Database, StoreError, Tx};

use std::time::Duration;

use crate::{BoxFuture, Incoming, Message, PublishError, Publisher, SubscribeError, Subscriber};

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
///   group gets every message. [`SqlTransport::claim`] leases ready deliveries of one
///   consumer, [`SqlTransport::ack`] deletes one, [`SqlTransport::nack`] reschedules it after
///   a delay (only for that consumer), [`SqlTransport::dead`] parks it with its last error. A
///   delivery whose lease runs out unacknowledged is claimed again.
/// - [`SqlTransport::receive`] takes (deletes) queue rows: at most once towards the
///   consumer process; kept for tools and tests that read the raw queue.
#[derive(Debug, Clone)]
pub struct SqlTransport {
    db: Database,
    max_message_bytes: usize,
}

/// A message taken from the SQL transport's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReceivedMessage {
    /// Queue position (insert order within the topic).
    pub queue_id: i64,
    /// The message id.
    pub id: MessageId,
    /// Topic.
    pub topic: String,
    /// Partition key.
    pub partition_key: String,
    /// Event type.
    pub event_type: String,
    /// All headers as published ([`Message::all_headers`]).
    pub headers: BTreeMap<String, String>,
    /// Body.
    pub payload: Vec<u8>,
    /// When it was queued, Unix ms.
    pub enqueued_at: i64,
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
    /// The message (`queue_id` is the delivery row id).
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

#[derive(sqlx::FromRow)]
pub(crate) struct DeliveryRow {
    id: i64,
    topic: String,
    message_id: String,
    partition_key: String,
    event_type: String,
    headers: String,
    payload: Vec<u8>,
    enqueued_at: i64,
    attempts: i32,
}

#[derive(sqlx::FromRow)]
pub(crate) struct QueueRow {
    id: i64,
    topic: String,
    message_id: String,
    partition_key: String,
    event_type: String,
    headers: String,
    payload: Vec<u8>,
    enqueued_at: i64,
}

impl SqlTransport {
    /// A transport on `db` that refuses payloads over `max_message_bytes` bytes
    /// (default in the binary: 1 MiB).
    pub fn new(db: Database, max_message_bytes: usize) -> Self {
        Self {
            db,
            max_message_bytes,
        }
    }

    async fn insert_batch(&self, batch: &[Message]) -> Vec<Result<(), PublishError>> {
        let mut results: Vec<Result<(), PublishError>> = batch
            .iter()
            .map(|m| {
                if m.payload.len() > self.max_message_bytes {
                    Err(PublishError::TooLarge {
                        size: m.payload.len(),
                        limit: self.max_message_bytes,
                    })
                } else {
                    Ok(())
                }
            })
            .collect();
        let outcome: Result<(), StoreError> = async {
            let mut tx = self.db.begin().await?;
            let now = oncely_core::now_ms();
            for (m, r) in batch.iter().zip(&results) {
                if r.is_err() {
                    continue;
                }
                let headers = serde_json::to_string(&m.all_headers())
                    .map_err(|e| StoreError::Corrupt(e.to_string()))?;
                let tx = &mut tx;
                if let Tx::MySql(t) = tx {
                    // A plain insert: the duplicate-key error (1062) on UNIQUE(message_id)
                    // is the republished copy to drop; the failed statement leaves no
                    // fan-out behind (statement atomicity), the transaction goes on.
                    let inserted = sqlx::query(
                        "INSERT INTO oncely_queue (topic, message_id, partition_key, \
                         event_type, headers, payload, enqueued_at) \
                         VALUES (?, ?, ?, ?, ?, ?, ?)",
                    )
                    .bind(&m.topic)
                    .bind(m.id.to_string())
                    .bind(&m.partition_key)
                    .bind(&m.event_type)
                    .bind(&headers)
                    .bind(&m.payload)
                    .bind(now)
                    .execute(&mut **t)
                    .await;
                    match inserted {
                        Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {}
                        other => {
                            other?;
                        }
                    }
                    continue;
                }
                on_tx!(tx, |c| sqlx::query(
                    "INSERT INTO oncely_queue (topic, message_id, partition_key, event_type, \
                     headers, payload, enqueued_at) VALUES ($1, $2, $3, $4, $5, $6, $7) \
                     ON CONFLICT (message_id) DO NOTHING",
                )
                .bind(&m.topic)
                .bind(m.id.to_string())
                .bind(&m.partition_key)
                .bind(&m.event_type)
                .bind(&headers)
                .bind(&m.payload)
                .bind(now)
                .execute(c)
                .await
                .map(|r| r.rows_affected()))?;
            }
            tx.commit().await
        }
        .await;
        if let Err(e) = outcome {
            let unavailable = e.is_unavailable();
            for r in &mut results {
                if r.is_ok() {
                    *r = Err(if unavailable {
                        PublishError::Unavailable(e.to_string())
                    } else {
                        PublishError::Rejected(e.to_string())
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
        let max = i64::from(max.max(1));
        let rows: Vec<QueueRow> =
            match &self.db {
                Database::Sqlite(s) => {
                    sqlx::query_as(
                        "DELETE FROM oncely_queue WHERE id IN (SELECT id FROM oncely_queue \
                     WHERE topic = $1 ORDER BY id LIMIT $2) RETURNING id, topic, message_id, \
                     partition_key, event_type, headers, payload, enqueued_at",
                    )
                    .bind(topic)
                    .bind(max)
                    .fetch_all(s.writer())
                    .await?
                }
                // The locking subquery in a CTE runs once (an `IN (…)` subquery may be
                // rescanned, and with SKIP LOCKED a rescan takes other rows).
                // Plan pinned, rows taken by TID (`oncely_sql::PINNED_PLAN`).
                Database::Postgres(p) => oncely_sql::fetch_all_pinned(
                    p.pool(),
                    sqlx::query_as(
                        "WITH c AS (SELECT ctid FROM oncely_queue WHERE topic = $1 ORDER BY id \
                         LIMIT $2 FOR UPDATE SKIP LOCKED) \
                         DELETE FROM oncely_queue q \
                         WHERE q.ctid = ANY (ARRAY(SELECT c.ctid FROM c)) \
                         RETURNING q.id, q.topic, q.message_id, q.partition_key, q.event_type, \
                         q.headers, q.payload, q.enqueued_at",
                    )
                    .bind(topic)
                    .bind(max),
                )
                .await?,
                Database::MySql(p) => crate::sql_mysql::receive(p.pool(), topic, max).await?,
            };
        let mut out = rows
            .into_iter()
            .map(|r| {
                Ok(ReceivedMessage {
                    queue_id: r.id,
                    id: MessageId::parse(&r.message_id)
                        .map_err(|e| StoreError::Corrupt(e.to_string()))?,
                    topic: r.topic,
                    partition_key: r.partition_key,
                    event_type: r.event_type,
                    headers: serde_json::from_str(&r.headers)
                        .map_err(|e| StoreError::Corrupt(format!("queue headers: {e}")))?,
                    payload: r.payload,
                    enqueued_at: r.enqueued_at,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        out.sort_by_key(|m| m.queue_id);
        Ok(out)
    }
}

impl SqlTransport {
    /// Subscribes consumer group `consumer` to `topic`: every message queued on `topic`
    /// from now on is delivered to it (earlier ones are not). Idempotent.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn subscribe(&self, consumer: &str, topic: &str) -> Result<(), StoreError> {
        let mut tx = self.db.begin().await?;
        if let Tx::MySql(t) = &mut tx {
            let inserted =
                sqlx::query("INSERT INTO oncely_subscriptions (consumer, topic) VALUES (?, ?)")
                    .bind(consumer)
                    .bind(topic)
                    .execute(&mut **t)
                    .await;
            match inserted {
                Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {}
                other => {
                    other?;
                }
            }
        } else {
            let tx = &mut tx;
            on_tx!(tx, |c| sqlx::query(
                "INSERT INTO oncely_subscriptions (consumer, topic) VALUES ($1, $2) \
                 ON CONFLICT (consumer, topic) DO NOTHING",
            )
            .bind(consumer)
            .bind(topic)
            .execute(c)
            .await
            .map(|r| r.rows_affected()))?;
        }
        tx.commit().await
    }

    /// Leases up to `max` ready deliveries of `consumer` (pending, due, not leased), oldest
    /// first, for `lease` (after which an unacknowledged delivery is claimed again).
    /// Concurrent claimers never hold the same delivery at once (PostgreSQL: `FOR UPDATE
    /// SKIP LOCKED` in a materialised CTE; SQLite: the single writer).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt.
    pub async fn claim(
        &self,
        consumer: &str,
        max: u32,
        lease: std::time::Duration,
    ) -> Result<Vec<Delivery>, StoreError> {
        let max = i64::from(max.max(1));
        let now = oncely_core::now_ms();
        let until = now.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX));
        let token = uuid::Uuid::new_v4().simple().to_string();
        let rows: Vec<DeliveryRow> = match &self.db {
            Database::Sqlite(s) => {
                sqlx::query_as(
                    "UPDATE oncely_deliveries SET lease_token = $3, locked_until = $4 \
                     WHERE id IN (SELECT id FROM oncely_deliveries WHERE consumer = $1 \
                     AND state = 'pending' AND available_at <= $5 \
                     AND (locked_until IS NULL OR locked_until <= $5) ORDER BY id LIMIT $2) \
                     RETURNING id, topic, message_id, partition_key, event_type, headers, \
                     payload, enqueued_at, attempts",
                )
                .bind(consumer)
                .bind(max)
                .bind(&token)
                .bind(until)
                .bind(now)
                .fetch_all(s.writer())
                .await?
            }
            // Plan pinned, rows taken by TID (`oncely_sql::PINNED_PLAN`).
            Database::Postgres(p) => {
                oncely_sql::fetch_all_pinned(
                    p.pool(),
                    sqlx::query_as(
                        "WITH c AS MATERIALIZED (SELECT ctid FROM oncely_deliveries \
                         WHERE consumer = $1 AND state = 'pending' AND available_at <= $5 \
                         AND (locked_until IS NULL OR locked_until <= $5) ORDER BY id \
                         LIMIT $2 FOR UPDATE SKIP LOCKED) \
                         UPDATE oncely_deliveries d SET lease_token = $3, locked_until = $4 \
                         WHERE d.ctid = ANY (ARRAY(SELECT c.ctid FROM c)) \
                         RETURNING d.id, d.topic, d.message_id, d.partition_key, d.event_type, \
                         d.headers, d.payload, d.enqueued_at, d.attempts",
                    )
                    .bind(consumer)
                    .bind(max)
                    .bind(&token)
                    .bind(until)
                    .bind(now),
                )
                .await?
            }
            Database::MySql(p) => {
                crate::sql_mysql::claim(p.pool(), consumer, max, &token, until, now).await?
            }
        };
        let mut out = rows
            .into_iter()
            .map(|r| {
                Ok(Delivery {
                    delivery_id: r.id,
                    consumer: consumer.to_owned(),
                    attempts: u32::try_from(r.attempts).unwrap_or(0),
                    lease_token: token.clone(),
                    message: ReceivedMessage {
                        queue_id: r.id,
                        id: MessageId::parse(&r.message_id)
                            .map_err(|e| StoreError::Corrupt(e.to_string()))?,
                        topic: r.topic,
                        partition_key: r.partition_key,
                        event_type: r.event_type,
                        headers: serde_json::from_str(&r.headers)
                            .map_err(|e| StoreError::Corrupt(format!("delivery headers: {e}")))?,
                        payload: r.payload,
                        enqueued_at: r.enqueued_at,
                    },
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        out.sort_by_key(|d| d.delivery_id);
        Ok(out)
    }

    /// Acknowledges a delivery: deletes it (whoever holds its lease now — the consumer
    /// committed its effect, so no copy is needed any more). Returns `false` when it was
    /// gone already.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the delivery then comes back after its
    /// lease and the consumer's inbox recognises it.
    pub async fn ack(&self, delivery: &Delivery) -> Result<bool, StoreError> {
        self.ack_handle(&delivery.handle()).await
    }

    async fn ack_handle(&self, delivery: &SqlHandle) -> Result<bool, StoreError> {
        let n = self
            .write(
                "DELETE FROM oncely_deliveries WHERE id = $1",
                delivery,
                None,
                0,
            )
            .await?;
        Ok(n == 1)
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
        delay: std::time::Duration,
        error: &str,
    ) -> Result<bool, StoreError> {
        self.nack_handle(&delivery.handle(), delay, error).await
    }

    async fn nack_handle(
        &self,
        delivery: &SqlHandle,
        delay: std::time::Duration,
        error: &str,
    ) -> Result<bool, StoreError> {
        let at = oncely_core::now_ms()
            .saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
        let n = self
            .write(
                "UPDATE oncely_deliveries SET attempts = attempts + 1, last_error = $1, \
                 available_at = $2, lease_token = NULL, locked_until = NULL \
                 WHERE id = $3 AND lease_token = $4",
                delivery,
                Some(error),
                at,
            )
            .await?;
        Ok(n == 1)
    }

    /// Counts a failed attempt and parks the delivery in state `dead` with `error`; it is
    /// not delivered again. Returns `false` when the lease was lost.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; the delivery then comes back after its lease.
    pub async fn dead(&self, delivery: &Delivery, error: &str) -> Result<bool, StoreError> {
        self.dead_handle(&delivery.handle(), error).await
    }

    async fn dead_handle(&self, delivery: &SqlHandle, error: &str) -> Result<bool, StoreError> {
        let n = self
            .write(
                "UPDATE oncely_deliveries SET attempts = attempts + 1, last_error = $1, \
                 state = 'dead', available_at = $2, lease_token = NULL, locked_until = NULL \
                 WHERE id = $3 AND lease_token = $4",
                delivery,
                Some(error),
                oncely_core::now_ms(),
            )
            .await?;
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
    ) -> Result<Vec<DeadDelivery>, StoreError> {
        let rows: Vec<(String, i32, Option<String>)> = oncely_sql::on_pool!(&self.db, |p| {
            sqlx::query_as(&sql_text(
                p,
                "SELECT message_id, attempts, last_error FROM oncely_deliveries \
                 WHERE consumer = $1 AND state = 'dead' ORDER BY id LIMIT $2",
            ))
            .bind(consumer)
            .bind(i64::from(limit))
            .fetch_all(p)
            .await
        })?;
        rows.into_iter()
            .map(|(id, attempts, last_error)| {
                Ok(DeadDelivery {
                    id: MessageId::parse(&id).map_err(|e| StoreError::Corrupt(e.to_string()))?,
                    attempts: u32::try_from(attempts).unwrap_or(0),
                    last_error,
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

    /// Deletes up to `batch` queue rows enqueued before `before_ms` (Unix ms) on topics
    /// that have a subscribed consumer group, returning how many went. Their copies live in
    /// `oncely_deliveries`; the queue row only keeps a republished copy (same message id)
    /// from being fanned out again while it exists, so `before_ms` must leave a window
    /// shorter than the consumers' inbox retention (a copy fanned out again after it is
    /// recognised by the inbox). Rows of topics nobody subscribed to stay for
    /// [`SqlTransport::receive`]. PostgreSQL: the locked batch is a materialised CTE, so the
    /// `LIMIT` holds.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub async fn collect_fanned_out(&self, before_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let batch = i64::from(batch.max(1));
        let n = match &self.db {
            Database::Sqlite(s) => sqlx::query(
                "DELETE FROM oncely_queue WHERE id IN (SELECT q.id FROM oncely_queue q \
                 WHERE q.enqueued_at < $1 AND EXISTS (SELECT 1 FROM oncely_subscriptions s \
                 WHERE s.topic = q.topic) ORDER BY q.id LIMIT $2)",
            )
            .bind(before_ms)
            .bind(batch)
            .execute(s.writer())
            .await?
            .rows_affected(),
            // Plan pinned, rows taken by TID (`oncely_sql::PINNED_PLAN`).
            Database::Postgres(p) => {
                oncely_sql::execute_pinned(
                    p.pool(),
                    sqlx::query(
                        "WITH doomed AS MATERIALIZED (SELECT q.ctid FROM oncely_queue q \
                         WHERE q.enqueued_at < $1 AND EXISTS (SELECT 1 FROM \
                         oncely_subscriptions s WHERE s.topic = q.topic) ORDER BY q.id \
                         LIMIT $2 FOR UPDATE SKIP LOCKED) \
                         DELETE FROM oncely_queue q \
                         WHERE q.ctid = ANY (ARRAY(SELECT d.ctid FROM doomed d))",
                    )
                    .bind(before_ms)
                    .bind(batch),
                )
                .await?
            }
            Database::MySql(p) => {
                crate::sql_mysql::collect_fanned_out(p.pool(), before_ms, batch).await?
            }
        };
        Ok(n)
    }

    async fn write(
        &self,
        sql: &str,
        delivery: &SqlHandle,
        error: Option<&str>,
        at: i64,
    ) -> Result<u64, StoreError> {
        // Placeholders are numbered in text order (`$1` first), so the binds line up on
        // MySQL's positional `?` too: (error, at, id, lease) or (id) alone.
        let n = on_writer!(&self.db, |p| {
            let sql = sql_text(p, sql);
            let mut q = sqlx::query(&sql);
            if error.is_some() {
                q = q.bind(error).bind(at);
            }
            q = q.bind(delivery.delivery_id);
            if error.is_some() {
                q = q.bind(&delivery.lease_token);
            }
            q.execute(p).await.map(|r| r.rows_affected())
        })?;
        Ok(n)
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
        Ok(self
            .transport
            .subscribe(&self.consumer, &self.topic)
            .await?)
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
        self.transport.ack_handle(&delivery.handle).await?;
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
        self.transport
            .nack_handle(&delivery.handle, delay, error)
            .await?;
        Ok(())
    }

    async fn dead<'a>(
        &'a self,
        delivery: &'a Incoming<SqlHandle>,
        error: &'a str,
    ) -> Result<(), SubscribeError> {
        self.transport.dead_handle(&delivery.handle, error).await?;
        Ok(())
    }

    async fn collect(&self, before_ms: i64, batch: u32) -> Result<u64, SubscribeError> {
        Ok(self.transport.collect_fanned_out(before_ms, batch).await?)
    }
}
