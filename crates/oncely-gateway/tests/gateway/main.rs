//! `oncely gateway` over real HTTP on `127.0.0.1:0`, in front of a real upstream: a
//! deliberately non-idempotent order service in Python (`upstream.py`, stdlib
//! `http.server` inserting a row per `POST` into SQLite), on a real store (SQLite,
//! PostgreSQL, MariaDB).
//!
//! - `forwarding` — keys, replays, headers, 422, 409, tenant scope, pass-through.
//! - `fingerprint` — per-route fingerprint parts: the body narrowed to JSON pointers,
//!   request headers covered.
//! - `business_key` — the operation's key read from the body at a JSON pointer.
//! - `faults` — the upstream's faults: 5xx, connection refused, a dropped answer, a
//!   timeout, and the probe that resolves them (an object over the stored bound too).
//! - `burst` — 64 requests with one key over two gateway instances reach the upstream
//!   once (PostgreSQL, MariaDB; SQLite with one instance).
//! - `verify` — `oncely verify` passes behind the gateway and fails directly.
//! - `config` — the TOML file and the command-line routes.
//! - `limits` — slow clients: a trickled request head or body.

mod burst;
mod business_key;
mod config;
mod faults;
mod fingerprint;
mod forwarding;
mod limits;
mod support;
mod verify;
