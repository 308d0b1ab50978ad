use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::StatusCode;
use oncely_http::Problem;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde::{Deserialize, Serialize};

/// One kind of injected fault (docs/DESIGN.md "Provider contracts").
///
/// Faults apply to the *effect* endpoints only (creates, refunds, cancels), never to status
/// lookups or the control endpoints. `rate_limit` and `latency` are drawn when the request
/// arrives (after authentication); the other four only for a request that is about to run
/// its effect — not for one rejected by validation and not for a Stripe idempotent replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FaultKind {
    /// Extra delay of [`FaultConfig::latency_ms`] before the request is handled.
    Latency,
    /// A 5xx before the effect: nothing is created. (On the Stripe API the 500 is still
    /// stored under the request's `Idempotency-Key`, as Stripe v1 does once an endpoint
    /// began executing.)
    ErrorBefore,
    /// The effect happens, then a 500 (or [`FaultConfig::error_after_status`]). On the
    /// Stripe API that answer is what is stored under
    /// the key and replayed.
    ErrorAfter,
    /// The effect happens, then the TCP connection is closed without an answer.
    DropAfter,
    /// The effect happens, then the answer comes [`FaultConfig::late_ms`] later.
    LateAfter,
    /// 429 with `Retry-After: `[`FaultConfig::retry_after_secs`]; nothing happens and
    /// nothing is stored under a key.
    RateLimit,
}

impl FaultKind {
    /// Every kind, in a fixed order.
    pub const ALL: [FaultKind; 6] = [
        FaultKind::Latency,
        FaultKind::ErrorBefore,
        FaultKind::ErrorAfter,
        FaultKind::DropAfter,
        FaultKind::LateAfter,
        FaultKind::RateLimit,
    ];

    /// The kind's name: `latency`, `error_before`, `error_after`, `drop_after`,
    /// `late_after`, `rate_limit`.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Latency => "latency",
            FaultKind::ErrorBefore => "error_before",
            FaultKind::ErrorAfter => "error_after",
            FaultKind::DropAfter => "drop_after",
            FaultKind::LateAfter => "late_after",
            FaultKind::RateLimit => "rate_limit",
        }
    }
}

impl FromStr for FaultKind {
    type Err = FaultParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FaultKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| FaultParseError::UnknownKind(s.to_owned()))
    }
}

/// A fault setting that does not parse.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FaultParseError {
    /// Not one of the [`FaultKind`] names.
    #[error("unknown fault kind {0:?} (expected one of latency, error_before, error_after, drop_after, late_after, rate_limit)")]
    UnknownKind(String),
    /// Not `kind=rate`.
    #[error("expected kind=rate, e.g. error_after=0.05")]
    Syntax,
    /// A rate outside 0.0–1.0 or not a number.
    #[error("a fault rate is a number from 0.0 to 1.0")]
    Rate,
}

/// The probability (0.0–1.0) of each fault kind, drawn independently per effect request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultRates {
    /// Rate of [`FaultKind::Latency`].
    pub latency: f64,
    /// Rate of [`FaultKind::ErrorBefore`].
    pub error_before: f64,
    /// Rate of [`FaultKind::ErrorAfter`].
    pub error_after: f64,
    /// Rate of [`FaultKind::DropAfter`].
    pub drop_after: f64,
    /// Rate of [`FaultKind::LateAfter`].
    pub late_after: f64,
    /// Rate of [`FaultKind::RateLimit`].
    pub rate_limit: f64,
}

impl FaultRates {
    /// The rate of `kind`.
    pub fn rate(&self, kind: FaultKind) -> f64 {
        *self.slot(kind)
    }

    /// Sets the rate of `kind`.
    ///
    /// # Errors
    /// [`FaultParseError::Rate`] when `rate` is not within 0.0–1.0.
    pub fn set(&mut self, kind: FaultKind, rate: f64) -> Result<(), FaultParseError> {
        if !(0.0..=1.0).contains(&rate) {
            return Err(FaultParseError::Rate);
        }
        *self.slot_mut(kind) = rate;
        Ok(())
    }

    /// Sets a rate from `kind=rate` (the CLI's `--fault error_after=0.05`).
    ///
    /// # Errors
    /// [`FaultParseError`] when the text is not `kind=rate` with a known kind and a rate in
    /// 0.0–1.0.
    pub fn set_from_str(&mut self, setting: &str) -> Result<(), FaultParseError> {
        let (kind, rate) = setting.split_once('=').ok_or(FaultParseError::Syntax)?;
        let rate = rate.trim().parse().map_err(|_| FaultParseError::Rate)?;
        self.set(kind.trim().parse()?, rate)
    }

    fn slot(&self, kind: FaultKind) -> &f64 {
        match kind {
            FaultKind::Latency => &self.latency,
            FaultKind::ErrorBefore => &self.error_before,
            FaultKind::ErrorAfter => &self.error_after,
            FaultKind::DropAfter => &self.drop_after,
            FaultKind::LateAfter => &self.late_after,
            FaultKind::RateLimit => &self.rate_limit,
        }
    }

    fn slot_mut(&mut self, kind: FaultKind) -> &mut f64 {
        match kind {
            FaultKind::Latency => &mut self.latency,
            FaultKind::ErrorBefore => &mut self.error_before,
            FaultKind::ErrorAfter => &mut self.error_after,
            FaultKind::DropAfter => &mut self.drop_after,
            FaultKind::LateAfter => &mut self.late_after,
            FaultKind::RateLimit => &mut self.rate_limit,
        }
    }
}

/// Fault injection settings of one simulated API. Also the JSON of `GET /_sim/faults`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultConfig {
    /// The rate of each kind.
    #[serde(flatten)]
    pub rates: FaultRates,
    /// Extra delay of a `latency` fault, in ms (default 200).
    pub latency_ms: u64,
    /// Delay of a `late_after` answer, in ms (default 5000: longer than a caller's
    /// timeout).
    pub late_ms: u64,
    /// `Retry-After` of a `rate_limit` answer, in seconds (default 1).
    pub retry_after_secs: u32,
    /// HTTP status of an `error_after` answer (default 500): what reaches the caller after
    /// the effect happened — a 503 from an egress proxy, a CDN's 520/524, a 507, Stripe's
    /// 409 "a request with this key is in progress".
    pub error_after_status: u16,
    /// Seed of the random draws, for reproducible runs; `None` seeds from the OS.
    pub seed: Option<u64>,
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            rates: FaultRates::default(),
            latency_ms: 200,
            late_ms: 5000,
            retry_after_secs: 1,
            error_after_status: 500,
            seed: None,
        }
    }
}

/// `POST /_sim/faults`: the settings to change; absent fields keep their value.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultPatch {
    latency: Option<f64>,
    error_before: Option<f64>,
    error_after: Option<f64>,
    drop_after: Option<f64>,
    late_after: Option<f64>,
    rate_limit: Option<f64>,
    latency_ms: Option<u64>,
    late_ms: Option<u64>,
    retry_after_secs: Option<u32>,
    error_after_status: Option<u16>,
    seed: Option<u64>,
    /// Drops every pending one-shot fault.
    clear_next: Option<bool>,
}

/// `POST /_sim/faults/next`: `count` (default 1) one-shot faults of `kind`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NextFault {
    kind: FaultKind,
    #[serde(default = "one")]
    count: u32,
}

fn one() -> u32 {
    1
}

/// What the draws decided for one request that is about to run its effect.
// Four independent draws, not a state: bools are the honest shape.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Outcome {
    pub(crate) error_before: bool,
    pub(crate) error_after: bool,
    pub(crate) drop_after: bool,
    pub(crate) late_after: bool,
    /// The status an `error_after` answers ([`FaultConfig::error_after_status`]).
    pub(crate) error_status: u16,
}

/// The fault state of one API: settings, the seeded RNG, pending one-shots and counts of
/// what was injected. Behind one `Mutex`: draws are short and never held across an await.
#[derive(Debug, Clone)]
pub(crate) struct Faults(Arc<Mutex<FaultState>>);

#[derive(Debug)]
struct FaultState {
    config: FaultConfig,
    rng: StdRng,
    next: BTreeMap<FaultKind, u32>,
    injected: BTreeMap<FaultKind, u64>,
}

fn rng_for(seed: Option<u64>) -> StdRng {
    StdRng::seed_from_u64(seed.unwrap_or_else(rand::random))
}

impl Faults {
    pub(crate) fn new(config: FaultConfig) -> Self {
        Self(Arc::new(Mutex::new(FaultState {
            rng: rng_for(config.seed),
            config,
            next: BTreeMap::new(),
            injected: BTreeMap::new(),
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FaultState> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Draws `kind`: a pending one-shot first, else the rate. Counts what fired.
    fn draw(state: &mut FaultState, kind: FaultKind) -> bool {
        let fired = match state.next.get_mut(&kind) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => {
                let rate = state.config.rates.rate(kind);
                rate > 0.0 && state.rng.random::<f64>() < rate
            }
        };
        if fired {
            *state.injected.entry(kind).or_default() += 1;
        }
        fired
    }

    /// The faults of an arriving effect request: `Some(retry_after_secs)` when it is
    /// rate-limited; otherwise waits out a `latency` fault, if one is drawn.
    pub(crate) async fn on_arrival(&self) -> Option<u32> {
        let delay = {
            let mut s = self.lock();
            if Self::draw(&mut s, FaultKind::RateLimit) {
                return Some(s.config.retry_after_secs);
            }
            Self::draw(&mut s, FaultKind::Latency)
                .then(|| Duration::from_millis(s.config.latency_ms))
        };
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        None
    }

    /// The faults of a request about to run its effect. `error_before` excludes the rest
    /// (nothing runs, so nothing is after).
    pub(crate) fn on_effect(&self) -> Outcome {
        let mut s = self.lock();
        if Self::draw(&mut s, FaultKind::ErrorBefore) {
            return Outcome {
                error_before: true,
                ..Outcome::default()
            };
        }
        Outcome {
            error_before: false,
            error_after: Self::draw(&mut s, FaultKind::ErrorAfter),
            drop_after: Self::draw(&mut s, FaultKind::DropAfter),
            late_after: Self::draw(&mut s, FaultKind::LateAfter),
            error_status: s.config.error_after_status,
        }
    }

    /// Delay of a `late_after` answer.
    pub(crate) fn late(&self) -> Duration {
        Duration::from_millis(self.lock().config.late_ms)
    }

    /// How many faults of each kind were injected so far.
    pub(crate) fn injected(&self) -> BTreeMap<FaultKind, u64> {
        self.lock().injected.clone()
    }

    fn snapshot(&self) -> serde_json::Value {
        let s = self.lock();
        let mut v = serde_json::to_value(&s.config).unwrap_or_default();
        v["next"] = serde_json::to_value(&s.next).unwrap_or_default();
        v["injected"] = serde_json::to_value(&s.injected).unwrap_or_default();
        v
    }

    fn apply(&self, patch: &FaultPatch) -> Result<(), FaultParseError> {
        let mut s = self.lock();
        let mut rates = s.config.rates;
        for (kind, rate) in [
            (FaultKind::Latency, patch.latency),
            (FaultKind::ErrorBefore, patch.error_before),
            (FaultKind::ErrorAfter, patch.error_after),
            (FaultKind::DropAfter, patch.drop_after),
            (FaultKind::LateAfter, patch.late_after),
            (FaultKind::RateLimit, patch.rate_limit),
        ] {
            if let Some(rate) = rate {
                rates.set(kind, rate)?;
            }
        }
        s.config.rates = rates;
        let c = &mut s.config;
        c.latency_ms = patch.latency_ms.unwrap_or(c.latency_ms);
        c.late_ms = patch.late_ms.unwrap_or(c.late_ms);
        c.retry_after_secs = patch.retry_after_secs.unwrap_or(c.retry_after_secs);
        c.error_after_status = patch.error_after_status.unwrap_or(c.error_after_status);
        if let Some(seed) = patch.seed {
            c.seed = Some(seed);
            s.rng = rng_for(Some(seed));
        }
        if patch.clear_next == Some(true) {
            s.next.clear();
        }
        Ok(())
    }

    /// The control endpoints: `GET`/`POST /_sim/faults`, `POST /_sim/faults/next`.
    pub(crate) fn router(&self) -> Router {
        Router::new()
            .route("/_sim/faults", get(get_faults).post(post_faults))
            .route("/_sim/faults/next", post(post_next))
            .with_state(self.clone())
    }
}

fn bad_control(detail: impl Into<String>) -> Response {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "sim-invalid-fault-setting",
        "Invalid fault setting",
    )
    .detail(detail)
    .into_response()
}

async fn get_faults(State(f): State<Faults>) -> Json<serde_json::Value> {
    Json(f.snapshot())
}

async fn post_faults(State(f): State<Faults>, body: axum::body::Bytes) -> Response {
    let patch: FaultPatch = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return bad_control(e.to_string()),
    };
    match f.apply(&patch) {
        Ok(()) => Json(f.snapshot()).into_response(),
        Err(e) => bad_control(e.to_string()),
    }
}

async fn post_next(State(f): State<Faults>, body: axum::body::Bytes) -> Response {
    let next: NextFault = match serde_json::from_slice(&body) {
        Ok(n) => n,
        Err(e) => return bad_control(e.to_string()),
    };
    *f.lock().next.entry(next.kind).or_default() += next.count;
    Json(f.snapshot()).into_response()
}
