//! Test fixtures for oncely: a fresh database per test on every backend, a fault-injecting
//! TCP proxy, and the service-availability policy.
//!
//! A test whose service is unreachable prints that it skipped; with
//! `ONCELY_TEST_REQUIRE_SERVICES=1` (set by `.ci/run`) it panics instead, so CI never
//! passes by skipping.
//!
//! # Layout
//! - `db` — [`TestDb`], [`TestBackend`]: fresh SQLite files and PostgreSQL schemas.
//! - `proxy` — [`FaultProxy`]: a TCP proxy that can cut every connection on demand.

mod db;
mod proxy;

pub use db::{postgres_url, require_services, TestBackend, TestDb};
pub use proxy::FaultProxy;
