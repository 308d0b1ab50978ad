//! `oncely saga list|show|retry`: the operator's view of sagas and the audited retry of a
//! parked step (logic in `oncely_saga::SagaOperator` and `Orchestrator::retry`).

use clap::{Subcommand, ValueEnum};
use oncely_saga::{Saga, SagaOperator, SagaState};
use oncely_sql::{Database, EffectStore};
use serde_json::json;

/// `oncely saga …`.
#[derive(Debug, Subcommand)]
pub(crate) enum SagaCommand {
    /// Lists sagas (newest first, every tenant's unless `--tenant`).
    List {
        /// Only sagas in this state.
        #[arg(long, value_enum)]
        state: Option<StateArg>,
        /// Only this tenant's sagas.
        #[arg(long)]
        tenant: Option<String>,
        #[command(flatten)]
        list: crate::ListArgs,
    },
    /// Shows one saga as JSON: its row, its step log with each step's evidence and
    /// effect (state, attempts with their evidence), and the operators' actions on it.
    Show {
        /// The saga's id.
        id: String,
    },
    /// Puts the parked step of a saga in `needs_review` back to work (audited): its effect
    /// is checked at the provider again (outcome unknown) or sent again under its next key
    /// (refused), a local step runs again.
    Retry {
        /// The saga's id.
        id: String,
        /// Who asks (for the audit row).
        #[arg(long, env = "USER", default_value = "operator")]
        actor: String,
    },
}

/// A saga state on the command line.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum StateArg {
    Running,
    Compensating,
    Completed,
    Compensated,
    /// `needs-review`, or `needs_review` as the output prints it.
    #[value(alias = "needs_review")]
    NeedsReview,
}

impl From<StateArg> for SagaState {
    fn from(s: StateArg) -> Self {
        match s {
            StateArg::Running => Self::Running,
            StateArg::Compensating => Self::Compensating,
            StateArg::Completed => Self::Completed,
            StateArg::Compensated => Self::Compensated,
            StateArg::NeedsReview => Self::NeedsReview,
        }
    }
}

fn row(s: &Saga) -> serde_json::Value {
    json!({
        "id": s.id, "tenant": s.tenant, "kind": s.kind, "state": s.state.as_str(),
        "version": s.version, "step": s.step, "error": s.error, "deadline": s.deadline,
        "created_at": s.created_at, "updated_at": s.updated_at,
    })
}

/// A saga's step in the table: its index, or `-` before its first step has begun (stored
/// as -1).
fn step_cell(step: i64) -> String {
    if step < 0 {
        "-".to_owned()
    } else {
        step.to_string()
    }
}

/// Runs an `oncely saga` command over `db`, printing to stdout.
pub(crate) async fn saga(db: Database, cmd: SagaCommand) -> anyhow::Result<()> {
    let sagas = SagaOperator::new(db.clone());
    match cmd {
        SagaCommand::List {
            state,
            tenant,
            list,
        } => {
            let rows = sagas
                .list(tenant.as_deref(), state.map(Into::into), list.limit)
                .await?;
            list.print(
                &rows,
                row,
                "id\ttenant\tkind\tstate\tstep\tupdated_at\terror",
                |s| {
                    format!(
                        "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                        s.id,
                        s.tenant,
                        s.kind,
                        s.state,
                        step_cell(s.step),
                        oncely_core::rfc3339(s.updated_at),
                        crate::cell(s.error.as_deref()),
                    )
                },
            );
        }
        SagaCommand::Show { id } => show(&db, &sagas, &id).await?,
        SagaCommand::Retry { id, actor } => {
            let done = sagas.retry(&id, &actor).await?;
            let mut out = row(&done.saga);
            out["retried"] = json!({
                "step": done.step, "phase": done.phase.as_str(), "detail": done.detail,
            });
            println!("{out}");
        }
    }
    Ok(())
}

/// `oncely saga show ID`: the saga, its steps with their effects' evidence, its audit.
async fn show(db: &Database, sagas: &SagaOperator, id: &str) -> anyhow::Result<()> {
    let saga = sagas
        .get(id)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no saga {id}"))?;
    let effects = EffectStore::new(db.clone());
    let mut steps = Vec::new();
    for s in sagas.steps(id).await? {
        let effect = match &s.effect_id {
            Some(effect_id) => effect_json(&effects, effect_id).await?,
            None => serde_json::Value::Null,
        };
        steps.push(json!({
            "step": s.step, "name": s.name, "phase": s.phase.as_str(), "state": s.state.as_str(),
            "attempts": s.attempts, "started_at": s.started_at, "finished_at": s.finished_at,
            "output": s.output, "evidence": s.evidence, "effect": effect,
        }));
    }
    let audit: Vec<_> = sagas
        .audit(id)
        .await?
        .into_iter()
        .map(|a| {
            json!({"at": a.at, "actor": a.actor, "action": a.action, "from": a.from,
                "to": a.to, "step": a.step, "detail": a.detail})
        })
        .collect();
    let mut out = row(&saga);
    out["input"] = saga.input;
    out["steps"] = steps.into();
    out["audit"] = audit.into();
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// A step's effect: its state, provider object and the evidence of each attempt.
async fn effect_json(effects: &EffectStore, id: &str) -> anyhow::Result<serde_json::Value> {
    let Some(e) = effects.get(id).await? else {
        return Ok(json!({"id": id, "state": null}));
    };
    let evidence: Vec<_> = effects
        .evidence(id)
        .await?
        .into_iter()
        .map(|a| {
            json!({"n": a.n, "kind": a.kind, "outcome": a.outcome, "http_status": a.http_status,
                "provider_ids": a.provider_ids, "detail": a.detail})
        })
        .collect();
    Ok(json!({
        "id": e.id, "provider": e.provider, "operation": e.operation,
        "reference": e.reference, "state": e.state_word, "attempts": e.attempts,
        "checks": e.checks, "provider_id": e.provider_id, "last_error": e.last_error,
        "evidence": evidence,
    }))
}
