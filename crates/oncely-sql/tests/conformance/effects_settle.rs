//! The effect store's group settle on every backend: one transaction settling many effects
//! in one fenced statement, where an effect whose lease another runner took over is skipped
//! and the others are written — also while that runner settles the same effects at once.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use oncely_sql::{Effect, EffectState, EffectStore, EvidenceKind, Settle, SettleItem};
use oncely_testkit::TestDb;

use super::effects::{enqueue, evidence, store, LEASE};

/// Longer than a `TEXT` column holds (65,535 bytes): the response must reach its column
/// whole from the group's values.
const LONG: usize = 70_000;

/// `n` effects enqueued and claimed by `runner-a` at 2,000 (lease [`LEASE`]).
async fn claimed_by_a(s: &EffectStore, n: usize) -> Vec<Effect> {
    for i in 0..n {
        enqueue(s, &format!("inv-{i}"), &format!("key-{i}")).await;
    }
    let claimed = s
        .claim("payments", "runner-a", 1_000, LEASE, 2_000)
        .await
        .unwrap();
    assert_eq!(claimed.len(), n);
    claimed
}

fn succeeded(provider_id: &str, response: String) -> Settle {
    Settle::Succeeded {
        provider_id: provider_id.into(),
        response,
    }
}

/// A group of five of `runner-a`'s outcomes, of several kinds (a first row without a
/// provider id or response, a response longer than `TEXT`), settled in one transaction
/// after `runner-b` took over the lease of the one in the middle: that one is `false` and
/// untouched (still `runner-b`'s, without evidence), the other four are written with one
/// evidence row each, and `runner-b` then settles its own.
pub(crate) async fn a_group_settle_skips_only_the_effect_whose_lease_was_taken_over(t: TestDb) {
    let s = store(&t).await;
    let claimed = claimed_by_a(&s, 5).await;
    // runner-a's lease ran out on one effect only: runner-b takes it over.
    let taken = s
        .claim("payments", "runner-b", 1, LEASE, 40_000)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(taken.state().unwrap(), EffectState::Unknown);
    let mut held_by_a = claimed.iter().filter(|e| e.id != taken.id);
    let mut next = || held_by_a.next().unwrap().clone();
    let a_lost = claimed.iter().find(|e| e.id == taken.id).unwrap().clone();
    // The lost lease in the middle of the group.
    let group = [next(), next(), a_lost, next(), next()];
    let settles = [
        Settle::Retry {
            at: 50_000,
            error: "503".into(),
            counts: false,
        },
        succeeded("pi_long", "x".repeat(LONG)),
        succeeded("pi_late", "{}".into()),
        Settle::Failed {
            error: "declined".into(),
            response: None,
        },
        succeeded("pi_4", "{\"id\":\"pi_4\"}".into()),
    ];
    let call = evidence(EvidenceKind::Call, "answered");
    let items: Vec<SettleItem<'_>> = group
        .iter()
        .zip(&settles)
        .map(|(effect, settle)| SettleItem {
            effect,
            settle,
            evidence: &call,
        })
        .collect();
    let mut tx = t.db.begin().await.unwrap();
    let held = EffectStore::settle_batch(&mut tx, &items, 41_000)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(held, [true, true, false, true, true]);

    let get = |i: usize| {
        let s = s.clone();
        let id = group[i].id.clone();
        async move { s.get(&id).await.unwrap().unwrap() }
    };
    let retried = get(0).await;
    assert_eq!(
        (
            retried.state().unwrap(),
            retried.attempts,
            retried.available_at,
            retried.unavailable_streak,
            retried.provider_id.as_deref(),
            retried.last_error.as_deref(),
        ),
        (EffectState::Pending, 0, 50_000, 1, None, Some("503"))
    );
    let long = get(1).await;
    assert_eq!(
        (long.state().unwrap(), long.provider_id.as_deref()),
        (EffectState::Succeeded, Some("pi_long"))
    );
    assert_eq!(long.response.map(|r| r.len()), Some(LONG));
    let failed = get(3).await;
    assert_eq!(
        (failed.state().unwrap(), failed.last_error.as_deref()),
        (EffectState::Failed, Some("declined"))
    );
    assert_eq!(get(4).await.provider_id.as_deref(), Some("pi_4"));
    assert_eq!(get(2).await, taken, "the lost lease wrote nothing");
    for (i, evidence_rows) in [(0, 1), (1, 1), (2, 0), (3, 1), (4, 1)] {
        assert_eq!(
            s.evidence(&group[i].id).await.unwrap().len(),
            evidence_rows,
            "effect {i}: evidence of held settles only, once"
        );
    }
    // The new lease holder settles it (a group of one).
    let check = evidence(EvidenceKind::Status, "found");
    let found = succeeded("pi_0", "{}".into());
    let mut tx = t.db.begin().await.unwrap();
    EffectStore::settle(&mut tx, &taken, &found, &check, 42_000)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let done = get(2).await;
    assert_eq!(
        (
            done.state().unwrap(),
            done.provider_id.as_deref(),
            done.checks
        ),
        (EffectState::Succeeded, Some("pi_0"), 1)
    );
    assert_eq!(s.evidence(&done.id).await.unwrap().len(), 1);
}

/// 40 effects claimed by `runner-a`, half of them taken over by `runner-b` after the
/// lease; then both settle at once, each in its own transaction held open a moment after
/// its update: `runner-a`'s group of 40 writes exactly the 20 it still holds, `runner-b`'s
/// group writes its 20, and every effect ends settled by its lease holder with one evidence
/// row — in each of several rounds, whoever's statement runs first.
pub(crate) async fn two_runners_settling_at_once_write_each_effect_once_by_its_lease_holder(
    t: TestDb,
) {
    const N: usize = 40;
    let s = store(&t).await;
    for round in 0..3_i64 {
        let claimed: Vec<Effect> = {
            for i in 0..N {
                let r = format!("r{round}-{i}");
                enqueue(&s, &r, &format!("key-{r}")).await;
            }
            let now = 2_000 + round * 100_000;
            s.claim("payments", "runner-a", 1_000, LEASE, now)
                .await
                .unwrap()
        };
        assert_eq!(claimed.len(), N);
        let taken = s
            .claim("payments", "runner-b", 20, LEASE, 40_000 + round * 100_000)
            .await
            .unwrap();
        let taken_ids: HashSet<&str> = taken.iter().map(|e| e.id.as_str()).collect();
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let a = settle_racing(&t, claimed.clone(), "pi_a", barrier.clone());
        let b = settle_racing(&t, taken.clone(), "pi_b", barrier);
        let (held_a, held_b) = tokio::join!(a, b);
        let expected_a: Vec<bool> = claimed
            .iter()
            .map(|e| !taken_ids.contains(e.id.as_str()))
            .collect();
        assert_eq!(
            held_a, expected_a,
            "round {round}: runner-a writes what it holds"
        );
        assert_eq!(held_b, vec![true; taken.len()], "round {round}: runner-b");
        for e in &claimed {
            let now = s.get(&e.id).await.unwrap().unwrap();
            let winner = if taken_ids.contains(e.id.as_str()) {
                "pi_b"
            } else {
                "pi_a"
            };
            assert_eq!(
                (now.state().unwrap(), now.provider_id.as_deref()),
                (EffectState::Succeeded, Some(winner)),
                "round {round}: {}",
                e.reference
            );
            assert_eq!(s.evidence(&e.id).await.unwrap().len(), 1, "{}", e.reference);
        }
    }
}

/// Settles every effect of `group` as succeeded at `provider_id` in one transaction, started
/// when `barrier` lets both racers go, held open 50 ms after the update; per effect whether
/// it was held.
async fn settle_racing(
    t: &TestDb,
    group: Vec<Effect>,
    provider_id: &str,
    barrier: Arc<tokio::sync::Barrier>,
) -> Vec<bool> {
    let settle = succeeded(provider_id, "{}".into());
    let call = evidence(EvidenceKind::Call, "succeeded");
    let items: Vec<SettleItem<'_>> = group
        .iter()
        .map(|effect| SettleItem {
            effect,
            settle: &settle,
            evidence: &call,
        })
        .collect();
    // Both begin after the barrier: SQLite's single writer lets the second `BEGIN` wait
    // for the first transaction.
    barrier.wait().await;
    let mut tx = t.db.begin().await.unwrap();
    let held = EffectStore::settle_batch(&mut tx, &items, 45_000)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    tx.commit().await.unwrap();
    held
}

/// MySQL / MariaDB: a group of 4 settled among 400 effects reads each by its primary key,
/// never the whole table (which it would lock, row by row, on the way): the settle's table
/// scans (`Handler_read_rnd_next` of its session, beyond what reading the counter costs)
/// are only those of its own derived table of new values.
pub(crate) async fn a_group_settle_finds_its_effects_by_key_never_by_a_scan(t: TestDb) {
    let s = store(&t).await;
    enqueue_backlog(&t, 400, |_| 1_000).await;
    let group = s
        .claim("payments", "runner-a", 4, LEASE, 2_000)
        .await
        .unwrap();
    let settle = succeeded("pi", "{}".into());
    let call = evidence(EvidenceKind::Call, "succeeded");
    let items: Vec<SettleItem<'_>> = group
        .iter()
        .map(|effect| SettleItem {
            effect,
            settle: &settle,
            evidence: &call,
        })
        .collect();
    let mut tx = t.db.begin().await.unwrap();
    let start = scans(&mut tx).await;
    let reading = scans(&mut tx).await - start;
    let before = scans(&mut tx).await;
    let held = EffectStore::settle_batch(&mut tx, &items, 3_000)
        .await
        .unwrap();
    let settling = scans(&mut tx).await - before - reading;
    tx.commit().await.unwrap();
    assert_eq!(held, [true; 4]);
    assert!(
        settling < 50,
        "{settling} rows scanned to settle 4 effects among 400"
    );
}

/// A claim of 16 among 2,000 due effects reads about 16 index entries, not the backlog: the
/// claim walks the due index in order and stops at its `LIMIT`. Read through a pool of one
/// connection, so the session's handler counters are the claim's own. (On the index of the
/// four due states, every claim read and sorted all 2,000: `Handler_read_next` ≈ 2,000.)
pub(crate) async fn a_claim_reads_its_limit_of_the_due_index_not_the_whole_backlog(t: TestDb) {
    store(&t).await;
    enqueue_backlog(&t, 2_000, |i| 1_000 + i).await;
    let db = super::one_connection(&t).await;
    let s1 = EffectStore::new(db.clone());
    for round in 0..3 {
        let before = rows_read(&db).await;
        let claimed = s1
            .claim("payments", "runner-a", 16, LEASE, 10_000)
            .await
            .unwrap();
        let read = rows_read(&db).await - before;
        assert_eq!(claimed.len(), 16);
        // The first claims take the oldest due effects, in order.
        let mut refs: Vec<&str> = claimed.iter().map(|e| e.reference.as_str()).collect();
        refs.sort_by_key(|r| r[4..].parse::<u32>().unwrap());
        assert_eq!(refs[0], format!("inv-{}", round * 16));
        assert!(
            read < 200,
            "round {round}: {read} rows read to claim 16 of 2,000"
        );
    }
}

/// The session's rows read through indexes and scans so far (`Handler_read_key`,
/// `Handler_read_next`, `Handler_read_rnd_next`), on `db`'s only connection.
async fn rows_read(db: &oncely_sql::Database) -> i64 {
    let rows: Vec<(String, String)> = oncely_sql::on_pool!(db, |p| sqlx::query_as(
        "SHOW SESSION STATUS WHERE Variable_name IN \
         ('Handler_read_key', 'Handler_read_next', 'Handler_read_rnd_next')"
    )
    .fetch_all(p)
    .await)
    .unwrap();
    rows.iter().map(|(_, v)| v.parse::<i64>().unwrap()).sum()
}

/// `n` effects (`inv-i`, `key-i`) enqueued in one transaction, effect `i` due at `due(i)`.
async fn enqueue_backlog(t: &TestDb, n: i64, due: impl Fn(i64) -> i64) {
    let request = serde_json::json!({});
    let mut tx = t.db.begin().await.unwrap();
    for i in 0..n {
        let (reference, key) = (format!("inv-{i}"), format!("key-{i}"));
        let new = oncely_sql::NewEffect {
            tenant: "acme",
            provider: "payments",
            operation: "charge",
            reference: &reference,
            key: &key,
            request: &request,
        };
        EffectStore::enqueue(&mut tx, &new, due(i)).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// The session's `Handler_read_rnd_next`: rows read by table scans so far.
async fn scans(tx: &mut oncely_sql::Tx) -> i64 {
    let (_, value): (String, String) = tx
        .fetch_optional(oncely_sql::query(
            "SHOW SESSION STATUS LIKE 'Handler_read_rnd_next'",
        ))
        .await
        .unwrap()
        .unwrap();
    value.parse().unwrap()
}

oncely_testkit::matrix! {
    tests: [
        a_group_settle_skips_only_the_effect_whose_lease_was_taken_over,
        two_runners_settling_at_once_write_each_effect_once_by_its_lease_holder,
        a_group_settle_finds_its_effects_by_key_never_by_a_scan,
        a_claim_reads_its_limit_of_the_due_index_not_the_whole_backlog,
    ],
    cannot_apply: [
        // Reads MySQL's session handler counters: the join order it checks is MySQL's
        // (the other backends update from their values list without a join to pin).
        a_group_settle_finds_its_effects_by_key_never_by_a_scan on sqlite | postgres,
        // Reads MySQL's session handler counters; PostgreSQL's partial index
        // `oncely_effects_due` and SQLite's single writer are checked by the claim tests.
        a_claim_reads_its_limit_of_the_due_index_not_the_whole_backlog on sqlite | postgres,
    ],
}
