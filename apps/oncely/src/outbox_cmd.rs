//! `oncely outbox …`: the outbox's depth and its dead events.

use clap::Subcommand;
use oncely_sql::{Database, OutboxStore, RequeueTarget};

/// `oncely outbox …`: operator commands.
#[derive(Debug, Subcommand)]
pub(crate) enum OutboxCommand {
    /// Depth, oldest pending age and dead count.
    Stats,
    /// Dead events.
    #[command(subcommand)]
    Dead(DeadCommand),
}

/// `oncely outbox dead …`.
#[derive(Debug, Subcommand)]
pub(crate) enum DeadCommand {
    /// Lists dead events (id, message id, topic, partition key, type, attempts, last error).
    List {
        /// Most rows to print.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Puts dead events back to pending (attempts reset).
    Requeue {
        /// The outbox row id to requeue.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<i64>,
        /// Requeue every dead event.
        #[arg(long)]
        all: bool,
    },
}

/// Runs an `oncely outbox` command, printing to stdout.
pub(crate) async fn outbox(db: Database, cmd: OutboxCommand) -> anyhow::Result<()> {
    let store = OutboxStore::new(db);
    match cmd {
        OutboxCommand::Stats => {
            let s = store.stats().await?;
            let age_ms = s.oldest_pending_age_ms(oncely_core::now_ms());
            println!(
                "{}",
                serde_json::json!({
                    "pending": s.pending,
                    "oldest_pending_age_seconds": age_ms as f64 / 1000.0,
                    "dead": s.dead,
                })
            );
        }
        OutboxCommand::Dead(DeadCommand::List { limit }) => {
            let rows = store.dead(0, limit).await?;
            println!("id\tmessage_id\ttopic\tpartition_key\tevent_type\tattempts\tlast_error");
            for r in rows {
                println!(
                    "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                    r.id,
                    r.event.message_id,
                    r.event.topic,
                    r.event.partition_key,
                    r.event.event_type,
                    r.attempts,
                    crate::cell(r.last_error.as_deref()),
                );
            }
        }
        OutboxCommand::Dead(DeadCommand::Requeue { id, all }) => {
            let target = match (id, all) {
                (_, true) => RequeueTarget::All,
                (Some(id), false) => RequeueTarget::Id(id),
                (None, false) => anyhow::bail!("give an id or --all"),
            };
            let n = store.requeue_dead(target, oncely_core::now_ms()).await?;
            if let (RequeueTarget::Id(id), 0) = (target, n) {
                anyhow::bail!("no dead event with id {id}");
            }
            println!("requeued {n}");
        }
    }
    Ok(())
}
