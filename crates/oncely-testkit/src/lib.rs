//! Test fixtures for oncely: a fresh database per test on every backend, a fresh topic per
//! test on every broker, the test matrix that runs a suite on each, a fault-injecting TCP
//! proxy, and the service-availability policy.
//!
//! A test whose service is unreachable prints that it skipped; with
//! `ONCELY_TEST_REQUIRE_SERVICES=1` (set by `.ci/run`) it panics instead, so CI never
//! passes by skipping.
//!
//! # Layout
//! - `db` — [`TestDb`], [`TestBackend`]: fresh SQLite files, PostgreSQL schemas and
//!   MySQL / MariaDB databases.
//! - `broker_conformance` — the publisher/subscriber conformance suite every broker runs
//!   ([`broker_conformance::BrokerUnderTest`], the cases, [`broker_conformance!`]).
//! - `brokers` — [`amqp_url`], [`nats_url`], [`kafka_brokers`], [`service_reachable`]: broker
//!   URLs and the skip-or-fail policy for RabbitMQ, NATS and Kafka.
//! - `proxy` — [`FaultProxy`]: a TCP proxy that can cut or freeze every connection on demand,
//!   or the one connection that sends given bytes ([`Fault`]).
//! - `topic` — [`TestTopic`]: a fresh topic on one broker with a publisher and a test
//!   consumer ([`Collector`], [`Delivered`]) subscribed before anything is published; the
//!   per-broker consumers and test publisher settings.
//! - [`matrix`] — [`matrix!`]: one list of tests run on every backend (× every broker), with
//!   the combinations that cannot apply listed once; [`TestBroker`] and the broker types
//!   ([`MatrixBroker`]) the runners are instantiated with.
//! - `http_faults` — [`HttpFaultProxy`]: an HTTP proxy in front of a provider that answers
//!   each order's requests as its seeded [`Schedule`] says (a failure before forwarding, a
//!   replaced answer after the commit, a slow commit, a lagging or rewritten lookup);
//!   [`SeededRng`], the replayable generator that draws schedules.
//! - `localstripe` — [`LocalStripe`]: a `localstripe` process (PyPI's fake Stripe) per test.
//! - [`process`] — [`process::command`], [`process::spawn`], [`process::ProcessGuard`]: the
//!   processes a test starts die with it, even when the test binary is killed.

pub mod broker_conformance;
mod brokers;
mod db;
mod http_faults;
mod localstripe;
pub mod matrix;
pub mod process;
mod proxy;
mod topic;

pub use brokers::{amqp_url, kafka_brokers, kafka_url, nats_url, service_reachable, url_authority};
pub use db::{mysql_url, park_effect, postgres_url, require_services, TestBackend, TestDb};
pub use http_faults::{
    order_of_request, Answer, BodyFault, Fault as HttpFault, HttpFaultProxy, OrderOf, ProxyOptions,
    RequestView, Schedule, SeededRng,
};
pub use localstripe::{localstripe_payment_intents, LocalStripe};
pub use matrix::{MatrixBroker, TestBroker};
pub use proxy::{without_statement_cache, Fault, FaultProxy};
#[cfg(feature = "kafka")]
pub use topic::{kafka_collector, kafka_config};
#[cfg(feature = "nats")]
pub use topic::{nats_collector, nats_config};
#[cfg(feature = "rabbitmq")]
pub use topic::{rabbitmq_collector, rabbitmq_config};
pub use topic::{
    Collector, Delivered, TestTopic, TopicParts, KAFKA_PARTITIONS, SQL_MAX_MESSAGE_BYTES,
    TEST_EXCHANGE,
};
