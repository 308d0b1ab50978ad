//! The checks themselves, run one after another against the endpoint.

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use crate::config::{ConfigError, VerifyConfig};
use crate::probe::{ms, Answer, Cred, Probe};
use crate::report::{CheckId, CheckReport, Outcome, Report, RequestEvidence};

/// Why a verification could not run at all (as opposed to a check that fails).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// The configuration is inconsistent with the body (e.g. a mutation pointer names nothing).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The HTTP client could not be built.
    #[error("building the HTTP client")]
    Client(#[source] reqwest::Error),
    /// This build speaks plain HTTP only.
    #[error("https:// endpoints are not supported by this build (no TLS); use http://")]
    HttpsUnsupported,
}

/// Every check, in the order [`verify`] runs them.
pub const ALL_CHECKS: [CheckId; 9] = [
    CheckId::KeyMissing,
    CheckId::KeyMalformed,
    CheckId::KeyMaxLength,
    CheckId::S1Sequential,
    CheckId::S2Concurrent,
    CheckId::S3Mutated,
    CheckId::S3Reordered,
    CheckId::S4HangUp,
    CheckId::Scope,
];

/// Runs every check of [`ALL_CHECKS`] against `config.url`, one after another (each on fresh
/// keys and a freshly rendered body), and returns the report. With `count_url`, objects are
/// counted before and after each check and the difference is part of the check.
///
/// The checks follow draft-ietf-httpapi-idempotency-key-header-07 (400 for a missing or
/// malformed key, 409 while the first request runs, 422 for a reused key with another
/// payload) and the project's acceptance checks S1–S4.
///
/// # Errors
/// [`VerifyError`] when the run cannot start: a mutation that names nothing in the body,
/// an `https://` URL, a client that cannot be built. A check that fails is not an error: it
/// is in the report.
pub async fn verify(config: VerifyConfig) -> Result<Report, VerifyError> {
    if config.url.scheme() == "https"
        || config
            .count_url
            .as_ref()
            .is_some_and(|u| u.scheme() == "https")
    {
        return Err(VerifyError::HttpsUnsupported);
    }
    let sample = config.body.render();
    if !config.mutations.is_empty() {
        let mut json = sample.json.clone().ok_or(ConfigError::MutationNeedsJson)?;
        for m in &config.mutations {
            m.apply(&mut json)?;
        }
    }
    let mut notes = Vec::new();
    if !config.body.has_placeholders() {
        notes.push(
            "the body has no {{uuid}} placeholder: every check sends the same business payload, \
             so an API with its own business-level unique keys answers later checks from them"
                .to_owned(),
        );
    }
    let mut report = Report::new(config.url.to_string(), config.method.to_string(), notes);
    let probe = Probe::new(config).map_err(VerifyError::Client)?;
    let started = Instant::now();
    for id in ALL_CHECKS {
        let (check, refused) = run_check(&probe, id).await;
        if report.sample_refused.is_none() {
            report.sample_refused = refused;
        }
        if check.outcome == Outcome::Fails {
            report.all_applicable_hold = false;
        }
        report.checks.push(check);
    }
    report.elapsed_ms = ms(started.elapsed());
    Ok(report)
}

/// What one check collects while it runs.
#[derive(Default)]
struct Run {
    requests: Vec<RequestEvidence>,
    findings: Vec<String>,
    ids: Vec<String>,
    failed: bool,
    not_applicable: bool,
    /// The change in the object count this check must cause, when it applies.
    expect_delta: Option<RangeInclusive<u64>>,
    /// The answer when the endpoint refused S1's first request, the plain sample (a fresh
    /// key, the first credential), with a 4xx.
    refused: Option<String>,
}

impl Run {
    fn record(&mut self, a: &Answer) {
        self.requests.push(a.ev.clone());
        if let Some(id) = a.id() {
            if !self.ids.iter().any(|i| i == id) {
                self.ids.push(id.to_owned());
            }
        }
    }
    fn fail(&mut self, msg: impl Into<String>) {
        self.failed = true;
        self.findings.push(msg.into());
    }
    /// Fails when the answers recorded name more than one object (the requests all
    /// carried one key).
    fn one_object_per_key(&mut self) {
        if self.ids.len() > 1 {
            let msg = format!(
                "{} objects for one key: {}",
                self.ids.len(),
                self.ids.join(", ")
            );
            self.fail(msg);
        }
    }
    fn note(&mut self, msg: impl Into<String>) {
        self.findings.push(msg.into());
    }
    fn not_applicable(&mut self, msg: impl Into<String>) {
        self.not_applicable = true;
        self.findings.push(msg.into());
    }
    /// Records the first answer of an operation and fails unless it succeeded (2xx).
    fn first_succeeded(&mut self, a: &Answer) -> bool {
        self.record(a);
        if !a.is_success() {
            self.fail(format!(
                "the first request of the operation got {}: the checks need a request \
                 the endpoint accepts (check --body and --header)",
                a.describe()
            ));
            return false;
        }
        if a.ev.replayed {
            self.fail("the first request with a fresh key carries the replay marker");
        }
        true
    }
}

/// Runs check `id`: its report, and the endpoint's answer if it refused the plain sample.
async fn run_check(probe: &Probe, id: CheckId) -> (CheckReport, Option<String>) {
    let started = Instant::now();
    let before = probe.count().await;
    let mut run = Run::default();
    match id {
        CheckId::KeyMissing => key_missing(probe, &mut run).await,
        CheckId::KeyMalformed => key_malformed(probe, &mut run).await,
        CheckId::KeyMaxLength => key_max_length(probe, &mut run).await,
        CheckId::S1Sequential => s1_sequential(probe, &mut run).await,
        CheckId::S2Concurrent => s2_concurrent(probe, &mut run).await,
        CheckId::S3Mutated => s3_mutated(probe, &mut run).await,
        CheckId::S3Reordered => s3_reordered(probe, &mut run).await,
        CheckId::S4HangUp => s4_hang_up(probe, &mut run).await,
        CheckId::Scope => scope(probe, &mut run).await,
    }
    let after = if before.is_some() {
        probe.count().await
    } else {
        None
    };
    let (mut count_before, mut count_after) = (None, None);
    match (before, after) {
        (Some(Ok(b)), Some(Ok(a))) => {
            count_before = Some(b);
            count_after = Some(a);
            if let (false, Some(expect)) = (run.not_applicable, run.expect_delta.clone()) {
                let delta = a.checked_sub(b);
                if delta.is_some_and(|d| expect.contains(&d)) {
                    run.note(format!("objects counted: {b} before, {a} after"));
                } else {
                    let want = if expect.start() == expect.end() {
                        format!("+{}", expect.start())
                    } else {
                        format!("+{}..+{}", expect.start(), expect.end())
                    };
                    run.fail(format!(
                        "objects counted: {b} before, {a} after; expected {want}"
                    ));
                }
            }
        }
        (Some(Err(e)), _) | (_, Some(Err(e))) if !run.not_applicable => run.fail(e),
        _ => {}
    }
    let outcome = if run.not_applicable && !run.failed {
        Outcome::NotApplicable
    } else if run.failed {
        Outcome::Fails
    } else {
        Outcome::Holds
    };
    let report = CheckReport {
        id,
        outcome,
        findings: run.findings,
        requests: run.requests,
        ids_seen: run.ids,
        count_before,
        count_after,
        elapsed_ms: ms(started.elapsed()),
    };
    (report, run.refused)
}

/// A fresh key for one logical operation: `oncely-verify-<UUIDv7>`.
fn fresh_key() -> Vec<u8> {
    format!("oncely-verify-{}", uuid::Uuid::now_v7()).into_bytes()
}

/// A fresh valid key of exactly `len` visible ASCII characters.
fn key_of_len(len: usize) -> Vec<u8> {
    let mut k = fresh_key();
    let pad = b"-._~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut i = 0;
    while k.len() < len {
        k.push(pad[i % pad.len()]);
        i += 1;
    }
    k.truncate(len);
    k
}

async fn key_missing(probe: &Probe, run: &mut Run) {
    let body = probe.cfg.body.render();
    let a = probe.send("no key", Cred::A, None, &body.text).await;
    run.record(&a);
    match a.status() {
        Some(400) => {
            run.expect_delta = Some(0..=0);
            run.note("a request without a key was refused with 400");
        }
        Some(s) if (200..300).contains(&s) => run.not_applicable(format!(
            "the endpoint does not require a key: a request without one got {s} \
             (executed); draft §2.7's 400 applies only where keys are required"
        )),
        _ => run.fail(format!(
            "a request without a key got {}; expected 400 (key required) or a \
             success (keys optional)",
            a.describe()
        )),
    }
}

async fn key_malformed(probe: &Probe, run: &mut Run) {
    run.expect_delta = Some(0..=0);
    let mut control = fresh_key();
    control.insert(4, b'\t');
    let mut space = fresh_key();
    space.insert(4, b' ');
    let cases: [(&str, Vec<u8>); 4] = [
        ("empty", Vec::new()),
        ("256 characters", key_of_len(256)),
        ("a control character (TAB)", control),
        ("a space", space),
    ];
    let mut refused = Vec::new();
    for (what, key) in cases {
        let body = probe.cfg.body.render();
        let a = probe
            .send(format!("key: {what}"), Cred::A, Some(&key), &body.text)
            .await;
        run.record(&a);
        if a.status() == Some(400) {
            refused.push(what);
        } else {
            run.fail(format!(
                "a key with {what} got {}; expected 400{}",
                a.describe(),
                if a.is_success() {
                    " (the request was executed under an invalid key)"
                } else {
                    ""
                }
            ));
        }
    }
    if !run.failed {
        run.note(format!("refused with 400: {}", refused.join(", ")));
    }
}

async fn key_max_length(probe: &Probe, run: &mut Run) {
    run.expect_delta = Some(1..=1);
    let key = key_of_len(255);
    let body = probe.cfg.body.render();
    let first = probe
        .send("first (255-character key)", Cred::A, Some(&key), &body.text)
        .await;
    if !run.first_succeeded(&first) {
        return;
    }
    let retry = probe.settle("retry", Cred::A, &key, &body.text).await;
    for a in &retry {
        run.record(a);
    }
    let last = retry.last().expect("settle sends at least once");
    expect_replay_of(
        probe,
        run,
        &first,
        last,
        "the retry with the 255-character key",
    );
    if !run.failed {
        run.note("a 255-character key was accepted and its retry replayed");
    }
}

/// Fails unless `a` replays `first`: same status, byte-identical body, the replay marker,
/// the same object id.
fn expect_replay_of(probe: &Probe, run: &mut Run, first: &Answer, a: &Answer, what: &str) {
    if a.status() != first.status() {
        run.fail(format!(
            "{what} got {}; the first was {}",
            a.describe(),
            first.describe()
        ));
        return;
    }
    if a.id() != first.id() {
        run.fail(format!(
            "{what} returned object {:?}; the first created {:?} (a second execution)",
            a.id().unwrap_or("-"),
            first.id().unwrap_or("-")
        ));
    }
    if a.body != first.body {
        run.fail(format!(
            "{what}: the body differs from the first answer's ({} vs {} bytes)",
            a.body.len(),
            first.body.len()
        ));
    }
    if !a.ev.replayed {
        run.fail(format!(
            "{what} lacks the replay marker `{}`",
            probe.cfg.replay_header
        ));
    }
}

async fn s1_sequential(probe: &Probe, run: &mut Run) {
    run.expect_delta = Some(1..=1);
    let key = fresh_key();
    let body = probe.cfg.body.render();
    let first = probe.send("first", Cred::A, Some(&key), &body.text).await;
    if first.status().is_some_and(|s| (400..500).contains(&s)) {
        run.refused = Some(first.describe());
    }
    if !run.first_succeeded(&first) {
        return;
    }
    let n = probe.cfg.sequential.max(2);
    for i in 2..=n {
        let a = probe
            .send(format!("retry {}", i - 1), Cred::A, Some(&key), &body.text)
            .await;
        run.record(&a);
        expect_replay_of(probe, run, &first, &a, &format!("retry {}", i - 1));
    }
    if !run.failed {
        run.note(format!(
            "{n} requests with one key: one object {}; {} replays identical in status and \
             body, each marked",
            first.id().unwrap_or("(no id in the answer)"),
            n - 1
        ));
    }
}

async fn s2_concurrent(probe: &Probe, run: &mut Run) {
    run.expect_delta = Some(1..=1);
    let key: Arc<[u8]> = fresh_key().into();
    let body: Arc<str> = probe.cfg.body.render().text.into();
    let n = probe.cfg.concurrency.max(2);
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let mut tasks = Vec::with_capacity(n);
    for i in 1..=n {
        let (probe, key, body, barrier) =
            (probe.clone(), key.clone(), body.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            probe
                .send(format!("simultaneous {i}"), Cred::A, Some(&key[..]), &body)
                .await
        }));
    }
    let mut answers = Vec::with_capacity(n);
    for t in tasks {
        if let Ok(a) = t.await {
            run.record(&a);
            answers.push(a);
        }
    }
    let other: Vec<String> = answers
        .iter()
        .filter(|a| !a.is_success() && a.status() != Some(409))
        .map(Answer::describe)
        .collect();
    if !other.is_empty() {
        run.fail(format!(
            "answers other than success or 409: {}",
            other.join(", ")
        ));
    }
    let executed = answers
        .iter()
        .filter(|a| a.is_success() && !a.ev.replayed)
        .count();
    if executed > 1 {
        run.fail(format!(
            "{executed} of {n} simultaneous requests were answered as executions (success \
             without the replay marker)"
        ));
    }
    let winner = answers.iter().find(|a| a.is_success()).cloned();
    if let Some(w) = &winner {
        if answers.iter().any(|a| a.is_success() && a.body != w.body) {
            run.fail("the successful answers differ in their bodies");
        }
    }
    let settled = probe.settle("retry after", Cred::A, &key, &body).await;
    for a in &settled {
        run.record(a);
    }
    let last = settled.last().expect("settle sends at least once");
    if !last.is_success() || !last.ev.replayed {
        run.fail(format!(
            "the retry after the burst got {}; expected the replay",
            last.describe()
        ));
    }
    run.one_object_per_key();
    if !run.failed {
        let conflicts = answers.iter().filter(|a| a.status() == Some(409)).count();
        run.note(format!(
            "{n} simultaneous requests with one key: one object {}; {executed} executed, {} \
             replayed, {conflicts} answered 409",
            run.ids
                .first()
                .map_or("(no id in the answers)", String::as_str),
            answers.len() - executed - conflicts
        ));
    }
}

async fn s3_mutated(probe: &Probe, run: &mut Run) {
    if probe.cfg.mutations.is_empty() {
        run.not_applicable(
            "no --mutate given: name a field whose change makes another request, e.g. \
             --mutate /amount_minor=2999",
        );
        return;
    }
    run.expect_delta = Some(1..=1);
    let key = fresh_key();
    let body = probe.cfg.body.render();
    let Some(mut mutated) = body.json.clone() else {
        run.not_applicable("the body is not JSON");
        return;
    };
    for m in &probe.cfg.mutations {
        if let Err(e) = m.apply(&mut mutated) {
            run.fail(e.to_string());
            return;
        }
    }
    let mutated = mutated.to_string();
    let first = probe.send("first", Cred::A, Some(&key), &body.text).await;
    if !run.first_succeeded(&first) {
        return;
    }
    let conflict = probe
        .settle("same key, mutated body", Cred::A, &key, &mutated)
        .await;
    for a in &conflict {
        run.record(a);
    }
    let last = conflict.last().expect("settle sends at least once");
    if last.status() == Some(422) {
        run.note("the same key with a mutated body was refused with 422");
    } else {
        run.fail(format!(
            "the same key with a mutated body got {}; expected 422{}",
            last.describe(),
            if last.is_success() {
                " (the key's request fingerprint is not compared)"
            } else {
                ""
            }
        ));
    }
    let again = probe
        .send("original body again", Cred::A, Some(&key), &body.text)
        .await;
    run.record(&again);
    expect_replay_of(
        probe,
        run,
        &first,
        &again,
        "the original request after the conflict",
    );
}

async fn s3_reordered(probe: &Probe, run: &mut Run) {
    let key = fresh_key();
    let body = probe.cfg.body.render();
    let Some(json) = body.json.clone() else {
        run.not_applicable("the body is not JSON");
        return;
    };
    run.expect_delta = Some(1..=1);
    let mut variant = String::new();
    reordered(&json, 1, &mut variant);
    let first = probe.send("first", Cred::A, Some(&key), &body.text).await;
    if !run.first_succeeded(&first) {
        return;
    }
    let answers = probe
        .settle(
            "same key, members reordered, whitespace changed",
            Cred::A,
            &key,
            &variant,
        )
        .await;
    for a in &answers {
        run.record(a);
    }
    let last = answers.last().expect("settle sends at least once");
    if last.status() == Some(422) {
        run.fail(
            "the same JSON with members reordered and whitespace changed was refused with 422: \
             the fingerprint is taken over bytes, not canonical JSON (RFC 8785)",
        );
    } else {
        expect_replay_of(probe, run, &first, last, "the reordered JSON");
    }
    if !run.failed {
        run.note("the same JSON with members reordered and whitespace changed was replayed");
    }
}

/// Writes `v` with object members in reverse order and generous whitespace: the same JSON
/// value, other bytes.
fn reordered(v: &Value, depth: usize, out: &mut String) {
    let indent = "  ".repeat(depth);
    match v {
        Value::Object(map) if !map.is_empty() => {
            out.push_str("{\n");
            let members: Vec<_> = map.iter().rev().collect();
            for (i, (k, val)) in members.iter().enumerate() {
                out.push_str(&indent);
                out.push_str(&Value::String((*k).clone()).to_string());
                out.push_str(" :  ");
                reordered(val, depth + 1, out);
                if i + 1 < members.len() {
                    out.push_str(" ,");
                }
                out.push('\n');
            }
            out.push_str(&"  ".repeat(depth - 1));
            out.push('}');
        }
        Value::Array(items) if !items.is_empty() => {
            out.push_str("[ ");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(" ,  ");
                }
                reordered(item, depth + 1, out);
            }
            out.push_str(" ]");
        }
        other => out.push_str(&other.to_string()),
    }
}

async fn s4_hang_up(probe: &Probe, run: &mut Run) {
    if probe.cfg.url.scheme() != "http" {
        run.not_applicable("S4 writes the request to a raw TCP socket: http:// only");
        return;
    }
    run.expect_delta = Some(1..=1);
    let key = fresh_key();
    let body = probe.cfg.body.render();
    let ev = probe
        .hang_up("first, connection closed before reading", &key, &body.text)
        .await;
    let arrived = ev
        .error
        .as_deref()
        .is_some_and(|e| e.contains("began to arrive"));
    run.requests.push(ev);
    if !arrived {
        run.fail("the first request got no answer before it was abandoned");
    }
    let retry = probe.settle("retry", Cred::A, &key, &body.text).await;
    for a in &retry {
        run.record(a);
    }
    let last = retry.last().expect("settle sends at least once");
    if !last.is_success() {
        run.fail(format!(
            "the retry after the hang-up got {}",
            last.describe()
        ));
        return;
    }
    if !last.ev.replayed {
        run.fail(format!(
            "the retry after the hang-up got {} without the replay marker: the \
             request that executed before the hang-up was executed again",
            last.describe()
        ));
    }
    let again = probe
        .send("retry again", Cred::A, Some(&key), &body.text)
        .await;
    run.record(&again);
    expect_replay_of(probe, run, last, &again, "the second retry");
    run.one_object_per_key();
    if !run.failed {
        run.note(format!(
            "the answer to the abandoned request was never read; the retry replayed object {}",
            last.id().unwrap_or("(no id in the answer)")
        ));
    }
}

async fn scope(probe: &Probe, run: &mut Run) {
    if !probe.has_credential_b() {
        run.not_applicable("no second credential given (--header-b)");
        return;
    }
    // The first credential's count sees one object, or two where it counts across
    // credentials.
    run.expect_delta = Some(1..=2);
    let key = fresh_key();
    let body_a = probe.cfg.body.render();
    let body_b = probe.cfg.body.render();
    let first = probe
        .send("credential a", Cred::A, Some(&key), &body_a.text)
        .await;
    if !run.first_succeeded(&first) {
        return;
    }
    let b = probe
        .send("credential b, same key", Cred::B, Some(&key), &body_b.text)
        .await;
    run.record(&b);
    if !b.is_success() {
        run.fail(format!(
            "the same key under the second credential got {}; expected its own \
             execution (keys are scoped by caller)",
            b.describe()
        ));
    } else if b.ev.replayed || (b.id().is_some() && b.id() == first.id()) {
        run.fail(
            "the second credential received the first credential's stored answer: keys are \
             not scoped by caller",
        );
    }
    let again = probe
        .send("credential a, retry", Cred::A, Some(&key), &body_a.text)
        .await;
    run.record(&again);
    expect_replay_of(probe, run, &first, &again, "the first credential's retry");
    if !run.failed {
        run.note(format!(
            "one key, two credentials: two independent objects {}",
            run.ids.join(", ")
        ));
    }
}
