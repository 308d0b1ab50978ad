//! Outbox + relay conformance, written once and run on every database (SQLite, PostgreSQL,
//! MariaDB / MySQL) × every broker (the SQL transport, RabbitMQ, NATS JetStream, Kafka),
//! against the real servers (Kafka: tansu, a Kafka-API broker), as
//! `<backend>::<broker>::<scenario>` (`oncely_testkit::matrix!`; the combinations that cannot
//! apply are listed there with their reasons). A consumer is subscribed before each run;
//! every scenario checks what it received. The store rules run on every backend
//! (`store::<backend>::…`), the claim-by-delete tests on PostgreSQL (`claim::postgres::…`).
//! (That the order service's created orders each yield one `order.created` is tested in
//! apps/orders.)

#[path = "relay/harness.rs"]
mod harness;
#[path = "relay/outage.rs"]
mod outage;
#[path = "relay/scenarios.rs"]
mod scenarios;

use harness::Harness;
use oncely_testkit::{MatrixBroker, TestBackend};
use outage::{
    broker_outage_longer_than_the_backoff_schedule_kills_no_event,
    database_outage_under_the_relay_delays_without_counting,
    kafka_publish_returns_in_time_while_the_broker_is_down,
};
use scenarios::{
    a_batch_reaches_the_broker_in_the_order_given, late_committing_rows_are_not_skipped,
    poison_event_goes_dead_while_the_rest_flow, postgres_notify_wakes_an_idle_relay,
    relay_killed_after_confirm_republishes_with_same_ids, three_relays_keep_each_aggregates_order,
};

mod publish_kafka {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn returns_in_time_while_the_broker_is_down() {
        super::kafka_publish_returns_in_time_while_the_broker_is_down().await;
    }
}

/// Runs `scenario` on a fresh [`Harness`] for `backend` and the broker `B` (or skips).
async fn run<B: MatrixBroker>(backend: TestBackend, scenario: impl AsyncFnOnce(Harness)) {
    if let Some(h) = Harness::new(backend, B::BROKER).await {
        scenario(h).await;
    }
}

oncely_testkit::matrix! {
    run: run,
    tests: [
        a_batch_reaches_the_broker_in_the_order_given,
        three_relays_keep_each_aggregates_order,
        relay_killed_after_confirm_republishes_with_same_ids,
        broker_outage_longer_than_the_backoff_schedule_kills_no_event,
        poison_event_goes_dead_while_the_rest_flow,
        database_outage_under_the_relay_delays_without_counting,
        late_committing_rows_are_not_skipped,
        postgres_notify_wakes_an_idle_relay,
    ],
    cannot_apply: [
        // The SQL transport's queue is a table in the test database: there is no broker
        // connection to cut (a cut database is `database_outage_…`).
        broker_outage_longer_than_the_backoff_schedule_kills_no_event on (_, sql),
        // SQLite is embedded: there is no connection to the database to cut.
        database_outage_under_the_relay_delays_without_counting on (sqlite, _),
        // SQLite has one writer: ids are assigned in commit order, so no row can commit
        // after a higher-numbered one.
        late_committing_rows_are_not_skipped on (sqlite, _),
        // LISTEN/NOTIFY is PostgreSQL's; relays on SQLite and MySQL poll.
        postgres_notify_wakes_an_idle_relay on (sqlite, _),
        postgres_notify_wakes_an_idle_relay on (mysql, _),
    ],
}

/// The store rules on every backend, as `store::<backend>::<test>`.
#[path = "relay/store.rs"]
mod store;

/// The claim-by-delete tests, as `claim::<backend>::<test>`.
#[path = "relay/claim.rs"]
mod claim;
