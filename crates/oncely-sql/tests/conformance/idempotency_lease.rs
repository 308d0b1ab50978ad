//! Multi-phase idempotency records on every backend: the reservation committed as
//! `processing` under a lease and fence 1, a stale fencing token refused with
//! `StoreError::Fenced` and nothing changed, take-over only of an `unknown` record, and
//! the lease sweep.

use std::time::Duration;

use oncely_core::{now_ms, RecordState, StoredResponse};
use oncely_sql::{LeaseReservation, StoreError};
use oncely_testkit::TestDb;

use super::{fp, key, scope, store};

const LEASE: Duration = Duration::from_secs(30);

fn answer(body: &str) -> StoredResponse {
    StoredResponse::new(
        201,
        [("content-type", "application/json")],
        body.as_bytes().to_vec(),
    )
}

async fn a_stale_fencing_token_changes_nothing(t: TestDb) {
    let s = store(&t).await;
    let (sc, k, body) = (scope("t1"), key("k-lease"), fp(r#"{"a":1}"#));
    let now = now_ms();
    let LeaseReservation::Leased(first) =
        s.reserve_leased(&sc, &k, &body, now, LEASE).await.unwrap()
    else {
        panic!("the first reservation leases the key");
    };
    assert_eq!(first.fence(), 1);
    let held = s.lookup(&sc, &k).await.unwrap().expect("committed at once");
    assert_eq!((held.state, held.fence), (RecordState::Processing, 1));
    assert!(matches!(
        s.reserve_leased(&sc, &k, &body, now, LEASE).await.unwrap(),
        LeaseReservation::Existing(found) if found.state == RecordState::Processing
    ));
    // Not expired yet: nothing turns unknown, nothing can be taken over.
    assert!(!s.expire_lease(&sc, &k, 1, now + 1).await.unwrap());
    assert!(matches!(
        s.take_over(&sc, &k, 1, now + 1, LEASE).await,
        Err(StoreError::NotHeld)
    ));
    let later = now + 31_000;
    assert!(s.expire_lease(&sc, &k, 1, later).await.unwrap());
    let second = s.take_over(&sc, &k, 1, later, LEASE).await.unwrap();
    assert_eq!(second.fence(), 2);
    // A second take-over naming the old fence loses.
    assert!(matches!(
        s.take_over(&sc, &k, 1, later, LEASE).await,
        Err(StoreError::NotHeld)
    ));

    let stale = s.complete_leased(&first, &answer("stale"), later).await;
    assert!(
        matches!(
            stale,
            Err(StoreError::Fenced {
                held: 1,
                current: 2
            })
        ),
        "{stale:?}"
    );
    let abandon = s.abandon_leased(&first, later).await;
    assert!(
        matches!(abandon, Err(StoreError::Fenced { .. })),
        "{abandon:?}"
    );
    let release = s.release_leased(first).await;
    assert!(
        matches!(release, Err(StoreError::Fenced { .. })),
        "{release:?}"
    );
    let kept = s.lookup(&sc, &k).await.unwrap().expect("still there");
    assert_eq!((kept.state, kept.fence), (RecordState::Processing, 2));
    assert!(kept.response.is_none(), "the stale holder stored nothing");

    s.complete_leased(&second, &answer("current"), later)
        .await
        .unwrap();
    let done = s.lookup(&sc, &k).await.unwrap().unwrap();
    assert_eq!((done.state, done.fence), (RecordState::Succeeded, 2));
    assert_eq!(done.response.unwrap().body, b"current");
    assert!(done.lease_until.is_none());
    assert!(matches!(
        s.complete_leased(&second, &answer("again"), later).await,
        Err(StoreError::NotHeld)
    ));
}

async fn the_lease_sweep_turns_only_expired_processing_records_unknown(t: TestDb) {
    let s = store(&t).await;
    let now = now_ms();
    for (k, lease) in [("short", Duration::from_secs(1)), ("long", LEASE)] {
        let r = s
            .reserve_leased(&scope("t1"), &key(k), &fp("{}"), now, lease)
            .await
            .unwrap();
        assert!(matches!(r, LeaseReservation::Leased(_)));
    }
    assert_eq!(s.expire_leases(now + 5_000, 1).await.unwrap(), 1);
    assert_eq!(s.expire_leases(now + 5_000, 10).await.unwrap(), 0);
    let state = |k: &'static str| {
        let s = s.clone();
        async move {
            s.lookup(&scope("t1"), &key(k))
                .await
                .unwrap()
                .unwrap()
                .state
        }
    };
    assert_eq!(state("short").await, RecordState::Unknown);
    assert_eq!(state("long").await, RecordState::Processing);
    let report = s.lease_report(now + 5_000).await.unwrap();
    assert_eq!((report.processing, report.unknown), (1, 1));
    assert_eq!(report.oldest_unknown_ms, Some(4_000));
    let listed = s
        .list_records(Some(RecordState::Unknown), 10)
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].key.as_str(), listed[0].fence), ("short", 1));
    // Other tenants' records are theirs: the same key in t2 is a record of its own.
    let other = s
        .reserve_leased(&scope("t2"), &key("short"), &fp("{}"), now, LEASE)
        .await
        .unwrap();
    assert!(matches!(other, LeaseReservation::Leased(_)));
}

oncely_testkit::matrix! {
    tests: [
        a_stale_fencing_token_changes_nothing,
        the_lease_sweep_turns_only_expired_processing_records_unknown,
    ],
}
