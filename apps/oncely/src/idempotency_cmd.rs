//! `oncely idempotency …`: the operator's view of idempotency records — above all the
//! multi-phase ones left `processing` past their lease or `unknown` (logic in
//! `oncely_sql::IdempotencyStore`).

use anyhow::Context as _;
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
    /// Resolves an `unknown` operation with what a person found at the other side
    /// (audited): `--status` and `--body`, the answer it gave, stored and replayed from now
    /// on; or `--absent`, it had no effect, and the key is freed so the next request with
    /// it runs once more.
    Resolve(ResolveArgs),
}

/// `oncely idempotency resolve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ResolveArgs {
    /// The record's tenant.
    #[arg(long)]
    tenant: String,
    /// The record's operation, as listed: `POST /orders`.
    #[arg(long)]
    operation: String,
    /// The record's `Idempotency-Key`.
    #[arg(long)]
    key: String,
    /// The operation had no effect: the key is freed.
    #[arg(long, conflicts_with_all = ["status", "body"])]
    absent: bool,
    /// The status of the answer the operation gave (with `--body`).
    #[arg(long, required_unless_present = "absent", requires = "body")]
    status: Option<u16>,
    /// The answer's body, stored and replayed byte for byte (JSON, as the API answers).
    #[arg(long)]
    body: Option<String>,
    /// The answer's `Content-Type`.
    #[arg(long, default_value = "application/json")]
    content_type: String,
    /// Why (for the audit row).
    #[arg(long)]
    reason: String,
    /// Who resolves (for the audit row).
    #[arg(long, env = "USER", default_value = "operator")]
    actor: String,
    /// How long the stored answer is replayed, in seconds (the service's
    /// `--retention-secs`).
    #[arg(long, default_value_t = 86_400)]
    retention_secs: u64,
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
    // Retention only matters to the collector, which no command here runs, and to a
    // resolution's stored answer (its own `--retention-secs`).
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
        IdempotencyCommand::Resolve(args) => {
            let retention = std::time::Duration::from_secs(args.retention_secs);
            let store = IdempotencyStore::new(store.database().clone(), retention);
            println!("{}", resolve(&store, &args).await?);
        }
    }
    Ok(())
}

/// `oncely idempotency resolve`: the record must be `unknown`; its fence is read with it,
/// so a retry that takes it over meanwhile wins and the resolution fails. Writes one
/// `oncely_operator_audit` row (`resolve-idempotency`). Returns the row printed.
///
/// # Errors
/// A bad tenant, key or status; no such record, or not `unknown`; the database fails.
async fn resolve(
    store: &IdempotencyStore,
    args: &ResolveArgs,
) -> anyhow::Result<serde_json::Value> {
    let tenant = oncely_core::TenantId::parse(&args.tenant).context("--tenant")?;
    let (method, template) = args
        .operation
        .split_once(' ')
        .context("--operation is `METHOD /path/template`, as listed")?;
    let scope = oncely_core::Scope::new(tenant, oncely_core::Operation::new(method, template));
    let key = oncely_core::IdempotencyKey::parse(args.key.as_bytes()).context("--key")?;
    let record = store.lookup(&scope, &key).await?.with_context(|| {
        format!(
            "no record of key {:?} for that tenant and operation",
            args.key
        )
    })?;
    anyhow::ensure!(
        record.state == RecordState::Unknown,
        "the record is {}, not unknown: only an operation whose outcome is unknown is resolved",
        record.state.as_str()
    );
    let now = oncely_core::now_ms();
    let detail = if let (Some(status), Some(body)) = (&args.status, &args.body) {
        anyhow::ensure!(
            (200..600).contains(status),
            "--status {status} is not a final HTTP status"
        );
        let answer = oncely_core::StoredResponse::new(
            *status,
            [("content-type", args.content_type.as_str())],
            body.clone().into_bytes(),
        );
        store
            .complete_unknown(&scope, &key, record.fence, &answer, now)
            .await?;
        format!(
            "found: {status}, {} bytes stored; reason: {}",
            body.len(),
            args.reason
        )
    } else {
        store.release_unknown(&scope, &key, record.fence).await?;
        format!("absent: key freed; reason: {}", args.reason)
    };
    let target = format!(
        "idempotency:{}:{}:{}",
        args.tenant,
        scope.operation.as_str(),
        args.key
    );
    oncely_sql::OperatorAudit::new(store.database().clone())
        .record(now, &args.actor, "resolve-idempotency", &target, &detail)
        .await?;
    Ok(
        json!({"tenant": args.tenant, "operation": scope.operation.as_str(), "key": args.key,
        "resolution": if args.absent { "absent" } else { "found" }, "detail": detail}),
    )
}
