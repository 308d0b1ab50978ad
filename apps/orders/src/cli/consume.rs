//! `orders consume billing|shipping|fulfilment`: one of the service's inbox consumers, and
//! the [`Flow`] that builds each (also for `orders serve`'s in-process consumers).

use std::net::SocketAddr;

use clap::{Args, ValueEnum};
use oncely_broker::Subscriber;
use oncely_inbox::{Consumer, ConsumerConfig};
use oncely_runtime::{shutdown_signal, ConsumerFactory};
use oncely_sql::Database;

/// The service's consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum ConsumerName {
    /// `billing`: one invoice per `order.created` (and its charge, with payments
    /// configured).
    Billing,
    /// `shipping`: one shipment booking per `invoice.paid`.
    Shipping,
    /// `fulfilment`: one fulfilment saga per `order.created` (`--fulfilment saga`).
    Fulfilment,
}

/// A consumer to build: which, whether billing enqueues each new invoice's charge
/// (payments configured), and the saga orchestrator the fulfilment consumer starts sagas
/// with.
#[derive(Debug, Clone)]
pub(super) struct Flow {
    /// The consumer.
    pub(super) name: ConsumerName,
    /// Billing: enqueue charges.
    pub(super) charge: bool,
    /// Fulfilment: the orchestrator (`None` for the other consumers).
    pub(super) orchestrator: Option<std::sync::Arc<oncely_saga::Orchestrator>>,
}

impl ConsumerFactory for Flow {
    fn build<S: Subscriber>(
        &self,
        db: &Database,
        subscriber: S,
        config: ConsumerConfig,
    ) -> Consumer<S> {
        match self.name {
            ConsumerName::Billing => {
                let handler = if self.charge {
                    crate::BillingHandler::charging()
                } else {
                    crate::BillingHandler::invoices_only()
                };
                crate::billing_consumer_with(db.clone(), subscriber, config, handler)
            }
            ConsumerName::Shipping => crate::shipping_consumer(db.clone(), subscriber, config),
            ConsumerName::Fulfilment => {
                let orchestrator = self.orchestrator.clone().unwrap_or_else(|| {
                    std::sync::Arc::new(fulfilment_orchestrator(
                        db,
                        &crate::FulfilmentConfig::default(),
                    ))
                });
                crate::fulfilment_consumer(db.clone(), subscriber, config, orchestrator)
            }
        }
    }
}

/// The consumer group of `name`.
pub(super) fn consumer_name(name: ConsumerName) -> &'static str {
    match name {
        ConsumerName::Billing => crate::BILLING_CONSUMER,
        ConsumerName::Shipping => crate::SHIPPING_CONSUMER,
        ConsumerName::Fulfilment => crate::FULFILMENT_CONSUMER,
    }
}

/// The fulfilment saga's orchestrator over `db` with `config`, chaining the choreography's
/// effects to [`crate::OrderEffects`] on the default events topic.
fn fulfilment_orchestrator(
    db: &Database,
    config: &crate::FulfilmentConfig,
) -> oncely_saga::Orchestrator {
    crate::fulfilment_orchestrator(
        db.clone(),
        config,
        oncely_saga::OrchestratorConfig::default(),
        std::sync::Arc::new(crate::OrderEffects::new(crate::ORDERS_TOPIC)),
    )
}

/// `orders consume NAME`.
#[derive(Debug, Args)]
pub(super) struct ConsumeArgs {
    /// Which consumer.
    #[arg(value_enum)]
    name: ConsumerName,
    #[command(flatten)]
    db: oncely_cli::DbArgs,
    #[command(flatten)]
    broker: oncely_cli::BrokerArgs,
    #[command(flatten)]
    consumer: oncely_cli::ConsumerArgs,
    /// Billing: payments are configured (the URL the runner charges at), so each new
    /// invoice's charge is enqueued with it. Unset: billing stops at the invoice.
    #[arg(long, env = "ONCELY_PAYMENTS_URL")]
    payments_url: Option<String>,
    /// Serve the consumer's metrics on `GET /metrics` at this address (e.g. 127.0.0.1:9465).
    #[arg(long, env = "ONCELY_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

/// `orders consume NAME`: the consumer alone until SIGTERM / Ctrl-C.
pub(super) async fn consume(args: ConsumeArgs) -> anyhow::Result<()> {
    args.db.require_pool(&[oncely_cli::PoolUser::Consumer]);
    let db = super::connect(&args.db).await?;
    let metrics = super::metrics_endpoint(args.metrics_listen);
    let broker = args.broker.config();
    let settings = args.consumer.settings(consumer_name(args.name));
    let flow = Flow {
        name: args.name,
        charge: args.payments_url.is_some(),
        orchestrator: None,
    };
    Ok(
        oncely_runtime::run_consumer(&db, &broker, &settings, &flow, metrics, shutdown_signal())
            .await?,
    )
}
