//! The saga orchestrator end to end, on SQLite, PostgreSQL and MariaDB / MySQL: the real
//! effect runner calling the payments and shipping simulators (`oncely-sim`) over real
//! HTTP on `127.0.0.1:0`, the orchestrator as its handler.
//!
//! - `harness`: the world (database, simulators, runner, orchestrator) and the order
//!   saga's definition: reserve (local) → charge → [record (local)] → ship (pivot);
//! - `flows`: fulfilled; a declined card and a refused shipment compensated;
//! - `concurrency`: two orchestrators complete one step at once, the continuation runs once;
//! - `late`: a shipment booked after its step's timeout is cancelled;
//! - `rerun`: a parked local step retried from outside the service, run once by its
//!   orchestrator.

#[path = "saga/concurrency.rs"]
mod concurrency;
#[path = "saga/flows.rs"]
mod flows;
#[path = "saga/harness.rs"]
mod harness;
#[path = "saga/late.rs"]
mod late;
#[path = "saga/rerun.rs"]
mod rerun;
