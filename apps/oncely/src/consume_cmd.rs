//! `oncely consume`'s arguments, the consumer arguments `oncely serve` shares, and
//! `oncely inbox …`.

use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use oncely_broker::{SqlTransport, Subscriber};
use oncely_core::{MessageId, RetryPolicy};
use oncely_inbox::{Consumer, ConsumerConfig};
use oncely_runtime::{ConsumerFactory, ConsumerSettings};
use oncely_sql::Database;

/// The consumers this binary can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ConsumerName {
    /// `billing`: one invoice per `order.created` (and its charge, with payments
    /// configured).
    Billing,
    /// `shipping`: one shipment booking per `invoice.paid`.
    Shipping,
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

/// A consumer to build: which, and whether billing enqueues each new invoice's charge
/// (payments configured).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Flow {
    /// The consumer.
    pub(crate) name: ConsumerName,
    /// Billing: enqueue charges.
    pub(crate) charge: bool,
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
        }
    }
}

/// `oncely inbox …`: operator commands for the SQL transport's consumer deliveries
/// (RabbitMQ and NATS keep dead letters in the group's dead queue / DLQ subject).
#[derive(Debug, Subcommand)]
pub(crate) enum InboxCommand {
    /// Dead deliveries of a consumer.
    #[command(subcommand)]
    Dead(DeadCommand),
}

/// `oncely inbox dead …`.
#[derive(Debug, Subcommand)]
pub(crate) enum DeadCommand {
    /// Lists dead deliveries (message id, attempts, last error).
    List {
        /// The consumer.
        #[arg(long, value_enum, default_value_t = ConsumerName::Billing)]
        consumer: ConsumerName,
        /// Most rows to print.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Puts dead deliveries back to pending for that consumer only (attempts reset).
    Requeue {
        /// The consumer.
        #[arg(long, value_enum, default_value_t = ConsumerName::Billing)]
        consumer: ConsumerName,
        /// The message id to requeue.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        message_id: Option<String>,
        /// Requeue every dead delivery of the consumer.
        #[arg(long)]
        all: bool,
    },
}

fn consumer_name(name: ConsumerName) -> &'static str {
    match name {
        ConsumerName::Billing => orders::BILLING_CONSUMER,
        ConsumerName::Shipping => orders::SHIPPING_CONSUMER,
    }
}

/// Runs an `oncely inbox` command, printing to stdout.
pub(crate) async fn inbox(db: Database, cmd: InboxCommand) -> anyhow::Result<()> {
    let transport = SqlTransport::new(db, usize::MAX);
    match cmd {
        InboxCommand::Dead(DeadCommand::List { consumer, limit }) => {
            let rows = transport
                .dead_deliveries(consumer_name(consumer), limit)
                .await?;
            println!("message_id\tattempts\tlast_error");
            for r in rows {
                println!(
                    "{}\t{}\t{}",
                    r.id,
                    r.attempts,
                    r.last_error.unwrap_or_default().replace(['\t', '\n'], " ")
                );
            }
        }
        InboxCommand::Dead(DeadCommand::Requeue {
            consumer,
            message_id,
            all,
        }) => {
            let id = match (message_id, all) {
                (_, true) => None,
                (Some(id), false) => Some(MessageId::parse(&id)?),
                (None, false) => anyhow::bail!("give a message id or --all"),
            };
            let n = transport
                .requeue_dead(consumer_name(consumer), id.as_ref())
                .await?;
            if let (Some(id), 0) = (id, n) {
                anyhow::bail!("no dead delivery of message {id}");
            }
            println!("requeued {n}");
        }
    }
    Ok(())
}
