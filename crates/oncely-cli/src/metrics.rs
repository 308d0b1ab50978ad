//! [`metrics_handle`]: the process-wide Prometheus recorder a command's `/metrics` renders.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// The process-wide Prometheus recorder, installed on first use, with the `# HELP` text of
/// the libraries' metrics (idempotency layer, relay, consumers, effect runner and
/// reconciler, brokers): outbox publish latencies and inbox handler run times as
/// histograms, with the bounds their crates define. Another recorder may already be
/// installed (by an embedding program); then this handle renders nothing but the process
/// still runs.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Prefix("oncely_outbox_publish".to_owned()),
                    oncely_outbox::metrics::LATENCY_BUCKETS,
                )
                .expect("a non-empty bucket list is accepted")
                .set_buckets_for_metric(
                    Matcher::Full(oncely_inbox::metrics::HANDLER_SECONDS.to_owned()),
                    oncely_inbox::metrics::HANDLER_BUCKETS,
                )
                .expect("a non-empty bucket list is accepted");
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            drop(metrics::set_global_recorder(recorder));
            oncely_http::metrics::describe();
            oncely_outbox::metrics::describe();
            oncely_inbox::metrics::describe();
            oncely_effects::metrics::describe();
            oncely_broker::describe_metrics();
            handle
        })
        .clone()
}
