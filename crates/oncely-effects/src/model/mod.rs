//! A model of one effect's life, checked with `stateright` over every interleaving (BFS):
//! the durable row as the store keeps it ([`EffectState`], the lease version, attempts,
//! checks, the key's generation, the settle window), a provider that commits a request now,
//! later or never, and two runners whose memory a crash wipes.
//!
//! The model reads answers through the crate's own types, so it follows them when they
//! change: a call's answer becomes a [`CallOutcome`](crate::CallOutcome) matched as
//! `runner/call.rs` matches it, a status check decides on
//! [`RemoteObject::deciding`](crate::RemoteObject::deciding) and
//! [`ObjectState`](crate::ObjectState) as `runner/check.rs` does, a resend is decided by
//! [`RetryPolicy::decide`](oncely_core::RetryPolicy::decide), and every state of
//! [`EffectState::ALL`] must be reached (`every_effect_state_is_reached`).
//!
//! Actions: a second path asking for the same business role (`Enqueue`), a claim by one of
//! two runners, the send bound passing before a claimed call left, a lease running out, a
//! send (past the bound, a fenced stamp first), the provider processing a request (live,
//! ended, pending, a word nobody listed, a 5xx before acting, 429, dropped), a pending
//! object moving on, an answer delivered or lost (a timeout), a status check (found,
//! absent, not yet visible, unavailable, invalid), the settle window passing, a settle
//! (fenced by the lease version), a crash, an operator's resolve and retry, a
//! reconciliation run completing an unknown effect, and a compensation (cancel or refund) of
//! a succeeded effect's object. docs/ARCHITECTURE.md "The effect protocol's model" has the
//! invariants, what the model found in the runner as built, and the fixes it checks.
//!
//! Time is abstract. The settle window is a flag of the row: a claim that starts a call and
//! the record of a call's evidence move `last_sent` to "now" (the window opens again and
//! every request sent so far is *covered* by it); the window may pass only once every
//! covered request has been processed — the provider's promise (docs/DESIGN.md "The settle
//! window") that it finishes or drops a request within the settle time.

use oncely_sql::EffectState;
use stateright::{Model, Property};

use runner::call_outcome;

/// When the runner's call leaves, relative to the claim that counts as its `sent_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Timing {
    /// The runner as built (`runner/call.rs`, [`SEND_BOUND`](crate::SEND_BOUND)): a call
    /// leaves within the send bound of its claim, unrecorded — the claim's lease outlasts the
    /// bound, and the settle window counts from `sent_at` plus the bound, so neither runs out
    /// before it leaves — or, once the bound has passed ([`Action::BoundPasses`]), only
    /// after `EffectStore::stamp_send` recorded the send, fenced by the claim's lease
    /// version: the stamp renews the lease and moves `sent_at` to the send, so the window
    /// opens again over every request sent so far. A stamp that matches nothing (another
    /// runner claimed the effect meanwhile) keeps the call from leaving.
    Bounded,
    /// The call leaves whenever its task gets a call slot — the pipeline claims up to
    /// `RunnerConfig::batch` effects ahead of the calls — even after the lease ran out; the
    /// settle window still counts from the claim until the call's evidence is recorded.
    Late,
}

/// What a status check makes of an ended object made under an earlier key (an attempt
/// before an operator's retry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum EarlierEnded {
    /// It decides, as `runner/check.rs` `found` reads every object: the effect is
    /// `failed` when no object is live or pending — even while the latest attempt may still
    /// commit.
    Decides,
    /// It is passed over: with nothing else found, the check reads "not found", subject to
    /// the settle window (the fix the model calls for).
    PassedOver,
}

/// The bounds, the provider's kind, and the runner's behaviour where the model found it
/// wanting (see docs/ARCHITECTURE.md "The effect protocol's model").
#[derive(Debug, Clone)]
pub(crate) struct EffectModel {
    /// The provider honours `Idempotency-Key` (Stripe) or not (the shipping contract).
    pub(crate) honours_keys: bool,
    pub(crate) timing: Timing,
    pub(crate) earlier_ended: EarlierEnded,
    /// `RetryPolicy::max_attempts` of `RunnerConfig::retry`.
    pub(crate) max_attempts: u8,
    /// `RunnerConfig::max_checks`.
    pub(crate) max_checks: u8,
    /// Requests sent, at most (the search's bound).
    pub(crate) max_sends: u8,
    pub(crate) max_crashes: u8,
    pub(crate) max_expiries: u8,
    /// 429s and unavailable status checks, at most.
    pub(crate) max_outages: u8,
    /// Operator actions (resolve, retry), at most.
    pub(crate) max_operator: u8,
    /// Reconciliation runs that complete an unknown effect, at most.
    pub(crate) max_reconciles: u8,
}

/// An object at the provider, by what its status word means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Obj {
    Live,
    Ended,
    Pending,
    Unrecognised,
}

impl Obj {
    fn may_be_live(self) -> bool {
        !matches!(self, Self::Ended)
    }
}

/// What the provider does with a request it received.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Fate {
    /// Makes an object in this state (a keyed provider replays the key's object instead).
    Makes(Obj),
    /// 5xx before acting (a keyed provider stores it under the key and replays it).
    ErrorBefore,
    /// 429 with `Retry-After`: did not act.
    RateLimited,
    /// Never arrives, no answer.
    Dropped,
}

/// The answer waiting for its runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Answer {
    Object(Obj),
    ServerError,
    RateLimited,
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Request {
    key_gen: u8,
    /// Sent before the row's `last_sent`: the settle window waits for it.
    covered: bool,
    /// `None` while the provider has not processed it.
    answer: Option<Answer>,
}

/// What a settle writes (the variants of `oncely_sql::Settle` the runner uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Settle {
    Succeeded,
    Failed,
    Unknown,
    Absent { next_key: bool },
    Unavailable,
    GaveUpUnavailable,
    NeedsReview,
}

/// The evidence a settle records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Evidence {
    Call { answered_5xx: bool },
    Status { counts: bool },
}

/// A runner's memory (lost in a crash).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Runner {
    Idle,
    /// Holds the effect as claimed with lease `version`; `call`: a call may go out (it was
    /// claimed `in_flight`), else a status check.
    Claimed {
        version: u8,
        call: bool,
        key_gen: u8,
        /// The send bound has passed since the claim (`Timing::Bounded`): the call may
        /// leave only under a fenced stamp.
        overdue: bool,
    },
    /// The call is out: request `req`.
    Waiting {
        version: u8,
        req: u8,
    },
    /// An outcome to settle.
    Settling {
        version: u8,
        settle: Settle,
        evidence: Evidence,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Lease {
    Free,
    /// By runner 0 or 1, or (2) the reconciler.
    Held(u8),
    Expired,
}

/// The effect's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Row {
    pub(crate) state: EffectState,
    version: u8,
    lease: Lease,
    attempts: u8,
    checks: u8,
    key_gen: u8,
    /// The evidence holds a 5xx answer to a call under the current key.
    answered_5xx: bool,
    /// `last_sent + settle` is past.
    window_passed: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct State {
    /// `None` until the first path asks for the business role.
    pub(crate) row: Option<Row>,
    /// Objects at the provider for the business role, oldest first, with their key's
    /// generation.
    pub(crate) objects: Vec<(u8, Obj)>,
    /// Key generations under which the provider stored a 5xx it replays.
    stored_failures: u8,
    requests: Vec<Request>,
    runners: [Runner; 2],
    sends: u8,
    crashes: u8,
    expiries: u8,
    /// 429s and unavailable status checks (each ends in a wait that changes nothing).
    outages: u8,
    operator: u8,
    reconciles: u8,
    compensated: bool,
    /// Ghost: no send happened since the last proof that nothing was done.
    absence_proven: bool,
    /// Ghost: a send went out without that proof, or while an earlier request could still
    /// commit.
    pub(crate) unproven_resend: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum CheckReply {
    /// The provider answers from what it has.
    Answered,
    /// The lookup lags: nothing found yet although something exists (only inside the
    /// settle window).
    Lagging,
    Unavailable,
    /// Unavailable, and the deadline passed.
    UnavailableGaveUp,
    Invalid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Action {
    Enqueue,
    Claim(usize),
    /// The send bound passes while runner `r` holds an in-flight claim it has not sent.
    BoundPasses(usize),
    ExpireLease,
    Send(usize),
    Process(usize, Fate),
    ObjectMoves(usize, bool),
    /// The answer reaches the runner; `gave_up`: the retry deadline passed (429 only).
    Deliver(usize, bool),
    Timeout(usize),
    Check(usize, CheckReply),
    WindowPasses,
    Settle(usize),
    Crash(usize),
    Resolve {
        succeeded: bool,
    },
    Retry,
    /// A reconciliation run completes the unknown effect from the provider's records.
    Reconcile,
    Compensate,
}

/// What a provider may do with a request. A 5xx before the effect differs from a dropped
/// request only for a provider that honours keys (it stores the 5xx under the key and
/// replays it; the evidence of a 5xx moves the resend to the key's next generation), so a
/// keyless provider is given the last six only. Left out to keep the search small, as they
/// read like fates kept: the effect followed by a 5xx (a live object whose answer was
/// lost), a 4xx refusal (an ended object, less the object; a call that gave up while the
/// provider was unavailable fails without one too).
const FATES: [Fate; 7] = [
    Fate::ErrorBefore,
    Fate::Makes(Obj::Live),
    Fate::Makes(Obj::Ended),
    Fate::Makes(Obj::Pending),
    Fate::Makes(Obj::Unrecognised),
    Fate::RateLimited,
    Fate::Dropped,
];

const REPLIES: [CheckReply; 5] = [
    CheckReply::Answered,
    CheckReply::Lagging,
    CheckReply::Unavailable,
    CheckReply::UnavailableGaveUp,
    CheckReply::Invalid,
];

impl Default for EffectModel {
    fn default() -> Self {
        Self {
            honours_keys: false,
            timing: Timing::Bounded,
            earlier_ended: EarlierEnded::PassedOver,
            max_attempts: 2,
            max_checks: 2,
            max_sends: 2,
            max_crashes: 1,
            max_expiries: 1,
            max_outages: 1,
            max_operator: 1,
            max_reconciles: 1,
        }
    }
}

impl State {
    /// The two runners are interchangeable: the state with the lesser runner first stands
    /// for both orders (symmetry reduction; the checker's own works for DFS only). Runner
    /// numbers in a trace are therefore those of the state they act in.
    fn canonical(mut self) -> Self {
        if self.runners[0] > self.runners[1] {
            self.runners.swap(0, 1);
            if let Some(Row {
                lease: Lease::Held(r @ (0 | 1)),
                ..
            }) = &mut self.row
            {
                *r = 1 - *r;
            }
        }
        self
    }

    fn live_objects(&self) -> usize {
        self.objects.iter().filter(|(_, o)| o.may_be_live()).count()
    }
}

mod runner;
#[cfg(test)]
mod tests;
mod world;

fn row_is(s: &State, state: EffectState) -> bool {
    s.row.is_some_and(|r| r.state == state)
}

/// A `sometimes` property: the model reaches `state`. A state the model does not know
/// fails `every_effect_state_is_reached`.
pub(crate) fn reaches(state: EffectState) -> Property<EffectModel> {
    match state {
        EffectState::Pending => Property::sometimes("reaches pending", |_, s: &State| {
            row_is(s, EffectState::Pending)
        }),
        EffectState::InFlight => Property::sometimes("reaches in_flight", |_, s: &State| {
            row_is(s, EffectState::InFlight)
        }),
        EffectState::Succeeded => Property::sometimes("reaches succeeded", |_, s: &State| {
            row_is(s, EffectState::Succeeded)
        }),
        EffectState::Failed => Property::sometimes("reaches failed", |_, s: &State| {
            row_is(s, EffectState::Failed)
        }),
        EffectState::Unknown => Property::sometimes("reaches unknown", |_, s: &State| {
            row_is(s, EffectState::Unknown)
        }),
        EffectState::Absent => Property::sometimes("reaches absent", |_, s: &State| {
            row_is(s, EffectState::Absent)
        }),
        EffectState::NeedsReview => Property::sometimes("reaches needs_review", |_, s: &State| {
            row_is(s, EffectState::NeedsReview)
        }),
        other => panic!("the effect model does not know state {other}"),
    }
}

impl Model for EffectModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            row: None,
            objects: Vec::new(),
            stored_failures: 0,
            requests: Vec::new(),
            runners: [Runner::Idle; 2],
            sends: 0,
            crashes: 0,
            expiries: 0,
            outages: 0,
            operator: 0,
            reconciles: 0,
            compensated: false,
            absence_proven: true,
            unproven_resend: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let Some(row) = s.row else {
            actions.push(Action::Enqueue);
            return;
        };
        if row.state == EffectState::Pending && row.version == 0 {
            // The second path asking for the business role (it records nothing).
            actions.push(Action::Enqueue);
        }
        for r in 0..2 {
            self.runner_actions(s, &row, r, actions);
        }
        self.world_actions(s, &row, actions);
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Enqueue => {
                // UNIQUE(provider, operation, reference): the second path records nothing
                // (`Enqueued::Existing`).
                s.row.get_or_insert(Row {
                    state: EffectState::Pending,
                    version: 0,
                    lease: Lease::Free,
                    attempts: 0,
                    checks: 0,
                    key_gen: 0,
                    answered_5xx: false,
                    window_passed: true,
                });
            }
            Action::Claim(r) => Self::claim(&mut s, r),
            Action::BoundPasses(r) => {
                let Runner::Claimed { overdue, .. } = &mut s.runners[r] else {
                    return None;
                };
                *overdue = true;
            }
            Action::ExpireLease => {
                s.expiries += 1;
                s.row.as_mut()?.lease = Lease::Expired;
            }
            Action::Send(r) => self.send(&mut s, r),
            Action::Process(i, fate) => self.process(&mut s, i, fate),
            Action::ObjectMoves(i, live) => {
                s.objects[i].1 = if live { Obj::Live } else { Obj::Ended };
            }
            Action::Deliver(r, gave_up) => {
                let Runner::Waiting { version, req } = s.runners[r] else {
                    return None;
                };
                let answer = s.requests[usize::from(req)].answer?;
                s.runners[r] = Runner::Settling {
                    version,
                    settle: Self::settle_call(&call_outcome(answer), gave_up),
                    evidence: Evidence::Call {
                        answered_5xx: answer == Answer::ServerError,
                    },
                };
            }
            Action::Timeout(r) => {
                let Runner::Waiting { version, .. } = s.runners[r] else {
                    return None;
                };
                s.runners[r] = Runner::Settling {
                    version,
                    settle: Self::settle_call(&call_outcome(Answer::None), false),
                    evidence: Evidence::Call {
                        answered_5xx: false,
                    },
                };
            }
            Action::Check(r, reply) => {
                let Runner::Claimed { version, .. } = s.runners[r] else {
                    return None;
                };
                if matches!(
                    reply,
                    CheckReply::Unavailable | CheckReply::UnavailableGaveUp
                ) {
                    s.outages += 1;
                }
                let (settle, evidence) = self.check(&s, &s.row?, reply);
                s.runners[r] = Runner::Settling {
                    version,
                    settle,
                    evidence,
                };
            }
            Action::WindowPasses => s.row.as_mut()?.window_passed = true,
            Action::Settle(r) => {
                let Runner::Settling {
                    version,
                    settle,
                    evidence,
                } = s.runners[r]
                else {
                    return None;
                };
                s.runners[r] = Runner::Idle;
                Self::settle(&mut s, version, settle, evidence);
            }
            Action::Crash(r) => {
                s.crashes += 1;
                s.runners[r] = Runner::Idle;
            }
            Action::Resolve { .. } | Action::Retry => Self::operator(&mut s, action),
            Action::Reconcile => self.reconcile(&mut s),
            Action::Compensate => {
                s.compensated = true;
                let live = s.objects.iter().position(|(_, o)| *o == Obj::Live)?;
                s.objects[live].1 = Obj::Ended;
            }
        }
        Some(s.canonical())
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always("one live object per business role", |_, s: &State| {
                s.live_objects() <= 1
            }),
            Property::always("never failed while an object is live", |_, s: &State| {
                !row_is(s, EffectState::Failed) || s.live_objects() == 0
            }),
            Property::always("no re-send before absence is proven", |_, s: &State| {
                !s.unproven_resend
            }),
            Property::sometimes("the effect can succeed", |_, s: &State| {
                row_is(s, EffectState::Succeeded)
            }),
        ];
        properties.extend(EffectState::ALL.iter().map(|&state| reaches(state)));
        properties
    }
}
