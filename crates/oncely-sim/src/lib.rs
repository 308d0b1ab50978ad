//! Simulated external providers for oncely's external-effect tests: a payments API that is a
//! subset of Stripe's API v1 (so an adapter written against it works against api.stripe.com
//! unchanged) and a shipping API without idempotency keys — each with exact fault injection
//! (docs/DESIGN.md "Provider contracts") and counts of what was really created, so tests can count
//! at the provider.
//!
//! ```no_run
//! # async fn run() -> std::io::Result<()> {
//! use oncely_sim::{serve, PaymentsConfig, PaymentsSim};
//! let sim = PaymentsSim::new(PaymentsConfig::default());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! serve(listener, sim.router(), std::future::pending()).await
//! # }
//! ```
//!
//! State lives in memory, behind one `Mutex` per simulator; restarting loses it.
//!
//! # Layout
//! - `payments` — [`PaymentsSim`], [`PaymentsConfig`], [`PaymentsStats`]: PaymentIntents,
//!   Charges, Refunds, list pagination, search with a lag, Stripe v1 idempotency (the first
//!   answer stored and replayed byte for byte, a 500 included).
//! - `shipping` — [`ShippingSim`], [`ShippingConfig`], [`ShippingStats`]: shipments booked
//!   by `merchant_reference`, no keys, cancel, a definitive 422 refusal.
//! - `faults` — [`FaultKind`], [`FaultRates`], [`FaultConfig`]: the six faults, their rates
//!   and one-shots, and the `/_sim/faults` control endpoints.
//! - `server` — [`serve`]: the accept loop that can drop a connection without an answer.

mod faults;
mod payments;
mod server;
mod shipping;

pub use faults::{FaultConfig, FaultKind, FaultParseError, FaultRates};
pub use payments::{MetadataCount, PaymentsConfig, PaymentsSim, PaymentsStats, RequestCounts};
pub use server::serve;
pub use shipping::{ReferenceCount, ShipmentItem, ShippingConfig, ShippingSim, ShippingStats};
