//! Migration 0005 on an outbox holding rows published under the old schema.

use std::sync::Arc;

use oncely_broker::Publisher;
use oncely_outbox::Relay;
use oncely_sql::{OutboxState, OutboxStore};
use oncely_testkit::TestDb;
use tokio_util::sync::CancellationToken;

use super::recorder::{claim_test_config, Recorder};
use crate::store::{enqueue_all, plain_event};

/// Migration 0005 on a database migrated up to 0004 that already
/// holds rows published under the old schema (state `published` in `oncely_outbox`): they
/// move to `oncely_outbox_published` (a missing `published_at` becomes `created_at`), stay
/// readable through `get`, their ids cannot be enqueued again, and the pending and dead
/// rows stay where they were and are relayed.
#[allow(
    clippy::too_many_lines,
    reason = "one migration's before and after, read top to bottom"
)]
pub(crate) async fn migration_0005_moves_rows_published_under_the_old_schema(t: TestDb) {
    let pool = t.db.as_postgres().expect("postgres").clone();
    let mut old = sqlx::migrate!("../oncely-sql/migrations/postgres");
    old.migrations = old
        .migrations
        .iter()
        .filter(|m| m.version < 5)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    old.run(&pool).await.unwrap();
    let published_table: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('oncely_outbox_published')::text")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        published_table.as_deref(),
        Some("oncely_outbox_published"),
        "0002's partial index of published rows"
    );
    // Old-schema rows: two published (one without published_at), one pending, one dead.
    let events = [
        plain_event("a"),
        plain_event("b"),
        plain_event("a"),
        plain_event("c"),
    ];
    // The old schema's enqueue (today's checks `oncely_outbox_published`, not yet a table).
    let mut ids = Vec::new();
    for e in &events {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, \
             payload, headers, created_at, available_at, attempts, state) \
             VALUES ($1, $2, $3, $4, $5, '{}', $6, $6, 0, 'pending') RETURNING id",
        )
        .bind(e.message_id.to_string())
        .bind(&e.topic)
        .bind(&e.partition_key)
        .bind(&e.event_type)
        .bind(&e.payload)
        .bind(oncely_core::now_ms())
        .fetch_one(&pool)
        .await
        .unwrap();
        ids.push(id);
    }
    sqlx::query("UPDATE oncely_outbox SET state = 'published', published_at = 1234 WHERE id = $1")
        .bind(ids[0])
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE oncely_outbox SET state = 'published' WHERE id = $1")
        .bind(ids[1])
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE oncely_outbox SET state = 'dead', attempts = 3 WHERE id = $1")
        .bind(ids[3])
        .execute(&pool)
        .await
        .unwrap();
    let created_b: i64 = sqlx::query_scalar("SELECT created_at FROM oncely_outbox WHERE id = $1")
        .bind(ids[1])
        .fetch_one(&pool)
        .await
        .unwrap();
    t.db.migrate().await.unwrap();
    let moved: Vec<(i64, i64)> =
        sqlx::query_as("SELECT id, published_at FROM oncely_outbox_published ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(moved, vec![(ids[0], 1234), (ids[1], created_b)]);
    let left: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, state FROM oncely_outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        left,
        vec![(ids[2], "pending".to_owned()), (ids[3], "dead".to_owned())]
    );
    let store = OutboxStore::new(t.db.clone());
    let a0 = store.get(ids[0]).await.unwrap().expect("kept");
    assert_eq!(
        (a0.state, a0.published_at, &a0.event),
        (OutboxState::Published, Some(1234), &events[0])
    );
    let mut tx = t.db.begin().await.unwrap();
    let again = OutboxStore::enqueue(&mut tx, &events[1]).await;
    assert!(
        matches!(again, Err(oncely_sql::StoreError::AlreadyPublished(_))),
        "{again:?}"
    );
    drop(tx);
    // New ids continue after the old ones; the pending row is relayed.
    let next = enqueue_all(&t.db, &[plain_event("d")]).await[0];
    assert!(next > ids[3]);
    let recorder = Arc::new(Recorder::new(0, 0, 0));
    let publisher: Arc<dyn Publisher> = recorder.clone();
    let relay = Relay::new(t.db.clone(), publisher, claim_test_config(0, true));
    let r = relay.drain(&CancellationToken::new()).await.unwrap();
    assert_eq!(r.published, 2, "{r:?}");
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.dead), (0, 1));
}
