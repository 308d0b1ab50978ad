//! The provider client and the processes beside the service: the Stripe client of a run's
//! provider kind, the consumer and runner settings, the choreography (relay, `billing` and
//! `shipping` consumers, effect runner) and the saga (relay, `fulfilment` consumer, runner
//! and orchestrator).

use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{SqlSubscriber, SqlTransport};
use oncely_core::RetryPolicy;
use oncely_effects::{EffectRunner, Provider, RunnerConfig, StripeConfig, StripePayments};
use oncely_inbox::ConsumerConfig;
use oncely_saga::OrchestratorConfig;
use oncely_sql::{Database, EffectStore};
use tokio_util::sync::CancellationToken;

use super::{Kind, PROVIDER_TIMEOUT, SETTLE, SK};

pub(super) fn stripe(base: &str, kind: Kind) -> StripePayments {
    StripePayments::new(StripeConfig {
        base_url: base.to_owned(),
        secret_key: SK.to_owned(),
        timeout: PROVIDER_TIMEOUT,
        settle_time: SETTLE,
        search: kind != Kind::Listing,
        ..StripeConfig::default()
    })
    .unwrap()
}

fn consumer_config() -> ConsumerConfig {
    ConsumerConfig {
        concurrency: 8,
        batch: 64,
        poll: Duration::from_millis(20),
        retry: RetryPolicy {
            base: Duration::from_millis(50),
            cap: Duration::from_millis(300),
            max_attempts: 30,
            ..RetryPolicy::default()
        },
        ..ConsumerConfig::default()
    }
}

fn runner_config() -> RunnerConfig {
    RunnerConfig {
        lease: Duration::from_secs(3),
        poll: Duration::from_millis(25),
        batch: 64,
        concurrency: 64,
        check_delay: Duration::from_millis(150),
        max_checks: 12,
        retry: RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_millis(500),
            max_attempts: 10,
            ..RetryPolicy::default()
        },
        outage: RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_millis(500),
            ..RetryPolicy::default()
        },
        ..RunnerConfig::default()
    }
}

/// The choreography beside the service: relay, `billing` (charging) and `shipping`
/// consumers, the effect runner.
pub(super) async fn spawn_choreography(
    db: &Database,
    stop: &CancellationToken,
    providers: Vec<Arc<dyn Provider>>,
) {
    let transport = SqlTransport::new(db.clone(), 1 << 20);
    spawn_relay(db, &transport, stop);
    let sub = |group: &str| {
        SqlSubscriber::new(
            transport.clone(),
            group,
            orders::ORDERS_TOPIC,
            Duration::from_secs(30),
        )
    };
    let billing = orders::billing_consumer_with(
        db.clone(),
        sub(orders::BILLING_CONSUMER),
        consumer_config(),
        orders::BillingHandler::charging(),
    );
    let shipping = orders::shipping_consumer(
        db.clone(),
        sub(orders::SHIPPING_CONSUMER),
        consumer_config(),
    );
    billing.subscribe().await.unwrap();
    shipping.subscribe().await.unwrap();
    tokio::spawn(billing.run(stop.clone()));
    tokio::spawn(shipping.run(stop.clone()));
    let runner = Arc::new(EffectRunner::new(
        EffectStore::new(db.clone()),
        providers,
        Arc::new(orders::OrderEffects::new(orders::ORDERS_TOPIC)),
        runner_config(),
    ));
    tokio::spawn(runner.run(stop.clone()));
}

/// The saga beside the service: relay, `fulfilment` consumer, the effect runner with the
/// orchestrator as its handler, the orchestrator's timeout sweep.
pub(super) async fn spawn_saga(
    db: &Database,
    stop: &CancellationToken,
    fulfilment: &orders::FulfilmentConfig,
    providers: Vec<Arc<dyn Provider>>,
) {
    let transport = SqlTransport::new(db.clone(), 1 << 20);
    spawn_relay(db, &transport, stop);
    let orchestrator = Arc::new(orders::fulfilment_orchestrator(
        db.clone(),
        fulfilment,
        OrchestratorConfig {
            poll: Duration::from_millis(50),
            ..OrchestratorConfig::default()
        },
        Arc::new(orders::OrderEffects::new(orders::ORDERS_TOPIC)),
    ));
    let consumer = orders::fulfilment_consumer(
        db.clone(),
        SqlSubscriber::new(
            transport,
            orders::FULFILMENT_CONSUMER,
            orders::ORDERS_TOPIC,
            Duration::from_secs(30),
        ),
        consumer_config(),
        orchestrator.clone(),
    );
    consumer.subscribe().await.unwrap();
    tokio::spawn(consumer.run(stop.clone()));
    let runner = Arc::new(EffectRunner::new(
        EffectStore::new(db.clone()),
        providers,
        orchestrator.clone(),
        runner_config(),
    ));
    tokio::spawn(runner.run(stop.clone()));
    tokio::spawn(orchestrator.run(stop.clone()));
}

fn spawn_relay(db: &Database, transport: &SqlTransport, stop: &CancellationToken) {
    let relay = oncely_outbox::Relay::new(
        db.clone(),
        Arc::new(transport.clone()),
        oncely_outbox::RelayConfig {
            poll_interval: Duration::from_millis(20),
            ..oncely_outbox::RelayConfig::default()
        },
    );
    tokio::spawn(relay.run(stop.clone()));
}
