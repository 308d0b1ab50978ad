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

mod conformance {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use lapin::options::{BasicGetOptions, ExchangeDeleteOptions};
    use oncely_broker::{
        retry_headers, DeadLetters, KafkaConfig, KafkaDeadLetters, KafkaDeadLettersConfig,
        KafkaPublisher, KafkaSubscriber, KafkaSubscriberConfig, Message, NatsConfig,
        NatsDeadLetters, NatsDeadLettersConfig, NatsPublisher, NatsSubscriber,
        NatsSubscriberConfig, Publisher, RabbitMqConfig, RabbitMqDeadLetters,
        RabbitMqDeadLettersConfig, RabbitMqPublisher, RabbitMqSubscriber, RabbitMqSubscriberConfig,
        Requeue, SqlDeadLetters, SqlSubscriber, SqlTransport, Subscriber,
    };
    use oncely_core::{MessageId, RetryBudget, RetryPolicy};
    use oncely_inbox::{Consumer, ConsumerConfig, Handler, Processed};
    use oncely_sql::{Database, DbOptions};
    use oncely_testkit::{
        amqp_url, kafka_brokers, kafka_url, matrix, nats_url, service_reachable, FaultProxy,
        TestBackend, TestDb,
    };
    use tokio_util::sync::CancellationToken;

    use super::{distinct_orders, eventually, invoices, Billing};

    /// One dead letter as its destination holds it.
    #[derive(Debug)]
    pub(super) struct DeadLetter {
        id: Option<MessageId>,
        attempts: u32,
        error: String,
    }

    /// A broker under test, on one test database.
    pub(super) trait Fixture: Sync {
        type S: Subscriber;
        fn db(&self) -> &Database;
        /// The topic messages go to.
        fn topic(&self) -> String;
        /// A new subscriber (own connection) of consumer group `group`; `settle` is the
        /// time after which an unacknowledged delivery comes again (SQL lease, JetStream
        /// `ack_wait`; RabbitMQ redelivers when the connection closes).
        fn subscriber(&self, group: &str, settle: Duration) -> Self::S;
        /// The test database's URL (reaches it from another pool).
        fn url(&self) -> &str;
        /// As [`Fixture::subscriber`], whose store is `db` where the transport lives in the
        /// database (the SQL transport); brokers ignore `db`.
        fn subscriber_via(&self, db: &Database, group: &str, settle: Duration) -> Self::S {
            let _ = db;
            self.subscriber(group, settle)
        }
        async fn publish(&self, batch: &[Message]);
        /// Publishes a second copy of `m` (same message id) as a republishing relay would;
        /// `false` where the transport cannot hold one (the SQL transport keeps one delivery
        /// per group and message).
        async fn publish_copy(&self, m: &Message) -> bool;
        /// Receives the group's deliveries through `a` and processes each on `a` and `b` at
        /// the same moment; returns how many (transports that cannot hold copies).
        async fn process_on_both(&self, a: &Consumer<Self::S>, b: &Consumer<Self::S>) -> usize {
            let _ = (a, b);
            unreachable!("this broker holds published copies")
        }
        /// Publishes a message without a message id; `false` where none can exist.
        async fn publish_undecodable(&self) -> bool;
        async fn dead_letters(&self, group: &str) -> Vec<DeadLetter>;
        /// The broker's dead-letter API on this fixture's namespace.
        fn dead_letter_admin(&self) -> Box<dyn DeadLetters>;
        async fn cleanup(&self);
    }

    async fn test_db(backend: TestBackend) -> Option<TestDb> {
        let t = TestDb::new(backend).await?;
        super::setup(&t).await;
        Some(t)
    }

    fn ns() -> String {
        uuid::Uuid::new_v4().simple().to_string()
    }

    // --- SQL transport --------------------------------------------------------------

    pub(super) struct SqlFixture {
        t: TestDb,
        transport: SqlTransport,
        topic: String,
    }

    impl SqlFixture {
        pub(super) async fn new(backend: TestBackend) -> Option<Self> {
            let t = test_db(backend).await?;
            let transport = SqlTransport::new(t.db.clone(), 1 << 20);
            Some(Self {
                t,
                transport,
                topic: format!("t{}.orders", ns()),
            })
        }
    }

    impl Fixture for SqlFixture {
        type S = SqlSubscriber;
        fn db(&self) -> &Database {
            &self.t.db
        }
        fn topic(&self) -> String {
            self.topic.clone()
        }
        fn subscriber(&self, group: &str, settle: Duration) -> SqlSubscriber {
            SqlSubscriber::new(self.transport.clone(), group, self.topic.clone(), settle)
        }
        fn url(&self) -> &str {
            &self.t.url
        }
        fn subscriber_via(&self, db: &Database, group: &str, settle: Duration) -> SqlSubscriber {
            let transport = SqlTransport::new(db.clone(), 1 << 20);
            SqlSubscriber::new(transport, group, self.topic.clone(), settle)
        }
        async fn publish(&self, batch: &[Message]) {
            for r in self.transport.publish(batch).await {
                r.expect("queued");
            }
        }
        async fn publish_copy(&self, _m: &Message) -> bool {
            false
        }
        async fn process_on_both(
            &self,
            a: &Consumer<SqlSubscriber>,
            b: &Consumer<SqlSubscriber>,
        ) -> usize {
            let deliveries = a.subscriber().receive(100, Duration::ZERO).await.unwrap();
            let count = deliveries.len();
            let runs = deliveries.into_iter().map(|delivery| async move {
                let (first, second) =
                    tokio::join!(a.process(delivery.clone()), b.process(delivery));
                let mut pair = [first, second];
                pair.sort_by_key(|p| format!("{p:?}"));
                assert_eq!(pair, [Processed::Consumed, Processed::Duplicate]);
            });
            futures_util::future::join_all(runs).await;
            count
        }
        async fn publish_undecodable(&self) -> bool {
            false
        }
        async fn dead_letters(&self, group: &str) -> Vec<DeadLetter> {
            self.transport
                .dead_deliveries(group, 100)
                .await
                .unwrap()
                .into_iter()
                .map(|d| DeadLetter {
                    id: Some(d.id),
                    attempts: d.attempts,
                    error: d.last_error.unwrap_or_default(),
                })
                .collect()
        }
        fn dead_letter_admin(&self) -> Box<dyn DeadLetters> {
            Box::new(SqlDeadLetters::new(self.t.db.clone()))
        }
        async fn cleanup(&self) {}
    }

    // --- RabbitMQ ---------------------------------------------------------------------

    pub(super) struct RabbitFixture {
        t: TestDb,
        ns: String,
        publisher: RabbitMqPublisher,
        queues: Mutex<Vec<RabbitMqSubscriberConfig>>,
    }

    impl RabbitFixture {
        pub(super) async fn new(backend: TestBackend) -> Option<Self> {
            if !service_reachable("RabbitMQ", &amqp_url()).await {
                return None;
            }
            let t = test_db(backend).await?;
            let ns = ns();
            let mut c = RabbitMqConfig::new(amqp_url());
            c.exchange = format!("t.{ns}");
            let publisher = RabbitMqPublisher::connect(c).await.expect("RabbitMQ");
            Some(Self {
                t,
                ns,
                publisher,
                queues: Mutex::new(Vec::new()),
            })
        }

        async fn channel(&self) -> (lapin::Connection, lapin::Channel) {
            let conn = lapin::Connection::connect(
                &amqp_url(),
                oncely_broker::amqp_connection_properties(),
            )
            .await
            .unwrap();
            let ch = conn.create_channel().await.unwrap();
            (conn, ch)
        }
    }

    fn amqp_str(v: &lapin::types::AMQPValue) -> String {
        match v {
            lapin::types::AMQPValue::LongString(s) => {
                String::from_utf8_lossy(s.as_bytes()).into_owned()
            }
            other => format!("{other:?}"),
        }
    }

    impl Fixture for RabbitFixture {
        type S = RabbitMqSubscriber;
        fn db(&self) -> &Database {
            &self.t.db
        }
        fn topic(&self) -> String {
            "orders".to_owned()
        }
        fn url(&self) -> &str {
            &self.t.url
        }
        fn subscriber(&self, group: &str, _settle: Duration) -> RabbitMqSubscriber {
            let mut c = RabbitMqSubscriberConfig::new(amqp_url(), group, self.topic());
            c.exchange = format!("t.{}", self.ns);
            c.queue = format!("t.{}.{group}", self.ns);
            c.retry_queue = format!("t.{}.{group}.retry", self.ns);
            c.dead_queue = format!("t.{}.{group}.dead", self.ns);
            c.prefetch = 8;
            self.queues.lock().unwrap().push(c.clone());
            RabbitMqSubscriber::new(c)
        }
        async fn publish(&self, batch: &[Message]) {
            for r in self.publisher.publish(batch).await {
                r.expect("confirmed");
            }
        }
        async fn publish_copy(&self, m: &Message) -> bool {
            self.publish(std::slice::from_ref(m)).await;
            true
        }
        async fn publish_undecodable(&self) -> bool {
            let (conn, ch) = self.channel().await;
            ch.basic_publish(
                &format!("t.{}", self.ns),
                &self.topic(),
                lapin::options::BasicPublishOptions::default(),
                b"no id",
                lapin::BasicProperties::default(),
            )
            .await
            .unwrap();
            drop(conn.close(200, "bye").await);
            true
        }
        async fn dead_letters(&self, group: &str) -> Vec<DeadLetter> {
            let (conn, ch) = self.channel().await;
            let queue = format!("t.{}.{group}.dead", self.ns);
            let mut out = Vec::new();
            while let Some(m) = ch
                .basic_get(&queue, BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                let h = m.delivery.properties.headers().clone().unwrap_or_default();
                let get = |k: &str| h.inner().get(k).map(amqp_str);
                out.push(DeadLetter {
                    id: m
                        .delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .and_then(|s| MessageId::parse(s.as_str()).ok()),
                    attempts: get(retry_headers::ATTEMPTS)
                        .and_then(|a| a.parse().ok())
                        .unwrap_or(0),
                    error: get(retry_headers::LAST_ERROR).unwrap_or_default(),
                });
            }
            drop(conn.close(200, "bye").await);
            out
        }
        fn dead_letter_admin(&self) -> Box<dyn DeadLetters> {
            let mut c = RabbitMqDeadLettersConfig::new(amqp_url());
            c.queue_prefix = format!("t.{}", self.ns);
            Box::new(RabbitMqDeadLetters::new(c))
        }
        async fn cleanup(&self) {
            let configs = self.queues.lock().unwrap().clone();
            let mut seen = std::collections::BTreeSet::new();
            for c in configs {
                if seen.insert(c.queue.clone()) {
                    RabbitMqSubscriber::new(c).delete_queues().await.unwrap();
                }
            }
            let (conn, ch) = self.channel().await;
            ch.exchange_delete(&format!("t.{}", self.ns), ExchangeDeleteOptions::default())
                .await
                .unwrap();
            drop(conn.close(200, "bye").await);
        }
    }

    // --- NATS JetStream -------------------------------------------------------------

    pub(super) struct NatsFixture {
        t: TestDb,
        ns: String,
        publisher: NatsPublisher,
    }

    impl NatsFixture {
        pub(super) async fn new(backend: TestBackend) -> Option<Self> {
            if !service_reachable("NATS", &nats_url()).await {
                return None;
            }
            let t = test_db(backend).await?;
            let ns = ns();
            let publisher = NatsPublisher::connect(NatsConfig::new(nats_url()))
                .await
                .expect("NATS");
            publisher
                .ensure_stream(&format!("T{ns}"), &[format!("t{ns}.orders")])
                .await
                .unwrap();
            Some(Self { t, ns, publisher })
        }
    }

    impl Fixture for NatsFixture {
        type S = NatsSubscriber;
        fn db(&self) -> &Database {
            &self.t.db
        }
        fn topic(&self) -> String {
            format!("t{}.orders", self.ns)
        }
        fn url(&self) -> &str {
            &self.t.url
        }
        fn subscriber(&self, group: &str, settle: Duration) -> NatsSubscriber {
            let mut c =
                NatsSubscriberConfig::new(nats_url(), format!("T{}", self.ns), group, self.topic());
            c.ack_wait = settle;
            c.batch = 8;
            c.dlq_prefix = format!("t{}.dlq", self.ns);
            c.dlq_stream = format!("T{}_DLQ", self.ns);
            NatsSubscriber::new(c)
        }
        async fn publish(&self, batch: &[Message]) {
            for r in self.publisher.publish(batch).await {
                r.expect("acknowledged");
            }
        }
        async fn publish_copy(&self, m: &Message) -> bool {
            // Past the stream's duplicate window a republished copy is a new stream message:
            // simulated with another Nats-Msg-Id (the message id travels in `message-id`).
            let mut h = async_nats::HeaderMap::new();
            h.insert(
                async_nats::header::NATS_MESSAGE_ID,
                format!("{}-copy", m.id).as_str(),
            );
            for (k, v) in m.all_headers() {
                h.insert(k.as_str(), v.as_str());
            }
            self.publisher
                .jetstream()
                .publish_with_headers(m.topic.clone(), h, m.payload.clone().into())
                .await
                .unwrap()
                .await
                .unwrap();
            true
        }
        async fn publish_undecodable(&self) -> bool {
            self.publisher
                .jetstream()
                .publish(self.topic(), "no id".into())
                .await
                .unwrap()
                .await
                .unwrap();
            true
        }
        async fn dead_letters(&self, _group: &str) -> Vec<DeadLetter> {
            let js = self.publisher.jetstream();
            let Ok(mut stream) = js.get_stream(format!("T{}_DLQ", self.ns)).await else {
                return Vec::new();
            };
            let last = stream.info().await.unwrap().state.last_sequence;
            let mut out = Vec::new();
            for seq in 1..=last {
                let Ok(m) = stream.get_raw_message(seq).await else {
                    continue;
                };
                let get = |k: &str| m.headers.get(k).map(|v| v.as_str().to_owned());
                out.push(DeadLetter {
                    id: get("message-id").and_then(|s| MessageId::parse(&s).ok()),
                    attempts: get(retry_headers::ATTEMPTS)
                        .and_then(|a| a.parse().ok())
                        .unwrap_or(0),
                    error: get(retry_headers::LAST_ERROR).unwrap_or_default(),
                });
            }
            out
        }
        fn dead_letter_admin(&self) -> Box<dyn DeadLetters> {
            let mut c = NatsDeadLettersConfig::new(nats_url());
            c.dlq_prefix = format!("t{}.dlq", self.ns);
            c.dlq_stream = format!("T{}_DLQ", self.ns);
            Box::new(NatsDeadLetters::new(c))
        }
        async fn cleanup(&self) {
            let js = self.publisher.jetstream();
            drop(js.delete_stream(format!("T{}", self.ns)).await);
            drop(js.delete_stream(format!("T{}_DLQ", self.ns)).await);
        }
    }

    // --- Kafka (tansu) -----------------------------------------------------------------

    pub(super) struct KafkaFixture {
        t: TestDb,
        ns: String,
        publisher: KafkaPublisher,
    }

    /// Partitions of the test topics (event, retry, dead-letter).
    const KAFKA_PARTITIONS: i32 = 3;

    impl KafkaFixture {
        pub(super) async fn new(backend: TestBackend) -> Option<Self> {
            if !service_reachable("Kafka", &kafka_url()).await {
                return None;
            }
            let t = test_db(backend).await?;
            let ns = ns();
            let publisher = KafkaPublisher::new(KafkaConfig::new(kafka_brokers())).unwrap();
            publisher
                .ensure_topic(&format!("t{ns}.orders"), KAFKA_PARTITIONS)
                .await
                .unwrap();
            Some(Self { t, ns, publisher })
        }
    }

    impl Fixture for KafkaFixture {
        type S = KafkaSubscriber;
        fn db(&self) -> &Database {
            &self.t.db
        }
        fn topic(&self) -> String {
            format!("t{}.orders", self.ns)
        }
        fn url(&self) -> &str {
            &self.t.url
        }
        fn subscriber(&self, group: &str, _settle: Duration) -> KafkaSubscriber {
            // Kafka redelivers on a rebalance (a member leaves or times out), not after a
            // settle time. The group id is namespaced so parallel tests do not share one
            // group (and its rebalances).
            let mut c = KafkaSubscriberConfig::new(kafka_brokers(), group, self.topic());
            c.group_id = format!("t{}.{group}", self.ns);
            c.partitions = KAFKA_PARTITIONS;
            c.session_timeout = Duration::from_secs(6);
            KafkaSubscriber::new(c)
        }
        async fn publish(&self, batch: &[Message]) {
            for r in self.publisher.publish(batch).await {
                r.expect("delivered");
            }
        }
        async fn publish_copy(&self, m: &Message) -> bool {
            // A relay that republishes after a crash produces a second record with the same
            // id (the idempotent producer only drops its own retries within a session).
            self.publish(std::slice::from_ref(m)).await;
            true
        }
        async fn publish_undecodable(&self) -> bool {
            let topic = self.topic();
            let record = rdkafka::producer::FutureRecord::<(), [u8]>::to(&topic)
                .payload(b"no id".as_slice());
            self.publisher
                .producer()
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(e, _)| e)
                .unwrap();
            true
        }
        async fn dead_letters(&self, group: &str) -> Vec<DeadLetter> {
            use rdkafka::consumer::{BaseConsumer, Consumer as _};
            use rdkafka::message::{Headers as _, Message as _};
            let topic = format!("{}.dlq.{group}", self.topic());
            let consumer: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", kafka_brokers())
                .set("group.id", format!("t{}.dlq-reader", self.ns))
                .set("enable.auto.commit", "false")
                .create()
                .unwrap();
            let mut tpl = rdkafka::TopicPartitionList::new();
            for p in 0..KAFKA_PARTITIONS {
                tpl.add_partition_offset(&topic, p, rdkafka::Offset::Beginning)
                    .unwrap();
            }
            consumer.assign(&tpl).unwrap();
            let mut out = Vec::new();
            // Up to 10 s for the first record, then until nothing more arrives for 2 s.
            let mut wait = Duration::from_secs(10);
            while let Some(r) = consumer.poll(wait) {
                wait = Duration::from_secs(2);
                let m = r.unwrap();
                let mut h = std::collections::BTreeMap::new();
                if let Some(hs) = m.headers() {
                    for x in hs.iter() {
                        h.insert(
                            x.key.to_owned(),
                            String::from_utf8_lossy(x.value.unwrap_or_default()).into_owned(),
                        );
                    }
                }
                out.push(DeadLetter {
                    id: h.get("message-id").and_then(|s| MessageId::parse(s).ok()),
                    attempts: h
                        .get(retry_headers::ATTEMPTS)
                        .and_then(|a| a.parse().ok())
                        .unwrap_or(0),
                    error: h
                        .get(retry_headers::LAST_ERROR)
                        .cloned()
                        .unwrap_or_default(),
                });
            }
            out
        }
        fn dead_letter_admin(&self) -> Box<dyn DeadLetters> {
            let mut c = KafkaDeadLettersConfig::new(kafka_brokers(), vec![self.topic()]);
            c.partitions = KAFKA_PARTITIONS;
            Box::new(KafkaDeadLetters::new(c))
        }
        async fn cleanup(&self) {}
    }

    // --- the cases --------------------------------------------------------------------

    fn message(f: &impl Fixture, order: &str, payload: &[u8]) -> Message {
        Message {
            topic: f.topic(),
            payload: payload.to_vec(),
            ..super::order_message(order)
        }
    }

    fn config(retry: RetryPolicy) -> ConsumerConfig {
        ConsumerConfig {
            retry,
            ..super::config()
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
        let first = consumer(f, "billing", first_handler.clone(), super::config(), settle)
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
        let second = consumer(f, "billing", handler.clone(), super::config(), settle);
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
        let a = consumer(f, "billing", handler.clone(), super::config(), settle);
        let b = consumer(f, "billing", handler.clone(), super::config(), settle);
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

    pub(super) async fn rejected_and_undecodable_messages_are_dead_lettered_at_once<F: Fixture>(
        f: &F,
    ) {
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

    /// The fixture of each broker of the matrix.
    pub(super) trait FixtureFor {
        type F: Fixture;
        async fn fixture(backend: TestBackend) -> Option<Self::F>;
    }

    impl FixtureFor for matrix::Sql {
        type F = SqlFixture;
        async fn fixture(backend: TestBackend) -> Option<SqlFixture> {
            SqlFixture::new(backend).await
        }
    }

    impl FixtureFor for matrix::RabbitMq {
        type F = RabbitFixture;
        async fn fixture(backend: TestBackend) -> Option<RabbitFixture> {
            RabbitFixture::new(backend).await
        }
    }

    impl FixtureFor for matrix::Nats {
        type F = NatsFixture;
        async fn fixture(backend: TestBackend) -> Option<NatsFixture> {
            NatsFixture::new(backend).await
        }
    }

    impl FixtureFor for matrix::Kafka {
        type F = KafkaFixture;
        async fn fixture(backend: TestBackend) -> Option<KafkaFixture> {
            KafkaFixture::new(backend).await
        }
    }

    /// Runs `case` on a fresh fixture of broker `B` on `backend` (or skips), then cleans up.
    async fn run<B: FixtureFor>(backend: TestBackend, case: impl AsyncFnOnce(&B::F)) {
        if let Some(f) = B::fixture(backend).await {
            case(&f).await;
            f.cleanup().await;
        }
    }

    oncely_testkit::matrix! {
        run: run,
        tests: [
            s5_consumer_faulted_after_commit_before_ack_is_redelivered_and_creates_one_invoice,
            same_message_at_two_consumer_instances_at_once_yields_one_invoice,
            handler_failing_twice_then_succeeding_yields_one_invoice_after_two_delayed_retries_sent_to_that_group_only,
            always_failing_handler_ends_in_the_dead_letter_destination_with_its_error_while_others_flow,
            rejected_and_undecodable_messages_are_dead_lettered_at_once,
            refused_message_requeued_after_the_handler_is_fixed_is_processed_once_by_its_group_only,
            database_outage_longer_than_the_retry_schedule_dead_letters_nothing_and_bills_each_order_once,
        ],
        cannot_apply: [
            // SQLite is embedded: there is no connection to the database to cut.
            database_outage_longer_than_the_retry_schedule_dead_letters_nothing_and_bills_each_order_once on (sqlite, _),
            // Kafka redelivers on a consumer-group rebalance, not after a settle time, and the
            // 6 s outage outlasts the group's 6 s session timeout: the case's timing is not
            // written for it (not yet covered, rather than impossible).
            database_outage_longer_than_the_retry_schedule_dead_letters_nothing_and_bills_each_order_once on (_, kafka),
        ],
    }
}
