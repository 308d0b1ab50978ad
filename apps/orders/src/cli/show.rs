//! `orders show ID --tenant T [--json]`: one order's whole chain ([`crate::order_chain`]) in
//! the terminal — the timeline the console's order page draws, one step a line with its
//! evidence below it — or as one JSON object (`--json`: the [`crate::OrderChain`], times in
//! RFC 3339). Exit status 1 when the tenant has no such order.

use std::io::Write as _;

use anyhow::Context as _;
use clap::Args;
use oncely_core::TenantId;

/// `orders show`.
#[derive(Debug, Args)]
pub(super) struct ShowArgs {
    #[command(flatten)]
    db: oncely_cli::DbArgs,
    /// The order's id (as in `Location: /v1/orders/{id}`).
    id: String,
    /// The tenant that owns it: another tenant's order is not found.
    #[arg(long)]
    tenant: String,
    /// Print the chain as one JSON object instead of the timeline.
    #[arg(long)]
    json: bool,
}

/// Runs `orders show`.
pub(super) async fn run(args: ShowArgs) -> anyhow::Result<()> {
    let tenant = TenantId::parse(&args.tenant)
        .with_context(|| format!("--tenant {:?} is not a tenant id", args.tenant))?;
    let db = super::connect(&args.db).await?;
    let chain = crate::order_chain(&db, &tenant, &args.id)
        .await
        .context("reading the order's chain")?;
    let Some(chain) = chain else {
        anyhow::bail!("tenant {tenant} has no order {}", args.id);
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &chain)?;
        writeln!(out)?;
    } else {
        write_timeline(&mut out, &chain)?;
    }
    Ok(())
}

/// The chain as text: the order's line, then one line per step (time, state, what) with its
/// evidence indented below.
fn write_timeline(out: &mut impl std::io::Write, c: &crate::OrderChain) -> std::io::Result<()> {
    let o = &c.order;
    writeln!(
        out,
        "order {}  tenant {}  {} / {}  {} {}  status {}  key {}",
        o.id,
        o.tenant,
        o.source,
        o.external_ref,
        o.amount_minor,
        o.currency,
        o.status,
        o.idempotency_key.as_deref().unwrap_or("-")
    )?;
    for step in &c.timeline {
        writeln!(
            out,
            "{}  {:<9}  {}  ({})",
            step.at,
            step.state.as_str(),
            step.title,
            step.detail
        )?;
        for line in &step.evidence {
            writeln!(out, "{:>28}{line}", "")?;
        }
    }
    Ok(())
}
