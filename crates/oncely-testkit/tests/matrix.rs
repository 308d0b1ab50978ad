//! `matrix!` itself: every combination not listed as unable to apply gets each test, once,
//! with the backend and broker its module names; the listed ones get none.

#[path = "matrix/dependencies.rs"]
mod dependencies;
#[path = "matrix/structure.rs"]
mod structure;

use oncely_testkit::{MatrixBroker, TestBackend, TestBroker};

/// The combination a case was instantiated for.
#[derive(Debug)]
struct Combination {
    backend: TestBackend,
    broker: TestBroker,
}

async fn run<B: MatrixBroker>(backend: TestBackend, case: impl AsyncFnOnce(&Combination)) {
    case(&Combination {
        backend,
        broker: B::BROKER,
    })
    .await;
}

async fn runs_everywhere(c: &Combination) {
    let _ = (c.backend, c.broker);
}

async fn never_on_sqlite(c: &Combination) {
    assert_ne!(c.backend, TestBackend::Sqlite, "{c:?}");
}

async fn never_on_kafka_nor_on_mysql_nats(c: &Combination) {
    assert_ne!(c.broker, TestBroker::Kafka, "{c:?}");
    assert_ne!(
        (c.backend, c.broker),
        (TestBackend::MySql, TestBroker::Nats),
        "{c:?}"
    );
}

oncely_testkit::matrix! {
    run: run,
    tests: [runs_everywhere, never_on_sqlite, never_on_kafka_nor_on_mysql_nats],
    cannot_apply: [
        // The test says so.
        never_on_sqlite on (sqlite, _),
        // The test says so.
        never_on_kafka_nor_on_mysql_nats on (_, kafka),
        never_on_kafka_nor_on_mysql_nats on (mysql, nats),
    ],
}

/// The backends-only form, inside a module of its own (the form defines `sqlite`,
/// `postgres` and `mysql` where it is invoked).
mod backends_only {
    use oncely_testkit::TestDb;

    async fn opens_a_fresh_database(t: TestDb) {
        assert!(!t.url.is_empty());
    }

    async fn never_on_mysql(t: TestDb) {
        assert!(!t.url.starts_with("mysql:"), "{}", t.url);
    }

    async fn on_postgres_only(t: TestDb) {
        assert!(t.url.starts_with("postgres:"), "{}", t.url);
    }

    oncely_testkit::matrix! {
        tests: [opens_a_fresh_database, never_on_mysql, on_postgres_only],
        cannot_apply: [
            // The tests say so.
            never_on_mysql on mysql,
            on_postgres_only on sqlite | mysql,
        ],
    }
}
