//! Store rules, broker-independent: what `OutboxStore` claims, settles, counts, requeues and
//! deletes, on every backend; also the event helpers the claim tests share
//! ([`plain_event`], [`enqueue_all`]).

use std::time::Duration;

use oncely_core::MessageId;
use oncely_sql::{OutboxEvent, OutboxState, OutboxStore, RequeueTarget};
use oncely_testkit::TestDb;

pub(crate) fn plain_event(partition: &str) -> OutboxEvent {
    OutboxEvent::new(
        MessageId::new_random(),
        "store-test",
        partition,
        "test.event",
        b"x".to_vec(),
    )
}

pub(crate) async fn enqueue_all(db: &oncely_sql::Database, events: &[OutboxEvent]) -> Vec<i64> {
    let mut tx = db.begin().await.unwrap();
    let mut ids = Vec::new();
    for e in events {
        ids.push(OutboxStore::enqueue(&mut tx, e).await.unwrap());
    }
    tx.commit().await.unwrap();
    ids
}

/// A claim takes only the oldest pending row of each partition, none of a partition with a
/// leased row, and nothing another relay leases; a reschedule records the failure and
/// blocks the partition until the row is available again; a lease that runs out frees it.
async fn claim_takes_partition_heads_and_honours_leases(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let ids = enqueue_all(
        &t.db,
        &[plain_event("a"), plain_event("a"), plain_event("b")],
    )
    .await;
    let lease = Duration::from_secs(60);
    let now = oncely_core::now_ms();
    let r1 = store.claim("r1", 10, lease, now).await.unwrap();
    assert_eq!(
        r1.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[0], ids[2]]
    );
    assert!(store.claim("r2", 10, lease, now).await.unwrap().is_empty());
    // Settling rows r1 does not hold changes nothing.
    assert_eq!(store.mark_published("r2", &[ids[0]], now).await.unwrap(), 0);
    assert_eq!(store.mark_published("r1", &[ids[0]], now).await.unwrap(), 1);
    let r2 = store.claim("r2", 10, lease, now).await.unwrap();
    assert_eq!(r2.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids[1]]);
    // A failure: attempts and error recorded, back to pending after the backoff.
    let outcome = store
        .reschedule("r2", ids[1], "broker said no", now + 60_000, 5)
        .await
        .unwrap();
    assert_eq!(outcome, oncely_sql::Rescheduled::Retry);
    let row = store.get(ids[1]).await.unwrap().unwrap();
    assert_eq!(
        (row.attempts, row.last_error.as_deref()),
        (1, Some("broker said no"))
    );
    assert!(
        store.claim("r3", 10, lease, now).await.unwrap().is_empty(),
        "in backoff"
    );
    let later = store.claim("r3", 10, lease, now + 60_000).await.unwrap();
    assert_eq!(later.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids[1]]);
    // b's lease (r1) runs out: another relay may take it.
    let expired = store.claim("r4", 10, lease, now + 61_000).await.unwrap();
    assert_eq!(
        expired.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[2]]
    );
    assert_eq!(store.mark_published("r1", &[ids[2]], now).await.unwrap(), 0);
}

/// Stats count pending and dead rows and age the oldest pending one; a dead row can be
/// requeued by id.
async fn stats_and_requeue_by_id(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let ids = enqueue_all(&t.db, &[plain_event("a"), plain_event("b")]).await;
    let now = oncely_core::now_ms();
    let rows = store
        .claim("r", 10, Duration::from_secs(60), now)
        .await
        .unwrap();
    assert_eq!(rows.len(), 2);
    let dead = store
        .reschedule("r", ids[0], "poison", now, 1)
        .await
        .unwrap();
    assert_eq!(dead, oncely_sql::Rescheduled::Dead);
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.dead), (1, 1));
    let age = s.oldest_pending_age_ms(s.oldest_pending_created_at.unwrap() + 1500);
    assert_eq!(age, 1500);
    assert_eq!(
        store
            .requeue_dead(RequeueTarget::Id(ids[1]), now)
            .await
            .unwrap(),
        0,
        "not dead"
    );
    assert_eq!(
        store
            .requeue_dead(RequeueTarget::Id(ids[0]), now)
            .await
            .unwrap(),
        1
    );
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.dead), (2, 0));
}

/// Published rows past the retention are deleted in batches of the given size; pending and
/// newer rows stay.
async fn published_rows_are_deleted_after_retention_in_batches(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let events: Vec<_> = (0..5).map(|i| plain_event(&format!("p{i}"))).collect();
    let ids = enqueue_all(&t.db, &events).await;
    let pending = enqueue_all(&t.db, &[plain_event("q")]).await;
    let now = oncely_core::now_ms();
    let claimed = store
        .claim("r", 5, Duration::from_secs(60), now)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 5);
    assert_eq!(
        store.mark_published("r", &ids[..4], 1_000).await.unwrap(),
        4
    );
    assert_eq!(
        store.mark_published("r", &ids[4..], 9_000).await.unwrap(),
        1
    );
    assert_eq!(store.delete_published(5_000, 3).await.unwrap(), 3);
    assert_eq!(store.delete_published(5_000, 3).await.unwrap(), 1);
    assert_eq!(store.delete_published(5_000, 3).await.unwrap(), 0);
    assert!(
        store.get(ids[4]).await.unwrap().is_some(),
        "newer than the cut-off"
    );
    assert!(
        store.get(pending[0]).await.unwrap().is_some(),
        "pending rows stay"
    );
    assert!(store.get(ids[0]).await.unwrap().is_none());
}

/// Settling a claimed batch: a published row is recorded as published (with its time) and
/// its message id cannot be enqueued again while it is kept; a failed row is back, same id,
/// with its attempt and error, blocking its partition until it is available again; a row
/// neither published nor failed is back untouched; a batch dropped unsettled gives its rows
/// back (PostgreSQL: its transaction rolls back when the pool takes the connection back;
/// elsewhere after the lease).
async fn settling_a_batch_records_each_row(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let events = [
        plain_event("a"),
        plain_event("b"),
        plain_event("c"),
        plain_event("a"),
    ];
    let ids = enqueue_all(&t.db, &events).await;
    let now = oncely_core::now_ms();
    let lease = Duration::from_millis(300);
    let batch = store.claim_batch("r", 10, lease, now, &[]).await.unwrap();
    let claimed: Vec<i64> = batch.rows().iter().map(|r| r.id).collect();
    assert_eq!(claimed, ids[..3], "the heads of a, b, c in id order");
    let failure = oncely_sql::PublishFailure::new(ids[1], "nack", now + 60_000);
    let settled = batch
        .settle(&[ids[0]], now + 5, &[failure], 5)
        .await
        .unwrap();
    assert_eq!(settled.published, 1);
    assert_eq!(
        settled.failures,
        vec![(ids[1], oncely_sql::Rescheduled::Retry)]
    );

    let published = store.get(ids[0]).await.unwrap().expect("kept");
    assert_eq!(published.state, OutboxState::Published);
    assert_eq!(published.published_at, Some(now + 5));
    assert_eq!(published.event, events[0]);
    let mut tx = t.db.begin().await.unwrap();
    let again = OutboxStore::enqueue(&mut tx, &events[0]).await;
    assert!(again.is_err(), "a published id enqueued again: {again:?}");
    drop(tx);

    let failed = store.get(ids[1]).await.unwrap().expect("back");
    assert_eq!(failed.state, OutboxState::Pending);
    assert_eq!(failed.attempts, 1);
    assert_eq!(failed.last_error.as_deref(), Some("nack"));
    assert_eq!(failed.available_at, now + 60_000);
    assert_eq!(failed.event, events[1]);
    let untouched = store.get(ids[2]).await.unwrap().expect("back");
    assert_eq!(
        (untouched.state, untouched.attempts),
        (OutboxState::Pending, 0)
    );
    assert_eq!(untouched.event, events[2]);

    // SQLite and MySQL leased the rows; let the leases of the released ones run out.
    tokio::time::sleep(lease + Duration::from_millis(50)).await;
    let now = oncely_core::now_ms();
    let batch = store.claim_batch("r", 10, lease, now, &[]).await.unwrap();
    let claimed: Vec<i64> = batch.rows().iter().map(|r| r.id).collect();
    assert_eq!(
        claimed,
        vec![ids[2], ids[3]],
        "b is in backoff; a's second event is its head now"
    );
    drop(batch);
    if matches!(t.db, oncely_sql::Database::Postgres(_)) {
        // The rollback runs when the pool takes the connection back, a moment later.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let batch = store.claim_batch("r", 10, lease, now, &[]).await.unwrap();
            if batch.rows().len() == 2 {
                break;
            }
            drop(batch);
            assert!(
                std::time::Instant::now() < deadline,
                "an unsettled batch gives its rows back"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Without retention, a published row is not kept: PostgreSQL forgets it when the batch is
/// settled; SQLite and MySQL mark it and the next cleanup deletes it.
async fn without_retention_published_rows_are_not_kept(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone()).keep_published(false);
    let ids = enqueue_all(&t.db, &[plain_event("a"), plain_event("b")]).await;
    let now = oncely_core::now_ms();
    let batch = store
        .claim_batch("r", 10, Duration::from_secs(60), now, &[])
        .await
        .unwrap();
    let settled = batch.settle(&ids, now, &[], 5).await.unwrap();
    assert_eq!(settled.published, 2);
    store.delete_published(now + 1, 500).await.unwrap();
    for id in ids {
        assert!(store.get(id).await.unwrap().is_none());
    }
    assert_eq!(store.stats().await.unwrap().pending, 0);
}

oncely_testkit::matrix! {
    tests: [
        settling_a_batch_records_each_row,
        without_retention_published_rows_are_not_kept,
        claim_takes_partition_heads_and_honours_leases,
        stats_and_requeue_by_id,
        published_rows_are_deleted_after_retention_in_batches,
    ],
}
