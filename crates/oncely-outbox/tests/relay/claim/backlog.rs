//! Backlogs in tables PostgreSQL believes empty (partition locks held, seq scans) and the
//! relay's vacuums of the outbox.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{Publisher, SqlTransport};
use oncely_outbox::{Relay, RelayConfig};
use oncely_sql::{OutboxEvent, OutboxStore};
use oncely_testkit::TestDb;
use tokio_util::sync::CancellationToken;

use super::recorder::{claim_test_config, lease_relay, seq_event, Recorder};
use crate::store::enqueue_all;

/// Manual vacuums of `oncely_outbox` (`pg_stat_user_tables.vacuum_count`; autovacuum
/// counts apart) since the table was created.
async fn outbox_vacuums(db: &oncely_sql::Database) -> i64 {
    let oncely_sql::Database::Postgres(p) = db else {
        panic!("PostgreSQL only");
    };
    sqlx::query_scalar(
        "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'oncely_outbox'::regclass",
    )
    .fetch_one(p.pool())
    .await
    .unwrap()
}

/// A relay vacuums the outbox after every `vacuum_after_rows` rows it claimed, in the
/// background while it goes on claiming, and never with 0. Dead entries then stop
/// accumulating in front of the claims.
pub(crate) async fn claim_relay_vacuums_the_outbox_every_vacuum_after_rows(t: TestDb) {
    t.db.migrate().await.unwrap();
    let store = OutboxStore::new(t.db.clone());
    let publisher: Arc<dyn Publisher> = Arc::new(Recorder::new(0, 0, 0));
    let relay = |vacuum_after_rows| {
        Relay::new(
            t.db.clone(),
            publisher.clone(),
            RelayConfig {
                batch_size: 50,
                vacuum_after_rows,
                ..claim_test_config(0, false)
            },
        )
    };
    let events = |round: usize| -> Vec<OutboxEvent> {
        (0..1000)
            .map(|p| seq_event(&format!("r{round}p{p}"), 0))
            .collect()
    };
    // Never with 0, however many rows it claims.
    enqueue_all(&t.db, &events(0)).await;
    let r = relay(0).drain(&CancellationToken::new()).await.unwrap();
    assert_eq!(r.published, 1000);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        outbox_vacuums(&t.db).await,
        0,
        "vacuum_after_rows 0 vacuumed"
    );
    // After 400 claimed rows: 1,000 rows make two vacuums (one at a time, so one may be
    // skipped while the first still runs: at least one).
    enqueue_all(&t.db, &events(1)).await;
    let r = relay(400).drain(&CancellationToken::new()).await.unwrap();
    assert_eq!(r.published, 1000);
    assert_eq!(store.stats().await.unwrap().pending, 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut vacuums = outbox_vacuums(&t.db).await;
    while vacuums == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        vacuums = outbox_vacuums(&t.db).await;
    }
    assert!(
        (1..=2).contains(&vacuums),
        "{vacuums} vacuums after 1,000 claimed rows, one due every 400"
    );
}

/// Advisory locks held right now, by any session, on the partition locks of this schema's
/// outbox for partition keys `{prefix}0` … `{prefix}{n - 1}` (the key
/// `oncely_sql`'s claim takes: a 64-bit hash of the partition key seeded with the table's
/// OID, shown by `pg_locks` as two 32-bit halves).
async fn partition_locks_held(pool: &sqlx::PgPool, prefix: &str, n: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN (SELECT hashtextextended($1 || g, \
         'oncely_outbox'::regclass::oid::bigint # 1869505381) AS k \
         FROM generate_series(0, $2 - 1) g) x \
         ON l.classid = ((x.k >> 32) & 4294967295)::oid \
         AND l.objid = (x.k & 4294967295)::oid AND l.objsubid = 1 \
         WHERE l.locktype = 'advisory'",
    )
    .bind(prefix)
    .bind(n)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Samples [`partition_locks_held`] every 2 ms until `stop` is cancelled; returns the most
/// seen at once.
fn sample_partition_locks(
    pool: sqlx::PgPool,
    prefix: &'static str,
    n: i64,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let mut most = 0;
        while !stop.is_cancelled() {
            most = most.max(partition_locks_held(&pool, prefix, n).await);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        most
    })
}

/// Bulk-inserts `rows` pending events over `partitions` partition keys `{prefix}0…` in one
/// statement, as a burst of writers would: payload `partition:seq` (the form of
/// [`seq_event`]), seq counting up within each partition in id order.
async fn bulk_enqueue(pool: &sqlx::PgPool, prefix: &str, rows: i64, partitions: i64) {
    sqlx::query(
        "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, payload, \
         headers, created_at, available_at) \
         SELECT gen_random_uuid()::text, 'claim-test', $1 || (g % $3), 'test.event', \
         convert_to($1 || (g % $3) || ':' || (g / $3), 'UTF8'), '{}', $4, $4 \
         FROM generate_series(0, $2 - 1) g ORDER BY g",
    )
    .bind(prefix)
    .bind(rows)
    .bind(partitions)
    .bind(oncely_core::now_ms())
    .execute(pool)
    .await
    .unwrap();
}

/// An outbox that PostgreSQL believes is empty (`VACUUM ANALYZE` ran while it was, as the
/// relay's own vacuum or autovacuum does after a quiet period) and whose relays already
/// claimed against it, so their cached plans were made for an empty table; then a burst of
/// 30,000 rows over 6,000 partitions. The relay drains it in order, and no session ever
/// holds more partition locks than the relay's batches in flight (`batch_size ×
/// max_in_flight_batches`), read from `pg_locks` throughout. With the lock tried in the
/// claim's `WHERE` over the table, a plan made for the empty table seq-scanned the outbox
/// and locked every pending row's partition (6,000 here; 20,000 exhausted the server's lock
/// table): issue 14, item 1.
pub(crate) async fn claim_backlog_in_an_outbox_believed_empty_locks_only_the_batches_in_flight(
    t: TestDb,
) {
    claim_backlog_believed_empty(t, false).await;
}

/// As [`claim_backlog_in_an_outbox_believed_empty_locks_only_the_batches_in_flight`], with
/// relays that claim by lease ([`OutboxStore::claim`], the statement SQLite and MySQL relays
/// share in shape): each claim locks at most its own batch's partitions.
pub(crate) async fn lease_claim_backlog_in_an_outbox_believed_empty_locks_only_its_batch(
    t: TestDb,
) {
    claim_backlog_believed_empty(t, true).await;
}

async fn claim_backlog_believed_empty(t: TestDb, lease: bool) {
    const ROWS: i64 = 30_000;
    const PARTITIONS: i64 = 6_000;
    const PREFIX: &str = "bp";
    t.db.migrate().await.unwrap();
    let pool = t.db.as_postgres().expect("postgres").clone();
    let store = OutboxStore::new(t.db.clone());
    let recorder = Arc::new(Recorder::new(0, 0, 0));
    let config = RelayConfig {
        batch_size: 64,
        max_in_flight_batches: 4,
        vacuum_after_rows: 0,
        ..claim_test_config(0, false)
    };
    let bound = i64::from(config.batch_size) * config.max_in_flight_batches as i64;
    let stop = CancellationToken::new();
    // Relays at work on the empty outbox: their claims plan (and cache) against it.
    let mut relays = Vec::new();
    if lease {
        for i in 0..4 {
            let (store, recorder, stop) = (store.clone(), recorder.clone(), stop.clone());
            let batch = config.batch_size;
            relays.push(tokio::spawn(async move {
                lease_relay(store, recorder, &format!("lease-{i}"), batch, stop).await;
            }));
        }
    } else {
        let relay = Relay::new(t.db.clone(), recorder.clone(), config.clone());
        relays.push(tokio::spawn(relay.run(stop.clone())));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query("VACUUM ANALYZE oncely_outbox")
        .execute(&pool)
        .await
        .unwrap();
    // Claims on the freshly analysed empty table, re-planned for it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let reltuples: f32 =
        sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE oid = 'oncely_outbox'::regclass")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        reltuples.abs() < f32::EPSILON,
        "believed empty: reltuples {reltuples}"
    );
    let sampling = CancellationToken::new();
    let sampler = sample_partition_locks(pool.clone(), PREFIX, PARTITIONS, sampling.clone());
    bulk_enqueue(&pool, PREFIX, ROWS, PARTITIONS).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while recorder.confirmed_distinct() < ROWS as usize {
        assert!(
            tokio::time::Instant::now() < deadline,
            "drained {} of {ROWS} in 120 s",
            recorder.confirmed_distinct()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sampling.cancel();
    let most = sampler.await.unwrap();
    stop.cancel();
    for r in relays {
        r.await.unwrap();
    }
    assert!(
        most <= bound,
        "a session held {most} partition locks at once; the relay's batches in flight hold at \
         most {bound}"
    );
    assert_eq!(store.stats().await.unwrap().pending, 0);
    let confirmed = recorder.confirmed();
    assert_eq!(confirmed.len(), PARTITIONS as usize);
    for (partition, payloads) in confirmed {
        let expected: Vec<String> = (0..ROWS / PARTITIONS)
            .map(|seq| format!("{partition}:{seq}"))
            .collect();
        assert_eq!(payloads, expected, "partition {partition} out of order");
    }
}

/// Seq scans of this schema's tables so far, as the statistics system counts them, after
/// flushing this backend's pending counts (`pool` must have a single connection: the one
/// whose statements are counted).
async fn seq_scans(pool: &sqlx::PgPool) -> BTreeMap<String, i64> {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query_as(
        "SELECT relname::text, seq_scan FROM pg_stat_user_tables \
         WHERE schemaname = current_schema()",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// Every other PostgreSQL claim and sweep on a backlog in tables PostgreSQL believes empty
/// (`VACUUM ANALYZE` while they were, then 20,000 rows each): the SQL transport's receive,
/// its consumers' delivery claim and its fan-out collector, the published-outbox cleanup,
/// the inbox collector and the idempotency collector each do their batch without a single
/// seq scan of their table. With the `DELETE … USING` joins planned for an empty table,
/// each batch seq-scanned the whole table (the queue's receive: 3.2 s for 64 of 100,000).
/// `oncely_subscriptions` is left out: a handful of rows, read by the fan-out trigger.
#[allow(
    clippy::too_many_lines,
    reason = "five tables' backlogs and sweeps checked in one statistics snapshot"
)]
pub(crate) async fn claims_and_sweeps_on_a_backlog_believed_empty_never_seq_scan(t: TestDb) {
    const ROWS: i64 = 20_000;
    let db = oncely_sql::Database::connect(
        &t.url,
        &oncely_sql::DbOptions {
            max_connections: 1,
            ..oncely_sql::DbOptions::default()
        },
    )
    .await
    .unwrap();
    db.migrate().await.unwrap();
    let pool = db.as_postgres().expect("postgres").clone();
    let transport = SqlTransport::new(db.clone(), 1 << 20);
    transport.subscribe("c1", "fan").await.unwrap();
    let tables = [
        "oncely_queue",
        "oncely_deliveries",
        "oncely_outbox_published",
        "oncely_inbox",
        "oncely_idempotency",
    ];
    for table in tables {
        sqlx::query(&format!("VACUUM ANALYZE {table}"))
            .execute(&pool)
            .await
            .unwrap();
    }
    for statement in [
        "INSERT INTO oncely_queue (topic, message_id, partition_key, event_type, headers, \
         payload, enqueued_at) SELECT CASE WHEN g % 2 = 0 THEN 'plain' ELSE 'fan' END, \
         gen_random_uuid()::text, 'p' || g, 'e', '{}', '\\x00', 0 \
         FROM generate_series(1, $1 * 2) g",
        "INSERT INTO oncely_outbox_published (id, message_id, topic, partition_key, \
         event_type, payload, headers, created_at, available_at, attempts, published_at) \
         SELECT g, gen_random_uuid()::text, 't', 'p', 'e', '\\x00', '{}', 0, 0, 0, 0 \
         FROM generate_series(1, $1) g",
        "INSERT INTO oncely_inbox (consumer, message_id, received_at) \
         SELECT 'c1', gen_random_uuid()::text, 0 FROM generate_series(1, $1) g",
        "INSERT INTO oncely_idempotency (tenant, operation, key, fingerprint, route_digest, \
         state, owner, created_at, completed_at, expires_at) \
         SELECT 't', 'POST /x', 'k' || g, '\\x00', '\\x00', 'succeeded', 'o', 0, 0, 0 \
         FROM generate_series(1, $1) g",
    ] {
        sqlx::query(statement)
            .bind(ROWS)
            .execute(&pool)
            .await
            .unwrap();
    }
    for table in tables {
        let reltuples: f32 = sqlx::query_scalar(&format!(
            "SELECT reltuples FROM pg_class WHERE oid = '{table}'::regclass"
        ))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(
            reltuples.abs() < f32::EPSILON,
            "{table} believed empty: {reltuples}"
        );
    }
    let before = seq_scans(&pool).await;
    let now = oncely_core::now_ms();
    for _ in 0..3 {
        assert_eq!(transport.receive("plain", 64).await.unwrap().len(), 64);
        let claimed = transport
            .claim("c1", 64, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(claimed.len(), 64);
        assert_eq!(transport.collect_fanned_out(now, 64).await.unwrap(), 64);
        assert_eq!(
            OutboxStore::new(db.clone())
                .delete_published(now, 64)
                .await
                .unwrap(),
            64
        );
        assert_eq!(
            oncely_sql::InboxStore::new(db.clone())
                .collect(now, 64)
                .await
                .unwrap(),
            64
        );
        assert_eq!(
            oncely_sql::IdempotencyStore::new(db.clone(), Duration::from_secs(60))
                .collect_expired(now, 64)
                .await
                .unwrap(),
            64
        );
    }
    let after = seq_scans(&pool).await;
    for table in tables {
        assert_eq!(
            after.get(table),
            before.get(table),
            "{table} was seq-scanned by a claim or sweep"
        );
    }
}
