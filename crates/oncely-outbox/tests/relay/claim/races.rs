//! Claim races and faults, one relay or claim at a time: late heads, a copy enqueued while
//! its original is published, one drain, partition locks across schemas, skip ranges and
//! re-inserted failures, a batch lost to a panic.

use std::sync::Arc;
use std::time::Duration;

use oncely_broker::Publisher;
use oncely_outbox::{Relay, RelayConfig};
use oncely_sql::{OutboxEvent, OutboxState, OutboxStore};
use oncely_testkit::{TestBackend, TestDb};
use tokio_util::sync::CancellationToken;

use super::recorder::{claim_test_config, seq_event, Recorder};
use crate::harness::{spawn_relay, stop};
use crate::store::{enqueue_all, plain_event};

/// A row whose transaction commits late — after a higher-numbered row of its partition
/// was committed and claimed — must wait until that row is settled: at most one event per
/// partition in flight across all relays (the rule `OutboxStore::claim` enforces with its
/// lease check, see the lease variant below). Row locks show only on the row a claim tries
/// to lock, so before the partition lock `claim_batch` handed the late head to a second
/// relay while the first was still publishing the partition's next row.
pub(crate) async fn claim_batch_late_head_waits_for_its_partitions_row_in_flight(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let lease = Duration::from_secs(60);
    let mut slow = t.db.begin().await.unwrap();
    let early = OutboxStore::enqueue(&mut slow, &plain_event("p"))
        .await
        .unwrap();
    let later = enqueue_all(&t.db, &[plain_event("p")]).await[0];
    assert!(early < later);
    let first = store
        .claim_batch("r1", 10, lease, oncely_core::now_ms(), &[])
        .await
        .unwrap();
    assert_eq!(
        first.rows().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![later]
    );
    slow.commit().await.unwrap();
    let second = store
        .claim_batch("r2", 10, lease, oncely_core::now_ms(), &[])
        .await
        .unwrap();
    let second_ids: Vec<i64> = second.rows().iter().map(|r| r.id).collect();
    assert!(
        second_ids.is_empty(),
        "partition p has row {later} in flight (relay r1), yet relay r2 claimed {second_ids:?} \
         of the same partition"
    );
    drop(second);
    drop(first);
}

/// The rule the test above expects of `claim_batch`, as the lease-based `claim` keeps it:
/// a late head waits while a higher row of its partition is leased.
pub(crate) async fn lease_claim_late_head_waits_for_its_partitions_leased_row(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let lease = Duration::from_secs(60);
    let mut slow = t.db.begin().await.unwrap();
    OutboxStore::enqueue(&mut slow, &plain_event("p"))
        .await
        .unwrap();
    let later = enqueue_all(&t.db, &[plain_event("p")]).await[0];
    let now = oncely_core::now_ms();
    let first = store.claim("r1", 10, lease, now).await.unwrap();
    assert_eq!(first.iter().map(|r| r.id).collect::<Vec<_>>(), vec![later]);
    slow.commit().await.unwrap();
    assert!(store.claim("r2", 10, lease, now).await.unwrap().is_empty());
    // claim_batch honours the lease too.
    let b = store.claim_batch("r3", 10, lease, now, &[]).await.unwrap();
    assert!(b.is_empty(), "{:?}", b.rows());
}

/// A writer enqueues an event whose original is being published right now (a retried
/// business transaction, say). Its INSERT waits on the unique index for the relay's
/// transaction; when that commits, the `NOT EXISTS (… oncely_outbox_published …)` guard
/// was already evaluated on the older snapshot, so the copy goes in — which the
/// documentation allows ("such a copy goes out with the same message id"). But with
/// retention on, settling the copy then inserts its message id into
/// `oncely_outbox_published` a second time: before `ON CONFLICT DO NOTHING`,
/// UNIQUE(message_id) failed the whole settle, the batch rolled back, and the relay
/// republished the copy *and every batch mate* forever (thousands of times a second).
pub(crate) async fn claim_copy_enqueued_while_original_is_published_does_not_wedge_the_relay(
    t: TestDb,
) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let original = plain_event("dup");
    enqueue_all(&t.db, std::slice::from_ref(&original)).await;
    let batch = store
        .claim_batch("r", 10, Duration::from_secs(60), oncely_core::now_ms(), &[])
        .await
        .unwrap();
    assert_eq!(batch.rows().len(), 1);
    let db = t.db.clone();
    let copy = original.clone();
    let writer = tokio::spawn(async move {
        let mut tx = db.begin().await.unwrap();
        let r = OutboxStore::enqueue(&mut tx, &copy).await;
        if r.is_ok() {
            tx.commit().await.unwrap();
        }
        r.map_err(|e| e.to_string())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ids: Vec<i64> = batch.rows().iter().map(|r| r.id).collect();
    batch
        .settle(&ids, oncely_core::now_ms(), &[], 5)
        .await
        .unwrap();
    let enqueued = writer.await.unwrap();
    eprintln!("enqueue of the copy while the original was being published: {enqueued:?}");
    if enqueued.is_err() {
        // The guard held: nothing more to check.
        return;
    }
    // The copy plus an unrelated event of another partition, relayed with retention.
    let mate = seq_event("mate", 0);
    enqueue_all(&t.db, std::slice::from_ref(&mate)).await;
    let recorder = Arc::new(Recorder::new(0, 0, 0));
    let publisher: Arc<dyn Publisher> = recorder.clone();
    let relay = spawn_relay(Relay::new(
        t.db.clone(),
        publisher,
        claim_test_config(0, true),
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop(relay).await;
    let mate_copies = recorder
        .confirmed()
        .get("mate")
        .map_or(0, std::vec::Vec::len);
    let pending = store.stats().await.unwrap().pending;
    // Show the settle error itself.
    let batch = store
        .claim_batch(
            "probe",
            10,
            Duration::from_secs(60),
            oncely_core::now_ms(),
            &[],
        )
        .await
        .unwrap();
    let ids: Vec<i64> = batch.rows().iter().map(|r| r.id).collect();
    let settle = batch.settle(&ids, oncely_core::now_ms(), &[], 5).await;
    assert!(
        mate_copies == 1 && pending == 0,
        "in 2 s the relay published the batch mate {mate_copies} times and {pending} rows are \
         still pending; settling the batch again gives {settle:?}"
    );
}

/// A race, hence 200 rounds (which made it fail reliably before the fix). `Relay::drain` "publishes until nothing is claimable" (`oncely-bench relay` relies on it,
/// checking `published == n` after one drain, though its events all have partitions of
/// their own and so do not meet this). With several events per partition, the relay's next
/// claim runs while the previous batch settles; when that claim comes back empty (its
/// snapshot still had the partition heads in flight) after the settle was reported, the
/// drain saw nothing in flight and returned with the partitions' next events unpublished.
pub(crate) async fn claim_one_drain_publishes_every_claimable_row(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let recorder = Arc::new(Recorder::new(0, 0, 0));
    let publisher: Arc<dyn Publisher> = recorder.clone();
    let relay = Relay::new(
        t.db.clone(),
        publisher,
        RelayConfig {
            batch_size: 64,
            ..claim_test_config(0, false)
        },
    );
    for round in 0..200 {
        let events: Vec<OutboxEvent> = (0..5)
            .flat_map(|seq| (0..8).map(move |p| seq_event(&format!("r{round}p{p}"), seq)))
            .collect();
        enqueue_all(&t.db, &events).await;
        let r = relay.drain(&CancellationToken::new()).await.unwrap();
        let pending = store.stats().await.unwrap().pending;
        assert_eq!(
            pending, 0,
            "round {round}: drain returned {r:?} with {pending} of 40 rows still pending"
        );
    }
}

/// Advisory locks are one namespace per database: a relay holding partition `p` of the
/// outbox in one schema must not hold up partition `p` of an outbox in another schema
/// (another service, another test). It did while the lock key was the partition key alone.
pub(crate) async fn claim_partition_locks_of_another_schemas_outbox_do_not_block(t: TestDb) {
    t.db.migrate().await.unwrap();
    let other = TestDb::new(TestBackend::Postgres).await.unwrap();
    other.db.migrate().await.unwrap();
    let lease = Duration::from_secs(60);
    enqueue_all(&other.db, &[plain_event("p")]).await;
    let held = OutboxStore::new(other.db.clone())
        .claim_batch("other", 10, lease, oncely_core::now_ms(), &[])
        .await
        .unwrap();
    assert_eq!(held.rows().len(), 1);
    let id = enqueue_all(&t.db, &[plain_event("p")]).await[0];
    let store = OutboxStore::new(t.db.clone());
    let mine = store
        .claim_batch("mine", 10, lease, oncely_core::now_ms(), &[])
        .await
        .unwrap();
    assert_eq!(
        mine.rows().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![id],
        "partition p of this outbox waited for partition p of another schema's outbox"
    );
    // The lease-based claim honours the partition locks too.
    mine.settle(&[], 0, &[], 10).await.unwrap();
    let leased = store
        .claim("mine", 10, lease, oncely_core::now_ms())
        .await
        .unwrap();
    assert_eq!(leased.iter().map(|r| r.id).collect::<Vec<_>>(), vec![id]);
    drop(held);
}

/// `claim_batch`'s `skip` leaves the given id ranges alone (rows
/// there stay for a later claim), empty or reversed ranges skip nothing, and a failed row
/// re-inserted by `settle` keeps its id and message id, goes dead at the attempt limit
/// (dead rows no longer block their partition) and is claimed by the next relay once
/// available.
pub(crate) async fn claim_batch_skip_ranges_and_reinserted_failures(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let lease = Duration::from_secs(60);
    let events: Vec<OutboxEvent> = (0..6).map(|i| plain_event(&format!("s{i}"))).collect();
    let ids = enqueue_all(&t.db, &events).await;
    let now = oncely_core::now_ms();
    #[allow(clippy::reversed_empty_ranges)]
    let skip = [ids[1]..=ids[2], ids[5]..=ids[4]];
    let b = store.claim_batch("r", 10, lease, now, &skip).await.unwrap();
    assert_eq!(
        b.rows().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[0], ids[3], ids[4], ids[5]]
    );
    // s0 fails for good (attempt limit 1), s3 fails once, s4 is published, s5 untouched.
    let failures = [
        oncely_sql::PublishFailure::new(ids[0], "gone", now),
        oncely_sql::PublishFailure::new(ids[3], "later", now),
    ];
    let settled = b.settle(&[ids[4]], now, &failures, 1).await.unwrap();
    assert_eq!(
        settled.failures,
        vec![
            (ids[0], oncely_sql::Rescheduled::Dead),
            (ids[3], oncely_sql::Rescheduled::Dead)
        ]
    );
    let follow = enqueue_all(&t.db, &[plain_event("s0")]).await[0];
    let b = store
        .claim_batch("r2", 10, lease, oncely_core::now_ms(), &[])
        .await
        .unwrap();
    assert_eq!(
        b.rows().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[1], ids[2], ids[5], follow],
        "s0's dead head no longer blocks it"
    );
    let dead = store.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(
        (dead.state, dead.attempts, dead.event.message_id),
        (OutboxState::Dead, 1, events[0].message_id)
    );
}

/// A relay task that panics mid-batch (here: the publisher panics once) drops its batch,
/// which rolls back, and `drain_woken` counts the task as lost; the batch's id range must
/// leave the relay's `held` list too, or every later claim of that drain keeps skipping
/// those rows. With a backlog the drain never runs dry, so the relay (alone on the outbox)
/// would leave the partitions of the lost batch unpublished until the whole backlog is
/// gone (before the fix: 8 partitions starved behind 12,000 events).
pub(crate) async fn claim_one_relay_republishes_a_panicked_batch_while_busy(t: TestDb) {
    const PARTITIONS: usize = 1200;
    const PER: usize = 10;
    t.db.migrate().await.unwrap();
    let events: Vec<OutboxEvent> = (0..PER)
        .flat_map(|seq| (0..PARTITIONS).map(move |p| seq_event(&format!("b{p}"), seq)))
        .collect();
    let mut ids = Vec::new();
    for chunk in events.chunks(2000) {
        ids.extend(enqueue_all(&t.db, chunk).await);
    }
    let recorder = Arc::new(Recorder::panicking_once(2_000));
    let publisher: Arc<dyn Publisher> = recorder.clone();
    let relay = spawn_relay(Relay::new(
        t.db.clone(),
        publisher,
        claim_test_config(0, false),
    ));
    let total = PARTITIONS * PER;
    // Half a second in, the lost batch's rows are back (rolled back, unlocked) and pending.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pool = t.db.as_postgres().expect("postgres").clone();
    let mut probe = pool.begin().await.unwrap();
    let free: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT id FROM oncely_outbox WHERE id = ANY($1) \
         FOR UPDATE SKIP LOCKED) f",
    )
    .bind(&ids[..8])
    .fetch_one(&mut *probe)
    .await
    .unwrap();
    probe.rollback().await.unwrap();
    let confirmed_then = recorder.confirmed_distinct();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while recorder.confirmed_distinct() < total && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop(relay).await;
    let global = recorder.state().global.clone();
    // The first batch claimed the heads of b0..b7 (ids 1..8): where did b0:0 .. b7:0 go out?
    let positions: Vec<Option<usize>> = (0..8)
        .map(|p| global.iter().position(|x| *x == format!("b{p}:0")))
        .collect();
    assert_eq!(recorder.confirmed_distinct(), total, "every event went out");
    assert!(
        positions.iter().all(|p| p.is_some_and(|p| p < total / 2)),
        "the rows of the batch lost to the panic went out at positions {positions:?} of \
         {total}, although 500 ms after the panic {free} of them were unlocked and pending \
         (while {confirmed_then} events had been confirmed)"
    );
}
