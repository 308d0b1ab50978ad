//! The gateway's own metrics, beside the idempotency layer's (`oncely_http::metrics`:
//! replays, executions, fingerprint mismatches, in-flight, unknown outcomes, resolutions —
//! the probe's results among them), all served on `/_oncely/metrics` ([`with_metrics`]).

use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;

/// Counter; labels `route` (`POST /orders`), `outcome`: `answered` (the upstream answered
/// in full; `status` carries its code), `not_sent` (a connect error: nothing was sent, the
/// key freed) or `unknown` (sent, no whole answer).
pub const FORWARDS_TOTAL: &str = "oncely_gateway_forwards_total";

/// Histogram, seconds from sending a guarded request to the end of the upstream's answer
/// (or its failure); labels `route`, `outcome` as [`FORWARDS_TOTAL`].
pub const UPSTREAM_DURATION_SECONDS: &str = "oncely_gateway_upstream_duration_seconds";

/// Adds `GET /_oncely/metrics` to a gateway `router`: every metric the process recorded
/// through the recorder `handle` belongs to, in the Prometheus text format.
pub fn with_metrics(router: Router, handle: PrometheusHandle) -> Router {
    router.route(
        "/_oncely/metrics",
        get(move || std::future::ready(handle.render())),
    )
}

/// Records one guarded forward of `route`, its `outcome` and upstream `status` (`-` when
/// none), and its `seconds`.
pub(crate) fn forwarded(route: &str, outcome: &'static str, status: String, seconds: f64) {
    metrics::counter!(FORWARDS_TOTAL, "route" => route.to_owned(), "outcome" => outcome,
        "status" => status)
    .increment(1);
    metrics::histogram!(UPSTREAM_DURATION_SECONDS, "route" => route.to_owned(),
        "outcome" => outcome)
    .record(seconds);
}
