//! The reference order service: `POST /v1/orders` creates exactly one order however often a
//! client retries, `GET /v1/orders/{id}` reads it back — with its invoice, payment and
//! shipment once the flow (order → invoice → charge → `invoice.paid` → shipment) got there.
//!
//! Two guards stand behind every order: the idempotency layer (the client's
//! `Idempotency-Key`, scoped by tenant and route) and the business key
//! `UNIQUE(tenant, source, external_ref)`, which holds even when a client loses its key or
//! retries after the record's retention.
//!
//! # Layout
//! - `config` — [`AppConfig`]: API keys → tenants, retention, idempotency settings.
//! - `app` — [`router`], [`migrate`], [`serve`]: wiring, start-up and graceful shutdown.
//! - authentication is `oncely_http::TenantLayer` with the service's `oncely_http::ApiKeys`
//!   (`Authorization: Bearer <api key>` → [`oncely_core::TenantId`]), wired in `app`.
//! - `problem` — the service's own problem kinds (the layer's are `oncely_http::kind`).
//! - `orders` — the handlers, input validation and the business-key rule.
//! - `list` — `GET /v1/orders`: the tenant's orders newest first, cursor pagination.
//! - `events` — the `order.created` outbox event: derived message id, headers.
//! - `billing` — [`BillingHandler`], [`billing_consumer`]: the `billing` inbox consumer of
//!   `order.created` (one invoice per order, table `invoices`; with payments configured,
//!   the invoice's `payments`/`charge` effect in the same transaction).
//! - `flow` — [`OrderEffects`]: the effect handler that marks an invoice paid and writes
//!   `invoice.paid` when its charge succeeds; the flow's provider and operation names.
//! - `shipping` — [`ShippingHandler`], [`shipping_consumer`]: the `shipping` inbox consumer
//!   of `invoice.paid` (one `shipping`/`book` effect per order).
//! - `openapi` — [`openapi_document`]: the OpenAPI 3.1 document generated from the
//!   handlers and types, served at `GET /openapi.json`.
//! - `schema` — the schema types the handlers' attributes name (the problem object, the
//!   `Idempotency-Key` header): a leaf, so handlers and `openapi` never import each other.
//! - `routes` — [`PAYMENT_ROUTE`], [`OPERATIONS_ROUTE`]: route templates more than one
//!   module names.
//! - `probes` — `GET /healthz`, `GET /metrics` and [`metrics_handle`], the process-wide
//!   Prometheus recorder.
//! - `fulfilment` — [`Fulfilment`], [`FulfilmentConfig`], [`FulfilmentHandler`],
//!   [`fulfilment_consumer`], [`fulfilment_orchestrator`]: the order-fulfilment saga
//!   (`--fulfilment saga`) — reserve stock → charge → ship (pivot) → invoice, started by
//!   `order.created` in the `fulfilment` consumer; `POST /v1/orders/{id}/cancel`; the
//!   saga's part of `GET /v1/orders/{id}` comes from `saga_view`, a leaf both use.
//! - `stock` — `PUT`/`GET /v1/stock/{sku}` (tables `stock`, `stock_reservations`) and
//!   the saga's reserve / release / consume writes.
//! - `ready` — `GET /readyz`: the database, the broker and each provider ([`Dependency`])
//!   checked apart.
//! - [`metrics`] — the service's metric names, the per-route request metrics and the
//!   `# HELP` text of everything `/metrics` renders.
//! - `console` — the operator console at `/console` (with [`AppConfig::admin_token`]):
//!   counts, stuck operations, dead letters with requeue, effects and discrepancies with
//!   their audited actions, the order search and each order's chain as a timeline;
//!   sign-out revokes the session in the store.
//! - `chain` — [`order_chain`], [`OrderChain`]: an order's whole chain (idempotency record,
//!   order, events, deliveries, invoices, every effect of every path with its evidence,
//!   saga) from the durable stores, and as a [`Step`] timeline; [`search_orders`] by id,
//!   external ref or key within a tenant. The console's order page and `orders show`.
//! - `status` — the order's `status`, one vocabulary for both fulfilment modes.
//! - `collector` — [`retention`]: the service's one retention runner, with
//!   [`collector_sweep`] (expired idempotency records deleted in batches) and the lease sweep.
//! - `payments` — `POST /v1/orders/{id}/payments` in multi-phase mode ([`PaymentsSettings`]):
//!   the order's charge, synchronously at the provider, with its status check. A folder:
//!   `charge` (the call and its answer), `status` (the resolver's status check), `answers`.
//! - `payment_store` — tables `order_payments` (one payment per order, endpoint or flow)
//!   and `order_payment_evidence` (every call and status check).
//! - `operations` — `GET /v1/operations/{key}`: a payment operation's state, attempts,
//!   lease and evidence (the 409s' status link).
//! - `webhooks` — `POST /v1/webhooks/stripe` ([`StripeWebhookSettings`]): Stripe's signed
//!   events, a `payment_intent.*` one applied once to the charge effect it names
//!   (docs/webhooks.md).
//! - `payments_source` — [`PaymentsSource`]: the endpoint's payments as reconciliation's
//!   local intents.
//! - [`cli`] — the `orders` binary's commands (`serve`, `migrate`, `consume`, `import`,
//!   `effects run`, `reconcile`, `show`): flags turned into the configuration above, with the
//!   shared argument groups of `oncely-cli`. A folder: `serve`, `consume`, `effects`,
//!   `import`, `show`.

mod app;
mod billing;
mod caller;
mod chain;
pub mod cli;
mod collector;
mod config;
mod console;
mod events;
mod flow;
mod fulfilment;
mod list;
pub mod metrics;
mod openapi;
mod operations;
mod orders;
mod payment_store;
mod payments;
mod payments_source;
mod probes;
pub mod problem;
mod ready;
mod routes;
mod saga_view;
mod schema;
mod shipping;
mod status;
mod stock;
mod webhooks;

pub use app::{migrate, router, router_without_idempotency, serve};
pub use billing::{
    billing_consumer, billing_consumer_with, BillingHandler, BILLING_CONSUMER, INVOICE_KIND_ORDER,
};
pub use chain::{
    order_chain, search_orders, ChainDelivery, ChainEffect, ChainEvent, ChainInvoice, ChainOrder,
    ChainRecord, ChainSaga, ChainSagaStep, EffectPath, Evidence, OrderChain, OrderHit, Step,
    StepState, Time, SEARCH_LIMIT,
};
pub use collector::{collector_sweep, retention};
pub use config::{parse_api_keys, AppConfig, ConfigError};
pub use events::{INVOICE_PAID, ORDERS_TOPIC, ORDER_CREATED};
pub use flow::{OrderEffects, BOOK, CHARGE, PAYMENTS, SHIPPING};
pub use fulfilment::{
    definition as fulfilment_definition, fulfilment_consumer,
    orchestrator as fulfilment_orchestrator, resolution_handler, saga_definitions, Fulfilment,
    FulfilmentConfig, FulfilmentHandler, CANCEL, FULFILMENT_CONSUMER, ORDER_SAGA, REFUND,
};
pub use list::{DEFAULT_LIMIT, MAX_LIMIT};
pub use openapi::document as openapi_document;
pub use orders::{NewOrder, OrderItem};
pub use payments::PaymentsSettings;
pub use payments_source::PaymentsSource;
pub use probes::metrics_handle;
pub use ready::{Dependency, CHECK_TIMEOUT};
pub use routes::{OPERATIONS_ROUTE, PAYMENT_ROUTE};
pub use shipping::{shipping_consumer, ShippingHandler, SHIPPING_CONSUMER};
pub use webhooks::{StripeWebhookSettings, STRIPE_WEBHOOK_ROUTE};
