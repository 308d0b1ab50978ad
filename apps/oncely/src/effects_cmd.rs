//! `oncely effects …`: the operator's view of outgoing effects and the two actions a person
//! takes on one (logic in `oncely_sql::EffectStore`; every action writes an audit row). A
//! resolution is recorded here and continued by the service's own runner
//! ([`oncely_effects::Continue::ByRunner`]).

use clap::{Subcommand, ValueEnum};
use oncely_effects::Continue;
use oncely_sql::{Database, Effect, EffectState, EffectStore, Resolution};
use serde_json::json;

/// `oncely effects …`.
#[derive(Debug, Subcommand)]
pub(crate) enum EffectsCommand {
    /// Lists effects (oldest first), in one state when `--state` is given.
    List {
        /// Only effects in this state.
        #[arg(long, value_parser = parse_state)]
        state: Option<EffectState>,
        #[command(flatten)]
        list: crate::ListArgs,
    },
    /// One effect with its evidence (every call and status check) and its audit trail.
    Show {
        /// The effect's id.
        id: String,
    },
    /// Tries a `needs_review`, `unknown` or `failed` effect again. Never a blind call: an
    /// unknown outcome is checked at the provider first; a failed one is sent under its
    /// key's next generation.
    Retry {
        /// The effect's id.
        id: String,
        /// Who asks (for the audit row).
        #[arg(long, env = "USER", default_value = "operator")]
        actor: String,
    },
    /// Records what a person found at the provider for a `needs_review`, `unknown` or
    /// `absent` effect; the service's runner continues it (an invoice marked paid, a saga's
    /// next step) with the service's own configuration.
    Resolve {
        /// The effect's id.
        id: String,
        /// What happened.
        #[arg(long = "as", value_enum)]
        outcome: Outcome,
        /// The provider's object id (required with `--as succeeded`).
        #[arg(long, required_if_eq("outcome", "succeeded"))]
        provider_id: Option<String>,
        /// Why (for the audit row).
        #[arg(long, default_value = "resolved by an operator")]
        reason: String,
        /// Who resolves (for the audit row).
        #[arg(long, env = "USER", default_value = "operator")]
        actor: String,
    },
}

/// An effect state on the command line: its stored word, with `-` or `_` between words
/// (`needs-review`).
fn parse_state(word: &str) -> Result<EffectState, String> {
    EffectState::parse(&word.replace('-', "_")).map_err(|_| {
        let words: Vec<&str> = EffectState::ALL.iter().map(|s| s.as_str()).collect();
        format!("one of {}", words.join(", "))
    })
}

/// What an operator resolves an effect as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Outcome {
    Succeeded,
    Failed,
}

fn row(e: &Effect) -> serde_json::Value {
    json!({
        "id": e.id, "tenant": e.tenant, "provider": e.provider, "operation": e.operation,
        "reference": e.reference, "state": e.state_word, "attempts": e.attempts,
        "checks": e.checks, "key": e.key, "provider_id": e.provider_id,
        "last_error": e.last_error, "created_at": e.created_at, "updated_at": e.updated_at,
    })
}

/// Runs an `oncely effects` command, printing to stdout.
pub(crate) async fn effects(db: Database, cmd: EffectsCommand) -> anyhow::Result<()> {
    let store = EffectStore::new(db);
    let now = oncely_core::now_ms();
    match cmd {
        EffectsCommand::List { state, list } => {
            let rows = store.list(state, list.limit).await?;
            list.print(
                &rows,
                row,
                "id\tprovider\toperation\treference\tstate\tattempts\tchecks\tprovider_id\tlast_error",
                |e| {
                    format!(
                        "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
                        e.id,
                        e.provider,
                        e.operation,
                        e.reference,
                        e.state_word,
                        e.attempts,
                        e.checks,
                        e.provider_id.as_deref().unwrap_or_default(),
                        crate::cell(e.last_error.as_deref()),
                    )
                },
            );
        }
        EffectsCommand::Show { id } => {
            let effect = store
                .get(&id)
                .await?
                .ok_or_else(|| anyhow::anyhow!("no effect {id}"))?;
            let evidence: Vec<_> = store
                .evidence(&id)
                .await?
                .into_iter()
                .map(|e| {
                    json!({"n": e.n, "kind": e.kind, "key": e.key, "started_at": e.started_at,
                        "finished_at": e.finished_at, "outcome": e.outcome,
                        "http_status": e.http_status, "provider_ids": e.provider_ids,
                        "detail": e.detail})
                })
                .collect();
            let audit: Vec<_> = store
                .audit_trail(&id)
                .await?
                .into_iter()
                .map(|(at, actor, action, from, to, detail)| {
                    json!({"at": at, "actor": actor, "action": action, "from": from, "to": to,
                        "detail": detail})
                })
                .collect();
            let mut out = row(&effect);
            out["request"] = effect.params()?;
            out["evidence"] = evidence.into();
            out["audit"] = audit.into();
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        EffectsCommand::Retry { id, actor } => {
            let e = oncely_effects::retry_effect(&store, &id, &actor, now).await?;
            println!("{}", row(&e));
        }
        EffectsCommand::Resolve {
            id,
            outcome,
            provider_id,
            reason,
            actor,
        } => {
            let resolution = Resolution {
                to: match outcome {
                    Outcome::Succeeded => EffectState::Succeeded,
                    Outcome::Failed => EffectState::Failed,
                },
                provider_id: provider_id.as_deref(),
                actor: &actor,
                reason: &reason,
            };
            // The resolution, its audit row and the mark commit together; the service's
            // runner makes the business update (invoice paid, invoice.paid; a saga step's
            // continuation) from the mark, with the service's own configuration.
            let e =
                oncely_effects::resolve_effect(&store, Continue::ByRunner, &id, &resolution, now)
                    .await?;
            println!("{}", row(&e));
        }
    }
    Ok(())
}
