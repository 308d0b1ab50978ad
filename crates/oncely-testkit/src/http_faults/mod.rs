//! [`HttpFaultProxy`]: an HTTP/1.1 proxy between a service and a provider (`oncely sim`,
//! localstripe) that decides, per request and per order, what the provider seems to do.
//!
//! Each request is attributed to an order ([`ProxyOptions::order_of`], then the aliases
//! and object ids the proxy learned from earlier traffic of that order) and takes the next
//! [`Fault`] of that order's [`Schedule`]: the effect requests (every method but `GET`)
//! from [`Schedule::effects`], the lookups (`GET`) from [`Schedule::lookups`]; past the end
//! of a list, requests pass. The answer of every lookup that lists objects (Stripe's search
//! and list, the shipping lookup by `merchant_reference`) is also filtered by each listed
//! object's order: an object is hidden while that order's [`Schedule::lag`] since the proxy
//! first saw it has not passed (a search index that lags writes), but never past
//! [`ProxyOptions::hide_window`].
//!
//! Every forward runs in a task of its own, so a caller that gives up (its timeout) does
//! not cancel the commit at the provider — as with a real network. What the proxy did is
//! kept per order ([`HttpFaultProxy::log`]) for the failure report.

//!
//! # Layout
//! - `proxy` — [`HttpFaultProxy`]: the server, the per-order state, forwarding and the
//!   faults applied to each exchange.
//! - `rng` — [`SeededRng`]: the seeded generator schedules are drawn from.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

mod proxy;
mod rng;
#[cfg(test)]
mod tests;

pub use proxy::HttpFaultProxy;
pub use rng::SeededRng;
/// What the caller is answered instead of the provider's answer, or before anything is
/// forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Answer {
    /// This status (100–599) with `body`. A status below 200 is informational and cannot
    /// end an exchange (hyper refuses to send one as the final answer): the caller sees no
    /// final answer, as with [`Answer::Hang`].
    Status {
        /// The HTTP status code, 100–599.
        status: u16,
        /// The body sent with it.
        body: BodyFault,
    },
    /// The connection is reset (closed with `SO_LINGER` 0): no answer at all.
    Reset,
    /// Nothing is answered until the caller gives up (or [`ProxyOptions::hang`] passes,
    /// then the connection is reset).
    Hang,
    /// The provider's own answer, this long (ms) after it came: past the caller's timeout
    /// when longer than it.
    Late(u64),
}

/// The body of a replaced answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyFault {
    /// The provider's own body (only after forwarding; before, an empty body).
    Upstream,
    /// No body at all.
    Empty,
    /// Bytes that are not the JSON they claim to be: the provider's body cut in half with
    /// junk appended (after forwarding), or junk alone (before).
    Garbled,
}

/// What the proxy does with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Forward it and answer what the provider answered.
    Pass,
    /// Do not forward it; answer this instead (a failure before the provider saw it).
    Before(Answer),
    /// Forward it (the provider commits), then answer this instead.
    After(Answer),
    /// Forward it only after this many ms (a slow commit: it lands even if the caller gave
    /// up meanwhile), then answer what the provider answered.
    SlowCommit(u64),
    /// Lookups: forward it, then drop this order's objects from the answer's `data` (an
    /// empty page), within [`ProxyOptions::hide_window`] of the object's creation.
    EmptyPage,
    /// Lookups: forward it, then replace the `status` of this order's objects in the
    /// answer (`processing`, `pending`, `label_created`, `in_transit`, …).
    StatusWord(String),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pass => f.write_str("pass"),
            Self::Before(a) => write!(f, "before:{a}"),
            Self::After(a) => write!(f, "after:{a}"),
            Self::SlowCommit(ms) => write!(f, "slow-commit:{ms}ms"),
            Self::EmptyPage => f.write_str("empty-page"),
            Self::StatusWord(w) => write!(f, "status-word:{w}"),
        }
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Status { status, body } => write!(f, "{status}/{body:?}"),
            Self::Reset => f.write_str("reset"),
            Self::Hang => f.write_str("hang"),
            Self::Late(ms) => write!(f, "late:{ms}ms"),
        }
    }
}

/// One order's faults: what its effect requests and lookups meet, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    /// The faults of the order's effect requests (every method but `GET`: creates,
    /// refunds, cancels), the first request taking the first; past the end, they pass.
    pub effects: Vec<Fault>,
    /// The faults of the order's lookups (`GET`), likewise.
    pub lookups: Vec<Fault>,
    /// How long (ms) each of the order's objects stays out of listing answers after the
    /// proxy first saw it (a lagging search index); at most
    /// [`ProxyOptions::hide_window`].
    pub lag_ms: u64,
}

/// A view of one request, for [`ProxyOptions::order_of`].
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// `GET`, `POST`, …
    pub method: &'a str,
    /// The path and query, percent-decoded.
    pub target: &'a str,
    /// The request body.
    pub body: &'a [u8],
}

/// Finds the order a request names ([`ProxyOptions::order_of`]).
pub type OrderOf = Arc<dyn Fn(&RequestView<'_>) -> Option<String> + Send + Sync>;

/// Settings of an [`HttpFaultProxy`].
#[derive(Clone)]
pub struct ProxyOptions {
    /// The order a request names, if any; [`order_of_request`] by default.
    pub order_of: OrderOf,
    /// Remove `Idempotency-Key` before forwarding: the provider then ignores keys.
    pub strip_idempotency_key: bool,
    /// Hiding faults ([`Schedule::lag_ms`], [`Fault::EmptyPage`]) never hide an object
    /// longer than this after the proxy first saw it. Default 1.5 s.
    pub hide_window: Duration,
    /// How long a request of an order without a schedule waits for
    /// [`HttpFaultProxy::plan`] before it passes. Default 3 s.
    pub wait_for_plan: Duration,
    /// How long [`Answer::Hang`] holds a request before resetting it. Default 10 s.
    pub hang: Duration,
}

impl fmt::Debug for ProxyOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyOptions")
            .field("strip_idempotency_key", &self.strip_idempotency_key)
            .field("hide_window", &self.hide_window)
            .field("wait_for_plan", &self.wait_for_plan)
            .field("hang", &self.hang)
            .finish_non_exhaustive()
    }
}

impl Default for ProxyOptions {
    fn default() -> Self {
        Self {
            order_of: Arc::new(order_of_request),
            strip_idempotency_key: false,
            hide_window: Duration::from_millis(1_500),
            wait_for_plan: Duration::from_secs(3),
            hang: Duration::from_secs(10),
        }
    }
}

/// The order a request of the reference flows names: Stripe's form field
/// `metadata[order_id]`, a JSON body's `order_id`, a search query's
/// `metadata['order_id']:'…'`, or a shipping lookup's `merchant_reference=` (up to its
/// first `:`, so `{order}:ship` is `{order}`).
pub fn order_of_request(req: &RequestView<'_>) -> Option<String> {
    let body = String::from_utf8_lossy(req.body);
    for (k, v) in form_urlencoded::parse(body.as_bytes()) {
        if k == "metadata[order_id]" {
            return Some(v.into_owned());
        }
    }
    if let Ok(v) = serde_json::from_slice::<Value>(req.body) {
        if let Some(id) = v["order_id"].as_str() {
            return Some(id.to_owned());
        }
    }
    if let Some(rest) = req.target.split("metadata['order_id']:'").nth(1) {
        return rest.split('\'').next().map(str::to_owned);
    }
    let query = req.target.split_once('?')?.1;
    form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "merchant_reference")
        .map(|(_, v)| v.split(':').next().unwrap_or_default().to_owned())
}
