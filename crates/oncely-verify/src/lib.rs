//! `oncely verify`: the acceptance checks that prove an HTTP endpoint idempotent, runnable
//! against any service that takes an `Idempotency-Key`, whatever it is written in.
//!
//! One passing API test proves nothing; these checks do. [`verify`] sends real requests
//! (HTTP/1.1 over TCP, one raw socket for S4) and reports, per check, whether it holds, fails
//! or does not apply, with its evidence: every request sent, status codes, object ids seen,
//! timings and — with a count URL — the number of objects before and after.
//!
//! | check | what must hold |
//! |---|---|
//! | `key-missing` | no key ⇒ 400 (draft-ietf-httpapi-idempotency-key-header-07 §2.7), or reported as "keys optional" |
//! | `key-malformed` | empty, 256-character, control-character and space-containing keys ⇒ 400 |
//! | `key-max-length` | a valid 255-character key is accepted and its retry replayed |
//! | `s1-sequential` | retries with one key ⇒ one object; replays identical in status and body, marked |
//! | `s2-concurrent` | simultaneous requests with one key ⇒ one object; the others replayed or 409 |
//! | `s3-mutated` | one key, a mutated field (`--mutate`) ⇒ 422, and nothing changes |
//! | `s3-reordered` | one key, the same JSON reordered with other whitespace ⇒ the replay |
//! | `s4-hang-up` | connection closed before the answer was read; the retry ⇒ the same one object |
//! | `scope` | one key under a second credential ⇒ an independent operation |
//!
//! Body placeholders (`{{uuid}}`) are filled afresh for every logical operation, so checks
//! on an API with its own business-level unique keys do not collide.
//!
//! # Layout
//! - `config` — [`VerifyConfig`], [`BodyTemplate`], [`Mutation`], [`ObjectIdSource`],
//!   [`Header`], [`ConfigError`]: what to check and how to read answers.
//! - `checks` — [`verify`], [`ALL_CHECKS`], [`VerifyError`]: the checks, run in order.
//! - `probe` — the HTTP client, the raw-socket hang-up and the object counter (private).
//! - `report` — [`Report`], [`CheckReport`], [`CheckId`], [`Outcome`], [`RequestEvidence`]:
//!   the outcome as a table or JSON.

mod checks;
mod config;
mod probe;
mod report;

pub use checks::{verify, VerifyError, ALL_CHECKS};
pub use config::{
    parse_url, BodyTemplate, ConfigError, Header, Mutation, ObjectIdSource, RenderedBody,
    VerifyConfig, UUID_PLACEHOLDER,
};
pub use report::{CheckId, CheckReport, Outcome, Report, RequestEvidence};
