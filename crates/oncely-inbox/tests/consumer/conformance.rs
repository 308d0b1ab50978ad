//! The conformance matrix: the fixture trait, each broker's fixture (a submodule each), the
//! cases (`cases`), and the `conformance::<backend>::<broker>::…` tests.

use std::time::Duration;

use oncely_broker::{DeadLetters, Message, Subscriber};
use oncely_core::MessageId;
use oncely_inbox::Consumer;
use oncely_sql::Database;
use oncely_testkit::{matrix, TestBackend, TestDb};

#[path = "conformance/cases.rs"]
mod cases;
#[path = "conformance/kafka.rs"]
mod kafka;
#[path = "conformance/nats.rs"]
mod nats;
#[path = "conformance/rabbitmq.rs"]
mod rabbitmq;
#[path = "conformance/sql.rs"]
mod sql;

use cases::{
    always_failing_handler_ends_in_the_dead_letter_destination_with_its_error_while_others_flow,
    database_outage_longer_than_the_retry_schedule_dead_letters_nothing_and_bills_each_order_once,
    handler_failing_twice_then_succeeding_yields_one_invoice_after_two_delayed_retries_sent_to_that_group_only,
    refused_message_requeued_after_the_handler_is_fixed_is_processed_once_by_its_group_only,
    rejected_and_undecodable_messages_are_dead_lettered_at_once,
    s5_consumer_faulted_after_commit_before_ack_is_redelivered_and_creates_one_invoice,
    same_message_at_two_consumer_instances_at_once_yields_one_invoice,
};
use kafka::KafkaFixture;
use nats::NatsFixture;
use rabbitmq::RabbitFixture;
use sql::SqlFixture;

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
