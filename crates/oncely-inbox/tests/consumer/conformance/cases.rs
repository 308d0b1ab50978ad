//! The conformance cases, each generic over the broker fixture, with their helpers.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{Message, Requeue};
use oncely_core::{RetryBudget, RetryPolicy};
use oncely_inbox::{Consumer, ConsumerConfig, Handler};
use oncely_sql::{Database, DbOptions};
use oncely_testkit::FaultProxy;
use tokio_util::sync::CancellationToken;

use super::Fixture;
use crate::{distinct_orders, eventually, invoices, Billing};

fn message(f: &impl Fixture, order: &str, payload: &[u8]) -> Message {
    Message {
        topic: f.topic(),
        payload: payload.to_vec(),
        ..crate::order_message(order)
    }
}

fn config(retry: RetryPolicy) -> ConsumerConfig {
    ConsumerConfig {
        retry,
        ..crate::config()
    }
}

fn consumer<F: Fixture>(
    f: &F,
    group: &str,
    handler: Arc<Billing>,
    config: ConsumerConfig,
    settle: Duration,
) -> Consumer<F::S> {
    Consumer::new(f.db().clone(), f.subscriber(group, settle), handler, config)
}

pub(super) async fn s5_consumer_faulted_after_commit_before_ack_is_redelivered_and_creates_one_invoice<
    F: Fixture,
>(
    f: &F,
) {
    let settle = Duration::from_millis(1_500);
    let first_handler = Arc::new(Billing::new("billing"));
    let crashed = Arc::new(AtomicBool::new(false));
    let crash = crashed.clone();
    let first = consumer(f, "billing", first_handler.clone(), crate::config(), settle)
        // Faulted exactly after the commit and before the ack, once.
        .with_fault_after_commit(move |_| !crash.swap(true, Ordering::SeqCst));
    first.subscribe().await.unwrap();
    f.publish(&[message(f, "o-1", b"o-1")]).await;
    eventually(Duration::from_secs(15), || async {
        first.run_once().await.unwrap();
        first.stats().consumed() == 1
    })
    .await;
    assert!(
        crashed.load(Ordering::SeqCst),
        "the fault point was reached"
    );
    assert_eq!(invoices(f.db(), "billing").await, 1);
    // The process dies: its connection goes (RabbitMQ requeues its unacknowledged
    // delivery; the SQL lease and JetStream ack_wait run out).
    first.close().await;
    drop(first);

    let handler = Arc::new(Billing::new("billing"));
    let second = consumer(f, "billing", handler.clone(), crate::config(), settle);
    second.subscribe().await.unwrap();
    eventually(Duration::from_secs(20), || async {
        second.run_once().await.unwrap();
        second.stats().duplicates() == 1
    })
    .await;
    assert_eq!(invoices(f.db(), "billing").await, 1, "one invoice");
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        0,
        "handler not run again"
    );
    assert_eq!(second.stats().consumed(), 0);
    // Acknowledged now: nothing comes again after another settle period.
    let until = tokio::time::Instant::now() + settle + Duration::from_millis(700);
    while tokio::time::Instant::now() < until {
        second.run_once().await.unwrap();
    }
    assert_eq!(
        second.stats().duplicates(),
        1,
        "acknowledged, not redelivered"
    );
    assert_eq!(first_handler.calls.load(Ordering::SeqCst), 1);
    second.close().await;
}

pub(super) async fn same_message_at_two_consumer_instances_at_once_yields_one_invoice<
    F: Fixture,
>(
    f: &F,
) {
    // Deliveries outlive their settle time while the slow handler runs, so the same
    // message is also redelivered to the other instance while the first still holds it
    // (on RabbitMQ and JetStream a second published copy makes the same point).
    let settle = Duration::from_millis(500);
    let handler = Arc::new(Billing {
        delay: Duration::from_millis(1_200),
        ..Billing::new("billing")
    });
    let a = consumer(f, "billing", handler.clone(), crate::config(), settle);
    let b = consumer(f, "billing", handler.clone(), crate::config(), settle);
    a.subscribe().await.unwrap();
    b.subscribe().await.unwrap();
    let orders: Vec<Message> = (0..3)
        .map(|i| message(f, &format!("o-{i}"), format!("o-{i}").as_bytes()))
        .collect();
    f.publish(&orders).await;
    let mut copies = 0;
    for m in &orders {
        if f.publish_copy(m).await {
            copies += 1;
        }
    }
    let (sa, sb) = (a.stats(), b.stats());
    if copies == 0 {
        // The SQL transport keeps one delivery per group and message: hand each claimed
        // delivery to both instances at the same moment.
        assert_eq!(f.process_on_both(&a, &b).await, 3);
    } else {
        let shutdown = CancellationToken::new();
        let runs = [
            tokio::spawn(a.run(shutdown.clone())),
            tokio::spawn(b.run(shutdown.clone())),
        ];
        eventually(Duration::from_secs(30), || async {
            sa.consumed() + sb.consumed() == 3 && sa.duplicates() + sb.duplicates() >= copies
        })
        .await;
        // Late redeliveries (settle time ran out during the slow handler) come in too.
        tokio::time::sleep(settle * 3).await;
        shutdown.cancel();
        for r in runs {
            r.await.unwrap();
        }
    }
    assert!(
        sa.duplicates() + sb.duplicates() >= 3,
        "every copy recognised"
    );
    assert!(copies == 0 || copies == 3);
    assert_eq!(
        invoices(f.db(), "billing").await,
        3,
        "one invoice per order"
    );
    assert_eq!(distinct_orders(f.db(), "billing").await, 3);
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        3,
        "one effect per message"
    );
    assert_eq!(sa.consumed() + sb.consumed(), 3);
}

pub(super) async fn handler_failing_twice_then_succeeding_yields_one_invoice_after_two_delayed_retries_sent_to_that_group_only<
    F: Fixture,
>(
    f: &F,
) {
    let retry = RetryPolicy {
        base: Duration::from_millis(300),
        cap: Duration::from_secs(1),
        max_attempts: 5,
        ..RetryPolicy::default()
    };
    let billing_handler = Arc::new(Billing {
        fail_first: AtomicU32::new(2),
        ..Billing::new("billing")
    });
    let audit_handler = Arc::new(Billing::new("audit"));
    let settle = Duration::from_secs(30);
    let billing = consumer(f, "billing", billing_handler.clone(), config(retry), settle);
    let audit = consumer(f, "audit", audit_handler.clone(), config(retry), settle);
    billing.subscribe().await.unwrap();
    audit.subscribe().await.unwrap();
    f.publish(&[message(f, "o-1", b"o-1")]).await;
    let (bs, au) = (billing.stats(), audit.stats());
    let shutdown = CancellationToken::new();
    let runs = [
        tokio::spawn(billing.run(shutdown.clone())),
        tokio::spawn(audit.run(shutdown.clone())),
    ];
    eventually(Duration::from_secs(20), || async {
        invoices(f.db(), "billing").await == 1
    })
    .await;
    // Time for a stray copy to reach audit, were the retries fanned out again.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    shutdown.cancel();
    for r in runs {
        r.await.unwrap();
    }
    assert_eq!(invoices(f.db(), "billing").await, 1);
    assert_eq!(billing_handler.calls.load(Ordering::SeqCst), 3);
    assert_eq!(bs.retries(), 2, "two delayed retries");
    assert_eq!(bs.consumed(), 1);
    assert_eq!(bs.dead_lettered(), 0);
    // The retries went to billing only.
    assert_eq!(audit_handler.calls.load(Ordering::SeqCst), 1);
    assert_eq!(au.consumed(), 1);
    assert_eq!(au.duplicates(), 0, "audit was not sent the retries");
    assert_eq!(invoices(f.db(), "audit").await, 1);
}

pub(super) async fn always_failing_handler_ends_in_the_dead_letter_destination_with_its_error_while_others_flow<
    F: Fixture,
>(
    f: &F,
) {
    let retry = RetryPolicy {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(100),
        max_attempts: 3,
        ..RetryPolicy::default()
    };
    let handler = Arc::new(Billing::new("billing"));
    let c = consumer(
        f,
        "billing",
        handler,
        config(retry),
        Duration::from_secs(30),
    );
    c.subscribe().await.unwrap();
    let poison = message(f, "poison", b"poison");
    // The poison message comes first; the others must not wait behind it.
    f.publish(std::slice::from_ref(&poison)).await;
    let orders: Vec<Message> = (0..10)
        .map(|i| message(f, &format!("o-{i}"), format!("o-{i}").as_bytes()))
        .collect();
    f.publish(&orders).await;
    let stats = c.stats();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(c.run(shutdown.clone()));
    eventually(Duration::from_secs(20), || async {
        invoices(f.db(), "billing").await == 10 && stats.dead_lettered() == 1
    })
    .await;
    shutdown.cancel();
    run.await.unwrap();
    let dead = f.dead_letters("billing").await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].id, Some(poison.id));
    assert_eq!(dead[0].attempts, 3);
    assert!(dead[0].error.contains("poison pill"), "{dead:?}");
    assert_eq!(stats.retries(), 2);
    assert_eq!(stats.consumed(), 10);
    assert_eq!(distinct_orders(f.db(), "billing").await, 10);
}

pub(super) async fn rejected_and_undecodable_messages_are_dead_lettered_at_once<F: Fixture>(f: &F) {
    let retry = RetryPolicy {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(100),
        max_attempts: 5,
        ..RetryPolicy::default()
    };
    // The test handler rejects a payload it cannot decode (`{not json`).
    let c = consumer(
        f,
        "billing",
        Arc::new(Billing::new("billing")),
        config(retry),
        Duration::from_secs(30),
    );
    c.subscribe().await.unwrap();
    let bad = message(f, "bad", b"{not json");
    f.publish(std::slice::from_ref(&bad)).await;
    let undecodable = f.publish_undecodable().await;
    let expected = if undecodable { 2 } else { 1 };
    eventually(Duration::from_secs(15), || async {
        c.run_once().await.unwrap();
        c.stats().dead_lettered() == expected
    })
    .await;
    assert_eq!(c.stats().retries(), 0, "no retry for what cannot decode");
    let dead = f.dead_letters("billing").await;
    assert_eq!(dead.len(), expected as usize, "{dead:?}");
    let rejected = dead.iter().find(|d| d.id == Some(bad.id)).unwrap();
    assert_eq!(rejected.attempts, 1);
    assert!(rejected.error.contains("cannot decode"), "{dead:?}");
    if undecodable {
        let raw = dead.iter().find(|d| d.id.is_none()).unwrap();
        assert!(raw.error.contains("undecodable"), "{dead:?}");
    }
    c.close().await;
}

/// The operator's fallback for a handler bug (issue 19 §3): while the handler refuses
/// every message for good, the message lands in group `billing`'s dead letters, listed
/// with its id, one attempt and the error, and group `audit` handles it normally. The
/// handler is fixed and the letter requeued: `billing` processes it once (one invoice),
/// the list no longer shows it, a second requeue finds nothing, and `audit` never sees
/// it again.
pub(super) async fn refused_message_requeued_after_the_handler_is_fixed_is_processed_once_by_its_group_only<
    F: Fixture,
>(
    f: &F,
) {
    let admin = f.dead_letter_admin();
    let billing_handler = Arc::new(Billing {
        refuse: AtomicBool::new(true),
        ..Billing::new("billing")
    });
    let audit_handler = Arc::new(Billing::new("audit"));
    let settle = Duration::from_secs(30);
    let retry = RetryPolicy {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(100),
        max_attempts: 5,
        ..RetryPolicy::default()
    };
    let billing = consumer(f, "billing", billing_handler.clone(), config(retry), settle);
    let audit = consumer(f, "audit", audit_handler.clone(), config(retry), settle);
    billing.subscribe().await.unwrap();
    audit.subscribe().await.unwrap();
    let m = message(f, "o-1", b"o-1");
    f.publish(std::slice::from_ref(&m)).await;
    let (bs, au) = (billing.stats(), audit.stats());
    let shutdown = CancellationToken::new();
    let runs = [
        tokio::spawn(billing.run(shutdown.clone())),
        tokio::spawn(audit.run(shutdown.clone())),
    ];
    eventually(Duration::from_secs(20), || async {
        bs.dead_lettered() == 1 && invoices(f.db(), "audit").await == 1
    })
    .await;
    let listed = {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let l = admin.list("billing", 10, None).await.unwrap();
            if !l.is_empty() || tokio::time::Instant::now() > deadline {
                break l;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].message_id, Some(m.id));
    assert_eq!(listed[0].attempts, 1);
    assert!(
        listed[0]
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("refused: handler bug")),
        "{listed:?}"
    );
    assert_eq!(invoices(f.db(), "billing").await, 0);

    billing_handler.refuse.store(false, Ordering::SeqCst);
    assert_eq!(
        admin
            .requeue("billing", Requeue::Message(m.id))
            .await
            .unwrap(),
        1
    );
    eventually(Duration::from_secs(20), || async {
        invoices(f.db(), "billing").await == 1
    })
    .await;
    // Time for a stray copy to reach either group, were the requeue fanned out.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    shutdown.cancel();
    for r in runs {
        r.await.unwrap();
    }
    assert!(admin.list("billing", 10, None).await.unwrap().is_empty());
    assert_eq!(
        admin
            .requeue("billing", Requeue::Message(m.id))
            .await
            .unwrap(),
        0,
        "nothing dead any more"
    );
    assert_eq!(invoices(f.db(), "billing").await, 1, "one invoice");
    assert_eq!(billing_handler.calls.load(Ordering::SeqCst), 2);
    assert_eq!(bs.consumed(), 1);
    assert_eq!(bs.dead_lettered(), 1);
    assert_eq!(audit_handler.calls.load(Ordering::SeqCst), 1);
    assert_eq!(au.duplicates(), 0, "audit was not sent the requeue");
    assert_eq!(invoices(f.db(), "audit").await, 1);
    admin.close().await;
}

/// The consumer's database (PostgreSQL or MariaDB, behind a [`FaultProxy`]) is cut for
/// 6 s — far longer than the consumer's retry schedule (3 attempts, 20 ms doubling to
/// 100 ms) — while messages are mid-transaction (the handler takes 300 ms) and while
/// more arrive. An unreachable database is no fault of the message: nothing is counted
/// as an attempt, nothing is dead-lettered, and once the database is back each order
/// has exactly one invoice. On the SQL transport the queue lives in that same
/// database, so the outage also stops receiving: messages wait in the queue table and
/// the transactions in hand are held like on the brokers. On JetStream the settle time
/// (`ack_wait`) is 3 s, shorter than the outage: the held messages are kept by
/// in-progress acks. (Before the fix: a held-up handler insert counted as an attempt
/// and went dead within the schedule, and a failed begin left the delivery unsettled.)
pub(super) async fn database_outage_longer_than_the_retry_schedule_dead_letters_nothing_and_bills_each_order_once<
    F: Fixture,
>(
    f: &F,
) {
    let retry = RetryPolicy {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(100),
        max_attempts: 3,
        ..RetryPolicy::default()
    };
    let (proxy, via) = FaultProxy::in_front_of(f.url()).await;
    let options = DbOptions {
        max_connections: 4,
        acquire_timeout: Duration::from_secs(1),
        ..DbOptions::default()
    };
    let db = Database::connect(&via, &options)
        .await
        .expect("connect via proxy");
    let handler = Arc::new(Billing {
        delay: Duration::from_millis(300),
        ..Billing::new("billing")
    });
    let mut config = config(retry);
    config.outage.cap = Duration::from_millis(300);
    // A budget for four outage retries, shared by every held message: the outage
    // spends it (the holds then probe at the cap, not each on its own schedule), the
    // transactions that go through after it refill it.
    let budget = Arc::new(RetryBudget::new(4 * RetryBudget::RETRY_COST));
    config.budget = budget.clone();
    let settle = Duration::from_secs(3);
    let subscriber = f.subscriber_via(&db, "billing", settle);
    let c = Consumer::new(db, subscriber, handler as Arc<dyn Handler>, config);
    c.subscribe().await.unwrap();
    let batch = |range: std::ops::Range<usize>| -> Vec<Message> {
        range
            .map(|i| message(f, &format!("o-{i}"), format!("o-{i}").as_bytes()))
            .collect()
    };
    let stats = c.stats();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(c.run(shutdown.clone()));
    f.publish(&batch(0..10)).await;
    eventually(Duration::from_secs(20), || async {
        invoices(f.db(), "billing").await == 10
    })
    .await;
    f.publish(&batch(10..20)).await;
    // Let the first of them begin their transactions, then cut mid-transaction.
    tokio::time::sleep(Duration::from_millis(150)).await;
    proxy.cut();
    f.publish(&batch(20..30)).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(stats.dead_lettered(), 0, "dead-lettered during the outage");
    assert_eq!(stats.retries(), 0, "an outage counted as a failed attempt");
    assert!(f.dead_letters("billing").await.is_empty());
    assert_eq!(budget.available(), 0, "the held messages spent the budget");
    proxy.restore();
    eventually(Duration::from_secs(30), || async {
        invoices(f.db(), "billing").await >= 30
    })
    .await;
    assert!(
        budget.available() >= RetryBudget::RETRY_COST,
        "the transactions after the outage refill the budget ({})",
        budget.available()
    );
    // Redelivered copies (if any) must find the inbox row, not bill twice.
    tokio::time::sleep(Duration::from_secs(1)).await;
    shutdown.cancel();
    run.await.unwrap();
    assert_eq!(
        invoices(f.db(), "billing").await,
        30,
        "one invoice per order"
    );
    assert_eq!(distinct_orders(f.db(), "billing").await, 30);
    assert_eq!(stats.dead_lettered(), 0);
    assert_eq!(stats.retries(), 0);
    assert!(f.dead_letters("billing").await.is_empty());
}
