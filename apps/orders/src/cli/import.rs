//! `orders import FILE --tenant T`: the manual fallback (docs/ACCEPTANCE.md S8).
//!
//! Each line of an NDJSON file is one `POST /v1/orders` body, sent as a request — never
//! written to the tables directly — so it goes through exactly the rules a client's request
//! does: the idempotency layer (an `Idempotency-Key` per line, the fingerprint, the
//! in-flight lock), the order's validation, the business key `UNIQUE(tenant, source,
//! external_ref)`, and the order with its `order.created` outbox event in one transaction.
//! Two ways to send it, the same code on the other side:
//! - `--url` + `--api-key`: to a running service over HTTP (the API key decides the tenant;
//!   `--tenant` must name it, as it enters the derived keys);
//! - `--database-url` alone: the service's own router ([`crate::router`]), in this process,
//!   on the database — for when the service cannot be reached. It coordinates with running
//!   services through the same idempotency records and unique index.
//!
//! A line's key is its `key` member when it has one (removed from the body), else derived
//! from the line's content: SHA-256 over the tenant and the body's RFC 8785 canonical form
//! (JCS, as the fingerprint canonicalises it), so the same order in another file, with its
//! members in another order, has the same key — re-running a file, or an overlapping one,
//! creates nothing new. Where two files carry one business key with other content, the
//! second is a conflict: reported, not applied.

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use axum::body::Body;
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tower::ServiceExt as _;

/// `orders import`.
#[derive(Debug, Args)]
pub(super) struct ImportArgs {
    #[command(flatten)]
    db: oncely_cli::DbArgs,
    /// The NDJSON file: one `POST /v1/orders` body per line, optionally with a string `key`
    /// member (its idempotency key). Blank lines are skipped.
    file: PathBuf,
    /// The tenant the orders belong to.
    #[arg(long)]
    tenant: String,
    /// A running service's base URL (e.g. http://127.0.0.1:8080); without it the orders go
    /// through the service's router in this process, on `--database-url`.
    #[arg(long, requires = "api_key")]
    url: Option<String>,
    /// The API key of `--tenant` at `--url`.
    #[arg(long, env = "ONCELY_API_KEY")]
    api_key: Option<String>,
    /// Topic of the `order.created` events (in-process only; the service's
    /// `--events-topic`).
    #[arg(long, env = "ONCELY_EVENTS_TOPIC", default_value = crate::ORDERS_TOPIC)]
    events_topic: String,
    /// Print each line's outcome and the summary as JSON objects, one a line.
    #[arg(long)]
    json: bool,
    /// Tries per line while the service or its database is unavailable (503, 429, a request
    /// in flight, no connection) before the line is reported `unavailable`.
    #[arg(long, default_value_t = 5)]
    tries: u32,
}

/// What became of one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// A new order (201).
    Created,
    /// The order exists with this content: a replay, or the business key's answer (200).
    Existing,
    /// The business key or the line's key is taken by other content; nothing applied.
    Conflict,
    /// The line is not a valid order (its JSON, the schema, the validation).
    Invalid,
    /// The service or its database did not answer within the tries; nothing known applied.
    Unavailable,
}

impl Outcome {
    fn word(self) -> &'static str {
        match self {
            Self::Created => "created",
            Self::Existing => "existing",
            Self::Conflict => "conflict",
            Self::Invalid => "invalid",
            Self::Unavailable => "unavailable",
        }
    }
}

/// One line's report.
struct LineReport {
    line: usize,
    outcome: Outcome,
    order_id: Option<String>,
    detail: Option<String>,
}

/// Where the requests go.
enum Target {
    Http {
        client: reqwest::Client,
        url: String,
        api_key: String,
    },
    InProcess {
        router: axum::Router,
        api_key: String,
    },
}

/// An answer: status, whether it is a replay (`Idempotent-Replayed: true`), body.
type Answer = Result<(u16, bool, Value), String>;

/// Whether `headers` mark a replayed answer.
fn replayed(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get("idempotent-replayed")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

impl Target {
    async fn post(&self, key: &str, body: String) -> Answer {
        match self {
            Self::Http {
                client,
                url,
                api_key,
            } => {
                let res = client
                    .post(format!("{}/v1/orders", url.trim_end_matches('/')))
                    .bearer_auth(api_key)
                    .header("content-type", "application/json")
                    .header("idempotency-key", key)
                    .body(body)
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                let status = res.status().as_u16();
                let replay = replayed(res.headers());
                let bytes = res.bytes().await.map_err(|e| e.to_string())?;
                Ok((
                    status,
                    replay,
                    serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                ))
            }
            Self::InProcess { router, api_key } => {
                let req = axum::http::Request::post("/v1/orders")
                    .header("authorization", format!("Bearer {api_key}"))
                    .header("content-type", "application/json")
                    .header("idempotency-key", key)
                    .body(Body::from(body))
                    .map_err(|e| e.to_string())?;
                let res = router
                    .clone()
                    .oneshot(req)
                    .await
                    .map_err(|e| e.to_string())?;
                let status = res.status().as_u16();
                let replay = replayed(res.headers());
                let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok((
                    status,
                    replay,
                    serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                ))
            }
        }
    }
}

/// The idempotency key of a line without a `key` member: `import-` and 32 hex digits of
/// SHA-256 over the tenant and the body's JCS form (length-prefixed, so no two pairs
/// collide by concatenation).
fn derived_key(tenant: &str, body: &Value) -> anyhow::Result<String> {
    let canonical = serde_json_canonicalizer::to_vec(body).context("canonicalising a line")?;
    let mut h = Sha256::new();
    for part in [
        b"oncely orders import".as_slice(),
        tenant.as_bytes(),
        &canonical,
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    let digest = h.finalize();
    let prefix = uuid::Uuid::from_slice(&digest[..16]).context("a 16-byte digest prefix")?;
    Ok(format!("import-{}", prefix.simple()))
}

/// The line's key and body, or why it is invalid.
fn prepare(tenant: &str, text: &str) -> Result<(String, String), String> {
    // The reading the API's fingerprint does (I-JSON): a duplicate member is refused here
    // as the API refuses it (400), never resolved to its last value.
    let mut value = oncely_core::parse_i_json(text.as_bytes()).map_err(|e| match e {
        // A duplicate member name, or a number that is not finite (RFC 7493 §2).
        oncely_core::FingerprintError::InvalidJson(e) if e.is_data() => format!("not I-JSON: {e}"),
        oncely_core::FingerprintError::InvalidJson(e) => {
            format!("not JSON: syntax error at column {}", e.column())
        }
        _ => "not JSON".to_owned(),
    })?;
    let Some(object) = value.as_object_mut() else {
        return Err("not a JSON object".to_owned());
    };
    let key = match object.remove("key") {
        None => None,
        Some(Value::String(k)) => Some(k),
        Some(_) => return Err("key must be a string".to_owned()),
    };
    let key = match key {
        Some(k) => k,
        None => derived_key(tenant, &value).map_err(|e| format!("{e:#}"))?,
    };
    Ok((key, value.to_string()))
}

/// The file's non-blank lines, numbered from 1, each its text or why it is not UTF-8.
fn lines(bytes: &[u8]) -> Vec<(usize, Result<&str, String>)> {
    bytes
        .split(|&b| b == b'\n')
        .enumerate()
        .map(|(i, l)| {
            let text = std::str::from_utf8(l).map(str::trim).map_err(|e| {
                format!(
                    "not UTF-8: an invalid byte at column {}",
                    e.valid_up_to() + 1
                )
            });
            (i + 1, text)
        })
        .filter(|(_, l)| !matches!(l, Ok(t) if t.is_empty()))
        .collect()
}

/// Sends one line until it has an answer that is not "unavailable" or the tries are spent.
async fn import_line(target: &Target, args: &ImportArgs, line: usize, text: &str) -> LineReport {
    let report = |outcome, order_id, detail| LineReport {
        line,
        outcome,
        order_id,
        detail,
    };
    let (key, body) = match prepare(&args.tenant, text) {
        Ok(p) => p,
        Err(detail) => return report(Outcome::Invalid, None, Some(detail)),
    };
    let mut last = String::new();
    for attempt in 0..args.tries.max(1) {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(250 << attempt.min(5))).await;
        }
        let (status, replay, answer) = match target.post(&key, body.clone()).await {
            Ok(a) => a,
            Err(e) => {
                last = e;
                continue;
            }
        };
        let kind = answer["type"]
            .as_str()
            .and_then(|t| t.rsplit(':').next())
            .unwrap_or_default()
            .to_owned();
        let detail = answer["detail"].as_str().map(str::to_owned);
        let id = answer["id"].as_str().map(str::to_owned);
        match (status, kind.as_str()) {
            // The stored answer of an earlier import of this line: nothing new.
            (201, _) if replay => return report(Outcome::Existing, id, None),
            (201, _) => return report(Outcome::Created, id, None),
            (200, _) => return report(Outcome::Existing, id, None),
            (409, "order-conflict") => {
                let existing = answer["order"].as_str().map(str::to_owned);
                return report(Outcome::Conflict, None, existing.or(detail));
            }
            (422, "idempotency-key-reused") => {
                return report(
                    Outcome::Conflict,
                    None,
                    Some("the line's key was used for another order".to_owned()),
                );
            }
            (409 | 429 | 500..=599, _) => last = format!("{status} {kind}"),
            (401 | 403, _) => {
                return report(
                    Outcome::Unavailable,
                    None,
                    Some(format!("{status}: the API key was refused")),
                )
            }
            _ => {
                return report(
                    Outcome::Invalid,
                    None,
                    Some(format!("{status} {kind}: {}", detail.unwrap_or_default())),
                )
            }
        }
    }
    report(Outcome::Unavailable, None, Some(last))
}

fn progress(lines: u64) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(lines), target);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:40} {pos}/{len} lines {per_sec} eta {eta}")
    {
        bar.set_style(style);
    }
    bar
}

fn print_line(r: &LineReport, as_json: bool) {
    if as_json {
        println!(
            "{}",
            json!({
                "line": r.line,
                "outcome": r.outcome.word(),
                "order_id": r.order_id,
                "detail": r.detail,
            })
        );
    } else {
        println!(
            "{}\t{}\t{}\t{}",
            r.line,
            r.outcome.word(),
            r.order_id.as_deref().unwrap_or("-"),
            r.detail.as_deref().unwrap_or("").replace(['\t', '\n'], " ")
        );
    }
}

/// Asks the service at `url` which tenant `api_key` authenticates (`GET /v1/tenant`) and
/// refuses to go on unless it is `tenant`: the tenant enters every derived key, so a
/// mismatch would import under the key's tenant with keys derived for another.
///
/// # Errors
/// The service cannot be reached, refuses the key, answers without a tenant, or names
/// another tenant.
async fn check_tenant(
    client: &reqwest::Client,
    url: &str,
    api_key: &str,
    tenant: &str,
) -> anyhow::Result<()> {
    let endpoint = format!("{}/v1/tenant", url.trim_end_matches('/'));
    let answer = client
        .get(&endpoint)
        .bearer_auth(api_key)
        .send()
        .await
        .with_context(|| format!("asking {endpoint} which tenant the API key is"))?;
    let status = answer.status();
    anyhow::ensure!(
        status.is_success(),
        "{endpoint} answered {status} for the API key: it is not a key of that service"
    );
    let caller: Value = answer
        .json()
        .await
        .with_context(|| format!("reading {endpoint}'s answer"))?;
    let of_key = caller["tenant"]
        .as_str()
        .with_context(|| format!("{endpoint} named no tenant: {caller}"))?;
    anyhow::ensure!(
        of_key == tenant,
        "the API key belongs to tenant {of_key:?}, not --tenant {tenant:?}; nothing imported"
    );
    Ok(())
}

/// Runs `orders import`; the database is connected only for the in-process path.
///
/// # Errors
/// The file cannot be read, the tenant is invalid, or the database cannot be reached.
pub(super) async fn run(args: ImportArgs) -> anyhow::Result<()> {
    oncely_core::TenantId::parse(&args.tenant).context("invalid --tenant")?;
    // Bytes, not a string: one line that is not UTF-8 is that line's fault, not the file's.
    let bytes =
        std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let target = if let (Some(url), Some(api_key)) = (&args.url, &args.api_key) {
        let client = reqwest::Client::new();
        check_tenant(&client, url, api_key, &args.tenant).await?;
        Target::Http {
            client,
            url: url.clone(),
            api_key: api_key.clone(),
        }
    } else {
        let db = super::connect(&args.db).await?;
        // A process-local random API key for the in-process router (never leaves it).
        let api_key = format!("import-{}", uuid::Uuid::new_v4().simple());
        let config = crate::AppConfig {
            api_keys: crate::parse_api_keys(&format!("{api_key}={}", args.tenant))?,
            events_topic: args.events_topic.clone(),
            ..crate::AppConfig::default()
        };
        Target::InProcess {
            router: crate::router(db, &config),
            api_key,
        }
    };
    let lines = lines(&bytes);
    let bar = progress(lines.len() as u64);
    let mut counts = [0_usize; 5];
    for (line, content) in lines {
        let r = match content {
            Ok(text) => import_line(&target, &args, line, text).await,
            Err(detail) => LineReport {
                line,
                outcome: Outcome::Invalid,
                order_id: None,
                detail: Some(detail),
            },
        };
        counts[r.outcome as usize] += 1;
        bar.suspend(|| print_line(&r, args.json));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let [created, existing, conflict, invalid, unavailable] = counts;
    if args.json {
        println!(
            "{}",
            json!({"summary": {"created": created, "existing": existing, "conflict": conflict,
                "invalid": invalid, "unavailable": unavailable}})
        );
    } else {
        println!(
            "created {created}, existing {existing}, conflict {conflict}, invalid {invalid}, \
             unavailable {unavailable}"
        );
    }
    if conflict + invalid + unavailable > 0 {
        std::process::exit(1);
    }
    Ok(())
}
