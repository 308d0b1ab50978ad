//! The effect store on every backend: one intent per reference, claims under a fenced
//! lease, a dead runner's `in_flight` turned `unknown` (never `pending`), and concurrent
//! runners never claiming one effect twice.

use std::collections::HashSet;
use std::time::Duration;

use oncely_sql::{
    EffectState, EffectStore, Enqueued, Evidence, EvidenceKind, NewEffect, Settle, StoreError,
};
use oncely_testkit::TestDb;
use serde_json::json;

pub(crate) const LEASE: Duration = Duration::from_secs(30);

pub(crate) async fn store(t: &TestDb) -> EffectStore {
    t.db.migrate().await.unwrap();
    EffectStore::new(t.db.clone())
}

pub(crate) async fn enqueue(s: &EffectStore, reference: &str, key: &str) -> Enqueued {
    let request = json!({"amount": 1250, "currency": "eur"});
    let mut tx = s.database().begin().await.unwrap();
    let new = NewEffect {
        tenant: "acme",
        provider: "payments",
        operation: "charge",
        reference,
        key,
        request: &request,
    };
    let done = EffectStore::enqueue(&mut tx, &new, 1_000).await.unwrap();
    tx.commit().await.unwrap();
    done
}

/// Settles `effect` into `settle` with `evidence` in a transaction of its own, committed.
async fn settle(
    t: &TestDb,
    effect: &oncely_sql::Effect,
    settle: &Settle,
    evidence: &Evidence,
    now_ms: i64,
) {
    let mut tx = t.db.begin().await.unwrap();
    EffectStore::settle(&mut tx, effect, settle, evidence, now_ms)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

pub(crate) fn evidence(kind: EvidenceKind, outcome: &str) -> Evidence {
    Evidence {
        kind,
        key: "k".into(),
        started_at: 1_000,
        finished_at: 1_010,
        outcome: outcome.into(),
        http_status: Some(200),
        provider_ids: vec!["pi_1".into()],
        detail: String::new(),
    }
}

pub(crate) async fn one_intent_per_reference_and_key(t: TestDb) {
    let s = store(&t).await;
    assert!(matches!(
        enqueue(&s, "inv-1", "key-1").await,
        Enqueued::Created(_)
    ));
    assert_eq!(enqueue(&s, "inv-1", "key-1").await, Enqueued::Existing);
    assert_eq!(enqueue(&s, "inv-1", "key-other").await, Enqueued::Existing);
    assert_eq!(enqueue(&s, "inv-2", "key-1").await, Enqueued::Existing);
    let all = s.list(None, 10).await.unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(
        (
            all[0].state().unwrap(),
            all[0].attempts,
            all[0].key.as_str()
        ),
        (EffectState::Pending, 0, "key-1")
    );
}

pub(crate) async fn a_claim_starts_the_attempt_before_the_call_and_a_dead_runners_call_is_unknown(
    t: TestDb,
) {
    let s = store(&t).await;
    enqueue(&s, "inv-1", "key-1").await;
    let claimed = s
        .claim("payments", "runner-a", 10, LEASE, 2_000)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(
        (claimed[0].state().unwrap(), claimed[0].attempts),
        (EffectState::InFlight, 1)
    );
    // Leased: nobody else gets it, and another provider's runner sees nothing.
    assert!(s
        .claim("payments", "runner-b", 10, LEASE, 3_000)
        .await
        .unwrap()
        .is_empty());
    assert!(s
        .claim("shipping", "runner-b", 10, LEASE, 99_000)
        .await
        .unwrap()
        .is_empty());
    // runner-a died mid-call: after its lease the effect is unknown, not pending, and the
    // attempt it started stays counted.
    let taken = s
        .claim("payments", "runner-b", 10, LEASE, 40_000)
        .await
        .unwrap();
    assert_eq!(
        (taken[0].state().unwrap(), taken[0].attempts),
        (EffectState::Unknown, 1)
    );
    // runner-a's late settle is fenced off.
    let late = Settle::Succeeded {
        provider_id: "pi_late".into(),
        response: "{}".into(),
    };
    let mut tx = t.db.begin().await.unwrap();
    let err = EffectStore::settle(
        &mut tx,
        &claimed[0],
        &late,
        &evidence(EvidenceKind::Call, "succeeded"),
        41_000,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, StoreError::NotHeld), "{err}");
    drop(tx);
    // runner-b's status check finds it.
    let found = Settle::Succeeded {
        provider_id: "pi_1".into(),
        response: "{\"id\":\"pi_1\"}".into(),
    };
    settle(
        &t,
        &taken[0],
        &found,
        &evidence(EvidenceKind::Status, "found"),
        41_000,
    )
    .await;
    let done = s.get(&taken[0].id).await.unwrap().unwrap();
    assert_eq!(
        (
            done.state().unwrap(),
            done.provider_id.as_deref(),
            done.checks
        ),
        (EffectState::Succeeded, Some("pi_1"), 1)
    );
    // Settled effects are never claimed again.
    assert!(s
        .claim("payments", "runner-c", 10, LEASE, 999_000)
        .await
        .unwrap()
        .is_empty());
    let ev = s.evidence(&done.id).await.unwrap();
    assert_eq!(
        ev.iter()
            .map(|e| (e.n, e.kind.as_str()))
            .collect::<Vec<_>>(),
        [(1, "status")]
    );
}

pub(crate) async fn an_unavailable_provider_does_not_count_and_absent_resends_with_the_given_key(
    t: TestDb,
) {
    let s = store(&t).await;
    enqueue(&s, "inv-1", "key-1").await;
    let c = s
        .claim("payments", "r", 10, LEASE, 2_000)
        .await
        .unwrap()
        .remove(0);
    let wait = Settle::Retry {
        at: 5_000,
        error: "connection refused".into(),
        counts: false,
    };
    settle(
        &t,
        &c,
        &wait,
        &evidence(EvidenceKind::Call, "not_sent"),
        2_100,
    )
    .await;
    let e = s.get(&c.id).await.unwrap().unwrap();
    assert_eq!(
        (e.state().unwrap(), e.attempts, e.available_at),
        (EffectState::Pending, 0, 5_000)
    );
    assert!(
        s.claim("payments", "r", 10, LEASE, 4_999)
            .await
            .unwrap()
            .is_empty(),
        "not due yet"
    );
    let c = s
        .claim("payments", "r", 10, LEASE, 5_000)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(c.attempts, 1);
    // Unknown, then a status check proves absence: sent again with the next key.
    let unknown = Settle::Unknown {
        at: 6_000,
        error: "timeout".into(),
    };
    settle(
        &t,
        &c,
        &unknown,
        &evidence(EvidenceKind::Call, "unknown"),
        5_100,
    )
    .await;
    let c = s
        .claim("payments", "r", 10, LEASE, 6_000)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(c.state().unwrap(), EffectState::Unknown);
    let absent = Settle::Absent {
        at: 6_000,
        key: "key-1-g1".into(),
        key_generation: 1,
    };
    settle(
        &t,
        &c,
        &absent,
        &evidence(EvidenceKind::Status, "absent"),
        6_000,
    )
    .await;
    let c = s
        .claim("payments", "r", 10, LEASE, 6_000)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(
        (
            c.state().unwrap(),
            c.attempts,
            c.key.as_str(),
            c.key_generation,
            c.checks
        ),
        (EffectState::InFlight, 2, "key-1-g1", 1, 1)
    );
    let kinds: Vec<_> = s
        .evidence(&c.id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.outcome)
        .collect();
    assert_eq!(kinds, ["not_sent", "unknown", "absent"]);
}

/// Four runners claim 120 effects at once, in batches of 8: each effect is claimed
/// exactly once (SKIP LOCKED on PostgreSQL and MySQL; SQLite's single writer).
pub(crate) async fn concurrent_runners_never_claim_one_effect_twice(t: TestDb) {
    let s = store(&t).await;
    for i in 0..120 {
        enqueue(&s, &format!("inv-{i}"), &format!("key-{i}")).await;
    }
    let runners: Vec<_> = (0..4)
        .map(|r| {
            let s = s.clone();
            tokio::spawn(async move {
                let mut mine = Vec::new();
                loop {
                    let got = s
                        .claim("payments", &format!("runner-{r}"), 8, LEASE, 2_000)
                        .await
                        .unwrap();
                    if got.is_empty() {
                        break mine;
                    }
                    mine.extend(got.into_iter().map(|e| e.id));
                }
            })
        })
        .collect();
    let mut seen = HashSet::new();
    let mut total = 0;
    for r in runners {
        for id in r.await.unwrap() {
            total += 1;
            assert!(seen.insert(id), "an effect was claimed twice");
        }
    }
    assert_eq!((total, seen.len()), (120, 120));
}

/// 20,000 due effects inserted after `VACUUM ANALYZE` saw the table empty: the claim's plan
/// (pinned) still reads the due index, never the whole table under lock.
pub(crate) async fn claims_on_a_backlog_believed_empty_never_seq_scan(t: TestDb) {
    // One connection: the statistics counted are the ones it flushes.
    let db = super::one_connection(&t).await;
    db.migrate().await.unwrap();
    let s = EffectStore::new(db.clone());
    let pool = db.as_postgres().expect("PostgreSQL").clone();
    sqlx::query("VACUUM ANALYZE oncely_effects")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO oncely_effects (id, tenant, provider, operation, reference, idem_key, \
         request, available_at, created_at, updated_at) \
         SELECT 'e' || g, 'acme', 'payments', 'charge', 'inv-' || g, 'key-' || g, '{}', g, g, g \
         FROM generate_series(1, 20000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    let believed: f64 = sqlx::query_scalar(
        "SELECT reltuples::float8 FROM pg_class WHERE oid = 'oncely_effects'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        believed <= 0.0,
        "the statistics must still say empty, say {believed}"
    );
    // The plan a long-running runner ends up with: generic, made once from these statistics.
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&pool)
        .await
        .unwrap();
    let before = seq_scans(&pool).await;
    for _ in 0..3 {
        let got = s.claim("payments", "r", 8, LEASE, 30_000).await.unwrap();
        assert_eq!(got.len(), 8);
    }
    assert_eq!(
        seq_scans(&pool).await,
        before,
        "a claim seq-scanned oncely_effects"
    );
}

/// Seq scans of `oncely_effects` so far, after flushing this connection's pending counts.
async fn seq_scans(pool: &sqlx::PgPool) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'oncely_effects'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// An operator's retry never calls blindly: a `needs_review` effect goes back to `unknown`
/// (its next claim is a status check). A resolution records what the person found. Both
/// leave an audit row; other states are refused and change nothing.
pub(crate) async fn operator_retries_check_the_status_first_and_resolutions_are_audited(t: TestDb) {
    let s = store(&t).await;
    enqueue(&s, "inv-1", "key-1").await;
    let c = s
        .claim("payments", "r", 10, LEASE, 2_000)
        .await
        .unwrap()
        .remove(0);
    let park = Settle::NeedsReview {
        error: "still unknown after 20 checks".into(),
    };
    settle(
        &t,
        &c,
        &park,
        &evidence(EvidenceKind::Status, "unavailable"),
        3_000,
    )
    .await;
    let retried = s.retry(&c.id, "unused", "ops@acme", 4_000).await.unwrap();
    assert_eq!(
        (retried.state().unwrap(), retried.checks),
        (EffectState::Unknown, 0)
    );
    let next = s
        .claim("payments", "r", 10, LEASE, 4_000)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(
        next.state().unwrap(),
        EffectState::Unknown,
        "a status check, not a call"
    );
    assert_eq!(next.attempts, 1, "no new attempt counted");
    // The person found the charge at the provider.
    let mut tx = t.db.begin().await.unwrap();
    let found = oncely_sql::Resolution {
        to: EffectState::Succeeded,
        provider_id: Some("pi_found"),
        actor: "ops@acme",
        reason: "seen in the provider's dashboard",
    };
    let done = s.resolve(&mut tx, &c.id, &found, 5_000).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        (done.state().unwrap(), done.provider_id.as_deref()),
        (EffectState::Succeeded, Some("pi_found"))
    );
    // The runner that held the lease is fenced off.
    let mut tx = t.db.begin().await.unwrap();
    let late = EffectStore::settle(
        &mut tx,
        &next,
        &park,
        &evidence(EvidenceKind::Status, "x"),
        5_100,
    )
    .await;
    assert!(matches!(late, Err(StoreError::NotHeld)), "{late:?}");
    drop(tx);
    let trail = s.audit_trail(&c.id).await.unwrap();
    let actions: Vec<_> = trail
        .iter()
        .map(|a| (a.2.as_str(), a.3.as_str(), a.4.as_str()))
        .collect();
    assert_eq!(
        actions,
        [
            ("retry", "needs_review", "unknown"),
            ("resolve", "unknown", "succeeded")
        ]
    );
    // Succeeded effects are neither retried nor resolved again; unknown ids are named.
    assert!(matches!(
        s.retry(&c.id, "k", "ops", 6_000).await,
        Err(StoreError::Conflict(_))
    ));
    let mut tx = t.db.begin().await.unwrap();
    assert!(matches!(
        s.resolve(&mut tx, &c.id, &found, 6_000).await,
        Err(StoreError::Conflict(_))
    ));
    drop(tx);
    assert!(matches!(
        s.retry("nope", "k", "ops", 6_000).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(s.audit_trail(&c.id).await.unwrap().len(), 2);
}

/// A `failed` effect retried by an operator is sent again under the next key: its old key
/// would only replay the stored refusal.
pub(crate) async fn a_failed_effect_retried_is_resent_under_the_next_key(t: TestDb) {
    let s = store(&t).await;
    enqueue(&s, "inv-1", "key-1").await;
    let c = s
        .claim("payments", "r", 10, LEASE, 2_000)
        .await
        .unwrap()
        .remove(0);
    let refused = Settle::Failed {
        error: "card_declined".into(),
        response: None,
    };
    settle(
        &t,
        &c,
        &refused,
        &evidence(EvidenceKind::Call, "failed"),
        3_000,
    )
    .await;
    let retried = s.retry(&c.id, "key-1-g1", "ops", 4_000).await.unwrap();
    assert_eq!(
        (
            retried.state().unwrap(),
            retried.key.as_str(),
            retried.key_generation
        ),
        (EffectState::Absent, "key-1-g1", 1)
    );
    let next = s
        .claim("payments", "r", 10, LEASE, 4_000)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(
        (next.state().unwrap(), next.attempts),
        (EffectState::InFlight, 2)
    );
}

/// The consecutive-unavailable streak (migration 0021): raised by every call and every
/// status check that found the provider unavailable — neither of which counts as an
/// attempt or a check — and reset by anything else.
pub(crate) async fn the_unavailable_streak_grows_with_uncounted_failures_and_resets_after_others(
    t: TestDb,
) {
    let s = store(&t).await;
    enqueue(&s, "inv-s", "key-s").await;
    let claim = |now: i64| {
        let s = s.clone();
        async move {
            s.claim("payments", "r", 10, LEASE, now)
                .await
                .unwrap()
                .remove(0)
        }
    };
    let down = |at: i64| Settle::Unavailable {
        at,
        error: "connection refused".into(),
    };
    let mut now = 2_000;
    // Three refused calls: the streak is 1, 2, 3 and no attempt counted.
    for n in 1..=3 {
        let c = claim(now).await;
        assert_eq!((c.attempts, c.unavailable_streak), (1, n - 1));
        now += 100;
        let call = evidence(EvidenceKind::Call, "not_sent");
        settle(&t, &c, &down(now), &call, now).await;
        let e = s.get(&c.id).await.unwrap().unwrap();
        assert_eq!(
            (e.state().unwrap(), e.attempts, e.unavailable_streak),
            (EffectState::Pending, 0, n)
        );
    }
    // `Retry { counts: false }` is the same: raised, not counted.
    let c = claim(now).await;
    let wait = Settle::Retry {
        at: now + 100,
        error: "HTTP 429".into(),
        counts: false,
    };
    now += 100;
    settle(
        &t,
        &c,
        &wait,
        &evidence(EvidenceKind::Call, "retryable"),
        now,
    )
    .await;
    let e = s.get(&c.id).await.unwrap().unwrap();
    assert_eq!((e.attempts, e.unavailable_streak), (0, 4));
    // An unknown outcome resets it...
    let c = claim(now).await;
    let unknown = Settle::Unknown {
        at: now + 100,
        error: "timeout".into(),
    };
    now += 100;
    settle(
        &t,
        &c,
        &unknown,
        &evidence(EvidenceKind::Call, "unknown"),
        now,
    )
    .await;
    let e = s.get(&c.id).await.unwrap().unwrap();
    assert_eq!((e.attempts, e.unavailable_streak), (1, 0));
    // ... status checks that find the provider down raise it, stay unknown, count no check.
    for n in 1..=2 {
        let c = claim(now).await;
        assert_eq!(c.state().unwrap(), EffectState::Unknown);
        now += 100;
        let check = evidence(EvidenceKind::Status, "unavailable");
        settle(&t, &c, &down(now), &check, now).await;
        let e = s.get(&c.id).await.unwrap().unwrap();
        assert_eq!(
            (
                e.state().unwrap(),
                e.attempts,
                e.checks,
                e.unavailable_streak
            ),
            (EffectState::Unknown, 1, 0, n)
        );
    }
    // A check that reaches the provider counts, and resets the streak.
    let c = claim(now).await;
    let lagging = Settle::Unknown {
        at: now + 100,
        error: "the lookup may lag".into(),
    };
    now += 100;
    let check = evidence(EvidenceKind::Status, "not_yet_visible");
    settle(&t, &c, &lagging, &check, now).await;
    let e = s.get(&c.id).await.unwrap().unwrap();
    assert_eq!(
        (e.state().unwrap(), e.checks, e.unavailable_streak),
        (EffectState::Unknown, 1, 0)
    );
}

/// Giving up while the provider is down ([`Settle::GaveUpUnavailable`]) counts nothing
/// either: a call that was never sent is `failed` with its attempt taken back, an unknown
/// outcome whose status could not be asked goes to `needs_review` with no check counted.
pub(crate) async fn giving_up_while_the_provider_is_down_counts_nothing(t: TestDb) {
    let s = store(&t).await;
    let gave_up = Settle::GaveUpUnavailable {
        error: "deadline".into(),
    };
    enqueue(&s, "inv-g1", "key-g1").await;
    let c = s
        .claim("payments", "r", 10, LEASE, 2_000)
        .await
        .unwrap()
        .remove(0);
    settle(
        &t,
        &c,
        &gave_up,
        &evidence(EvidenceKind::Call, "not_sent"),
        2_100,
    )
    .await;
    let e = s.get(&c.id).await.unwrap().unwrap();
    assert_eq!((e.state().unwrap(), e.attempts), (EffectState::Failed, 0));
    enqueue(&s, "inv-g2", "key-g2").await;
    let c = s
        .claim("payments", "r", 10, LEASE, 3_000)
        .await
        .unwrap()
        .remove(0);
    let unknown = Settle::Unknown {
        at: 3_000,
        error: "timeout".into(),
    };
    settle(
        &t,
        &c,
        &unknown,
        &evidence(EvidenceKind::Call, "unknown"),
        3_000,
    )
    .await;
    let c = s
        .claim("payments", "r", 10, LEASE, 3_000)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(c.state().unwrap(), EffectState::Unknown);
    let check = evidence(EvidenceKind::Status, "unavailable");
    settle(&t, &c, &gave_up, &check, 3_100).await;
    let e = s.get(&c.id).await.unwrap().unwrap();
    assert_eq!(
        (e.state().unwrap(), e.attempts, e.checks),
        (EffectState::NeedsReview, 1, 0)
    );
}

oncely_testkit::matrix! {
    tests: [
        one_intent_per_reference_and_key,
        a_claim_starts_the_attempt_before_the_call_and_a_dead_runners_call_is_unknown,
        an_unavailable_provider_does_not_count_and_absent_resends_with_the_given_key,
        concurrent_runners_never_claim_one_effect_twice,
        claims_on_a_backlog_believed_empty_never_seq_scan,
        operator_retries_check_the_status_first_and_resolutions_are_audited,
        a_failed_effect_retried_is_resent_under_the_next_key,
        the_unavailable_streak_grows_with_uncounted_failures_and_resets_after_others,
        giving_up_while_the_provider_is_down_counts_nothing,
    ],
    cannot_apply: [
        // Plans from statistics: SQLite's claim is one statement on its single writer, and
        // MySQL's optimizer does not plan from a stale "empty" the way PostgreSQL's
        // generic plans do; the check reads PostgreSQL's pg_stat views.
        claims_on_a_backlog_believed_empty_never_seq_scan on sqlite,
        claims_on_a_backlog_believed_empty_never_seq_scan on mysql,
    ],
}
