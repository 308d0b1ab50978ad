//! The PostgreSQL retention sweep of published outbox rows (`OutboxStore::delete_published`)
//! reads the expired rows and nothing else: the B-tree on `published_at` (migration 0038)
//! gives it their pages, wherever they lie in the table.

use oncely_sql::OutboxStore;
use oncely_testkit::TestDb;

/// Rows of about 1 KB, seven to a page: about 1,300 pages, ten BRIN block ranges.
const ROWS: i64 = 9_000;
/// Every this-many-th row is published at 1,000 ms, the others from 1,000,000 ms on: 30
/// expired rows, one in each 300, so that every block range of the table holds some.
const EVERY: i64 = 300;

/// Accesses to heap pages of `oncely_outbox_published` so far (read, or found in shared
/// buffers), as the statistics of `pool`'s one connection have them.
async fn heap_accesses(pool: &sqlx::PgPool) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT heap_blks_read + heap_blks_hit FROM pg_statio_user_tables \
         WHERE relid = 'oncely_outbox_published'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// 30 expired rows spread over a 1,300-page table that PostgreSQL believes empty (`VACUUM
/// ANALYZE` before the insert): the batch that deletes them touches their pages only (the
/// BRIN index of 0005 offered every block range, each holding an expired row, so the whole
/// table), and the batch after it, which finds nothing as the last batch of every round
/// does, touches none.
async fn sweep_batches_touch_only_the_pages_of_expired_rows(t: TestDb) {
    // One connection: the statistics counted are the ones it flushes.
    let db = super::one_connection(&t).await;
    db.migrate().await.unwrap();
    let pool = db.as_postgres().expect("PostgreSQL").clone();
    sqlx::query("VACUUM ANALYZE oncely_outbox_published")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO oncely_outbox_published (id, message_id, topic, partition_key, \
         event_type, payload, headers, created_at, available_at, attempts, published_at) \
         SELECT g, 'm-' || g, 't', 'p', 'e', convert_to(repeat('x', 1000), 'UTF8'), '{}', \
         0, 0, 1, CASE WHEN g % $2 = 0 THEN 1000 ELSE 1000000 + g END \
         FROM generate_series(1, $1) g",
    )
    .bind(ROWS)
    .bind(EVERY)
    .execute(&pool)
    .await
    .unwrap();
    let pages: i64 =
        sqlx::query_scalar("SELECT pg_relation_size('oncely_outbox_published') / 8192")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(pages > 1_000, "{pages} pages");
    let store = OutboxStore::new(db.clone());
    let expired = u64::try_from(ROWS / EVERY).unwrap();

    let before = heap_accesses(&pool).await;
    assert_eq!(store.delete_published(5_000, 500).await.unwrap(), expired);
    let deleting = heap_accesses(&pool).await - before;
    // Each expired row's page a few times: read by the index scan, locked, found by TID
    // and deleted.
    assert!(
        deleting <= 6 * ROWS / EVERY,
        "{deleting} heap page accesses (of {pages} pages) to delete {expired} rows"
    );

    let before = heap_accesses(&pool).await;
    assert_eq!(store.delete_published(5_000, 500).await.unwrap(), 0);
    let finding_nothing = heap_accesses(&pool).await - before;
    assert!(
        finding_nothing <= ROWS / EVERY,
        "{finding_nothing} heap page accesses for a batch that deletes nothing"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM oncely_outbox_published")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, ROWS - ROWS / EVERY);
}

oncely_testkit::matrix! {
    tests: [
        sweep_batches_touch_only_the_pages_of_expired_rows,
    ],
    cannot_apply: [
        // `oncely_outbox_published` and pg_statio are PostgreSQL's; MySQL and SQLite keep
        // published rows in `oncely_outbox` under an index on (state, published_at) or a
        // partial one on published_at.
        sweep_batches_touch_only_the_pages_of_expired_rows on sqlite,
        sweep_batches_touch_only_the_pages_of_expired_rows on mysql,
    ],
}
