//! `oncely idempotency …`: the operator's view of idempotency records — above all the
//! multi-phase ones left `processing` past their lease or `unknown` (logic in
//! `oncely_sql::IdempotencyStore`).

use clap::{Subcommand, ValueEnum};
use oncely_core::RecordState;
use oncely_sql::{Database, IdempotencyStore, RecordSummary};
use serde_json::json;

/// `oncely idempotency …`.
#[derive(Debug, Subcommand)]
pub(crate) enum IdempotencyCommand {
    /// Lists records (oldest first, every tenant's), in one state when `--state` is given.
    List {
        /// Only records in this state.
        #[arg(long, value_enum)]
        state: Option<StateArg>,
        #[command(flatten)]
        list: crate::ListArgs,
    },
}

/// A record state on the command line.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum StateArg {
    Processing,
    Succeeded,
    Failed,
    Unknown,
}

impl From<StateArg> for RecordState {
    fn from(s: StateArg) -> Self {
        match s {
            StateArg::Processing => Self::Processing,
            StateArg::Succeeded => Self::Succeeded,
            StateArg::Failed => Self::Failed,
            StateArg::Unknown => Self::Unknown,
        }
    }
}

fn row(r: &RecordSummary) -> serde_json::Value {
    json!({
        "tenant": r.tenant, "operation": r.operation, "key": r.key, "state": r.state,
        "fence": r.fence, "lease_until": r.lease_until, "created_at": r.created_at,
        "completed_at": r.completed_at,
    })
}

/// Runs an `oncely idempotency` command, printing to stdout.
pub(crate) async fn idempotency(db: Database, cmd: IdempotencyCommand) -> anyhow::Result<()> {
    // Retention only matters to the collector, which no command here runs.
    let store = IdempotencyStore::new(db, std::time::Duration::from_secs(24 * 3600));
    match cmd {
        IdempotencyCommand::List { state, list } => {
            let rows = store
                .list_records(state.map(Into::into), list.limit)
                .await?;
            list.print(
                &rows,
                row,
                "tenant\toperation\tkey\tstate\tfence\tlease_until\tcreated_at",
                |r| {
                    format!(
                        "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                        r.tenant,
                        r.operation,
                        r.key,
                        r.state,
                        r.fence,
                        r.lease_until.map(oncely_core::rfc3339).unwrap_or_default(),
                        oncely_core::rfc3339(r.created_at),
                    )
                },
            );
        }
    }
    Ok(())
}
