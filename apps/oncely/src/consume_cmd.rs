//! `oncely consume`'s arguments, the consumer arguments `oncely serve` shares, and
//! `oncely inbox …`.

use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};

use oncely_broker::{DeadLetter, DeadLetterPosition, DeadLetters, Requeue, Subscriber};
use oncely_core::{MessageId, RetryPolicy};
use oncely_inbox::{Consumer, ConsumerConfig};
use oncely_runtime::{ConsumerFactory, ConsumerSettings};
use oncely_sql::Database;

use crate::relay_cmd::BrokerArgs;

/// The consumers this binary can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ConsumerName {
    /// `billing`: one invoice per `order.created` (and its charge, with payments
    /// configured).
    Billing,
    /// `shipping`: one shipment booking per `invoice.paid`.
    Shipping,
    /// `fulfilment`: one fulfilment saga per `order.created` (`--fulfilment saga`).
    Fulfilment,
}

/// Inbox consumer settings (shared by `serve` and `consume`); the broker comes from
/// `BrokerArgs` (`--broker`, the relay's).
#[derive(Debug, Args)]
pub(crate) struct ConsumerArgs {
    /// Topic the consumer reads (the order service's events topic). `oncely serve` ignores
    /// it: its in-process consumer reads the service's own `--events-topic`.
    #[arg(long, env = "ONCELY_CONSUMER_TOPIC", default_value = orders::ORDERS_TOPIC)]
    pub(crate) consumer_topic: String,
    /// Messages handled at once.
    #[arg(long, env = "ONCELY_CONSUMER_CONCURRENCY", default_value_t = 8)]
    consumer_concurrency: usize,
    /// Idle polling interval (SQL transport) / longest wait of one receive, in ms.
    #[arg(long, env = "ONCELY_CONSUMER_POLL_MS", default_value_t = 100)]
    consumer_poll_ms: u64,
    /// Lease on a claimed message (SQL transport) / `ack_wait` (NATS), in seconds: an
    /// unacknowledged message is delivered again after it (must exceed the handler's
    /// longest run). RabbitMQ redelivers when the channel closes instead.
    #[arg(long, env = "ONCELY_CONSUMER_LEASE_SECS", default_value_t = 30)]
    consumer_lease_secs: u64,
    /// Failed handler runs after which a message is dead.
    #[arg(long, env = "ONCELY_CONSUMER_MAX_ATTEMPTS", default_value_t = 10)]
    consumer_max_attempts: u32,
    /// Backoff: upper bound of the first retry's wait, in ms (full jitter, doubling).
    #[arg(long, env = "ONCELY_CONSUMER_BACKOFF_BASE_MS", default_value_t = 500)]
    consumer_backoff_base_ms: u64,
    /// Backoff: upper bound of any wait, in seconds.
    #[arg(long, env = "ONCELY_CONSUMER_BACKOFF_CAP_SECS", default_value_t = 300)]
    consumer_backoff_cap_secs: u64,
    /// How long inbox rows are kept, in seconds; must be longer than the broker's
    /// redelivery window (default 7 days).
    #[arg(long, env = "ONCELY_INBOX_RETENTION_SECS", default_value_t = 604_800)]
    inbox_retention_secs: u64,
}

impl ConsumerArgs {
    fn config(&self) -> ConsumerConfig {
        ConsumerConfig {
            concurrency: self.consumer_concurrency.max(1),
            poll: Duration::from_millis(self.consumer_poll_ms.max(1)),
            retry: RetryPolicy {
                base: Duration::from_millis(self.consumer_backoff_base_ms),
                cap: Duration::from_secs(self.consumer_backoff_cap_secs),
                max_attempts: self.consumer_max_attempts.max(1),
                ..RetryPolicy::default()
            },
            inbox_retention: Duration::from_secs(self.inbox_retention_secs),
            ..ConsumerConfig::default()
        }
    }

    /// The settings of consumer `name` these arguments describe.
    pub(crate) fn settings(&self, name: ConsumerName) -> ConsumerSettings {
        ConsumerSettings {
            group: consumer_name(name).to_owned(),
            topic: self.consumer_topic.clone(),
            lease: Duration::from_secs(self.consumer_lease_secs.max(1)),
            consumer: self.config(),
        }
    }
}

/// A consumer to build: which, whether billing enqueues each new invoice's charge
/// (payments configured), and the saga orchestrator the fulfilment consumer starts sagas
/// with.
#[derive(Debug, Clone)]
pub(crate) struct Flow {
    /// The consumer.
    pub(crate) name: ConsumerName,
    /// Billing: enqueue charges.
    pub(crate) charge: bool,
    /// Fulfilment: the orchestrator (`None` for the other consumers).
    pub(crate) orchestrator: Option<std::sync::Arc<oncely_saga::Orchestrator>>,
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
                    orders::BillingHandler::charging()
                } else {
                    orders::BillingHandler::invoices_only()
                };
                orders::billing_consumer_with(db.clone(), subscriber, config, handler)
            }
            ConsumerName::Shipping => orders::shipping_consumer(db.clone(), subscriber, config),
            ConsumerName::Fulfilment => {
                let orchestrator = self.orchestrator.clone().unwrap_or_else(|| {
                    std::sync::Arc::new(fulfilment_orchestrator(
                        db,
                        &orders::FulfilmentConfig::default(),
                    ))
                });
                orders::fulfilment_consumer(db.clone(), subscriber, config, orchestrator)
            }
        }
    }
}

/// `oncely inbox …`: operator commands for the consumer groups' dead letters, on the broker
/// `--broker` names (SQL transport: `oncely_deliveries`; RabbitMQ: the group's dead queue;
/// NATS: the DLQ stream; Kafka: the dead-letter topic).
#[derive(Debug, Subcommand)]
pub(crate) enum InboxCommand {
    /// Dead letters of a consumer group.
    #[command(subcommand)]
    Dead(DeadCommand),
}

/// `oncely inbox dead …`.
#[derive(Debug, Subcommand)]
pub(crate) enum DeadCommand {
    /// Lists dead letters, oldest first: message id, attempts, last error, topic,
    /// dead-lettered at (Unix ms, 0 when the broker does not say), position, payload bytes.
    List {
        #[command(flatten)]
        broker: BrokerArgs,
        /// The consumer group.
        #[arg(long, default_value = orders::BILLING_CONSUMER)]
        consumer: String,
        /// Most letters to print.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Only letters after this position (the last one a previous page printed, e.g.
        /// `sql:42`, `amqp:99`, `nats:7`, `kafka:orders.dlq.billing:0:12`).
        #[arg(long)]
        after: Option<DeadLetterPosition>,
        /// One JSON object per letter, one per line (with a payload preview).
        #[arg(long)]
        json: bool,
    },
    /// Sends dead letters back to that consumer group only, attempts reset (requeued
    /// first, then removed from the dead letters).
    Requeue {
        #[command(flatten)]
        broker: BrokerArgs,
        /// The consumer group.
        #[arg(long, default_value = orders::BILLING_CONSUMER)]
        consumer: String,
        /// The message id to requeue.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        message_id: Option<String>,
        /// Requeue every dead letter of the group.
        #[arg(long)]
        all: bool,
    },
}

impl InboxCommand {
    /// The broker the command acts on.
    pub(crate) fn broker(&self) -> &BrokerArgs {
        match self {
            Self::Dead(DeadCommand::List { broker, .. } | DeadCommand::Requeue { broker, .. }) => {
                broker
            }
        }
    }
}

fn consumer_name(name: ConsumerName) -> &'static str {
    match name {
        ConsumerName::Billing => orders::BILLING_CONSUMER,
        ConsumerName::Shipping => orders::SHIPPING_CONSUMER,
        ConsumerName::Fulfilment => orders::FULFILMENT_CONSUMER,
    }
}

/// The fulfilment saga's orchestrator over `db` with `config`, chaining the choreography's
/// effects to [`orders::OrderEffects`] on the default events topic.
pub(crate) fn fulfilment_orchestrator(
    db: &Database,
    config: &orders::FulfilmentConfig,
) -> oncely_saga::Orchestrator {
    orders::fulfilment_orchestrator(
        db.clone(),
        config,
        oncely_saga::OrchestratorConfig::default(),
        std::sync::Arc::new(orders::OrderEffects::new(orders::ORDERS_TOPIC)),
    )
}

/// Runs an `oncely inbox` command on `dead` (the configured broker's dead letters),
/// printing to stdout.
pub(crate) async fn inbox(dead: Arc<dyn DeadLetters>, cmd: InboxCommand) -> anyhow::Result<()> {
    let result = run_inbox(&*dead, cmd).await;
    dead.close().await;
    result
}

async fn run_inbox(dead: &dyn DeadLetters, cmd: InboxCommand) -> anyhow::Result<()> {
    match cmd {
        InboxCommand::Dead(DeadCommand::List {
            consumer,
            limit,
            after,
            json,
            ..
        }) => {
            let letters = dead.list(&consumer, limit, after.as_ref()).await?;
            if !json {
                println!(
                    "message_id\tattempts\tlast_error\ttopic\tdead_at_ms\tposition\tpayload_bytes"
                );
            }
            for l in letters {
                if json {
                    println!("{}", letter_json(&l));
                } else {
                    println!("{}", letter_row(&l));
                }
            }
        }
        InboxCommand::Dead(DeadCommand::Requeue {
            consumer,
            message_id,
            all,
            ..
        }) => {
            let which = match (message_id, all) {
                (_, true) => Requeue::All,
                (Some(id), false) => Requeue::Message(MessageId::parse(&id)?),
                (None, false) => anyhow::bail!("give a message id or --all"),
            };
            let n = dead.requeue(&consumer, which).await?;
            if let (Requeue::Message(id), 0) = (which, n) {
                anyhow::bail!("no dead letter of message {id} for consumer {consumer}");
            }
            println!("requeued {n}");
        }
    }
    Ok(())
}

fn one_line(s: &str) -> String {
    s.replace(['\t', '\n', '\r'], " ")
}

fn letter_row(l: &DeadLetter) -> String {
    format!(
        "{}\t{}\t{}\t{}\t{}\t{}\t{}",
        l.message_id
            .map_or_else(|| "-".to_owned(), |i| i.to_string()),
        l.attempts,
        one_line(l.last_error.as_deref().unwrap_or_default()),
        l.topic,
        l.dead_at_ms,
        l.position,
        l.payload_size,
    )
}

fn letter_json(l: &DeadLetter) -> serde_json::Value {
    serde_json::json!({
        "message_id": l.message_id.map(|i| i.to_string()),
        "group": l.group,
        "topic": l.topic,
        "event_type": l.event_type,
        "attempts": l.attempts,
        "last_error": l.last_error,
        "dead_at_ms": l.dead_at_ms,
        "position": l.position.to_string(),
        "payload_bytes": l.payload_size,
        "payload_preview": l.payload_preview,
    })
}
