//! [`ReconcileArgs`] and [`reconcile`]: one reconciliation run of a provider over a window,
//! printed as a table or JSON, and the operator's resolution of a discrepancy (logic in
//! `oncely_effects::Reconciler` and `oncely_effects::resolve`). Every resolution writes an
//! audit row. `oncely reconcile` runs it with the effect store alone, its completions left
//! to the service's runner; a service's own binary adds its local sources and handler
//! ([`Service`]).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Args, Subcommand, ValueEnum};
use oncely_effects::{
    Continue, EffectHandler, LocalSource, Provider, ReconcileConfig, ReconcileReport, Reconciler,
    ResolveAction, ShippingClient, StripePayments,
};
use oncely_sql::{Database, Discrepancy, DiscrepancyStore, EffectStore};
use serde_json::json;

/// `reconcile …`: a run (`--provider …`) or `reconcile resolve ID`.
#[derive(Debug, Args)]
pub struct ReconcileArgs {
    /// The database.
    #[command(flatten)]
    pub db: crate::DbArgs,
    /// `resolve`, or none for a run.
    #[command(subcommand)]
    pub command: Option<ReconcileCommand>,
    /// The run's flags.
    #[command(flatten)]
    pub run: RunArgs,
}

/// The run's flags (`reconcile --provider …`).
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The provider to reconcile (its `charge`s, its `book`ings).
    #[arg(long, value_enum)]
    provider: Option<ProviderName>,
    /// The window's start: a duration back from now (`90s`, `30m`, `24h`, `7d`) or an RFC
    /// 3339 time (`2026-12-01T00:00:00Z`).
    #[arg(long, default_value = "24h")]
    since: String,
    /// Print `{"discrepancies": [...], …}` instead of a table.
    #[arg(long)]
    json: bool,
    /// Page size of the provider's listing, 1–100.
    #[arg(long, default_value_t = 100)]
    page_limit: u8,
    /// Where the providers are (the flags of a service's `serve` and `effects run`).
    #[command(flatten)]
    pub providers: crate::ProviderArgs,
}

/// A provider on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProviderName {
    /// `payments` (Stripe API v1).
    Payments,
    /// `shipping`.
    Shipping,
}

/// `reconcile resolve …`.
#[derive(Debug, Subcommand)]
pub enum ReconcileCommand {
    /// Resolves an open discrepancy (audited). `acknowledge`: any kind, not reported again;
    /// `mark-succeeded`: a status_mismatch of an effect in review whose record is live;
    /// `refund`: a payments duplicate_remote or missing_local, refunded through an effect.
    Resolve {
        /// The discrepancy's id.
        id: String,
        /// What to do.
        #[arg(long, value_enum)]
        action: Action,
        /// The provider object meant, when the discrepancy names more than one.
        #[arg(long)]
        provider_id: Option<String>,
        /// Why (for the audit row).
        #[arg(long, default_value = "resolved by an operator")]
        reason: String,
        /// Who resolves (for the audit row).
        #[arg(long, env = "USER", default_value = "operator")]
        actor: String,
    },
}

/// An operator's action on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Action {
    /// [`ResolveAction::Acknowledge`].
    Acknowledge,
    /// [`ResolveAction::MarkSucceeded`].
    MarkSucceeded,
    /// [`ResolveAction::Refund`].
    Refund,
}

/// `--since` as a time: a duration back from `now` (`s`, `m`, `h`, `d`) or RFC 3339.
fn parse_since(s: &str, now: SystemTime) -> anyhow::Result<SystemTime> {
    let unit = |c: char| match c {
        's' => Some(1),
        'm' => Some(60),
        'h' => Some(3600),
        'd' => Some(86_400),
        _ => None,
    };
    if let Some((n, u)) = s
        .char_indices()
        .last()
        .and_then(|(i, c)| Some((&s[..i], unit(c)?)))
    {
        if let Ok(n) = n.parse::<u64>() {
            return Ok(now - Duration::from_secs(n.saturating_mul(u)));
        }
    }
    rfc3339(s).ok_or_else(|| {
        anyhow::anyhow!("--since {s:?}: a duration (90s, 30m, 24h, 7d) or an RFC 3339 time")
    })
}

/// An RFC 3339 `date-time` (RFC 3339 §5.6), fractions of a second ignored.
fn rfc3339(text: &str) -> Option<SystemTime> {
    let bytes = text.as_bytes();
    let num = |r: std::ops::Range<usize>| text.get(r)?.parse::<i64>().ok();
    if bytes.len() < 20
        || bytes[4] != b'-'
        || bytes[7] != b'-'
        || !matches!(bytes[10], b'T' | b't' | b' ')
    {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let mut rest = &text[19..];
    if let Some(fraction) = rest.strip_prefix('.') {
        rest = fraction.trim_start_matches(|c: char| c.is_ascii_digit());
    }
    let len = text.len();
    let offset = match rest {
        "Z" | "z" => 0,
        _ if rest.len() == 6 && matches!(&rest[..1], "+" | "-") => {
            let east = num(len - 5..len - 3)? * 3600 + num(len - 2..len)? * 60;
            if rest.starts_with('-') {
                -east
            } else {
                east
            }
        }
        _ => return None,
    };
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset;
    Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
}

/// The adapter of provider `name` from the provider flags; the listing's page size from
/// `--page-limit`.
fn provider(name: ProviderName, args: &RunArgs) -> anyhow::Result<Arc<dyn Provider>> {
    let config = args.providers.config();
    Ok(match name {
        ProviderName::Payments => {
            let mut payments = config
                .payments
                .ok_or_else(|| anyhow::anyhow!("--provider payments needs --payments-url"))?;
            anyhow::ensure!(
                !payments.secret_key.is_empty(),
                "--provider payments needs --payments-secret-key"
            );
            payments.page_limit = args.page_limit.clamp(1, 100);
            Arc::new(StripePayments::new(payments)?)
        }
        ProviderName::Shipping => {
            Arc::new(ShippingClient::new(config.shipping.ok_or_else(|| {
                anyhow::anyhow!("--provider shipping needs --shipping-url")
            })?)?)
        }
    })
}

fn row(d: &Discrepancy) -> anyhow::Result<serde_json::Value> {
    let details = d.details_json()?;
    Ok(json!({
        "id": d.id, "provider": d.provider, "kind": d.kind_word, "reference": d.reference,
        "tenant": d.tenant, "effect_id": d.effect_id, "provider_ids": d.provider_id_list(),
        "local_status": details["local_status"], "remote_status": details["remote_status"],
        "local_amount": details["local_amount"], "remote_amount": details["remote_amount"],
        "business_ref": details["business_ref"],
        "detail": details["detail"], "found_at": d.found_at, "last_seen_at": d.last_seen_at,
        "resolved_at": d.resolved_at, "resolution": d.resolution,
    }))
}

fn print_table(report: &ReconcileReport) -> anyhow::Result<()> {
    println!("id\tkind\treference\tbusiness_ref\teffect_id\tprovider_ids\tlocal\tremote\tdetail");
    for d in &report.discrepancies {
        let r = row(d)?;
        let side = |status: &str, amount: &str| {
            let s = r[status].as_str().unwrap_or("-").to_owned();
            match r[amount].as_i64() {
                Some(a) => format!("{s} {a}"),
                None => s,
            }
        };
        println!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            d.id,
            d.kind_word,
            d.reference,
            r["business_ref"].as_str().unwrap_or("-"),
            d.effect_id.as_deref().unwrap_or("-"),
            d.provider_ids,
            side("local_status", "local_amount"),
            side("remote_status", "remote_amount"),
            r["detail"]
                .as_str()
                .unwrap_or_default()
                .replace(['\t', '\n'], " "),
        );
    }
    println!(
        "run {}: {} records in {} pages, {} local intents, {} discrepancies, {} acknowledged before, \
         {} unknown effects completed, {} still unknown",
        report.run.id,
        report.run.objects,
        report.pages,
        report.run.intents,
        report.discrepancies.len(),
        report.acknowledged,
        report.completed.len(),
        report.still_unknown.len()
    );
    Ok(())
}

/// What a service's own binary adds to a reconciliation: its handler, which completes
/// effects in process ([`Continue::Here`]; without it, [`Continue::ByRunner`]), and its
/// further sources of local intents.
#[derive(Default)]
pub struct Service {
    /// The service's handler (its events topic and configuration), `None` outside it.
    pub handler: Option<Arc<dyn EffectHandler>>,
    /// Further sources of local intents, asked after the effect store.
    pub sources: Vec<Arc<dyn LocalSource>>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("handler", &self.handler.is_some())
            .field("sources", &self.sources)
            .finish()
    }
}

impl Service {
    /// A reconciler of `provider` over `db` with this service's handler and sources.
    pub fn reconciler(&self, db: &Database, provider: Arc<dyn Provider>) -> Reconciler {
        let operation = oncely_effects::default_operation(provider.name()).unwrap_or("charge");
        let config = ReconcileConfig::new(operation);
        let effects = EffectStore::new(db.clone());
        let reconciler = match &self.handler {
            Some(handler) => Reconciler::new(provider, effects, handler.clone(), config),
            None => Reconciler::by_runner(provider, effects, config),
        };
        self.sources
            .iter()
            .fold(reconciler, |r, source| r.with_source(source.clone()))
    }
}

/// The exit status of a run that found discrepancies still open (new, or found before and
/// not yet resolved), so that a scheduled `reconcile` alerts the way a failed check does.
pub const EXIT_OPEN_DISCREPANCIES: i32 = 1;

/// The exit status of a `reconcile` that could not do its work: the database or the
/// provider cannot be reached, a flag is missing, a resolution does not fit.
pub const EXIT_CANNOT_RUN: i32 = 2;

/// Runs a `reconcile` command on the database a service set up, printing to stdout;
/// `service` builds what the service adds ([`Service::default`] for `oncely reconcile`).
///
/// Ends the process with its exit status, as `diff` and `oncely verify` do: 0 when the run
/// leaves no discrepancy open (or the resolution is done),
/// [`EXIT_OPEN_DISCREPANCIES`] (1) when some are open, [`EXIT_CANNOT_RUN`] (2) with the error
/// and its causes on stderr when it could not run.
pub async fn reconcile(args: ReconcileArgs, service: impl FnOnce(&Database) -> Service) -> ! {
    let code = match run_or_resolve(args, service).await {
        Ok(0) => 0,
        Ok(_) => EXIT_OPEN_DISCREPANCIES,
        Err(e) => {
            eprintln!("reconcile: {e:#}");
            EXIT_CANNOT_RUN
        }
    };
    let _ = std::io::Write::flush(&mut std::io::stdout());
    std::process::exit(code)
}

/// [`reconcile`]'s work: the number of discrepancies the run leaves open (0 after a
/// resolution).
///
/// # Errors
/// The database cannot be reached; a provider is not configured; the run or the
/// resolution fails.
async fn run_or_resolve(
    args: ReconcileArgs,
    service: impl FnOnce(&Database) -> Service,
) -> anyhow::Result<usize> {
    let db = args.db.connect_existing().await?;
    let service = service(&db);
    if let Some(ReconcileCommand::Resolve {
        id,
        action,
        provider_id,
        reason,
        actor,
    }) = args.command
    {
        let action = match action {
            Action::Acknowledge => ResolveAction::Acknowledge,
            Action::MarkSucceeded => ResolveAction::MarkSucceeded { provider_id },
            Action::Refund => ResolveAction::Refund { provider_id },
        };
        let how = match &service.handler {
            Some(handler) => Continue::Here(&**handler),
            None => Continue::ByRunner,
        };
        let store = DiscrepancyStore::new(db);
        let d = oncely_effects::resolve(&store, how, &id, &action, &actor, &reason).await?;
        println!("{}", row(&d)?);
        return Ok(0);
    }
    let run = &args.run;
    let name = run
        .provider
        .ok_or_else(|| anyhow::anyhow!("--provider payments|shipping is required"))?;
    let since = parse_since(&run.since, SystemTime::now())?;
    let reconciler = service.reconciler(&db, provider(name, run)?);
    let report = reconciler.run(since).await?;
    if run.json {
        let discrepancies = report
            .discrepancies
            .iter()
            .map(row)
            .collect::<anyhow::Result<Vec<_>>>()?;
        let out = json!({
            "run": {"id": report.run.id, "provider": report.run.provider,
                "since_ms": report.run.since_ms, "records": report.run.objects,
                "pages": report.pages, "intents": report.run.intents},
            "discrepancies": discrepancies,
            "acknowledged": report.acknowledged,
            "completed": report.completed,
            "still_unknown": report.still_unknown,
        });
        println!("{out}");
    } else {
        print_table(&report)?;
    }
    Ok(report.discrepancies.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_takes_durations_and_rfc3339_times() {
        let now = UNIX_EPOCH + Duration::from_secs(1_764_547_200);
        assert_eq!(
            parse_since("24h", now).unwrap(),
            now - Duration::from_secs(86_400)
        );
        assert_eq!(
            parse_since("90s", now).unwrap(),
            now - Duration::from_secs(90)
        );
        assert_eq!(
            parse_since("7d", now).unwrap(),
            now - Duration::from_secs(7 * 86_400)
        );
        // 2025-12-01T00:00:00Z is 1_764_547_200.
        assert_eq!(parse_since("2025-12-01T00:00:00Z", now).unwrap(), now);
        assert_eq!(
            parse_since("2025-12-01T01:30:00.250+01:30", now).unwrap(),
            now
        );
        for bad in [
            "",
            "h",
            "24x",
            "2025-13-01T00:00:00Z",
            "2025-12-01T00:00:00",
            "yesterday",
        ] {
            assert!(parse_since(bad, now).is_err(), "{bad}");
        }
    }
}
