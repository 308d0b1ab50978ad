//! The report: each check's outcome and its evidence, as a table or JSON.

use std::fmt::Write as _;

use serde::Serialize;

/// Which check a [`CheckReport`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum CheckId {
    /// A request without a key is refused with 400 when keys are required
    /// (draft-ietf-httpapi-idempotency-key-header-07 §2.7).
    KeyMissing,
    /// Malformed keys (empty, 256 characters, a control character, a space) are refused
    /// with 400.
    KeyMalformed,
    /// A valid 255-character key is accepted and its retry replayed.
    KeyMaxLength,
    /// S1: sequential retries with one key give one object; every later answer is the
    /// replay, identical in status and body, with the replay marker.
    S1Sequential,
    /// S2: simultaneous requests with one key give one object; the others are replays or 409.
    S2Concurrent,
    /// S3: the same key with a mutated body is a 422 conflict, and nothing changes.
    S3Mutated,
    /// S3: the same JSON with its members reordered and whitespace changed is the replay,
    /// not a conflict (RFC 8785 canonical form).
    S3Reordered,
    /// S4: the connection is closed after the request was written and before the answer was
    /// read; the retry returns the one object.
    S4HangUp,
    /// The same key under a second credential is an independent operation.
    Scope,
}

impl CheckId {
    /// The id as shown in the table and the JSON report, e.g. `s2-concurrent`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::KeyMissing => "key-missing",
            Self::KeyMalformed => "key-malformed",
            Self::KeyMaxLength => "key-max-length",
            Self::S1Sequential => "s1-sequential",
            Self::S2Concurrent => "s2-concurrent",
            Self::S3Mutated => "s3-mutated",
            Self::S3Reordered => "s3-reordered",
            Self::S4HangUp => "s4-hang-up",
            Self::Scope => "scope",
        }
    }
}

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Every expectation of the check held.
    Holds,
    /// At least one expectation did not hold; [`CheckReport::findings`] says which.
    Fails,
    /// The check cannot apply to this endpoint or configuration; never counted as passed.
    NotApplicable,
}

impl Outcome {
    /// `holds`, `FAILS` or `not applicable`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Holds => "holds",
            Self::Fails => "FAILS",
            Self::NotApplicable => "not applicable",
        }
    }
}

/// One request a check sent, and what came back.
#[derive(Debug, Clone, Serialize)]
pub struct RequestEvidence {
    /// The request's role in the check, e.g. `first`, `retry 2`, `simultaneous 7`.
    pub step: String,
    /// `a` (the first credential) or `b` (`--header-b`).
    pub credential: char,
    /// The key sent, `None` when none was; keys over 48 characters are shortened.
    pub key: Option<String>,
    /// The HTTP status, `None` when no answer was read.
    pub status: Option<u16>,
    /// Whether the answer carried the replay marker.
    pub replayed: bool,
    /// The object id found in the answer.
    pub object_id: Option<String>,
    /// The `Retry-After` header, when present.
    pub retry_after: Option<String>,
    /// Bytes of the answer's body.
    pub body_bytes: usize,
    /// A transport error, or why no answer was read.
    pub error: Option<String>,
    /// Time from sending to the whole answer, in milliseconds.
    pub elapsed_ms: f64,
}

/// One check's outcome with its evidence.
#[derive(Debug, Clone, Serialize)]
pub struct CheckReport {
    /// Which check.
    pub id: CheckId,
    /// Holds, fails or not applicable.
    pub outcome: Outcome,
    /// Why it holds, what failed, or why it does not apply — one line each.
    pub findings: Vec<String>,
    /// Every request sent, in order.
    pub requests: Vec<RequestEvidence>,
    /// Distinct object ids seen, in order of first appearance.
    pub ids_seen: Vec<String>,
    /// Objects counted by `--count-url` before the check.
    pub count_before: Option<u64>,
    /// Objects counted by `--count-url` after the check.
    pub count_after: Option<u64>,
    /// The wall time of the check, in milliseconds.
    pub elapsed_ms: f64,
}

impl CheckReport {
    /// `statuses` in order of first appearance with their number, e.g. `201×12 409×4`;
    /// `-` for a request without an answer.
    pub fn status_summary(&self) -> String {
        let mut seen: Vec<(String, usize)> = Vec::new();
        for r in &self.requests {
            let s = r.status.map_or_else(|| "-".to_owned(), |s| s.to_string());
            match seen.iter_mut().find(|(k, _)| *k == s) {
                Some((_, n)) => *n += 1,
                None => seen.push((s, 1)),
            }
        }
        seen.iter()
            .map(|(s, n)| {
                if *n == 1 {
                    s.clone()
                } else {
                    format!("{s}×{n}")
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// The whole verification: every check, in the order run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The endpoint checked.
    pub url: String,
    /// The method used.
    pub method: String,
    /// Warnings about the configuration (e.g. a body without placeholders).
    pub notes: Vec<String>,
    /// Every check.
    pub checks: Vec<CheckReport>,
    /// True when no check fails (checks that do not apply neither pass nor fail).
    pub all_applicable_hold: bool,
    /// Wall time of the whole run, in milliseconds.
    pub elapsed_ms: f64,
    /// The endpoint's answer when it refused (4xx) the sample request that opens an
    /// operation, e.g. `400 Bad Request: {"title":…}`: the checks then say nothing about
    /// idempotency, only that `--body` or `--header` is not what the endpoint accepts.
    pub sample_refused: Option<String>,
}

impl Report {
    pub(crate) fn new(url: String, method: String, notes: Vec<String>) -> Self {
        Self {
            url,
            method,
            notes,
            checks: Vec::new(),
            all_applicable_hold: true,
            elapsed_ms: 0.0,
            sample_refused: None,
        }
    }

    /// The report of `id`, if it ran.
    pub fn check(&self, id: CheckId) -> Option<&CheckReport> {
        self.checks.iter().find(|c| c.id == id)
    }

    /// The outcome of `id`, if it ran.
    pub fn outcome(&self, id: CheckId) -> Option<Outcome> {
        self.check(id).map(|c| c.outcome)
    }

    /// True when every applicable check holds (the process exits 0 exactly then).
    pub fn passed(&self) -> bool {
        self.all_applicable_hold
    }

    /// The report as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|_| "{}".into())
    }

    /// The human-readable table: one row per check (result, requests, statuses, distinct
    /// ids, count before→after, wall time), then each check's findings.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "oncely verify: {} {}", self.method, self.url);
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        let _ = writeln!(
            out,
            "{:<15} {:<15} {:>5}  {:<24} {:>4}  {:<12} {:>9}",
            "check", "result", "reqs", "statuses", "ids", "count", "time"
        );
        for c in &self.checks {
            let count = match (c.count_before, c.count_after) {
                (Some(b), Some(a)) => format!("{b}→{a}"),
                _ => "-".into(),
            };
            let _ = writeln!(
                out,
                "{:<15} {:<15} {:>5}  {:<24} {:>4}  {:<12} {:>7.0}ms",
                c.id.as_str(),
                c.outcome.as_str(),
                c.requests.len(),
                c.status_summary(),
                c.ids_seen.len(),
                count,
                c.elapsed_ms
            );
        }
        let _ = writeln!(out);
        for c in &self.checks {
            for f in &c.findings {
                let _ = writeln!(out, "{:<15} {f}", c.id.as_str());
            }
        }
        let count = |o: Outcome| self.checks.iter().filter(|c| c.outcome == o).count();
        let _ = writeln!(
            out,
            "\n{} checks: {} hold, {} fail, {} not applicable ({:.0} ms)",
            self.checks.len(),
            count(Outcome::Holds),
            count(Outcome::Fails),
            count(Outcome::NotApplicable),
            self.elapsed_ms
        );
        out
    }
}
