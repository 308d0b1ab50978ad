use std::sync::Mutex;
use std::time::Instant;

use oncely_core::error_chain;
use oncely_sql::Database;

/// Gauge: 1 while a dependency answers, 0 while it is unavailable, per dependency
/// (`dependency` = `broker` | `database`), its `backend` (`rabbitmq`, `nats`, `kafka`,
/// `sql`; `sqlite`, `postgres`, `mysql`) and the `component` that depends on it (`relay`,
/// `consumer:<group>`). Absent until the component first used the dependency.
pub const DEPENDENCY_UP: &str = "oncely_dependency_up";

/// The up/down state of one dependency (the broker or the database) of one component (a
/// relay, a consumer group), as that component sees it through its own calls.
///
/// It turns a stream of per-call outcomes into state changes: the first failure after a
/// success logs one `warn` line with the root cause ("… connection refused") and sets
/// [`DEPENDENCY_UP`] to 0; the first success after that logs one `info` line with how long
/// the dependency was down and sets it to 1. Calls in between log nothing above `debug`, so
/// an outage with a thousand messages waiting is two lines, not a thousand.
#[derive(Debug)]
pub struct DependencyHealth {
    dependency: &'static str,
    backend: &'static str,
    component: String,
    state: Mutex<State>,
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// No outcome yet.
    Unknown,
    Up,
    Down {
        since: Instant,
    },
}

impl DependencyHealth {
    /// The state of `dependency` (`broker` or `database`, the metric's label) of backend
    /// `backend` as `component` sees it. Unknown until the first [`DependencyHealth::up`]
    /// or [`DependencyHealth::down`].
    pub fn new(dependency: &'static str, backend: &'static str, component: &str) -> Self {
        Self {
            dependency,
            backend,
            component: component.to_owned(),
            state: Mutex::new(State::Unknown),
        }
    }

    /// A broker's state: `backend` is the publisher's or subscriber's name.
    pub fn broker(backend: &'static str, component: &str) -> Self {
        Self::new("broker", backend, component)
    }

    /// `db`'s state (`backend` `sqlite`, `postgres` or `mysql`).
    pub fn database(db: &Database, component: &str) -> Self {
        Self::new("database", db.backend().as_str(), component)
    }

    /// `true` while the last outcome was a failure.
    pub fn is_down(&self) -> bool {
        matches!(*self.lock(), State::Down { .. })
    }

    /// Records a successful call. Logs `info` (with the outage's length, ms) when the
    /// dependency was down.
    pub fn up(&self) {
        let was = std::mem::replace(&mut *self.lock(), State::Up);
        match was {
            State::Up => return,
            State::Down { since } => tracing::info!(
                dependency = self.dependency,
                backend = self.backend,
                component = %self.component,
                down_ms = oncely_core::millis(since.elapsed()),
                "{} {} is available again", self.dependency, self.backend
            ),
            State::Unknown => {}
        }
        self.gauge(1.0);
    }

    /// Records a call that failed because the dependency is unavailable. Logs `warn` with
    /// `error`'s chain (see [`error_chain`]) on the change from up (or unknown) to down;
    /// later failures log at `debug`.
    pub fn down(&self, error: &(dyn std::error::Error + 'static)) {
        let mut state = self.lock();
        if let State::Down { .. } = *state {
            drop(state);
            tracing::debug!(dependency = self.dependency, backend = self.backend,
                component = %self.component, error = error_chain(error), "still unavailable");
            return;
        }
        *state = State::Down {
            since: Instant::now(),
        };
        drop(state);
        tracing::warn!(
            dependency = self.dependency,
            backend = self.backend,
            component = %self.component,
            error = error_chain(error),
            "{} {} is unavailable; waiting for it (nothing counts as a failed attempt meanwhile)",
            self.dependency,
            self.backend
        );
        self.gauge(0.0);
    }

    fn gauge(&self, value: f64) {
        metrics::gauge!(DEPENDENCY_UP, "dependency" => self.dependency,
            "backend" => self.backend, "component" => self.component.clone())
        .set(value);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Registers the `# HELP` text of [`DEPENDENCY_UP`] with the installed
/// recorder; call it once after installing one (the order service does, in
/// `orders::metrics_handle`).
pub fn describe_metrics() {
    metrics::describe_gauge!(
        DEPENDENCY_UP,
        "1 while a dependency answers, 0 while it is unavailable, per dependency (dependency = broker | database), its backend (rabbitmq, nats, kafka, sql; sqlite, postgres, mysql) and the component that depends on it (relay, consumer:<group>). Absent until the component first used the dependency."
    );
}
