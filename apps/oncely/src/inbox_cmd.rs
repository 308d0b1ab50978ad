//! `oncely inbox …`: a consumer group's dead letters on any broker.

use std::sync::Arc;

use clap::Subcommand;

use oncely_broker::{DeadLetter, DeadLetterPosition, DeadLetters, Requeue};
use oncely_cli::BrokerArgs;
use oncely_core::MessageId;

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
        #[arg(long, default_value = "billing")]
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
        #[arg(long, default_value = "billing")]
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
                    "message_id\tattempts\tlast_error\ttopic\tdead_at\tposition\tpayload_bytes"
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

fn letter_row(l: &DeadLetter) -> String {
    format!(
        "{}\t{}\t{}\t{}\t{}\t{}\t{}",
        l.message_id
            .map_or_else(|| "-".to_owned(), |i| i.to_string()),
        l.attempts,
        crate::cell(l.last_error.as_deref()),
        l.topic,
        oncely_core::rfc3339(l.dead_at_ms),
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
