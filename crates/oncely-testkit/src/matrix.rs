//! The test matrix: one list of tests, run on every backend (× every broker), with the
//! combinations that cannot apply listed once, each with its reason.
//!
//! [`matrix!`](crate::matrix) generates a module per backend (`sqlite`, `postgres`, `mysql`)
//! and, in the broker form, per broker inside it (`sql`, `rabbitmq`, `nats`, `kafka`), so
//! every test is named `<backend>::<test>` or `<backend>::<broker>::<test>`. A test runs on
//! every combination unless its suite's `cannot_apply` list names it there; the list is the
//! only place where coverage differs between combinations.

/// The brokers the suites run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestBroker {
    /// The SQL transport: a queue table in the test database itself.
    Sql,
    /// RabbitMQ (AMQP 0-9-1) at [`amqp_url`](crate::amqp_url).
    RabbitMq,
    /// NATS JetStream at [`nats_url`](crate::nats_url).
    Nats,
    /// Kafka (tansu) at [`kafka_brokers`](crate::kafka_brokers).
    Kafka,
}

/// A broker of the matrix as a type, so a suite's runner can pick a type per broker (its
/// fixture) with an associated type of its own: [`matrix!`](crate::matrix) calls
/// `run::<B>(backend, case)` with `B` one of [`Sql`], [`RabbitMq`], [`Nats`], [`Kafka`].
pub trait MatrixBroker {
    /// The broker this type stands for.
    const BROKER: TestBroker;
}

/// [`TestBroker::Sql`] as a type.
#[derive(Debug, Clone, Copy)]
pub struct Sql;

/// [`TestBroker::RabbitMq`] as a type.
#[derive(Debug, Clone, Copy)]
pub struct RabbitMq;

/// [`TestBroker::Nats`] as a type.
#[derive(Debug, Clone, Copy)]
pub struct Nats;

/// [`TestBroker::Kafka`] as a type.
#[derive(Debug, Clone, Copy)]
pub struct Kafka;

impl MatrixBroker for Sql {
    const BROKER: TestBroker = TestBroker::Sql;
}

impl MatrixBroker for RabbitMq {
    const BROKER: TestBroker = TestBroker::RabbitMq;
}

impl MatrixBroker for Nats {
    const BROKER: TestBroker = TestBroker::Nats;
}

impl MatrixBroker for Kafka {
    const BROKER: TestBroker = TestBroker::Kafka;
}

/// Instantiates one list of tests on every backend, or on every backend × broker, as
/// `#[tokio::test]`s (multi-threaded runtime, 4 workers). Invoke it once per module: it
/// defines the modules `sqlite`, `postgres` and `mysql` there.
///
/// **Backends only.** Each test is an `async fn name(db: TestDb)` in the invoking module;
/// it runs as `sqlite::name`, `postgres::name` and `mysql::name`, each on a fresh
/// [`TestDb`](crate::TestDb). An unreachable server skips with a message, or fails under
/// `ONCELY_TEST_REQUIRE_SERVICES=1`.
///
/// ```text
/// oncely_testkit::matrix! {
///     tests: [s1_sequential_retries_create_one_order, connection_lost_mid_transaction_is_503],
///     cannot_apply: [
///         // SQLite is embedded: there is no connection to lose.
///         connection_lost_mid_transaction_is_503 on sqlite,
///     ],
/// }
/// ```
///
/// **Backends × brokers.** Each test is an `async fn` taking whatever the suite's runner
/// hands it (a harness, a fixture). `run` names a function of the invoking module,
/// `async fn run<B: MatrixBroker>(backend: TestBackend, case: impl AsyncFnOnce(…))`, that
/// builds the fixture for `backend` and the broker `B` (or skips) and runs the case; the
/// test runs as `<backend>::<broker>::name` (brokers `sql`, `rabbitmq`, `nats`, `kafka`).
/// A generic case (`async fn name<F: Fixture>(f: &F)`) is instantiated by the runner.
///
/// ```text
/// oncely_testkit::matrix! {
///     run: run,
///     tests: [poison_event_goes_dead_while_the_rest_flow, postgres_notify_wakes_an_idle_relay],
///     cannot_apply: [
///         // LISTEN/NOTIFY is PostgreSQL's; SQLite and MySQL relays poll.
///         postgres_notify_wakes_an_idle_relay on (sqlite, _),
///         postgres_notify_wakes_an_idle_relay on (mysql, _),
///     ],
/// }
/// ```
///
/// `cannot_apply` entries are `test on backend` or `test on backend | backend` (backends
/// only), or `test on (backend, broker)` with `_` for every backend or every broker. Give each entry
/// a comment saying why the combination cannot apply: this list is the only place where
/// coverage differs between combinations.
#[macro_export]
macro_rules! matrix {
    (
        run: $run:ident,
        tests: [$($test:ident),* $(,)?]
        $(, cannot_apply: [$($except:tt)*])?
        $(,)?
    ) => {
        $crate::__matrix! { ($) [brokers $run] [$($test)*] [] $($($except)*)? }
    };
    (
        tests: [$($test:ident),* $(,)?]
        $(, cannot_apply: [$($except:tt)*])?
        $(,)?
    ) => {
        $crate::__matrix! { ($) [backends] [$($test)*] [] $($($except)*)? }
    };
}

/// The machinery of [`matrix!`]: turns each `cannot_apply` entry into an arm (that
/// expands to nothing) of a case macro whose last arm expands to the test, then
/// instantiates that macro for every test on every combination. `$d` is a `$`, so the
/// generated macro can have metavariables of its own.
#[doc(hidden)]
#[macro_export]
macro_rules! __matrix {
    // Collect the exceptions, `_` first (it is not an identifier).
    (($d:tt) $mode:tt $tests:tt [$($arms:tt)*]
        $t:ident on (_, $broker:ident) $(, $($rest:tt)*)?) => {
        $crate::__matrix! { ($d) $mode $tests
            [$($arms)* ($t, $d _backend:ident, $broker, $d _variants:tt) => {};]
            $($($rest)*)? }
    };
    (($d:tt) $mode:tt $tests:tt [$($arms:tt)*]
        $t:ident on ($backend:ident, _) $(, $($rest:tt)*)?) => {
        $crate::__matrix! { ($d) $mode $tests
            [$($arms)* ($t, $backend, $d _broker:ident, $d _variants:tt) => {};]
            $($($rest)*)? }
    };
    (($d:tt) $mode:tt $tests:tt [$($arms:tt)*]
        $t:ident on ($backend:ident, $broker:ident) $(, $($rest:tt)*)?) => {
        $crate::__matrix! { ($d) $mode $tests
            [$($arms)* ($t, $backend, $broker, $d _variants:tt) => {};]
            $($($rest)*)? }
    };
    (($d:tt) $mode:tt $tests:tt [$($arms:tt)*]
        $t:ident on $backend:ident | $($rest:tt)*) => {
        $crate::__matrix! { ($d) $mode $tests
            [$($arms)* ($t, $backend, $d _variants:tt) => {};]
            $t on $($rest)* }
    };
    (($d:tt) $mode:tt $tests:tt [$($arms:tt)*]
        $t:ident on $backend:ident $(, $($rest:tt)*)?) => {
        $crate::__matrix! { ($d) $mode $tests
            [$($arms)* ($t, $backend, $d _variants:tt) => {};]
            $($($rest)*)? }
    };
    // Backends × brokers.
    (($d:tt) [brokers $run:ident] [$($test:ident)*] [$($arms:tt)*]) => {
        macro_rules! __oncely_matrix_case {
            $($arms)*
            ($d test:ident, $d _backend:ident, $d _broker:ident,
                [$d backend:ident $d broker:ident]) => {
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $d test() {
                    super::super::$run::<$crate::matrix::$d broker>(
                        $crate::TestBackend::$d backend,
                        super::super::$d test,
                    )
                    .await;
                }
            };
        }
        $crate::__matrix! { @brokers [$($test)*] sqlite Sqlite }
        $crate::__matrix! { @brokers [$($test)*] postgres Postgres }
        $crate::__matrix! { @brokers [$($test)*] mysql MySql }
    };
    (@brokers [$($test:ident)*] $be:ident $backend:ident) => {
        mod $be {
            mod sql {
                $( __oncely_matrix_case!($test, $be, sql, [$backend Sql]); )*
            }
            mod rabbitmq {
                $( __oncely_matrix_case!($test, $be, rabbitmq, [$backend RabbitMq]); )*
            }
            mod nats {
                $( __oncely_matrix_case!($test, $be, nats, [$backend Nats]); )*
            }
            mod kafka {
                $( __oncely_matrix_case!($test, $be, kafka, [$backend Kafka]); )*
            }
        }
    };
    // Backends only.
    (($d:tt) [backends] [$($test:ident)*] [$($arms:tt)*]) => {
        macro_rules! __oncely_matrix_case {
            $($arms)*
            ($d test:ident, $d _backend:ident, [$d backend:ident]) => {
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $d test() {
                    if let Some(db) =
                        $crate::TestDb::new($crate::TestBackend::$d backend).await
                    {
                        super::$d test(db).await;
                    }
                }
            };
        }
        mod sqlite {
            $( __oncely_matrix_case!($test, sqlite, [Sqlite]); )*
        }
        mod postgres {
            $( __oncely_matrix_case!($test, postgres, [Postgres]); )*
        }
        mod mysql {
            $( __oncely_matrix_case!($test, mysql, [MySql]); )*
        }
    };
}
