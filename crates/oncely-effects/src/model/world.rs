//! Which actions are enabled, and what the store, the provider and the runners' memory do with them.

use oncely_sql::EffectState;

use super::{
    Action, Answer, CheckReply, EffectModel, Evidence, Fate, Lease, Obj, Request, Row, Runner,
    Settle, State, Timing, FATES, REPLIES,
};

impl EffectModel {
    pub(super) fn runner_actions(&self, s: &State, row: &Row, r: usize, actions: &mut Vec<Action>) {
        match s.runners[r] {
            Runner::Idle => {
                let due = matches!(
                    row.state,
                    EffectState::Pending
                        | EffectState::Absent
                        | EffectState::Unknown
                        | EffectState::InFlight
                );
                if due && !matches!(row.lease, Lease::Held(_)) {
                    actions.push(Action::Claim(r));
                }
            }
            Runner::Claimed {
                version,
                call,
                overdue,
                ..
            } => {
                if call && s.sends < self.max_sends && self.may_send(row, version, overdue) {
                    actions.push(Action::Send(r));
                }
                if call && self.timing == Timing::Bounded && !overdue {
                    actions.push(Action::BoundPasses(r));
                }
                if !call {
                    for reply in REPLIES {
                        let outage = matches!(
                            reply,
                            CheckReply::Unavailable | CheckReply::UnavailableGaveUp
                        );
                        let lags = !row.window_passed && !s.objects.is_empty();
                        if (reply != CheckReply::Lagging || lags)
                            && (!outage || s.outages < self.max_outages)
                        {
                            actions.push(Action::Check(r, reply));
                        }
                    }
                }
            }
            Runner::Waiting { req, .. } => {
                match s.requests[usize::from(req)].answer {
                    Some(Answer::RateLimited) => {
                        actions.push(Action::Deliver(r, false));
                        actions.push(Action::Deliver(r, true));
                    }
                    Some(Answer::None) | None => {}
                    Some(_) => actions.push(Action::Deliver(r, false)),
                }
                actions.push(Action::Timeout(r));
            }
            Runner::Settling { .. } => actions.push(Action::Settle(r)),
        }
        if s.runners[r] != Runner::Idle && s.crashes < self.max_crashes {
            actions.push(Action::Crash(r));
        }
    }

    /// Whether a runner holding a claim of `version` may send now: within the send bound
    /// always (the claim stands for the send), past it only while the stamp, fenced by the
    /// lease version, matches (`EffectStore::stamp_send`: `lease_version`, `locked_by` and
    /// `in_flight`, all of which only a claim, a settle or an operator changes).
    pub(super) fn may_send(&self, row: &Row, version: u8, overdue: bool) -> bool {
        match self.timing {
            Timing::Bounded => !overdue || row.version == version,
            Timing::Late => true,
        }
    }

    pub(super) fn world_actions(&self, s: &State, row: &Row, actions: &mut Vec<Action>) {
        // Within the send bound of a claim that starts a call, neither its lease (the lease
        // plus the bound) nor the settle window (from `sent_at` plus the bound) runs out (a
        // crash may still come first).
        let bounded_send_pending = self.timing == Timing::Bounded
            && s.runners.iter().any(|r| {
                matches!(r, Runner::Claimed { version, call: true, overdue: false, .. }
                    if *version == row.version)
            });
        if matches!(row.lease, Lease::Held(_))
            && s.expiries < self.max_expiries
            && !bounded_send_pending
        {
            actions.push(Action::ExpireLease);
        }
        for (i, req) in s.requests.iter().enumerate() {
            if req.answer.is_none() {
                let fates = if self.honours_keys {
                    &FATES[..]
                } else {
                    &FATES[1..]
                };
                for &fate in fates {
                    if fate != Fate::RateLimited || s.outages < self.max_outages {
                        actions.push(Action::Process(i, fate));
                    }
                }
            }
        }
        for (i, (_, obj)) in s.objects.iter().enumerate() {
            if *obj == Obj::Pending {
                actions.push(Action::ObjectMoves(i, true));
                actions.push(Action::ObjectMoves(i, false));
            }
        }
        let covered_pending = s.requests.iter().any(|q| q.covered && q.answer.is_none());
        if !row.window_passed && !covered_pending && !bounded_send_pending {
            actions.push(Action::WindowPasses);
        }
        if s.operator < self.max_operator {
            let live = s.objects.iter().any(|(_, o)| *o == Obj::Live);
            if matches!(
                row.state,
                EffectState::NeedsReview | EffectState::Unknown | EffectState::Absent
            ) {
                if live {
                    actions.push(Action::Resolve { succeeded: true });
                }
                if s.live_objects() == 0 && row.window_passed {
                    actions.push(Action::Resolve { succeeded: false });
                }
            }
            if matches!(
                row.state,
                EffectState::NeedsReview | EffectState::Unknown | EffectState::Failed
            ) {
                actions.push(Action::Retry);
            }
        }
        if s.reconciles < self.max_reconciles
            && row.state == EffectState::Unknown
            && !matches!(row.lease, Lease::Held(_))
        {
            actions.push(Action::Reconcile);
        }
        if !s.compensated
            && row.state == EffectState::Succeeded
            && s.objects.iter().any(|(_, o)| *o == Obj::Live)
        {
            actions.push(Action::Compensate);
        }
    }

    /// The provider processes request `i`.
    pub(super) fn process(&self, s: &mut State, i: usize, fate: Fate) {
        let key_gen = s.requests[i].key_gen;
        let existing = s.objects.iter().find(|(g, _)| *g == key_gen).map(|o| o.1);
        let stored_failure = s.stored_failures & (1 << key_gen) != 0;
        let answer = match fate {
            Fate::Dropped => Answer::None,
            _ if self.honours_keys && stored_failure => Answer::ServerError,
            _ if self.honours_keys && existing.is_some() => {
                Answer::Object(existing.expect("checked"))
            }
            Fate::Makes(obj) => {
                s.objects.push((key_gen, obj));
                Answer::Object(obj)
            }
            Fate::ErrorBefore => {
                if self.honours_keys {
                    s.stored_failures |= 1 << key_gen;
                }
                Answer::ServerError
            }
            Fate::RateLimited => {
                s.outages += 1;
                Answer::RateLimited
            }
        };
        s.requests[i].answer = Some(answer);
    }

    /// `EffectStore::claim` (`CLAIM_SET`): pending and absent effects become `in_flight`
    /// with one more attempt and `sent_at` now; unknown ones, and in-flight ones whose
    /// lease ran out, `unknown`.
    pub(super) fn claim(s: &mut State, r: usize) {
        let row = s.row.as_mut().expect("claimed");
        let call = matches!(row.state, EffectState::Pending | EffectState::Absent);
        if call {
            row.attempts += 1;
            row.state = EffectState::InFlight;
            row.window_passed = false;
            s.requests.iter_mut().for_each(|q| q.covered = true);
        } else {
            row.state = EffectState::Unknown;
        }
        row.version += 1;
        row.lease = Lease::Held(r as u8);
        s.runners[r] = Runner::Claimed {
            version: row.version,
            call,
            key_gen: row.key_gen,
            overdue: false,
        };
    }

    pub(super) fn send(&self, s: &mut State, r: usize) {
        let Runner::Claimed {
            version,
            key_gen,
            overdue,
            ..
        } = s.runners[r]
        else {
            return;
        };
        let may_commit = s.requests.iter().any(|q| q.answer.is_none());
        if !s.absence_proven || may_commit {
            s.unproven_resend = true;
        }
        s.absence_proven = false;
        s.sends += 1;
        if self.timing == Timing::Bounded && overdue {
            // `stamp_send`: the lease renewed and `sent_at` now — the window opens again.
            if let Some(row) = s.row.as_mut() {
                row.lease = Lease::Held(r as u8);
                row.window_passed = false;
            }
            s.requests.iter_mut().for_each(|q| q.covered = true);
        }
        s.requests.push(Request {
            key_gen,
            covered: self.timing == Timing::Bounded,
            answer: None,
        });
        s.runners[r] = Runner::Waiting {
            version,
            req: (s.requests.len() - 1) as u8,
        };
    }

    /// `EffectStore::settle_batch` (`SettleFields::of`), fenced by the lease version.
    pub(super) fn settle(s: &mut State, version: u8, settle: Settle, evidence: Evidence) {
        let row = s.row.as_mut().expect("settled");
        if row.version != version {
            return; // The lease was lost: the successor settles it.
        }
        let claimed = row.state;
        // One arm per `Settle` variant, as `SettleFields::of` reads them.
        #[allow(clippy::match_same_arms)]
        let state = match settle {
            Settle::Succeeded => EffectState::Succeeded,
            Settle::Failed => EffectState::Failed,
            Settle::Unknown => EffectState::Unknown,
            Settle::Absent { next_key } => {
                if next_key {
                    row.key_gen += 1;
                    row.answered_5xx = false;
                }
                EffectState::Absent
            }
            Settle::Unavailable if claimed == EffectState::Unknown => EffectState::Unknown,
            Settle::Unavailable => EffectState::Pending,
            Settle::GaveUpUnavailable if claimed == EffectState::Unknown => {
                EffectState::NeedsReview
            }
            Settle::GaveUpUnavailable => EffectState::Failed,
            Settle::NeedsReview => EffectState::NeedsReview,
        };
        row.state = state;
        if matches!(settle, Settle::Unavailable | Settle::GaveUpUnavailable)
            && claimed == EffectState::InFlight
        {
            row.attempts -= 1;
        }
        match evidence {
            Evidence::Call { answered_5xx } => {
                row.window_passed = false;
                row.answered_5xx |= answered_5xx;
                s.requests.iter_mut().for_each(|q| q.covered = true);
            }
            Evidence::Status { counts } => row.checks += u8::from(counts),
        }
        row.lease = Lease::Free;
        if matches!(
            row.state,
            EffectState::Pending | EffectState::Absent | EffectState::Failed
        ) {
            s.absence_proven = true;
        }
    }

    /// `EffectsSource::complete` (`reconcile/source.rs`): the unknown effect leased
    /// (`lease_unknown`, which raises the version) and settled from the records found, read
    /// as the runner reads them: live `succeeded`, ended `failed`, a word nobody listed
    /// `needs_review`, pending left leased, none noted (still `unknown`). The listing is
    /// taken in the same step.
    pub(super) fn reconcile(&self, s: &mut State) {
        s.reconciles += 1;
        let found = match s.row.as_ref() {
            Some(row) => self.found_objects(s, row),
            None => return,
        };
        let row = s.row.as_mut().expect("reconciled");
        row.version += 1;
        row.lease = Lease::Held(2);
        let version = row.version;
        let settle = if found.is_empty() {
            Settle::Unknown
        } else {
            match self.found(row, &found) {
                // Pending: the runner's next check decides (the lease stays until it runs out).
                Settle::Unknown | Settle::NeedsReview
                    if found.iter().any(|(_, o)| *o == Obj::Pending)
                        && !found.iter().any(|(_, o)| *o == Obj::Live) =>
                {
                    return;
                }
                settle => settle,
            }
        };
        Self::settle(s, version, settle, Evidence::Status { counts: true });
    }

    /// `EffectStore::resolve` and `EffectStore::retry`: an operator's decision, which raises
    /// the lease version (fencing a runner off) and leaves the lease as it is.
    pub(super) fn operator(s: &mut State, action: Action) {
        s.operator += 1;
        let row = s.row.as_mut().expect("resolved");
        row.version += 1;
        row.state = match (action, row.state) {
            (Action::Resolve { succeeded: true }, _) => EffectState::Succeeded,
            (Action::Resolve { succeeded: false }, _) => {
                s.absence_proven = true;
                EffectState::Failed
            }
            (_, EffectState::Failed) => {
                row.key_gen += 1;
                row.answered_5xx = false;
                EffectState::Absent
            }
            _ => {
                row.checks = 0;
                EffectState::Unknown
            }
        };
    }
}
