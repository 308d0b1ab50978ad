//! Inbox consumer on the SQL transport on every backend, then (`conformance`) the same
//! cases on every backend × broker (real servers, real concurrency). The test handler writes one row per effect into `test_invoices`, which has
//! *no* unique constraint: only the inbox stands between a redelivery and a second invoice,
//! so each test fails if the inbox does not hold. (The order service's own `billing`
//! consumer is tested in apps/orders.)

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{
    BoxFuture, Message, Publisher, ReceivedMessage, SqlSubscriber, SqlTransport, Subscriber,
};
use oncely_core::{MessageId, RetryPolicy};
use oncely_inbox::{
    Consumer, ConsumerConfig, Handler, HandlerError, Processed, Rejected, SqlConsumer,
};
use oncely_sql::{on_pool, on_tx, Database, Tx};
use oncely_testkit::TestDb;
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "orders";

/// Writes an invoice row per handled message; fails `fail_first` times first, always fails
/// on a payload of `poison`; sleeps `delay` inside the transaction.
#[derive(Debug, Default)]
struct Billing {
    consumer: String,
    /// Refuses every message for good ([`Rejected`]) while set: a handler bug an operator
    /// fixes, then requeues the dead letters.
    refuse: AtomicBool,
    fail_first: AtomicU32,
    delay: Duration,
    calls: AtomicU32,
}

impl Billing {
    fn new(consumer: &str) -> Self {
        Self {
            consumer: consumer.to_owned(),
            ..Self::default()
        }
    }
}

impl Handler for Billing {
    fn handle<'a>(
        &'a self,
        tx: &'a mut Tx,
        message: &'a ReceivedMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if !self.delay.is_zero() {
                tokio::time::sleep(self.delay).await;
            }
            assert!(message.payload != b"panic", "handler bug on purpose");
            if self.refuse.load(Ordering::SeqCst) {
                return Err(Rejected("refused: handler bug".to_owned()).into());
            }
            if message.payload == b"poison" {
                return Err("poison pill: no such order".into());
            }
            // No retry can decode it: dead at once.
            if message.payload.starts_with(b"{not json") {
                return Err(Rejected("cannot decode the payload".to_owned()).into());
            }
            if self
                .fail_first
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err("transient failure: ledger unavailable".into());
            }
            let order = String::from_utf8_lossy(&message.payload).into_owned();
            let id = message.id.to_string();
            on_tx!(tx, |c| sqlx::query(&oncely_sql::sql_text(
                c,
                "INSERT INTO test_invoices (consumer, order_id, message_id) VALUES ($1, $2, $3)"
            ))
            .bind(&self.consumer)
            .bind(&order)
            .bind(&id)
            .execute(c)
            .await
            .map(|_| ()))?;
            Ok(())
        })
    }
}

pub(crate) async fn setup(t: &TestDb) -> SqlTransport {
    t.db.migrate().await.unwrap();
    let mut tx = t.db.begin().await.unwrap();
    {
        let tx = &mut tx;
        on_tx!(tx, |c| sqlx::query(
            "CREATE TABLE test_invoices (consumer TEXT NOT NULL, order_id TEXT NOT NULL, \
             message_id TEXT NOT NULL)"
        )
        .execute(c)
        .await
        .map(|_| ()))
        .unwrap();
    }
    tx.commit().await.unwrap();
    SqlTransport::new(t.db.clone(), 1 << 20)
}

const LEASE: Duration = Duration::from_secs(30);

/// A consumer of group `name` on the SQL transport.
fn sql_consumer(
    db: &Database,
    transport: &SqlTransport,
    name: &str,
    handler: Arc<dyn Handler>,
    config: ConsumerConfig,
    lease: Duration,
) -> SqlConsumer {
    Consumer::new(
        db.clone(),
        SqlSubscriber::new(transport.clone(), name, TOPIC, lease),
        handler,
        config,
    )
}

fn config() -> ConsumerConfig {
    ConsumerConfig {
        concurrency: 4,
        batch: 16,
        poll: Duration::from_millis(10),
        retry: RetryPolicy {
            base: Duration::from_millis(50),
            cap: Duration::from_millis(200),
            max_attempts: 5,
            ..RetryPolicy::default()
        },
        ..ConsumerConfig::default()
    }
}

fn order_message(order: &str) -> Message {
    Message {
        id: MessageId::derive_from_parts(&["test-order", order]),
        topic: TOPIC.to_owned(),
        partition_key: order.to_owned(),
        event_type: "order.created".to_owned(),
        payload: order.as_bytes().to_vec(),
        headers: std::collections::BTreeMap::new(),
    }
}

async fn publish(t: &SqlTransport, orders: &[&str]) {
    let batch: Vec<Message> = orders.iter().map(|o| order_message(o)).collect();
    for r in t.publish(&batch).await {
        r.expect("queued");
    }
}

async fn scalar(db: &Database, sql: &str, consumer: &str) -> i64 {
    on_pool!(db, |p| sqlx::query_scalar::<_, i64>(&oncely_sql::sql_text(
        p, sql
    ))
    .bind(consumer)
    .fetch_one(p)
    .await)
    .unwrap()
}

async fn invoices(db: &Database, consumer: &str) -> i64 {
    scalar(
        db,
        "SELECT COUNT(*) FROM test_invoices WHERE consumer = $1",
        consumer,
    )
    .await
}

async fn distinct_orders(db: &Database, consumer: &str) -> i64 {
    scalar(
        db,
        "SELECT COUNT(DISTINCT order_id) FROM test_invoices WHERE consumer = $1",
        consumer,
    )
    .await
}

async fn open_deliveries(db: &Database, consumer: &str) -> i64 {
    scalar(
        db,
        "SELECT COUNT(*) FROM oncely_deliveries WHERE consumer = $1 AND state = 'pending'",
        consumer,
    )
    .await
}

/// Runs `step` until `done` holds or `within` passes.
async fn eventually<F, Fut>(within: Duration, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

oncely_testkit::matrix! {
    tests: [
        s5_consumer_killed_after_commit_before_ack_causes_no_second_invoice,
        same_message_delivered_to_two_consumer_instances_at_once_yields_one_invoice,
        handler_failing_twice_then_succeeding_creates_one_invoice_after_two_delayed_retries_for_that_consumer_only,
        always_failing_handler_ends_dead_with_its_error_while_other_messages_flow,
        two_running_instances_of_one_group_bill_every_order_once,
        panicking_handler_counts_as_a_failed_attempt_and_ends_dead,
        fanned_out_queue_rows_are_collected_in_batches_and_unsubscribed_topics_kept,
    ],
}

async fn s5_consumer_killed_after_commit_before_ack_causes_no_second_invoice(t: TestDb) {
    let transport = setup(&t).await;
    let handler = Arc::new(Billing::new("billing"));
    let crashed = Arc::new(AtomicBool::new(false));
    let crash = crashed.clone();
    let consumer = sql_consumer(
        &t.db,
        &transport,
        "billing",
        handler.clone(),
        config(),
        Duration::from_millis(1_500),
    )
    // Faulted exactly after the commit and before the ack, once.
    .with_fault_after_commit(move |_| !crash.swap(true, Ordering::SeqCst));
    consumer.subscribe().await.unwrap();
    publish(&transport, &["o-1"]).await;

    assert_eq!(consumer.run_once().await.unwrap(), 1);
    assert!(
        crashed.load(Ordering::SeqCst),
        "the fault point was reached"
    );
    assert_eq!(invoices(&t.db, "billing").await, 1);
    assert_eq!(
        open_deliveries(&t.db, "billing").await,
        1,
        "not acknowledged"
    );
    // Leased: not delivered again before the lease runs out.
    assert_eq!(consumer.run_once().await.unwrap(), 0);

    tokio::time::sleep(Duration::from_millis(1_600)).await;
    assert_eq!(
        consumer.run_once().await.unwrap(),
        1,
        "redelivered after the lease"
    );
    assert_eq!(invoices(&t.db, "billing").await, 1, "one invoice");
    assert_eq!(
        consumer.stats().duplicates(),
        1,
        "the duplicate counter moved"
    );
    assert_eq!(consumer.stats().consumed(), 1);
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        1,
        "handler not run again"
    );
    assert_eq!(
        open_deliveries(&t.db, "billing").await,
        0,
        "acknowledged now"
    );
}

async fn same_message_delivered_to_two_consumer_instances_at_once_yields_one_invoice(t: TestDb) {
    let transport = setup(&t).await;
    let instance = || {
        sql_consumer(
            &t.db,
            &transport,
            "billing",
            Arc::new(Billing {
                delay: Duration::from_millis(100),
                ..Billing::new("billing")
            }),
            config(),
            LEASE,
        )
    };
    let (a, b) = (instance(), instance());
    a.subscribe().await.unwrap();
    let orders: Vec<String> = (0..8).map(|i| format!("o-{i}")).collect();
    publish(
        &transport,
        &orders.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;

    let deliveries = a.subscriber().receive(100, Duration::ZERO).await.unwrap();
    assert_eq!(deliveries.len(), 8);
    // Each delivery handed to both instances at the same moment.
    let runs = deliveries.into_iter().map(|d| {
        let (a, b) = (&a, &b);
        async move { tokio::join!(a.process(d.clone()), b.process(d)) }
    });
    let outcomes = futures_util::future::join_all(runs).await;
    for (x, y) in outcomes {
        let mut pair = [x, y];
        pair.sort_by_key(|p| format!("{p:?}"));
        assert_eq!(pair, [Processed::Consumed, Processed::Duplicate]);
    }
    assert_eq!(invoices(&t.db, "billing").await, 8, "one invoice per order");
    assert_eq!(distinct_orders(&t.db, "billing").await, 8);
    assert_eq!(a.stats().duplicates() + b.stats().duplicates(), 8);
    assert_eq!(open_deliveries(&t.db, "billing").await, 0);
}

async fn handler_failing_twice_then_succeeding_creates_one_invoice_after_two_delayed_retries_for_that_consumer_only(
    t: TestDb,
) {
    let transport = setup(&t).await;
    let billing_handler = Arc::new(Billing {
        fail_first: AtomicU32::new(2),
        ..Billing::new("billing")
    });
    let audit_handler = Arc::new(Billing::new("audit"));
    let cfg = ConsumerConfig {
        retry: RetryPolicy {
            base: Duration::from_millis(300),
            cap: Duration::from_secs(1),
            max_attempts: 5,
            ..RetryPolicy::default()
        },
        ..config()
    };
    let billing = sql_consumer(
        &t.db,
        &transport,
        "billing",
        billing_handler.clone(),
        cfg.clone(),
        LEASE,
    );
    let audit = sql_consumer(
        &t.db,
        &transport,
        "audit",
        audit_handler.clone(),
        cfg.clone(),
        LEASE,
    );
    billing.subscribe().await.unwrap();
    audit.subscribe().await.unwrap();
    publish(&transport, &["o-1"]).await;

    // Both groups receive the message; audit succeeds at once, billing fails.
    assert_eq!(audit.run_once().await.unwrap(), 1);
    let before = oncely_core::now_ms();
    assert_eq!(billing.run_once().await.unwrap(), 1);
    assert_eq!(invoices(&t.db, "billing").await, 0, "rolled back");
    let (attempts, error, available_at): (i32, Option<String>, i64) =
        on_pool!(&t.db, |p| sqlx::query_as(&oncely_sql::sql_text(
            p,
            "SELECT attempts, last_error, available_at FROM oncely_deliveries WHERE consumer = $1"
        ))
        .bind("billing")
        .fetch_one(p)
        .await)
        .unwrap();
    assert_eq!(attempts, 1);
    assert!(error.unwrap().contains("ledger unavailable"));
    // Full jitter: the retry waits somewhere in [0, base].
    assert!(available_at >= before && available_at <= oncely_core::now_ms() + 300);

    eventually(Duration::from_secs(10), || async {
        billing.run_once().await.unwrap();
        invoices(&t.db, "billing").await == 1
    })
    .await;
    assert_eq!(billing_handler.calls.load(Ordering::SeqCst), 3);
    assert_eq!(billing.stats().retries(), 2, "two delayed retries");
    assert_eq!(billing.stats().consumed(), 1);
    assert_eq!(open_deliveries(&t.db, "billing").await, 0);
    // The retries went to billing only.
    assert_eq!(audit.run_once().await.unwrap(), 0);
    assert_eq!(audit_handler.calls.load(Ordering::SeqCst), 1);
    assert_eq!(invoices(&t.db, "audit").await, 1);
}

async fn always_failing_handler_ends_dead_with_its_error_while_other_messages_flow(t: TestDb) {
    let transport = setup(&t).await;
    let handler = Arc::new(Billing::new("billing"));
    let consumer = sql_consumer(
        &t.db,
        &transport,
        "billing",
        handler.clone(),
        ConsumerConfig {
            retry: RetryPolicy {
                base: Duration::from_millis(20),
                cap: Duration::from_millis(100),
                max_attempts: 3,
                ..RetryPolicy::default()
            },
            ..config()
        },
        LEASE,
    );
    consumer.subscribe().await.unwrap();
    let stats = consumer.stats();
    // The poison message comes first; the others must not wait behind it.
    transport
        .publish(&[Message {
            payload: b"poison".to_vec(),
            ..order_message("poison")
        }])
        .await
        .into_iter()
        .for_each(|r| r.unwrap());
    let orders: Vec<String> = (0..20).map(|i| format!("o-{i}")).collect();
    publish(
        &transport,
        &orders.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;

    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    eventually(Duration::from_secs(15), || async {
        invoices(&t.db, "billing").await == 20 && stats.dead_lettered() == 1
    })
    .await;
    shutdown.cancel();
    running.await.unwrap();

    let dead = transport.dead_deliveries("billing", 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, order_message("poison").id);
    assert_eq!(dead[0].attempts, 3);
    assert!(dead[0]
        .last_error
        .as_deref()
        .unwrap()
        .contains("poison pill"));
    assert_eq!(stats.retries(), 2);
    assert_eq!(stats.consumed(), 20);
    assert_eq!(distinct_orders(&t.db, "billing").await, 20);
    assert_eq!(open_deliveries(&t.db, "billing").await, 0);

    // An operator requeues it: pending again, attempts reset, delivered again.
    let other = MessageId::new_random();
    assert_eq!(
        transport
            .requeue_dead("billing", Some(&other))
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        transport
            .requeue_dead("billing", Some(&dead[0].id))
            .await
            .unwrap(),
        1
    );
    assert_eq!(open_deliveries(&t.db, "billing").await, 1);
    let again = transport
        .claim("billing", 10, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].attempts, 0);
    assert!(transport
        .dead_deliveries("billing", 10)
        .await
        .unwrap()
        .is_empty());
}

async fn two_running_instances_of_one_group_bill_every_order_once(t: TestDb) {
    let transport = setup(&t).await;
    let handler = Arc::new(Billing {
        delay: Duration::from_millis(2),
        ..Billing::new("billing")
    });
    let instance = || {
        sql_consumer(
            &t.db,
            &transport,
            "billing",
            handler.clone(),
            ConsumerConfig {
                batch: 4,
                ..config()
            },
            LEASE,
        )
    };
    let (a, b) = (instance(), instance());
    a.subscribe().await.unwrap();
    let (sa, sb) = (a.stats(), b.stats());
    let shutdown = CancellationToken::new();
    let runs = [
        tokio::spawn(a.run(shutdown.clone())),
        tokio::spawn(b.run(shutdown.clone())),
    ];
    let orders: Vec<String> = (0..100).map(|i| format!("o-{i}")).collect();
    for chunk in orders.chunks(10) {
        publish(
            &transport,
            &chunk.iter().map(String::as_str).collect::<Vec<_>>(),
        )
        .await;
    }
    eventually(Duration::from_secs(20), || async {
        sa.consumed() + sb.consumed() == 100
    })
    .await;
    shutdown.cancel();
    for r in runs {
        r.await.unwrap();
    }
    assert_eq!(invoices(&t.db, "billing").await, 100);
    assert_eq!(distinct_orders(&t.db, "billing").await, 100);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 100);
    assert_eq!(open_deliveries(&t.db, "billing").await, 0);
}

async fn panicking_handler_counts_as_a_failed_attempt_and_ends_dead(t: TestDb) {
    let transport = setup(&t).await;
    let consumer = sql_consumer(
        &t.db,
        &transport,
        "billing",
        Arc::new(Billing::new("billing")),
        ConsumerConfig {
            retry: RetryPolicy {
                base: Duration::from_millis(10),
                cap: Duration::from_millis(10),
                max_attempts: 2,
                ..RetryPolicy::default()
            },
            ..config()
        },
        LEASE,
    );
    consumer.subscribe().await.unwrap();
    for r in transport
        .publish(&[Message {
            payload: b"panic".to_vec(),
            ..order_message("p-1")
        }])
        .await
    {
        r.unwrap();
    }
    let mut d = consumer
        .subscriber()
        .receive(1, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(consumer.process(d.remove(0)).await, Processed::Retried);
    eventually(Duration::from_secs(5), || async {
        consumer.run_once().await.unwrap();
        consumer.stats().dead_lettered() == 1
    })
    .await;
    let dead = transport.dead_deliveries("billing", 10).await.unwrap();
    assert_eq!(dead[0].attempts, 2);
    assert!(dead[0]
        .last_error
        .as_deref()
        .unwrap()
        .contains("handler panicked: handler bug on purpose"));
}

async fn fanned_out_queue_rows_are_collected_in_batches_and_unsubscribed_topics_kept(t: TestDb) {
    let transport = setup(&t).await;
    transport.subscribe("billing", TOPIC).await.unwrap();
    publish(&transport, &["a", "b", "c"]).await;
    let other: Vec<Message> = ["x", "y"]
        .iter()
        .map(|o| Message {
            topic: "unsubscribed".to_owned(),
            ..order_message(o)
        })
        .collect();
    for r in transport.publish(&other).await {
        r.unwrap();
    }
    let later = oncely_core::now_ms() + 1_000;
    assert_eq!(transport.collect_fanned_out(later, 2).await.unwrap(), 2);
    assert_eq!(transport.collect_fanned_out(later, 2).await.unwrap(), 1);
    assert_eq!(transport.collect_fanned_out(later, 2).await.unwrap(), 0);
    // Counted rather than read back: MySQL's binary-collated `topic` decodes as bytes.
    let left: (i64, i64) = on_pool!(&t.db, |p| sqlx::query_as(
        "SELECT COUNT(*), COUNT(CASE WHEN topic = 'unsubscribed' THEN 1 END) FROM oncely_queue"
    )
    .fetch_one(p)
    .await)
    .unwrap();
    assert_eq!(left, (2, 2), "only the unsubscribed topic's rows are left");
    assert_eq!(open_deliveries(&t.db, "billing").await, 3, "copies stay");
    // Rows younger than the window stay.
    publish(&transport, &["d"]).await;
    assert_eq!(
        transport
            .collect_fanned_out(oncely_core::now_ms() - 60_000, 10)
            .await
            .unwrap(),
        0
    );
}

// ---------------------------------------------------------------------------------------
// Conformance: the same cases on every broker (SQL transport, RabbitMQ, NATS JetStream, Kafka) and
// every backend (SQLite, PostgreSQL, MariaDB / MySQL), as `conformance::<backend>::<broker>::…`.
// Each test gets its own database, and its own broker
// namespace (RabbitMQ exchange and queues, JetStream streams, all named with a uuid), so
// tests run in parallel without seeing each other.
// ---------------------------------------------------------------------------------------

#[path = "consumer/conformance.rs"]
mod conformance;
