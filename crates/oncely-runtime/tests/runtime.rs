//! The runtime's assembly driven without a process: relay and consumer from configuration
//! on the SQL transport, supervision of a broker that is down, the metrics endpoint,
//! injected shutdown, the database connection's refusals, and the effect runner from
//! configuration.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{BoxFuture, ReceivedMessage, Subscriber};
use oncely_inbox::{Consumer, ConsumerConfig, Handler, HandlerError};
use oncely_runtime::{
    BrokerConfig, BrokerKind, ConsumerFactory, ConsumerSettings, MetricsEndpoint, RelaySupervisor,
    RuntimeError,
};
use oncely_sql::{Database, DbOptions, OutboxEvent, OutboxStore, Tx};
use oncely_testkit::{TestBackend, TestDb};
use tokio_util::sync::CancellationToken;

/// Counts the messages it handles, writing nothing.
#[derive(Default)]
struct Counting(AtomicUsize);

impl Handler for Counting {
    fn handle<'a>(
        &'a self,
        _tx: &'a mut Tx,
        _message: &'a ReceivedMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Ok(()) })
    }
}

struct CountingConsumer(Arc<Counting>);

impl ConsumerFactory for CountingConsumer {
    fn build<S: Subscriber>(
        &self,
        db: &Database,
        subscriber: S,
        config: ConsumerConfig,
    ) -> Consumer<S> {
        Consumer::new(db.clone(), subscriber, self.0.clone(), config)
    }
}

fn settings(topic: &str) -> ConsumerSettings {
    ConsumerSettings {
        group: "runtime-test".to_owned(),
        topic: topic.to_owned(),
        lease: Duration::from_secs(30),
        consumer: ConsumerConfig {
            poll: Duration::from_millis(10),
            ..ConsumerConfig::default()
        },
    }
}

async fn sqlite() -> TestDb {
    let t = TestDb::new(TestBackend::Sqlite).await.expect("SQLite");
    t.db.migrate().await.unwrap();
    t
}

async fn enqueue(db: &Database, topic: &str, n: usize) {
    let mut tx = db.begin().await.unwrap();
    for i in 0..n {
        let event = OutboxEvent::new(
            oncely_core::MessageId::new_random(),
            topic,
            format!("p-{i}"),
            "test.event",
            b"{}".to_vec(),
        );
        OutboxStore::enqueue(&mut tx, &event).await.unwrap();
    }
    tx.commit().await.unwrap();
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    tokio::time::timeout(Duration::from_secs(20), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_from_configuration_carry_events_over_the_sql_transport_until_shutdown()
{
    let t = sqlite().await;
    let broker = BrokerConfig::default();
    assert_eq!(broker.kind, BrokerKind::Sql);
    let handled = Arc::new(Counting::default());
    let stop_consumer = CancellationToken::new();
    let consumer = settings("runtime.events")
        .spawn(
            &broker,
            &t.db,
            &CountingConsumer(handled.clone()),
            stop_consumer.clone(),
        )
        .await
        .unwrap();
    enqueue(&t.db, "runtime.events", 5).await;

    let relay = RelaySupervisor {
        broker: broker.clone(),
        ..RelaySupervisor::default()
    };
    let seen = handled.clone();
    oncely_runtime::run_relay(&t.db, &relay, None, async move {
        until("5 events handled", || seen.0.load(Ordering::SeqCst) >= 5).await;
    })
    .await
    .unwrap();
    stop_consumer.cancel();
    tokio::time::timeout(Duration::from_secs(10), consumer)
        .await
        .expect("the consumer stops once cancelled")
        .unwrap();
    assert_eq!(
        handled.0.load(Ordering::SeqCst),
        5,
        "each event handled once"
    );
    let stats = OutboxStore::new(t.db.clone()).stats().await.unwrap();
    assert_eq!(stats.pending, 0, "the relay published every event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_broker_is_unreachable_keeps_the_events_and_stops_at_shutdown() {
    let t = sqlite().await;
    enqueue(&t.db, "orders", 2).await;
    let relay = RelaySupervisor {
        broker: BrokerConfig {
            kind: BrokerKind::Rabbitmq,
            // Nothing listens on port 1.
            amqp_url: "amqp://guest:guest@127.0.0.1:1/%2f".to_owned(),
            ..BrokerConfig::default()
        },
        ..RelaySupervisor::default()
    };
    let stop = CancellationToken::new();
    let task = relay.spawn(&t.db, stop.clone()).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !task.is_finished(),
        "an unreachable broker does not end the relay"
    );
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the relay stops while waiting to reconnect")
        .unwrap();
    let stats = OutboxStore::new(t.db.clone()).stats().await.unwrap();
    assert_eq!(stats.pending, 2, "the outbox keeps the events");
}

#[tokio::test]
async fn a_nats_consumer_without_a_stream_is_refused() {
    let t = sqlite().await;
    let broker = BrokerConfig {
        kind: BrokerKind::Nats,
        nats_stream: String::new(),
        ..BrokerConfig::default()
    };
    let err = settings("orders")
        .spawn(
            &broker,
            &t.db,
            &CountingConsumer(Arc::default()),
            CancellationToken::new(),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, RuntimeError::NatsStreamRequired), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_renders_the_recorder_and_closes_at_shutdown() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        metrics::counter!("oncely_runtime_test_total").increment(3);
    });
    let stop = CancellationToken::new();
    let (addr, task) = oncely_runtime::serve_metrics(
        MetricsEndpoint {
            listen: "127.0.0.1:0".parse().unwrap(),
            handle,
        },
        stop.clone(),
    )
    .await
    .unwrap();
    let body = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(body.contains("oncely_runtime_test_total 3"), "{body}");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the listener closes once cancelled")
        .unwrap();

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap();
    let err = oncely_runtime::serve_metrics(
        MetricsEndpoint {
            listen: busy,
            handle: metrics_exporter_prometheus::PrometheusBuilder::new()
                .build_recorder()
                .handle(),
        },
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, RuntimeError::Bind { addr, .. } if addr == busy),
        "{err:?}"
    );
}

#[tokio::test]
async fn connect_existing_refuses_a_missing_sqlite_file_and_a_database_without_the_schema() {
    let dir = tempfile::tempdir().unwrap();
    let missing = format!("sqlite://{}", dir.path().join("none.db").display());
    let err = oncely_runtime::connect_existing(&missing, &DbOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, RuntimeError::NoSqliteFile { .. }), "{err:?}");
    assert!(!dir.path().join("none.db").exists(), "no file created");

    let empty = format!("sqlite://{}", dir.path().join("empty.db").display());
    drop(
        oncely_runtime::connect(&empty, &DbOptions::default())
            .await
            .unwrap(),
    );
    let err = oncely_runtime::connect_existing(&empty, &DbOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, RuntimeError::SchemaMissing { .. }), "{err:?}");
    assert!(err.to_string().contains("oncely migrate"), "{err}");
}

#[tokio::test]
async fn a_database_that_cannot_be_reached_is_named_without_its_password() {
    let err = oncely_runtime::connect(
        "postgres://u:secret@127.0.0.1:1/db",
        &DbOptions {
            store_timeout: Duration::from_secs(1),
            ..DbOptions::default()
        },
    )
    .await
    .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("postgres://u:***@127.0.0.1:1/db"), "{text}");
    assert!(!text.contains("secret"), "{text}");
}

/// The effect runner from configuration: its refusals, and a charge settled against the
/// payments simulator on `127.0.0.1:0` until shutdown.
mod effects {
    use super::*;
    use oncely_effects::{NoHandler, RunnerConfig, ShippingConfig, StripeConfig};
    use oncely_runtime::EffectsConfig;
    use oncely_sql::{EffectStore, NewEffect};

    fn payments(base: &str, key: &str) -> StripeConfig {
        StripeConfig {
            base_url: base.to_owned(),
            secret_key: key.to_owned(),
            timeout: Duration::from_secs(5),
            ..StripeConfig::default()
        }
    }

    #[tokio::test]
    async fn a_configuration_without_providers_a_secret_key_or_a_lease_above_the_timeout_is_refused(
    ) {
        let db = sqlite().await;
        let none = EffectsConfig::default();
        assert!(none.is_empty());
        let refused = oncely_runtime::run_effects(
            &db.db,
            &none,
            Arc::new(NoHandler),
            None,
            std::future::ready(()),
        )
        .await;
        assert!(
            matches!(refused, Err(RuntimeError::NoProviders)),
            "{refused:?}"
        );
        let keyless = EffectsConfig {
            payments: Some(payments("http://127.0.0.1:9", "")),
            ..EffectsConfig::default()
        };
        assert!(matches!(
            keyless.providers(),
            Err(RuntimeError::PaymentsSecretKeyMissing)
        ));
        let short = EffectsConfig {
            shipping: Some(ShippingConfig {
                timeout: Duration::from_secs(90),
                ..ShippingConfig::default()
            }),
            ..EffectsConfig::default()
        };
        assert!(matches!(
            short.providers(),
            Err(RuntimeError::LeaseTooShort { .. })
        ));
        let both = EffectsConfig {
            payments: Some(payments("http://127.0.0.1:9", "sk_test_x")),
            shipping: Some(ShippingConfig::default()),
            ..EffectsConfig::default()
        };
        let names: Vec<String> = both
            .providers()
            .unwrap()
            .iter()
            .map(|p| p.name().to_owned())
            .collect();
        assert_eq!(names, ["payments", "shipping"]);
    }

    #[tokio::test]
    async fn a_runner_from_configuration_settles_a_charge_at_the_simulator_and_stops_at_shutdown() {
        let sim = oncely_sim::PaymentsSim::new(oncely_sim::PaymentsConfig {
            secret_keys: vec!["sk_test_rt".to_owned()],
            ..oncely_sim::PaymentsConfig::default()
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let stop_sim = CancellationToken::new();
        tokio::spawn(oncely_sim::serve(
            listener,
            sim.router(),
            stop_sim.clone().cancelled_owned(),
        ));
        let t = sqlite().await;
        let request = serde_json::json!({"amount": 700, "currency": "eur"});
        let mut tx = t.db.begin().await.unwrap();
        let new = NewEffect {
            tenant: "acme",
            provider: "payments",
            operation: "charge",
            reference: "inv-rt",
            key: "key-rt",
            request: &request,
        };
        EffectStore::enqueue(&mut tx, &new, oncely_core::now_ms())
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let config = EffectsConfig {
            payments: Some(payments(&base, "sk_test_rt")),
            runner: RunnerConfig {
                poll: Duration::from_millis(20),
                ..RunnerConfig::default()
            },
            ..EffectsConfig::default()
        };
        let stop = CancellationToken::new();
        let task = config
            .spawn(&t.db, Arc::new(NoHandler), stop.clone())
            .unwrap();
        let store = EffectStore::new(t.db.clone());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let e = store
                .find("payments", "charge", "inv-rt")
                .await
                .unwrap()
                .unwrap();
            if e.state_word == "succeeded" {
                assert!(e.provider_id.unwrap().starts_with("pi_"));
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "not settled: {e:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the runner stops at shutdown")
            .unwrap();
        assert_eq!(sim.stats().payment_intents, 1);
        stop_sim.cancel();
    }
}
