//! The order service's own metric names, the per-route request metrics, and the `# HELP`
//! text of the service's own metrics ([`describe`]).

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;

/// Counter: requests answered, labels `route` (the route template, `unmatched` for a path
/// no route serves), `method`, `status` and `replayed` (`true` when the idempotency layer
/// answered with a stored outcome).
pub const HTTP_REQUESTS_TOTAL: &str = "oncely_http_requests_total";
/// Histogram: time to the response head, seconds, labels `route` and `method`.
pub const HTTP_REQUEST_DURATION_SECONDS: &str = "oncely_http_request_duration_seconds";
/// Counter: request bodies refused before they were read (oncely-http's body guard).
pub use oncely_http::metrics::HTTP_BODY_REJECTED_TOTAL;
/// Counter: orders created (201).
pub const ORDERS_CREATED_TOTAL: &str = "oncely_orders_created_total";
/// Counter: `POST /v1/orders` whose business key `(source, external_ref)` was taken: the
/// existing order (200) or, with other content, 409 `order-conflict`.
pub const ORDERS_BUSINESS_KEY_HITS_TOTAL: &str = "oncely_orders_business_key_hits_total";
/// Counter: invoices marked paid after their charge succeeded.
pub const ORDERS_INVOICES_PAID_TOTAL: &str = "oncely_orders_invoices_paid_total";
/// Counter: expired idempotency records deleted by the retention collector.
pub const IDEMPOTENCY_COLLECTED_TOTAL: &str = "oncely_idempotency_collected_total";

/// Registers the `# HELP` text of the service's own metrics above (the libraries' are
/// [`oncely_cli::metrics_handle`]'s).
pub(crate) fn describe() {
    metrics::describe_counter!(
        HTTP_REQUESTS_TOTAL,
        "Requests answered, by route template (unmatched: no route), method, status and \
         replayed (true: a stored outcome answered the retry)."
    );
    metrics::describe_histogram!(
        HTTP_REQUEST_DURATION_SECONDS,
        metrics::Unit::Seconds,
        "Time from the request to its response head, by route template and method."
    );
    metrics::describe_counter!(ORDERS_CREATED_TOTAL, "Orders created (201).");
    metrics::describe_counter!(
        ORDERS_BUSINESS_KEY_HITS_TOTAL,
        "POST /v1/orders whose business key (source, external_ref) was taken: the existing \
         order (200) or, with other content, 409 order-conflict."
    );
    metrics::describe_counter!(
        ORDERS_INVOICES_PAID_TOTAL,
        "Invoices marked paid after their charge succeeded."
    );
    metrics::describe_counter!(
        IDEMPOTENCY_COLLECTED_TOTAL,
        "Expired idempotency records deleted by the retention collector."
    );
}

/// Middleware: counts each answer in [`HTTP_REQUESTS_TOTAL`] and times it in
/// [`HTTP_REQUEST_DURATION_SECONDS`], by route template — never the concrete path, so the
/// series stay bounded.
pub(crate) async fn track(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |m| m.as_str().to_owned());
    let method = req.method().as_str().to_owned();
    let started = Instant::now();
    let res = next.run(req).await;
    let replayed = res.headers().contains_key(oncely_http::IDEMPOTENT_REPLAYED);
    metrics::histogram!(HTTP_REQUEST_DURATION_SECONDS, "route" => route.clone(), "method" => method.clone())
        .record(started.elapsed().as_secs_f64());
    metrics::counter!(HTTP_REQUESTS_TOTAL, "route" => route, "method" => method,
        "status" => res.status().as_str().to_owned(), "replayed" => if replayed { "true" } else { "false" })
    .increment(1);
    res
}
