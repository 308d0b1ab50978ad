//! `oncely verify`: arguments → [`oncely_verify::VerifyConfig`] → run → table, JSON, exit code.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use oncely_verify::{BodyTemplate, Header, Mutation, ObjectIdSource, VerifyConfig};
use reqwest::header::HeaderName;

/// Run the idempotency acceptance checks against any HTTP endpoint that takes an
/// `Idempotency-Key` (key handling, S1–S4, scope). Exit status 0 only when every applicable
/// check holds, 1 when one fails, 2 when the checks cannot run.
#[derive(Debug, Args)]
pub(crate) struct VerifyArgs {
    /// The endpoint, e.g. http://127.0.0.1:8080/v1/orders.
    #[arg(long)]
    url: String,
    /// The method.
    #[arg(long, default_value = "POST")]
    method: String,
    /// The request body: inline JSON, or a file (`body.json` or `@body.json`). `{{uuid}}` is
    /// replaced by a new UUIDv7 for every logical operation.
    #[arg(long)]
    body: String,
    /// A header sent with every request, `Name: value` (repeatable), e.g. the credential.
    #[arg(long = "header", short = 'H', value_name = "NAME: VALUE")]
    headers: Vec<String>,
    /// A header of a second credential, replacing the same-named `--header` (repeatable);
    /// enables the scope check.
    #[arg(long = "header-b", value_name = "NAME: VALUE")]
    headers_b: Vec<String>,
    /// A change that makes another request, `<json-pointer>=<value>` (value as JSON, else a
    /// string), e.g. `/amount_minor=2999` (repeatable); enables the 422 check.
    #[arg(long = "mutate", value_name = "POINTER=VALUE")]
    mutations: Vec<String>,
    /// Where an answer carries the object id: a JSON pointer into the body (`/id`) or
    /// `Location`. Default: `/id`, else `Location`.
    #[arg(long)]
    object_id: Option<String>,
    /// A URL answering the number of objects (a number, a JSON array, or `{"count": n}`),
    /// read with the `--header`s before and after each check.
    #[arg(long)]
    count_url: Option<String>,
    /// Simultaneous requests in S2.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Requests with one key in S1 (the first and its retries).
    #[arg(long, default_value_t = 5)]
    sequential: usize,
    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// The key header.
    #[arg(long, default_value = "Idempotency-Key")]
    key_header: String,
    /// The header that marks a replayed answer.
    #[arg(long, default_value = "Idempotent-Replayed")]
    replay_header: String,
    /// Send keys as RFC 8941 sf-strings (`"…"`), as the draft writes them, not bare.
    #[arg(long)]
    quote_keys: bool,
    /// Timeout of each request, in seconds.
    #[arg(long, default_value_t = 30)]
    timeout_secs: u64,
}

impl VerifyArgs {
    fn config(&self) -> anyhow::Result<VerifyConfig> {
        let mut cfg = VerifyConfig::new(&self.url, BodyTemplate::from_arg(&self.body)?)?;
        cfg.method = self
            .method
            .to_ascii_uppercase()
            .parse()
            .with_context(|| format!("invalid --method {:?}", self.method))?;
        cfg.headers = self
            .headers
            .iter()
            .map(|h| Header::parse(h))
            .collect::<Result<_, _>>()?;
        if !self.headers_b.is_empty() {
            cfg.headers_b = Some(
                self.headers_b
                    .iter()
                    .map(|h| Header::parse(h))
                    .collect::<Result<_, _>>()?,
            );
        }
        cfg.mutations = self
            .mutations
            .iter()
            .map(|m| Mutation::parse(m))
            .collect::<Result<_, _>>()?;
        if let Some(o) = &self.object_id {
            cfg.object_id = ObjectIdSource::parse(o)?;
        }
        cfg.count_url = self
            .count_url
            .as_deref()
            .map(oncely_verify::parse_url)
            .transpose()?;
        cfg.concurrency = self.concurrency.max(2);
        cfg.sequential = self.sequential.max(2);
        cfg.key_header =
            HeaderName::from_bytes(self.key_header.as_bytes()).context("invalid --key-header")?;
        cfg.replay_header = HeaderName::from_bytes(self.replay_header.as_bytes())
            .context("invalid --replay-header")?;
        cfg.quote_keys = self.quote_keys;
        cfg.request_timeout = Duration::from_secs(self.timeout_secs.max(1));
        Ok(cfg)
    }
}

/// Runs the checks, prints the table, writes the JSON report; exits 1 when a check fails
/// and 2 when the checks cannot run, or ran but the endpoint refused (4xx) the sample
/// request (a wrong `--body` or `--header` says nothing about idempotency).
pub(crate) async fn run(args: &VerifyArgs) -> anyhow::Result<()> {
    let report = match args.config() {
        Ok(cfg) => oncely_verify::verify(cfg)
            .await
            .map_err(anyhow::Error::from),
        Err(e) => Err(e),
    };
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("oncely verify: {e:#}");
            std::process::exit(2);
        }
    };
    print!("{}", report.to_table());
    if let Some(path) = &args.json {
        std::fs::write(path, report.to_json())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(answer) = &report.sample_refused {
        eprintln!(
            "oncely verify: the endpoint refused the sample request ({answer}); \
             the checks need a --body and --header it accepts"
        );
        std::process::exit(2);
    }
    if !report.passed() {
        std::process::exit(1);
    }
    Ok(())
}
