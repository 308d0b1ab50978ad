//! The SQLite plans of the polling and sweeping statements, on a temporary database file
//! with a realistic backlog (thousands of finished rows beside a few due ones, many ties),
//! with no statistics and after `ANALYZE`.

use std::path::PathBuf;

use super::{sweep_sql, SqliteStore};
use crate::driver::Sweep;
use crate::effects::continuation::DUE_CONTINUATIONS;
use crate::outbox::driver::{PUBLISHED_BEFORE, STATS_BY_STATE};
use crate::{Database, DbOptions};

/// A migrated database in a temporary file, filled by `fill` (statements run in order).
async fn backlog(fill: &[&str]) -> (Database, PathBuf) {
    let path = std::env::temp_dir().join(format!("oncely-plan-{}.db", uuid::Uuid::new_v4()));
    let db = Database::connect(
        &format!("sqlite://{}", path.display()),
        &DbOptions::default(),
    )
    .await
    .unwrap();
    db.migrate().await.unwrap();
    for sql in fill {
        sqlx::query(sql).execute(store(&db).writer()).await.unwrap();
    }
    (db, path)
}

/// `db`'s SQLite store.
fn store(db: &Database) -> &SqliteStore {
    let Database::Sqlite(store) = db else {
        unreachable!("a sqlite:// URL")
    };
    store
}

/// A value bound to a planned statement's placeholder.
#[derive(Clone, Copy)]
enum Bind<'a> {
    Int(i64),
    Text(&'a str),
}

/// The plan lines of `sql` with `binds`, on the writer.
async fn plan(db: &Database, sql: &str, binds: &[Bind<'_>]) -> Vec<String> {
    let explain = format!("EXPLAIN QUERY PLAN {sql}");
    let mut q = sqlx::query_as::<_, (i64, i64, i64, String)>(&explain);
    for b in binds {
        q = match *b {
            Bind::Int(v) => q.bind(v),
            Bind::Text(v) => q.bind(v),
        };
    }
    let rows = q.fetch_all(store(db).writer()).await.unwrap();
    rows.into_iter().map(|row| row.3).collect()
}

/// Runs `check` on the plan of `sql` with no statistics and after `ANALYZE`, then removes the
/// database.
async fn before_and_after_analyze(
    (db, path): (Database, PathBuf),
    sql: &str,
    binds: &[Bind<'_>],
    check: impl Fn(bool, &[String]),
) {
    for analyzed in [false, true] {
        if analyzed {
            sqlx::query("ANALYZE")
                .execute(store(&db).writer())
                .await
                .unwrap();
        }
        check(analyzed, &plan(&db, sql, binds).await);
    }
    db.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

/// Asserts that the plan `steps` (taken after `ANALYZE` when `analyzed`) has a step
/// containing each of `uses` and no step for which `never` holds.
fn assert_plan(analyzed: bool, steps: &[String], uses: &[&str], never: impl Fn(&str) -> bool) {
    for u in uses {
        assert!(
            steps.iter().any(|s| s.contains(u)),
            "analyzed {analyzed}: {steps:?}"
        );
    }
    assert!(
        !steps.iter().any(|s| never(s)),
        "analyzed {analyzed}: {steps:?}"
    );
}

/// 6,000 numbers `i` as a recursive CTE, to insert from.
const NUMBERS: &str =
    "WITH RECURSIVE n (i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 5999)";

/// 5,900 published outbox rows (60 per `published_at`) beside 60 pending and 40 dead.
fn outbox_rows() -> String {
    format!(
        "{NUMBERS} INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, \
         payload, headers, created_at, available_at, state, published_at) \
         SELECT printf('%08x-0000-4000-8000-%012x', i, i), 'orders', 'p' || (i % 50), 'e', \
         x'00', '{{}}', 1000 + i / 100, 1000 + i / 100, \
         CASE WHEN i < 5900 THEN 'published' WHEN i < 5960 THEN 'pending' ELSE 'dead' END, \
         CASE WHEN i < 5900 THEN 2000 + i / 100 END FROM n"
    )
}

/// A sweep's plan: its index searched, no table scan.
async fn assert_sweep_reads_its_index(sweep: &Sweep, fill: &str, bound: i64) {
    let sql = sweep_sql(sweep);
    before_and_after_analyze(
        backlog(&[fill]).await,
        &sql,
        &[Bind::Int(bound), Bind::Int(64)],
        |analyzed, steps| {
            let index = format!("INDEX {} (", sweep.index);
            assert_plan(analyzed, steps, &[index.as_str()], |s| {
                s.starts_with("SCAN")
            });
        },
    )
    .await;
}

/// The idempotency sweep on 5,000 finished records (50 per `expires_at`) beside 1,000 in
/// `processing` or `unknown`: without the pin SQLite read `oncely_idempotency_state` (every
/// finished record) until `ANALYZE`.
#[tokio::test]
async fn the_idempotency_sweep_reads_the_expiry_index() {
    let fill = format!(
        "{NUMBERS} INSERT INTO oncely_idempotency (tenant, operation, key, fingerprint, \
         route_digest, state, owner, lease_until, created_at, expires_at) \
         SELECT 'acme', 'pay', 'k' || i, x'00', x'00', \
         CASE WHEN i < 4000 THEN 'succeeded' WHEN i < 5000 THEN 'failed' \
         WHEN i < 5500 THEN 'processing' ELSE 'unknown' END, 'o', 1000 + i / 100, i, \
         CASE WHEN i < 5000 THEN 10000 + i / 50 END FROM n"
    );
    let sweep = crate::idempotency::EXPIRED_RECORDS;
    assert_sweep_reads_its_index(&sweep, &fill, 10_010).await;
}

/// The outbox sweep of published rows.
#[tokio::test]
async fn the_outbox_sweep_reads_the_published_index() {
    assert_sweep_reads_its_index(&PUBLISHED_BEFORE, &outbox_rows(), 2_010).await;
}

/// The inbox sweep on 6,000 rows, 60 per `received_at`.
#[tokio::test]
async fn the_inbox_sweep_reads_the_received_index() {
    let fill = format!(
        "{NUMBERS} INSERT INTO oncely_inbox (consumer, message_id, received_at) \
         SELECT 'billing', 'm' || i, 1000 + i / 60 FROM n"
    );
    assert_sweep_reads_its_index(&crate::inbox::RECEIVED_BEFORE, &fill, 1_010).await;
}

/// The continuation poll on 6,000 effects, 3,000 of them owing a continuation recorded in one
/// millisecond: the partial index read in order, no sort of the tied rows.
#[tokio::test]
async fn the_continuation_poll_reads_its_index_in_order() {
    let fill = format!(
        "{NUMBERS} INSERT INTO oncely_effects (id, tenant, provider, operation, reference, \
         idem_key, request, state, available_at, created_at, updated_at, continuation, \
         continuation_at) SELECT printf('%08x-0000-7000-8000-%012x', i, i), 'acme', \
         'payments', 'charge', 'inv-' || i, 'key-' || i, '{{}}', 'succeeded', 1000, 1000, \
         1000, CASE WHEN i % 2 = 0 THEN '{{}}' END, CASE WHEN i % 2 = 0 THEN 5000 END FROM n"
    );
    before_and_after_analyze(
        backlog(&[&fill]).await,
        DUE_CONTINUATIONS,
        &[Bind::Int(6_000), Bind::Int(64)],
        |analyzed, steps| {
            assert_plan(
                analyzed,
                steps,
                &["USING INDEX oncely_effects_continuation ("],
                |s| s.contains("TEMP B-TREE"),
            );
        },
    )
    .await;
}

/// The outbox gauges' statement reads the pending and dead rows from their partial indexes,
/// not the retained published rows (`SCAN oncely_outbox`).
#[tokio::test]
async fn the_outbox_stats_read_the_state_indexes() {
    before_and_after_analyze(
        backlog(&[&outbox_rows()]).await,
        STATS_BY_STATE,
        &[],
        |analyzed, steps| {
            assert_plan(
                analyzed,
                steps,
                &["oncely_outbox_pending_id", "oncely_outbox_dead"],
                |s| s == "SCAN oncely_outbox",
            );
        },
    )
    .await;
}

/// Reconciliation's window on 6,000 effects of one operation, 60 created per millisecond: a
/// range of `oncely_effects_created`, not every effect of the provider (the unique
/// `(provider, operation, reference)` index or, after `ANALYZE`, `SCAN oncely_effects`). The
/// statement has no `LIMIT`: the sort of ties by `id` covers the returned rows only.
#[tokio::test]
async fn reconciliation_reads_the_window_from_the_created_index() {
    use crate::effects::driver::EffectsBackend;
    let fill = format!(
        "{NUMBERS} INSERT INTO oncely_effects (id, tenant, provider, operation, reference, \
         idem_key, request, state, available_at, created_at, updated_at) \
         SELECT printf('%08x-0000-7000-8000-%012x', i, i), 'acme', 'payments', 'charge', \
         'inv-' || i, 'key-' || i, '{{}}', 'succeeded', 1000, 1000 + i / 60, 1000 FROM n"
    );
    let sql = crate::reconcile::created_since_sql(<SqliteStore as EffectsBackend>::COLUMNS);
    before_and_after_analyze(
        backlog(&[&fill]).await,
        &sql,
        &[
            Bind::Text("payments"),
            Bind::Text("charge"),
            Bind::Int(1_095),
        ],
        |analyzed, steps| {
            assert_plan(
                analyzed,
                steps,
                &["USING INDEX oncely_effects_created ("],
                |s| s.starts_with("SCAN"),
            );
        },
    )
    .await;
}

/// The effect claim's ids (`sqlite::effects::due_ids`) on 3,000 effects due at one instant
/// beside 3,000 finished ones: a search of the due index, no sort (a temporary B-tree would
/// mean every due row is read before the `LIMIT`).
#[tokio::test]
async fn a_claim_reads_the_due_index_in_order() {
    let fill = format!(
        "{NUMBERS} INSERT INTO oncely_effects (id, tenant, provider, operation, reference, \
         idem_key, request, state, available_at, created_at, updated_at) \
         SELECT printf('%08x-0000-7000-8000-%012x', i, i), 'acme', 'payments', 'charge', \
         'inv-' || i, 'key-' || i, '{{}}', CASE WHEN i < 3000 THEN 'succeeded' \
         ELSE 'pending' END, 1000, 1000, 1000 FROM n"
    );
    before_and_after_analyze(
        backlog(&[&fill]).await,
        &super::effects::due_ids(),
        &[
            Bind::Text("runner"),
            Bind::Int(0),
            Bind::Int(2_000),
            Bind::Text("payments"),
            Bind::Int(16),
        ],
        |analyzed, steps| {
            assert_plan(analyzed, steps, &["USING INDEX oncely_effects_due "], |s| {
                s.contains("TEMP B-TREE")
            });
        },
    )
    .await;
}
