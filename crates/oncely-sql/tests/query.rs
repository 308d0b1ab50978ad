//! The portable API for a user's own SQL ([`oncely_sql::query`] on [`Tx`] and
//! [`Database`]), pools handed in, per-backend migrations and [`Backend`]'s name: the same
//! checks on SQLite, PostgreSQL and MySQL/MariaDB.

use std::time::Duration;

use oncely_sql::{query, Backend, Database, DbOptions, Migrations, StoreError};
use oncely_testkit::{TestBackend, TestDb};

oncely_testkit::matrix! {
    tests: [
        own_sql_runs_in_the_transaction_and_reads_back_through_from_row,
        a_duplicate_on_the_conflict_target_inserts_nothing_and_says_so,
        migrations_are_asked_only_for_the_backend_in_use,
        a_pool_handed_in_gets_the_same_per_connection_settings,
        a_lock_wait_that_runs_out_is_a_lock_conflict,
    ],
    cannot_apply: [
        // SQLite has no row locks to wait on: a second writer waits for the whole database
        // (its busy timeout), so the case of a row lock wait running out does not arise.
        a_lock_wait_that_runs_out_is_a_lock_conflict on sqlite,
    ],
}

/// A row of the test table, decoded on every backend by `derive(sqlx::FromRow)`.
#[derive(Debug, PartialEq, sqlx::FromRow)]
struct Widget {
    tenant: String,
    name: String,
    qty: i64,
    price: f64,
    active: bool,
    data: Vec<u8>,
    note: Option<String>,
}

/// `widgets` with a UNIQUE business key, in each backend's type names.
async fn widgets(db: &Database) {
    let (float, bytes) = match db.backend() {
        Backend::Postgres => ("DOUBLE PRECISION", "BYTEA"),
        Backend::MySql => ("DOUBLE", "BLOB"),
        _ => ("REAL", "BLOB"),
    };
    db.execute(query(format!(
        "CREATE TABLE widgets (tenant VARCHAR(64) NOT NULL, name VARCHAR(64) NOT NULL, \
         qty BIGINT NOT NULL, price {float} NOT NULL, active BOOLEAN NOT NULL, \
         data {bytes} NOT NULL, note TEXT, UNIQUE (tenant, name))"
    )))
    .await
    .unwrap();
}

const INSERT: &str = "INSERT INTO widgets (tenant, name, qty, price, active, data, note) \
                      VALUES ($1, $2, $3, $4, $5, $6, $7)";

fn insert(name: &str, qty: i64, note: Option<&str>) -> oncely_sql::Query {
    query(INSERT)
        .bind("t1")
        .bind(name)
        .bind(qty)
        .bind(2.5)
        .bind(true)
        .bind(vec![0_u8, 159, 255])
        .bind(note)
}

async fn own_sql_runs_in_the_transaction_and_reads_back_through_from_row(t: TestDb) {
    widgets(&t.db).await;
    let mut tx = t.db.begin().await.unwrap();
    assert_eq!(tx.execute(insert("a", 1, None)).await.unwrap(), 1);
    assert_eq!(tx.execute(insert("b", 2, Some("second"))).await.unwrap(), 1);
    let updated = tx
        .execute(
            query("UPDATE widgets SET qty = qty + $1 WHERE tenant = $2 AND name = $3")
                .bind(10)
                .bind("t1")
                .bind("a"),
        )
        .await
        .unwrap();
    assert_eq!(updated, 1);
    let a: Option<Widget> = tx
        .fetch_optional(query("SELECT * FROM widgets WHERE name = $1").bind("a"))
        .await
        .unwrap();
    assert_eq!(
        a,
        Some(Widget {
            tenant: "t1".into(),
            name: "a".into(),
            qty: 11,
            price: 2.5,
            active: true,
            data: vec![0, 159, 255],
            note: None,
        })
    );
    let b: Widget = tx
        .fetch_one(query("SELECT * FROM widgets WHERE name = $1").bind("b"))
        .await
        .unwrap();
    assert_eq!(b.note.as_deref(), Some("second"));
    // Uncommitted: the read pool sees nothing yet.
    let seen: Vec<Widget> =
        t.db.fetch_all(query("SELECT * FROM widgets"))
            .await
            .unwrap();
    assert!(seen.is_empty());
    tx.commit().await.unwrap();
    let seen: Vec<Widget> =
        t.db.fetch_all(query("SELECT * FROM widgets ORDER BY name"))
            .await
            .unwrap();
    assert_eq!(seen.len(), 2);
    let none: Option<Widget> =
        t.db.fetch_optional(query("SELECT * FROM widgets WHERE name = $1").bind("zzz"))
            .await
            .unwrap();
    assert!(none.is_none());

    // A rolled-back transaction leaves nothing.
    let mut tx = t.db.begin().await.unwrap();
    tx.execute(insert("c", 3, None)).await.unwrap();
    tx.rollback().await.unwrap();
    let seen: Vec<Widget> =
        t.db.fetch_all(query("SELECT * FROM widgets"))
            .await
            .unwrap();
    assert_eq!(seen.len(), 2);
}

async fn a_duplicate_on_the_conflict_target_inserts_nothing_and_says_so(t: TestDb) {
    widgets(&t.db).await;
    let target = "(tenant, name)";
    let mut tx = t.db.begin().await.unwrap();
    assert!(tx
        .insert_ignoring_duplicate(insert("a", 1, None), target)
        .await
        .unwrap());
    // Same key, other content: nothing inserted, and the transaction goes on (MySQL's
    // duplicate-key error does not end it).
    assert!(!tx
        .insert_ignoring_duplicate(insert("a", 99, None), target)
        .await
        .unwrap());
    assert!(tx
        .insert_ignoring_duplicate(insert("b", 2, None), target)
        .await
        .unwrap());
    tx.commit().await.unwrap();
    let rows: Vec<Widget> =
        t.db.fetch_all(query("SELECT * FROM widgets ORDER BY name"))
            .await
            .unwrap();
    assert_eq!(
        rows.iter()
            .map(|w| (w.name.as_str(), w.qty))
            .collect::<Vec<_>>(),
        [("a", 1), ("b", 2)]
    );
    // A plain insert of a taken key is an error, not a silent no-op.
    let mut tx = t.db.begin().await.unwrap();
    let err = tx.execute(insert("a", 5, None)).await.unwrap_err();
    assert!(matches!(err, StoreError::Database(_)), "{err:?}");
}

async fn migrations_are_asked_only_for_the_backend_in_use(t: TestDb) {
    let backend = t.db.backend();
    let err = t.db.run_migrator(Migrations::new()).await.unwrap_err();
    assert!(
        matches!(err, StoreError::NoMigrations(b) if b == backend),
        "{err:?}"
    );
    assert!(err.to_string().contains(&backend.to_string()), "{err}");
    // Only the set of the backend in use: oncely's own migrations as an app's.
    let only = match backend {
        Backend::Postgres => Migrations::new().postgres(sqlx::migrate!("./migrations/postgres")),
        Backend::MySql => Migrations::new().mysql(sqlx::migrate!("./migrations/mysql")),
        _ => Migrations::new().sqlite(sqlx::migrate!("./migrations/sqlite")),
    };
    t.db.run_migrator(only).await.unwrap();
    t.db.check_schema().await.unwrap();
}

async fn a_pool_handed_in_gets_the_same_per_connection_settings(t: TestDb) {
    let options = DbOptions {
        lock_timeout: Duration::from_millis(1500),
        ..DbOptions::default()
    };
    let db = match t.db.backend() {
        Backend::Postgres => {
            let opts = Database::postgres_connect_options(t.url.parse().unwrap(), &options);
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect_with(opts)
                .await
                .unwrap();
            let db = Database::from_postgres_pool(pool, &options);
            let lock: String = db
                .as_postgres()
                .map(|p| sqlx::query_scalar("SHOW lock_timeout").fetch_one(p))
                .unwrap()
                .await
                .unwrap();
            assert_eq!(lock, "1500ms");
            db
        }
        Backend::MySql => {
            let init = Database::mysql_session_init(&options);
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(2)
                .after_connect(move |conn, _| {
                    let init = init.clone();
                    Box::pin(async move {
                        sqlx::Executor::execute(conn, init.as_str()).await?;
                        Ok(())
                    })
                })
                .connect(&t.url)
                .await
                .unwrap();
            let db = Database::from_mysql_pool(pool, &options);
            // Set by the same init statement as READ COMMITTED (whose variable MariaDB
            // and MySQL name differently).
            let lock: i64 =
                sqlx::query_scalar("SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED)")
                    .fetch_one(db.as_mysql().unwrap())
                    .await
                    .unwrap();
            assert_eq!(lock, 2);
            db
        }
        _ => {
            let opts = Database::sqlite_connect_options(t.url.parse().unwrap(), &options);
            let writer = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(1)
                .connect_with(opts.clone())
                .await
                .unwrap();
            let reader = sqlx::sqlite::SqlitePoolOptions::new()
                .connect_with(opts.read_only(true))
                .await
                .unwrap();
            let db = Database::from_sqlite_pools(writer, reader);
            let (w, _) = db.as_sqlite().unwrap();
            let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
                .fetch_one(w)
                .await
                .unwrap();
            assert_eq!(mode, "wal");
            let busy: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
                .fetch_one(w)
                .await
                .unwrap();
            assert_eq!(busy, 1500);
            db
        }
    };
    assert_eq!(db.backend(), t.db.backend());
    db.migrate().await.unwrap();
    db.ping().await.unwrap();
    let mut tx = db.begin().await.unwrap();
    tx.execute(query("DELETE FROM oncely_inbox WHERE consumer = $1").bind("nobody"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

async fn a_lock_wait_that_runs_out_is_a_lock_conflict(t: TestDb) {
    let options = DbOptions {
        lock_timeout: Duration::from_secs(1),
        ..DbOptions::default()
    };
    let backend = match t.db.backend() {
        Backend::Postgres => TestBackend::Postgres,
        _ => TestBackend::MySql,
    };
    drop(t);
    let Some(t) = TestDb::with_options(backend, &options).await else {
        return;
    };
    widgets(&t.db).await;
    t.db.execute(insert("a", 1, None)).await.unwrap();
    let bump = || query("UPDATE widgets SET qty = qty + 1 WHERE name = $1").bind("a");
    let mut holder = t.db.begin().await.unwrap();
    holder.execute(bump()).await.unwrap();
    let mut waiter = t.db.begin().await.unwrap();
    let err = waiter.execute(bump()).await.unwrap_err();
    assert!(err.is_lock_conflict(), "{err:?}");
    assert!(err.is_unavailable(), "{err:?}");
    holder.rollback().await.unwrap();
}

#[test]
fn backends_have_human_and_short_names() {
    assert_eq!(Backend::Postgres.to_string(), "PostgreSQL");
    assert_eq!(Backend::MySql.to_string(), "MySQL / MariaDB");
    assert_eq!(Backend::Sqlite.to_string(), "SQLite");
    assert_eq!(
        [Backend::Sqlite, Backend::Postgres, Backend::MySql].map(Backend::as_str),
        ["sqlite", "postgres", "mysql"]
    );
    assert!(Backend::Postgres.needs_vacuum() && !Backend::Sqlite.needs_vacuum());
}
