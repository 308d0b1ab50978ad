//! The console's HTML (maud: every interpolated value is escaped). No script and nothing
//! loaded from elsewhere: the style sheet is inline, every action a plain form POST with the
//! session's CSRF token.

use maud::{html, Markup, DOCTYPE};
use oncely_saga::StepInReview;
use oncely_sql::{Discrepancy, Effect, RecordSummary};

use super::data::{DeadLetter, EffectLine, Overview};
use crate::{OrderChain, OrderHit, StepState};

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:0;color:#222}\
nav{background:#223;padding:.6em 1em}nav a{color:#fff;margin-right:1.2em;text-decoration:none}\
nav form{display:inline;float:right}main{padding:1em 1.5em}\
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .5em;\
text-align:left;vertical-align:top;font-size:.9em}th{background:#eee}.msg{background:#efe;\
border:1px solid #9c9;padding:.5em}.err{background:#fee;border:1px solid #c99;padding:.5em}\
form.inline{display:inline}input,select,button{font-size:.85em}\
ol.timeline{list-style:none;padding:0;border-left:3px solid #ccc;margin-left:.5em}\
li.step{margin:.4em 0 .4em 1em;padding:.4em .6em;border:1px solid #999;border-left-width:8px;\
border-radius:3px;max-width:60em}li.step time{font-family:monospace;font-size:.85em}\
li.step .word{float:right;font-size:.85em}details ul{font-family:monospace;font-size:.8em;margin:.3em 0}\
.box{padding:.1em .5em;border:1px solid #999;border-left-width:8px}\
.done{background:#eefbea;border-color:#3a3}.waiting{background:#eef3fb;border-color:#36c}\
.unknown{background:#fdf6e3;border-color:#c90}.in_review{background:#f6eefb;border-color:#93c}\
.failed{background:#fdecec;border-color:#c33}";

/// Unix ms as `YYYY-MM-DD HH:MM:SS` UTC (the RFC 3339 time of [`crate::Time`] to the
/// second).
pub(crate) fn ts(ms: i64) -> String {
    oncely_core::rfc3339(ms)[..19].replace('T', " ")
}

fn opt_ts(ms: Option<i64>) -> String {
    ms.map_or_else(String::new, ts)
}

/// A page: navigation (with the sign-out form when signed in), an optional message, body.
pub(crate) fn layout(title: &str, csrf: Option<&str>, msg: Option<&str>, body: &Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { "oncely console — " (title) }
                style { (STYLE) }
            }
            body {
                @if let Some(csrf) = csrf {
                    nav {
                        a href="/console" { "Overview" }
                        a href="/console/stuck" { "Stuck and unknown" }
                        a href="/console/dead-letters" { "Dead letters" }
                        a href="/console/review" { "In review" }
                        a href="/console/reconciliation" { "Reconciliation" }
                        a href="/console/orders" { "Orders" }
                        form method="post" action="/console/logout" {
                            input type="hidden" name="csrf" value=(csrf);
                            button id="sign-out" { "Sign out" }
                        }
                    }
                }
                main {
                    h1 { (title) }
                    @if let Some(m) = msg { p.msg id="message" { (m) } }
                    (body)
                }
            }
        }
    }
}

/// The sign-in form; `error` says why the last attempt was refused.
pub(crate) fn sign_in(error: Option<&str>) -> Markup {
    let body = html! {
        @if let Some(e) = error { p.err id="error" { (e) } }
        form method="post" action="/console/login" {
            p { label { "Admin token " input type="password" name="token" id="token" autocomplete="off"; } }
            p { label { "Your name (for the audit trail) " input type="text" name="name" id="name" maxlength="64"; } }
            p { button id="sign-in" { "Sign in" } }
        }
    };
    layout("Sign in", None, None, &body)
}

/// A result page: what an action did (or why it was refused), with a way back.
pub(crate) fn outcome(title: &str, csrf: &str, text: &str, ok: bool, back: &str) -> Markup {
    let body = html! {
        p class=(if ok { "msg" } else { "err" }) id=(if ok { "message" } else { "error" }) { (text) }
        p { a href=(back) id="back" { "Back" } }
    };
    layout(title, Some(csrf), None, &body)
}

fn csrf_field(csrf: &str) -> Markup {
    html! { input type="hidden" name="csrf" value=(csrf); }
}

/// The overview of counts.
pub(crate) fn overview(o: &Overview, csrf: &str) -> Markup {
    let body = html! {
        table id="counts" {
            tr { th { "Orders" } td id="count-orders" { (o.orders) } }
            @for g in &o.idempotency {
                tr { th { "Idempotency records " (g.label) } td id={"count-idempotency-" (g.label)} { (g.n) } }
            }
            tr { th { "Idempotency records processing past their lease" } td id="count-past-lease" { (o.processing_past_lease) } }
            tr { th { "Outbox pending" } td id="count-outbox-pending" { (o.outbox_pending) } }
            tr { th { "Outbox dead" } td id="count-outbox-dead" { (o.outbox_dead) } }
            @match &o.dead_letters {
                Ok(groups) => {
                    @for g in groups {
                        tr { th { "Inbox dead letters, " (g.label) } td id={"count-dead-" (g.label)} { (g.n) } }
                    }
                }
                Err(why) => {
                    tr { th { "Inbox dead letters" } td id="count-dead-unavailable" { (why) } }
                }
            }
            @for (provider, state, n) in &o.effects {
                tr { th { "Effects " (provider) " " (state) } td id={"count-effects-" (provider) "-" (state)} { (n) } }
            }
            @for g in &o.sagas {
                tr { th { "Sagas " (g.label) } td id={"count-sagas-" (g.label)} { (g.n) } }
            }
            tr { th { "Saga steps in review" } td id="count-saga-steps-review" { (o.saga_steps_in_review) } }
            @for g in &o.discrepancies {
                tr { th { "Open discrepancies, " (g.label) } td id={"count-discrepancies-" (g.label)} { (g.n) } }
            }
        }
    };
    layout("Overview", Some(csrf), None, &body)
}

fn order_link(order_id: Option<&str>) -> Markup {
    html! {
        @if let Some(id) = order_id { a href={"/console/orders/" (id)} { (id) } }
    }
}

fn effect_row(line: &EffectLine) -> Markup {
    let e = &line.effect;
    html! {
        td { (e.id) } td { (e.tenant) } td { (e.provider) "/" (e.operation) } td { (e.reference) }
        td.state { (e.state_word) } td { (e.attempts) } td { (e.checks) }
        td { (e.provider_id.as_deref().unwrap_or("")) } td { (e.last_error.as_deref().unwrap_or("")) }
        td { (order_link(line.order_id.as_deref())) }
    }
}

const EFFECT_HEAD: [&str; 10] = [
    "Effect",
    "Tenant",
    "Provider/operation",
    "Reference",
    "State",
    "Attempts",
    "Checks",
    "Provider id",
    "Last error",
    "Order",
];

/// Stuck and unknown operations with a link to each one's lineage.
pub(crate) fn stuck(records: &[RecordSummary], effects: &[EffectLine], csrf: &str) -> Markup {
    let body = html! {
        h2 { "Idempotency records processing past their lease, or unknown" }
        @if records.is_empty() { p { "None." } } @else {
            table id="stuck-records" {
                tr { th { "Tenant" } th { "Operation" } th { "Key" } th { "State" } th { "Fence" } th { "Lease until" } th { "Created" } }
                @for r in records {
                    tr { td { (r.tenant) } td { (r.operation) } td { (r.key) } td { (r.state) } td { (r.fence) }
                         td { (opt_ts(r.lease_until)) } td { (ts(r.created_at)) } }
                }
            }
            p { "A multi-phase record's holder may have died mid-operation; its order, if any, \
                 is found by its key with the order search." }
        }
        h2 { "Effects unknown or in review" }
        @if effects.is_empty() { p { "None." } } @else {
            table id="stuck-effects" {
                tr { @for h in EFFECT_HEAD { th { (h) } } }
                @for l in effects { tr id={"stuck-" (l.effect.id)} { (effect_row(l)) } }
            }
        }
    };
    layout("Stuck and unknown operations", Some(csrf), None, &body)
}

/// Dead letters with a requeue form each.
pub(crate) fn dead_letters(
    letters: &[DeadLetter],
    note: Option<&str>,
    csrf: &str,
    msg: Option<&str>,
) -> Markup {
    let body = html! {
        @if let Some(n) = note { p { (n) } }
        @if letters.is_empty() { p id="no-dead-letters" { "No dead letters." } } @else {
            table id="dead-letters" {
                tr { th { "Consumer" } th { "Message" } th { "Topic" } th { "Event" } th { "Order" } th { "Attempts" } th { "Last error" } th { "" } }
                @for d in letters {
                    tr id={"dead-" (d.consumer) "-" (d.message_id)} {
                        td { (d.consumer) } td { (d.message_id) } td { (d.topic) } td { (d.event_type) }
                        td { (order_link(d.order_id.as_deref())) } td { (d.attempts) }
                        td { (d.last_error.as_deref().unwrap_or("")) }
                        td {
                            form.inline method="post" action="/console/dead-letters/requeue" {
                                (csrf_field(csrf))
                                input type="hidden" name="consumer" value=(d.consumer);
                                input type="hidden" name="message_id" value=(d.message_id);
                                button.requeue { "Requeue" }
                            }
                        }
                    }
                }
            }
        }
    };
    layout("Dead letters", Some(csrf), msg, &body)
}

fn resolve_form(e: &Effect, csrf: &str) -> Markup {
    html! {
        form.inline.resolve method="post" action={"/console/effects/" (e.id) "/resolve"} {
            (csrf_field(csrf))
            select name="outcome" { option value="succeeded" { "succeeded" } option value="failed" { "failed" } }
            input type="text" name="provider_id" placeholder="provider id (succeeded)";
            input type="text" name="reason" placeholder="reason";
            button.resolve { "Resolve" }
        }
        " "
        form.inline method="post" action={"/console/effects/" (e.id) "/retry"} {
            (csrf_field(csrf))
            button.retry { "Retry" }
        }
    }
}

/// Effects and saga steps in review.
pub(crate) fn review(
    effects: &[EffectLine],
    steps: &[StepInReview],
    csrf: &str,
    msg: Option<&str>,
) -> Markup {
    let body = html! {
        h2 { "Effects" }
        p { "Resolve records what you found at the provider (succeeded needs its object id); \
             retry checks an unknown outcome at the provider first and never calls blindly." }
        @if effects.is_empty() { p id="no-effects" { "No effect needs review." } } @else {
            table id="review-effects" {
                tr { @for h in EFFECT_HEAD { th { (h) } } th { "Action" } }
                @for l in effects {
                    tr id={"effect-" (l.effect.id)} { (effect_row(l)) td { (resolve_form(&l.effect, csrf)) } }
                }
            }
        }
        h2 { "Saga steps" }
        p { "A step in review waits on its effect: resolve or retry the effect above and the saga goes on." }
        @if steps.is_empty() { p { "No saga step needs review." } } @else {
            table id="review-steps" {
                tr { th { "Saga" } th { "Kind" } th { "Tenant" } th { "Step" } th { "Phase" } th { "Name" } th { "Attempts" } th { "Effect" } }
                @for s in steps {
                    tr { td { (s.saga_id) } td { (s.kind) } td { (s.tenant) } td { (s.step) } td { (s.phase) }
                         td { (s.name) } td { (s.attempts) } td { (s.effect_id.as_deref().unwrap_or("")) } }
                }
            }
        }
    };
    layout("In review", Some(csrf), msg, &body)
}

/// Open discrepancies with their actions; each with the business object its provider
/// records name, linked to the order's page when that order exists here.
pub(crate) fn reconciliation(
    open: &[(Discrepancy, Option<String>)],
    csrf: &str,
    msg: Option<&str>,
) -> Markup {
    let body = html! {
        p { "acknowledge: accepted as it is; mark-succeeded: a status_mismatch whose record is live at \
             the provider resolves its effect as succeeded; refund: a duplicate_remote or missing_local \
             payment is refunded through an effect (asking twice refunds once)." }
        @if open.is_empty() { p id="no-discrepancies" { "No open discrepancy." } } @else {
            table id="discrepancies" {
                tr { th { "Id" } th { "Provider" } th { "Kind" } th { "Reference" } th { "Business ref" } th { "Effect" } th { "Provider ids" } th { "Found" } th { "Action" } }
                @for (d, order) in open {
                    tr id={"discrepancy-" (d.id)} {
                        td { (d.id) } td { (d.provider) } td { (d.kind_word) } td { (d.reference) }
                        td.business-ref {
                            @if let Some(order) = order { a href={"/console/orders/" (order)} { (order) } }
                            @else { (d.business_ref().unwrap_or_default()) }
                        }
                        td { (d.effect_id.as_deref().unwrap_or("")) } td { (d.provider_ids) } td { (ts(d.found_at)) }
                        td {
                            form.inline method="post" action={"/console/discrepancies/" (d.id) "/resolve"} {
                                (csrf_field(csrf))
                                select name="action" {
                                    option value="acknowledge" { "acknowledge" }
                                    option value="mark-succeeded" { "mark-succeeded" }
                                    option value="refund" { "refund" }
                                }
                                input type="text" name="provider_id" placeholder="provider id (if several)";
                                input type="text" name="reason" placeholder="reason";
                                button { "Apply" }
                            }
                        }
                    }
                }
            }
        }
    };
    layout("Reconciliation", Some(csrf), msg, &body)
}

/// The order search: a tenant and an id, external ref or key; `hits` once searched.
pub(crate) fn search(tenant: &str, q: &str, hits: Option<&[OrderHit]>, csrf: &str) -> Markup {
    let body = html! {
        form method="get" action="/console/orders" id="search" {
            label { "Tenant " input type="text" name="tenant" id="search-tenant" value=(tenant) required; }
            " "
            label { "Order id, external ref or idempotency key " input type="text" name="q" id="search-q" value=(q) size="40"; }
            " " button { "Search" }
        }
        @if let Some(hits) = hits {
            @if hits.is_empty() { p id="no-hits" { "No order of tenant " (tenant) " matches." } } @else {
                table id="hits" {
                    tr { th { "Order" } th { "Source" } th { "External ref" } th { "Key" } th { "Amount" } th { "Created" } }
                    @for h in hits {
                        tr.hit {
                            td { a href={"/console/orders/" (h.id) "?tenant=" (tenant)} { (h.id) } }
                            td { (h.source) } td { (h.external_ref) }
                            td { (h.idempotency_key.as_deref().unwrap_or("")) }
                            td { (h.amount_minor) " " (h.currency) } td { (h.created_at) }
                        }
                    }
                }
            }
        }
    };
    layout("Orders", Some(csrf), None, &body)
}

/// One order's chain as a timeline: one box per step in time order, coloured by its state,
/// its evidence one click away (`<details>`, no script).
pub(crate) fn chain(c: &OrderChain, csrf: &str) -> Markup {
    let o = &c.order;
    let body = html! {
        p id="summary" {
            "Tenant " strong { (o.tenant) } ", " (o.source) " / " (o.external_ref) ", "
            (o.amount_minor) " " (o.currency) ", status " strong id="status" { (o.status) } ", key "
            span.key { (o.idempotency_key.as_deref().unwrap_or("none recorded")) }
        }
        p.legend {
            @for st in [StepState::Done, StepState::Waiting, StepState::Unknown, StepState::InReview, StepState::Failed] {
                span class={"box " (st.as_str())} { (st.as_str()) } " "
            }
        }
        ol.timeline id="timeline" {
            @for (n, step) in c.timeline.iter().enumerate() {
                li class={"step " (step.state.as_str())} id={"step-" (n)} data-kind=(step.kind) data-state=(step.state.as_str()) {
                    div.head {
                        time datetime=(step.at) { (step.at) } " "
                        strong.title { (step.title) } " "
                        span.word { (step.detail) }
                    }
                    @if !step.evidence.is_empty() {
                        details {
                            summary { "Evidence" }
                            ul { @for line in &step.evidence { li { (line) } } }
                        }
                    }
                }
            }
        }
    };
    layout(&format!("Order {}", o.id), Some(csrf), None, &body)
}

#[cfg(test)]
mod tests {
    #[test]
    fn timestamps_render_in_utc() {
        assert_eq!(super::ts(0), "1970-01-01 00:00:00");
        assert_eq!(super::ts(1_764_547_200_000), "2025-12-01 00:00:00");
        assert_eq!(
            super::ts(951_782_400_000 + 3_661_000),
            "2000-02-29 01:01:01"
        );
    }
}
