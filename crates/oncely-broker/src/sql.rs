use std::collections::BTreeMap;

use oncely_core::MessageId;
use oncely_sql::{on_tx, Database, StoreError};

use crate::{BoxFuture, Message, PublishError, Publisher};

/// The SQL transport: the embedded default broker, a queue table (`oncely_queue`, created
/// by [`Database::migrate`]) in the same database as the outbox, so `oncely serve` works
/// with no broker at all.
///
/// A batch is inserted in one transaction; success means it committed. `UNIQUE(message_id)`
/// drops a republished copy while the first is still queued. Consumers take messages with
/// [`SqlTransport::receive`] (taking deletes them: at-most-once towards the consumer process,
/// so a consumer records them in its inbox in the same transaction as its effect).
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

#[derive(sqlx::FromRow)]
struct QueueRow {
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
    /// order. Concurrent consumers never receive the same message (PostgreSQL: `FOR UPDATE
    /// SKIP LOCKED`; SQLite: the single writer).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is corrupt; nothing is taken then.
    pub async fn receive(&self, topic: &str, max: u32) -> Result<Vec<ReceivedMessage>, StoreError> {
        let max = i64::from(max.max(1));
        let rows: Vec<QueueRow> = match &self.db {
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
            Database::Postgres(p) => {
                sqlx::query_as(
                    "WITH c AS (SELECT id FROM oncely_queue WHERE topic = $1 ORDER BY id \
                     LIMIT $2 FOR UPDATE SKIP LOCKED) \
                     DELETE FROM oncely_queue q USING c WHERE q.id = c.id \
                     RETURNING q.id, q.topic, q.message_id, q.partition_key, q.event_type, \
                     q.headers, q.payload, q.enqueued_at",
                )
                .bind(topic)
                .bind(max)
                .fetch_all(p.pool())
                .await?
            }
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

impl Publisher for SqlTransport {
    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
        Box::pin(self.insert_batch(batch))
    }

    fn name(&self) -> &'static str {
        "sql"
    }
}
