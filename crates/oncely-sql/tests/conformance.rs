//! Idempotency store conformance: the same checks on SQLite, PostgreSQL and MySQL/MariaDB.

use std::sync::Arc;
use std::time::Duration;

use oncely_core::{
    Fingerprint, IdempotencyKey, Operation, RecordState, Scope, StoredResponse, TenantId,
};
use oncely_sql::{
    on_pool, on_tx, Database, IdempotencyStore, InboxOutcome, InboxStore, Reservation, StoreError,
};
#[path = "conformance/effects.rs"]
mod effects;
#[path = "conformance/effects_settle.rs"]
mod effects_settle;
#[path = "conformance/idempotency_lease.rs"]
mod idempotency_lease;
#[path = "conformance/outbox_published.rs"]
mod outbox_published;

use oncely_testkit::TestDb;

/// A second pool on `t`'s database with one connection, so that the session statistics a
/// test reads (PostgreSQL's flushed counters, MariaDB's handler counters) are those of the
/// statements it runs through this pool alone.
async fn one_connection(t: &TestDb) -> Database {
    let one = oncely_sql::DbOptions {
        max_connections: 1,
        ..oncely_sql::DbOptions::default()
    };
    Database::connect(&t.url, &one).await.unwrap()
}

fn scope(tenant: &str) -> Scope {
    Scope::new(
        TenantId::parse(tenant).unwrap(),
        Operation::new("POST", "/v1/things"),
    )
}

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::parse(k.as_bytes()).unwrap()
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::compute(
        "POST",
        "/v1/things",
        "/v1/things",
        Some("application/json"),
        body.as_bytes(),
    )
    .unwrap()
}

async fn store(t: &TestDb) -> IdempotencyStore {
    t.db.migrate().await.unwrap();
    IdempotencyStore::new(t.db.clone(), Duration::from_secs(60))
}

oncely_testkit::matrix! {
    tests: [
        reserve_complete_then_existing_with_stored_response,
        rollback_leaves_the_key_free,
        same_key_in_other_tenant_is_independent,
        concurrent_reservations_of_one_key_reserve_once,
        key_claim_ends_with_its_transaction_even_when_dropped_unfinished,
        collector_deletes_only_expired_finished_records,
        migrations_are_idempotent,
        inbox_records_a_message_once_per_consumer_and_a_rollback_forgets_it,
        inbox_collector_deletes_only_rows_past_retention_in_bounded_batches,
        a_fingerprint_s_headers_digest_is_stored_and_read_back,
    ],
}

async fn reserve_complete_then_existing_with_stored_response(t: TestDb) {
    let s = store(&t).await;
    let (sc, k, f) = (scope("t1"), key("k1"), fp(r#"{"a":1}"#));
    assert!(s.lookup(&sc, &k).await.unwrap().is_none());
    let mut tx = t.db.begin().await.unwrap();
    let Reservation::Reserved(token) = s.reserve(&mut tx, &sc, &k, &f, 1_000).await.unwrap() else {
        panic!("first reservation must reserve");
    };
    let response = StoredResponse::new(
        201,
        [("location", "/v1/things/1"), ("set-cookie", "x")],
        b"{\"id\":1}".to_vec(),
    );
    s.complete(&mut tx, token, &response, 2_000).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = t.db.begin().await.unwrap();
    let Reservation::Existing(rec) = s.reserve(&mut tx, &sc, &k, &f, 3_000).await.unwrap() else {
        panic!("second reservation must find the record");
    };
    tx.rollback().await.unwrap();
    assert_eq!(rec.state, RecordState::Succeeded);
    assert_eq!(rec.fingerprint.mismatch(&f), None);
    assert_eq!(
        rec.fingerprint.mismatch(&fp(r#"{"a":2}"#)),
        Some(oncely_core::FingerprintMismatch::Body)
    );
    assert_eq!(rec.response.as_ref(), Some(&response));
    assert!(response.headers.iter().all(|(n, _)| n != "set-cookie"));
    assert_eq!(rec.created_at, 1_000);
    assert_eq!(rec.completed_at, Some(2_000));
    assert_eq!(rec.expires_at, Some(62_000));
    let looked = s.lookup(&sc, &k).await.unwrap().unwrap();
    assert_eq!(looked.response, rec.response);
}

/// Both inserts (atomic `complete`, multi-phase `reserve_leased`) keep the headers digest,
/// so a retry that differs only in a covered header is named `headers`; a fingerprint
/// without one reads back without one.
async fn a_fingerprint_s_headers_digest_is_stored_and_read_back(t: TestDb) {
    let s = store(&t).await;
    let parts = oncely_core::FingerprintParts::default().headers(["Stripe-Version"]);
    let of = |version: &'static [u8]| {
        parts
            .compute(&oncely_core::FingerprintInput {
                method: "POST",
                template: "/v1/things",
                path: "/v1/things",
                content_type: Some("application/json"),
                headers: &[("stripe-version", version)],
                body: b"{}",
            })
            .unwrap()
    };
    let (sc, f) = (scope("t1"), of(b"2024-06-20"));
    let mut tx = t.db.begin().await.unwrap();
    let Reservation::Reserved(token) = s.reserve(&mut tx, &sc, &key("hd-1"), &f, 1).await.unwrap()
    else {
        panic!("first reservation must reserve");
    };
    let response = StoredResponse::new(201, [("content-type", "text/plain")], b"ok".to_vec());
    s.complete(&mut tx, token, &response, 2).await.unwrap();
    tx.commit().await.unwrap();
    let leased = s
        .reserve_leased(&sc, &key("hd-2"), &f, 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(matches!(leased, oncely_sql::LeaseReservation::Leased(_)));
    for k in ["hd-1", "hd-2"] {
        let record = s.lookup(&sc, &key(k)).await.unwrap().unwrap();
        assert_eq!(record.fingerprint, f, "{k}");
        assert_eq!(
            record.fingerprint.mismatch(&of(b"2025-01-01")),
            Some(oncely_core::FingerprintMismatch::Headers),
            "{k}"
        );
    }
    let plain = fp("{}");
    let mut tx = t.db.begin().await.unwrap();
    let Reservation::Reserved(token) = s
        .reserve(&mut tx, &sc, &key("hd-3"), &plain, 1)
        .await
        .unwrap()
    else {
        panic!("first reservation must reserve");
    };
    s.complete(&mut tx, token, &response, 2).await.unwrap();
    tx.commit().await.unwrap();
    let record = s.lookup(&sc, &key("hd-3")).await.unwrap().unwrap();
    assert_eq!(record.fingerprint.headers(), None);
    assert_eq!(record.fingerprint, plain);
}

async fn rollback_leaves_the_key_free(t: TestDb) {
    let s = store(&t).await;
    let (sc, k, f) = (scope("t1"), key("k-rb"), fp("{}"));
    let mut tx = t.db.begin().await.unwrap();
    assert!(matches!(
        s.reserve(&mut tx, &sc, &k, &f, 1).await.unwrap(),
        Reservation::Reserved(_)
    ));
    tx.rollback().await.unwrap();
    assert!(s.lookup(&sc, &k).await.unwrap().is_none());
    let mut tx = t.db.begin().await.unwrap();
    assert!(matches!(
        s.reserve(&mut tx, &sc, &k, &f, 2).await.unwrap(),
        Reservation::Reserved(_)
    ));
}

async fn same_key_in_other_tenant_is_independent(t: TestDb) {
    let s = store(&t).await;
    let (k, f) = (key("shared"), fp("{}"));
    for tenant in ["t1", "t2"] {
        let mut tx = t.db.begin().await.unwrap();
        let Reservation::Reserved(token) =
            s.reserve(&mut tx, &scope(tenant), &k, &f, 1).await.unwrap()
        else {
            panic!("each tenant reserves its own key");
        };
        s.complete(
            &mut tx,
            token,
            &StoredResponse::new(201, [], tenant.as_bytes().to_vec()),
            2,
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let r1 = s.lookup(&scope("t1"), &k).await.unwrap().unwrap();
    let r2 = s.lookup(&scope("t2"), &k).await.unwrap().unwrap();
    assert_eq!(r1.response.unwrap().body, b"t1");
    assert_eq!(r2.response.unwrap().body, b"t2");
}

async fn concurrent_reservations_of_one_key_reserve_once(t: TestDb) {
    let s = Arc::new(store(&t).await);
    let db = t.db.clone();
    let mut tasks = Vec::new();
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    for _ in 0..32 {
        let (s, db, barrier) = (s.clone(), db.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut tx = db.begin().await.unwrap();
            match s
                .reserve(&mut tx, &scope("t1"), &key("hot"), &fp("{}"), 1)
                .await
                .unwrap()
            {
                Reservation::Reserved(token) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let done = StoredResponse::new(201, [], vec![]);
                    match s.complete(&mut tx, token, &done, 2).await {
                        Ok(()) => {
                            tx.commit().await.unwrap();
                            "reserved"
                        }
                        // Lost to a transaction that committed first: the UNIQUE key held.
                        Err(StoreError::NotHeld) => "lost",
                        Err(e) => panic!("{e}"),
                    }
                }
                Reservation::Existing(r) => {
                    assert_eq!(
                        r.state,
                        RecordState::Succeeded,
                        "only committed, finished records are seen"
                    );
                    "existing"
                }
                Reservation::InFlight => "in-flight",
                _ => "other",
            }
        }));
    }
    let mut reserved = 0;
    for t in tasks {
        let outcome = t.await.unwrap();
        assert_ne!(outcome, "other");
        if outcome == "reserved" {
            reserved += 1;
        }
    }
    assert_eq!(
        reserved, 1,
        "exactly one transaction commits a record for the key"
    );
}

async fn collector_deletes_only_expired_finished_records(t: TestDb) {
    let s = store(&t).await;
    let sc = scope("t1");
    // Three finished records completed at 0 (expire at 60 000) and one left processing.
    for i in 0..3 {
        let mut tx = t.db.begin().await.unwrap();
        let Reservation::Reserved(token) = s
            .reserve(&mut tx, &sc, &key(&format!("f{i}")), &fp("{}"), 0)
            .await
            .unwrap()
        else {
            panic!()
        };
        s.complete(&mut tx, token, &StoredResponse::new(200, [], vec![]), 0)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    // A record left `processing` (as a multi-phase reservation commits it) and one left
    // `unknown`: neither is ever collected.
    let mut tx = t.db.begin().await.unwrap();
    for (k, state) in [("p", "processing"), ("u", "unknown")] {
        // `key` is a reserved word on MySQL.
        let key_column = if matches!(t.db, Database::MySql(_)) {
            "`key`"
        } else {
            "key"
        };
        let sql = format!(
            "INSERT INTO oncely_idempotency (tenant, operation, {key_column}, fingerprint, \
             route_digest, state, owner, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 'o', 0, 0)"
        );
        on_tx!(&mut tx, |c| sqlx::query(&oncely_sql::sql_text(c, &sql))
            .bind("t1")
            .bind(sc.operation.as_str())
            .bind(k)
            .bind(&[0_u8; 32][..])
            .bind(&[0_u8; 32][..])
            .bind(state)
            .execute(c)
            .await
            .map(drop))
        .unwrap();
    }
    tx.commit().await.unwrap();

    assert_eq!(
        s.collect_expired(59_999, 10).await.unwrap(),
        0,
        "nothing has expired yet"
    );
    assert_eq!(
        s.collect_expired(i64::MAX, 2).await.unwrap(),
        2,
        "batches are bounded"
    );
    assert_eq!(s.collect_expired(i64::MAX, 2).await.unwrap(), 1);
    assert_eq!(s.collect_expired(i64::MAX, 2).await.unwrap(), 0);
    let left: i64 = on_pool!(&t.db, |p| sqlx::query_scalar(
        "SELECT COUNT(*) FROM oncely_idempotency"
    )
    .fetch_one(p)
    .await)
    .unwrap();
    assert_eq!(
        left, 2,
        "processing and unknown records are never collected"
    );
    assert_eq!(
        s.lookup(&sc, &key("p")).await.unwrap().unwrap().state,
        RecordState::Processing
    );
}

async fn migrations_are_idempotent(t: TestDb) {
    t.db.migrate().await.unwrap();
    t.db.migrate().await.unwrap();
}

async fn inbox_records_a_message_once_per_consumer_and_a_rollback_forgets_it(t: TestDb) {
    t.db.migrate().await.unwrap();
    let id = oncely_core::MessageId::new_random();
    let mut tx = t.db.begin().await.unwrap();
    assert_eq!(
        InboxStore::record(&mut tx, "billing", &id, 1_000)
            .await
            .unwrap(),
        InboxOutcome::New
    );
    tx.rollback().await.unwrap();
    let mut tx = t.db.begin().await.unwrap();
    assert_eq!(
        InboxStore::record(&mut tx, "billing", &id, 1_000)
            .await
            .unwrap(),
        InboxOutcome::New,
        "a rolled-back effect leaves no inbox row"
    );
    tx.commit().await.unwrap();
    let mut tx = t.db.begin().await.unwrap();
    assert_eq!(
        InboxStore::record(&mut tx, "billing", &id, 2_000)
            .await
            .unwrap(),
        InboxOutcome::Duplicate
    );
    assert_eq!(
        InboxStore::record(&mut tx, "audit", &id, 2_000)
            .await
            .unwrap(),
        InboxOutcome::New,
        "each consumer has its own inbox"
    );
    tx.commit().await.unwrap();
}

async fn inbox_collector_deletes_only_rows_past_retention_in_bounded_batches(t: TestDb) {
    t.db.migrate().await.unwrap();
    let inbox = InboxStore::new(t.db.clone());
    let mut tx = t.db.begin().await.unwrap();
    for i in 0..7 {
        let at = if i < 5 { 1_000 } else { 9_000 };
        let id = oncely_core::MessageId::new_random();
        InboxStore::record(&mut tx, "billing", &id, at)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    assert_eq!(inbox.collect(5_000, 2).await.unwrap(), 2);
    assert_eq!(inbox.collect(5_000, 2).await.unwrap(), 2);
    assert_eq!(inbox.collect(5_000, 2).await.unwrap(), 1);
    assert_eq!(inbox.collect(5_000, 2).await.unwrap(), 0);
    let left: i64 = on_pool!(&t.db, |p| sqlx::query_scalar(
        "SELECT COUNT(*) FROM oncely_inbox"
    )
    .fetch_one(p)
    .await)
    .unwrap();
    assert_eq!(left, 2);
}

/// A claim lasts exactly as long as its transaction: after a rollback, after a commit that
/// wrote nothing, and after a transaction dropped unfinished, another session (a second pool
/// on the same database) can claim the key. On MySQL the claim is a session-scoped named lock,
/// so this proves it is released before the connection goes back to the pool, and that a
/// dropped transaction's session is closed rather than reused with the lock still held.
async fn key_claim_ends_with_its_transaction_even_when_dropped_unfinished(t: TestDb) {
    let first = store(&t).await;
    let other = oncely_sql::Database::connect(&t.url, &oncely_sql::DbOptions::default())
        .await
        .unwrap();
    let s2 = IdempotencyStore::new(other.clone(), Duration::from_secs(60));
    let (sc, k, fprint) = (scope("t1"), key("claimed"), fp("{}"));
    let reserve_on = |store: IdempotencyStore, db: oncely_sql::Database| {
        let (sc, k) = (sc.clone(), k.clone());
        async move {
            let mut tx = db.begin().await.unwrap();
            let r = store.reserve(&mut tx, &sc, &k, &fprint, 1).await.unwrap();
            (tx, r)
        }
    };
    for end in ["rollback", "commit", "drop"] {
        let (tx, r) = reserve_on(first.clone(), t.db.clone()).await;
        assert!(matches!(r, Reservation::Reserved(_)), "{end}: first claim");
        match end {
            "rollback" => tx.rollback().await.unwrap(),
            "commit" => tx.commit().await.unwrap(),
            _ => drop(tx),
        }
        // A dropped transaction is ended by the server closing its session: give it a
        // moment, bounded.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let (tx2, r2) = reserve_on(s2.clone(), other.clone()).await;
            tx2.rollback().await.unwrap();
            match r2 {
                Reservation::Reserved(_) => break,
                Reservation::InFlight if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => panic!("{end}: the claim outlived its transaction"),
            }
        }
        // And the pooled connection that held it claims it again (nothing left behind).
        let (tx3, r3) = reserve_on(first.clone(), t.db.clone()).await;
        assert!(matches!(r3, Reservation::Reserved(_)), "{end}: reclaim");
        tx3.rollback().await.unwrap();
    }
    other.close().await;
}

/// MySQL / MariaDB: a record insert that runs into another transaction's uncommitted row
/// for the same key waits at most the lock timeout, and the lock-wait timeout (1205) is
/// reported as `NotHeld` — the caller rolls back and answers with the winner's record or
/// 409 — not as a failure (500) and never as a second record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_lock_wait_timeout_on_the_record_insert_is_not_held() {
    let options = oncely_sql::DbOptions {
        lock_timeout: Duration::from_secs(1),
        ..oncely_sql::DbOptions::default()
    };
    let Some(t) = TestDb::with_options(oncely_testkit::TestBackend::MySql, &options).await else {
        return;
    };
    let s = store(&t).await;
    let (sc, k, f) = (scope("t1"), key("contended"), fp("{}"));
    // Another writer inserted the key's row and has not committed (it bypassed the claim,
    // as a process of an older version or a manual fix-up might).
    let mut holder = t.db.begin().await.unwrap();
    on_tx!(&mut holder, |c| sqlx::query(&oncely_sql::sql_text(
        c,
        "INSERT INTO oncely_idempotency (tenant, operation, `key`, fingerprint, route_digest, \
         state, owner, created_at) VALUES ($1, $2, $3, $4, $5, 'processing', 'x', 0)"
    ))
    .bind("t1")
    .bind(sc.operation.as_str())
    .bind("contended")
    .bind(&[0_u8; 32][..])
    .bind(&[0_u8; 32][..])
    .execute(c)
    .await
    .map(drop))
    .unwrap();
    let mut tx = t.db.begin().await.unwrap();
    let Reservation::Reserved(token) = s.reserve(&mut tx, &sc, &k, &f, 1).await.unwrap() else {
        panic!("the uncommitted row is invisible (READ COMMITTED) and the named lock is free");
    };
    let started = std::time::Instant::now();
    let done = StoredResponse::new(201, [], vec![]);
    assert!(matches!(
        s.complete(&mut tx, token, &done, 2).await,
        Err(StoreError::NotHeld)
    ));
    assert!(started.elapsed() < Duration::from_secs(4), "bounded wait");
    tx.rollback().await.unwrap();
    holder.rollback().await.unwrap();
}
