//! Named crash points: the `fail` crate's [`fail_point!`](crate::fail_point), switched at
//! run time by name.
//!
//! A point marks a boundary where a crash changes what must happen next (after the key
//! is reserved, after the provider committed and before we recorded it, after the inbox
//! commit and before the ack, …). Without the `failpoints` cargo feature every point
//! compiles to nothing; the shipped binaries do not enable it, the test build does (the
//! apps' dev-dependencies turn it on).
//!
//! A process built with the feature reads `FAILPOINTS` at start ([`setup`]), in the `fail`
//! crate's syntax: `name=action;name=action`, where an action is `panic`, `sleep(ms)`,
//! `pause`, `print`, `off`, optionally `N*` (the first N evaluations only) or `P%`.
//! `panic(abort)` ends the whole process at once, as a SIGKILL would: no destructor runs,
//! no transaction is rolled back by us, no answer is written ([`ABORT`]). A plain `panic`
//! panics the task that evaluates the point, for points inside a task its supervisor
//! restarts.
//!
//! The names are `area.moment` (`request.after_reserve`, `relay.after_confirm`, …); the
//! crash tests scan the sources for them, and a point without a crash test fails the
//! suite (`apps/orders/tests/acceptance/binary/crash`).
//!
//! Source: TiKV's failpoints (the `fail` crate, tikv/fail-rs); FoundationDB's and
//! Jepsen's practice of crashing at every step that matters.

/// A named crash point: `fail_point!("relay.after_claim")`. Nothing without the
/// `failpoints` feature. Re-exported from the `fail` crate.
pub use fail::fail_point;

/// The panic message of a point configured to end the process: `FAILPOINTS` set to
/// `name=panic(abort)`.
pub const ABORT: &str = "abort";

/// Configures the points named in `FAILPOINTS` and makes `panic(abort)` end the process.
/// Call once, first thing in `main` (after the logger). Does nothing in a build without
/// the `failpoints` feature, whatever `FAILPOINTS` says.
///
/// # Panics
/// When `FAILPOINTS` does not parse (the `fail` crate's own check): a crash test with a
/// misspelt action must not silently run without it.
pub fn setup() {
    if !fail::has_failpoints() {
        return;
    }
    // The scenario holds the registry's lock for the life of the process; a binary never
    // tears it down.
    std::mem::forget(fail::FailScenario::setup());
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied());
        if message == Some(ABORT) {
            eprintln!("failpoint: aborting the process at {:?}", info.location());
            std::process::abort();
        }
        previous(info);
    }));
}
