//! An order's chain as one timeline: one [`Step`] per thing that happened or waits, in time
//! order, each with its state and its evidence.

use serde::Serialize;

use super::{ChainEffect, OrderChain, Time};

/// How a step stands, for the operator: the colour of its box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepState {
    /// It happened.
    Done,
    /// It is due, or under way (a pending event, an effect in flight, a running saga).
    Waiting,
    /// Its outcome is not known yet (a call that may have reached the provider).
    Unknown,
    /// A person decides (`/console/review`).
    InReview,
    /// It failed, or was undone.
    Failed,
}

impl StepState {
    /// The word shown (and the console's CSS class).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::Waiting => "waiting",
            Self::Unknown => "unknown",
            Self::InReview => "in_review",
            Self::Failed => "failed",
        }
    }
}

/// One box of the timeline.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    /// When it happened (or was recorded).
    pub at: Time,
    /// What part of the chain it is: `request`, `order`, `event`, `delivery`, `invoice`,
    /// `effect`, `saga`, `saga_step`.
    pub kind: &'static str,
    /// One line: what it is.
    pub title: String,
    /// How it stands.
    pub state: StepState,
    /// The state word of its store (`succeeded`, `pending`, `needs_review`, …).
    pub detail: String,
    /// The evidence: one line per fact (ids, keys, attempts, each call and status check).
    pub evidence: Vec<String>,
}

/// An effect's or payment's state word as a step state.
fn effect_state(word: &str) -> StepState {
    match word {
        "succeeded" => StepState::Done,
        "unknown" => StepState::Unknown,
        "needs_review" => StepState::InReview,
        "failed" | "declined" | "not_charged" => StepState::Failed,
        _ => StepState::Waiting,
    }
}

fn opt<T: std::fmt::Display>(name: &str, v: Option<T>) -> Option<String> {
    v.map(|v| format!("{name}: {v}"))
}

fn effect_step(e: &ChainEffect) -> Step {
    let title = match &e.saga_step {
        Some(step) => format!("saga step {step}: {}/{}", e.provider, e.operation),
        None => format!("{}: {}/{}", e.path.as_str(), e.provider, e.operation),
    };
    let mut evidence = vec![
        format!("id: {}", e.id),
        format!("reference: {}", e.reference),
        format!("key: {}", e.key),
        format!("attempts: {}", e.attempts),
    ];
    evidence.extend(opt("provider id", e.provider_id.as_deref()));
    evidence.extend(opt("last error", e.last_error.as_deref()));
    evidence.push(format!("updated: {}", e.updated_at));
    for (n, ev) in e.evidence.iter().enumerate() {
        let status = ev
            .http_status
            .map_or_else(|| "-".to_owned(), |s| s.to_string());
        let end = ev
            .finished_at
            .map_or_else(|| "never ended".to_owned(), |t| t.to_string());
        evidence.push(format!(
            "#{} {} {} → {end}: {} (HTTP {status}) ids [{}] key {} {}",
            n + 1,
            ev.kind,
            ev.started_at,
            ev.outcome,
            ev.provider_ids,
            ev.key,
            ev.detail
        ));
    }
    Step {
        at: e.created_at,
        kind: "effect",
        title,
        state: effect_state(&e.state),
        detail: e.state.clone(),
        evidence,
    }
}

/// The request's step: its idempotency record while kept, else what the order says.
fn request_step(c: &OrderChain) -> Step {
    let o = &c.order;
    let Some(r) = &c.record else {
        let (detail, evidence) = match &o.idempotency_key {
            Some(k) => (
                "record collected after its retention".to_owned(),
                vec![format!("key: {k}")],
            ),
            None => ("no Idempotency-Key recorded".to_owned(), Vec::new()),
        };
        return Step {
            at: o.created_at,
            kind: "request",
            title: "POST /v1/orders".to_owned(),
            state: StepState::Done,
            detail,
            evidence,
        };
    };
    let state = match r.state {
        "succeeded" => StepState::Done,
        "processing" => StepState::Waiting,
        "unknown" => StepState::Unknown,
        _ => StepState::Failed,
    };
    let mut evidence = vec![
        format!("key: {}", o.idempotency_key.as_deref().unwrap_or("")),
        format!("operation: {}", r.operation),
    ];
    evidence.extend(opt("answer", r.response_status));
    evidence.extend(opt("completed", r.completed_at));
    evidence.extend(opt("kept until", r.expires_at));
    Step {
        at: r.created_at,
        kind: "request",
        title: r.operation.clone(),
        state,
        detail: r.state.to_owned(),
        evidence,
    }
}

/// The timeline of `c`, oldest first (steps at one time keep the chain's order: request,
/// order, events, deliveries, invoices, effects, saga).
pub(super) fn steps(c: &OrderChain) -> Vec<Step> {
    let o = &c.order;
    let mut out = vec![
        request_step(c),
        Step {
            at: o.created_at,
            kind: "order",
            title: format!("order {} stored", o.id),
            state: StepState::Done,
            detail: o.status.to_owned(),
            evidence: vec![
                format!("tenant: {}", o.tenant),
                format!("business key: {} / {}", o.source, o.external_ref),
                format!("amount: {} {}", o.amount_minor, o.currency),
            ],
        },
    ];
    for e in &c.events {
        let mut evidence = vec![
            format!("message id: {}", e.message_id),
            format!("read from: {}", e.seen_in),
            format!("attempts: {}", e.attempts),
        ];
        evidence.extend(opt("published", e.published_at));
        evidence.extend(opt("last error", e.last_error.as_deref()));
        out.push(Step {
            at: e.created_at,
            kind: "event",
            title: format!("event {}", e.event_type),
            state: match e.state.as_str() {
                "published" => StepState::Done,
                "dead" => StepState::Failed,
                _ => StepState::Waiting,
            },
            detail: e.state.clone(),
            evidence,
        });
    }
    for d in &c.deliveries {
        let mut evidence = vec![
            format!("message id: {}", d.message_id),
            format!("attempts: {}", d.attempts),
        ];
        evidence.extend(opt("last error", d.last_error.as_deref()));
        out.push(Step {
            at: d.received_at.unwrap_or(o.created_at),
            kind: "delivery",
            title: format!(
                "{} received {}",
                d.consumer,
                d.event_type.as_deref().unwrap_or("a message")
            ),
            state: match d.state.as_str() {
                "processed" => StepState::Done,
                "dead" => StepState::Failed,
                _ => StepState::Waiting,
            },
            detail: d.state.clone(),
            evidence,
        });
    }
    for i in &c.invoices {
        let mut evidence = vec![
            format!("id: {}", i.id),
            format!("amount: {} {}", i.amount_minor, i.currency),
            format!("made from message: {}", i.message_id),
        ];
        evidence.extend(opt("paid", i.paid_at));
        evidence.extend(opt("payment", i.payment_id.as_deref()));
        out.push(Step {
            at: i.created_at,
            kind: "invoice",
            title: format!("invoice ({}) {} {}", i.kind, i.amount_minor, i.currency),
            state: StepState::Done,
            detail: if i.paid_at.is_some() { "paid" } else { "open" }.to_owned(),
            evidence,
        });
    }
    out.extend(c.effects.iter().map(effect_step));
    for s in &c.sagas {
        saga_steps(s, &mut out);
    }
    out.sort_by_key(|s| s.at);
    out
}

/// The saga's own box, and a box per step log row that has no effect (local steps; an
/// effect step's box is its effect's).
fn saga_steps(s: &super::ChainSaga, out: &mut Vec<Step>) {
    let mut evidence = vec![
        format!("id: {}", s.id),
        format!("updated: {}", s.updated_at),
    ];
    evidence.extend(opt("error", s.error.as_deref()));
    out.push(Step {
        at: s.created_at,
        kind: "saga",
        title: format!("saga {}", s.kind),
        state: match s.state.as_str() {
            "completed" => StepState::Done,
            "compensated" => StepState::Failed,
            "needs_review" => StepState::InReview,
            _ => StepState::Waiting,
        },
        detail: s.state.clone(),
        evidence,
    });
    for st in s.steps.iter().filter(|st| st.effect_id.is_none()) {
        let mut evidence = vec![format!("attempts: {}", st.attempts)];
        evidence.extend(opt("finished", st.finished_at));
        evidence.extend(opt("evidence", st.evidence.as_deref()));
        out.push(Step {
            at: st.started_at,
            kind: "saga_step",
            title: format!("saga step {} ({})", st.name, st.phase),
            state: match st.state.as_str() {
                "succeeded" => StepState::Done,
                "running" => StepState::Waiting,
                "needs_review" => StepState::InReview,
                _ => StepState::Failed,
            },
            detail: st.state.clone(),
            evidence,
        });
    }
}
