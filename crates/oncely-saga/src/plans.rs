//! The SQLite plans of the saga store's polling statements, on a temporary database file.

use oncely_sql::{query, Database, DbOptions};

use crate::store::due_sql;

/// The deadline poll's plan on 6,000 sagas (5,500 completed, 500 running with deadlines, many
/// tied), with no statistics and after `ANALYZE`: a search of the partial index
/// `oncely_sagas_deadline`, no sort (a temporary B-tree would mean every running saga is read
/// before the `LIMIT`).
#[tokio::test]
async fn the_deadline_poll_reads_the_deadline_index_in_order() {
    let path = std::env::temp_dir().join(format!("oncely-plan-{}.db", uuid::Uuid::new_v4()));
    let db = Database::connect(
        &format!("sqlite://{}", path.display()),
        &DbOptions::default(),
    )
    .await
    .unwrap();
    db.migrate().await.unwrap();
    let mut tx = db.begin().await.unwrap();
    tx.execute(query(
        "WITH RECURSIVE n (i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 5999) \
         INSERT INTO oncely_sagas (id, tenant, kind, state, input, deadline, created_at, \
         updated_at) SELECT 'saga-' || i, 'acme', 'order', \
         CASE WHEN i < 5500 THEN 'completed' ELSE 'running' END, '{}', \
         CASE WHEN i < 5500 THEN NULL ELSE 1000 + i / 100 END, i, i FROM n",
    ))
    .await
    .unwrap();
    tx.commit().await.unwrap();
    for analyzed in [false, true] {
        let mut tx = db.begin().await.unwrap();
        if analyzed {
            tx.execute(query("ANALYZE")).await.unwrap();
        }
        let plan: Vec<(i64, i64, i64, String)> = tx
            .fetch_all(
                query(format!("EXPLAIN QUERY PLAN {}", due_sql(db.backend())))
                    .bind(2_000_i64)
                    .bind(16_i64),
            )
            .await
            .unwrap();
        let steps: Vec<&str> = plan.iter().map(|row| row.3.as_str()).collect();
        assert!(
            steps
                .iter()
                .any(|s| s.contains("USING INDEX oncely_sagas_deadline ")),
            "analyzed {analyzed}: {steps:?}"
        );
        assert!(
            !steps.iter().any(|s| s.contains("TEMP B-TREE")),
            "analyzed {analyzed}: {steps:?}"
        );
        tx.commit().await.unwrap();
    }
    db.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}
