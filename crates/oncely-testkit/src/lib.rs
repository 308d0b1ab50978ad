//! Test fixtures for oncely: a fresh database per test on every backend, a fault-injecting
//! TCP proxy, and the service-availability policy.
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
//! - [`matrix`] — [`matrix!`]: one list of tests run on every backend (× every broker), with
//!   the combinations that cannot apply listed once; [`TestBroker`] and the broker types
//!   ([`MatrixBroker`]) the runners are instantiated with.
//! - `localstripe` — [`LocalStripe`]: a `localstripe` process (PyPI's fake Stripe) per test.

pub mod broker_conformance;
mod brokers;
mod db;
mod localstripe;
pub mod matrix;
mod proxy;

pub use brokers::{amqp_url, kafka_brokers, kafka_url, nats_url, service_reachable, url_authority};
pub use db::{mysql_url, postgres_url, require_services, TestBackend, TestDb};
pub use localstripe::LocalStripe;
pub use matrix::{MatrixBroker, TestBroker};
pub use proxy::{without_statement_cache, Fault, FaultProxy};

/// Instantiates each listed `async fn name(db: TestDb)` once per backend, as
/// `sqlite::name`, `postgres::name` and `mysql::name` (multi-threaded runtime, 4 workers). A backend that
/// is unreachable skips with a message, or fails under `ONCELY_TEST_REQUIRE_SERVICES=1`.
///
/// ```text
/// oncely_testkit::on_every_backend!(s1_sequential_retries_create_one_order);
/// ```
#[macro_export]
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    if let Some(db) = $crate::TestDb::new($crate::TestBackend::Sqlite).await {
                        super::$name(db).await;
                    }
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    if let Some(db) = $crate::TestDb::new($crate::TestBackend::Postgres).await {
                        super::$name(db).await;
                    }
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    if let Some(db) = $crate::TestDb::new($crate::TestBackend::MySql).await {
                        super::$name(db).await;
                    }
                }
            )*
        }
    };
}

/// Instantiates each listed `async fn name(db: TestDb)` on the backends reached over the
/// network, as `postgres::name` and `mysql::name` (multi-threaded runtime, 4 workers), for
/// faults on the path to the database ([`FaultProxy`]). SQLite is embedded: it has no
/// network path to cut or freeze, so these tests are not instantiated for it (listing them
/// here is the statement that the combination cannot apply). Unreachable servers skip or
/// fail as in [`on_every_backend!`].
#[macro_export]
macro_rules! on_network_backends {
    ($($name:ident),* $(,)?) => {
        mod postgres_net {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    if let Some(db) = $crate::TestDb::new($crate::TestBackend::Postgres).await {
                        super::$name(db).await;
                    }
                }
            )*
        }
        mod mysql_net {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    if let Some(db) = $crate::TestDb::new($crate::TestBackend::MySql).await {
                        super::$name(db).await;
                    }
                }
            )*
        }
    };
}
