//! The model's checks: the invariants hold over the whole bounded state space, and every state of the effect is reached.

use stateright::{Checker, Model};

use super::*;

/// Runs the BFS of `model`; the checker, done.
fn check(model: EffectModel) -> impl Checker<EffectModel> {
    let started = std::time::Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let checker = model.checker().threads(threads).spawn_bfs().join();
    println!(
        "{:?}: {} unique states ({} visited, depth {}) in {:.1?}",
        checker.model(),
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker
}

/// Prints every counterexample found, action by action.
fn report(checker: &impl Checker<EffectModel>) -> Vec<&'static str> {
    let mut found = Vec::new();
    for p in checker.model().properties() {
        if p.expectation == stateright::Expectation::Sometimes {
            continue;
        }
        if let Some(path) = checker.discovery(p.name) {
            println!("counterexample of \"{}\":", p.name);
            for (state, action) in path.into_vec() {
                println!("  {state:?}");
                if let Some(action) = action {
                    println!("    -> {action:?}");
                }
            }
            found.push(p.name);
        }
    }
    found
}

#[test]
fn effect_protocol_model_holds() {
    // Keys change what the provider does with a request (one object per key, a stored 5xx
    // replayed, the resend under the next generation); a reconciliation run and an outage
    // (a 429, an unavailable status check) do the same whatever the provider, so they are
    // checked keyless only — which keeps the whole search near 20 s.
    let keyless = EffectModel::default();
    let keyed = EffectModel {
        honours_keys: true,
        max_reconciles: 0,
        max_outages: 0,
        ..EffectModel::default()
    };
    for model in [keyless, keyed] {
        let checker = check(model);
        assert!(report(&checker).is_empty());
        assert!(checker.discovery("the effect can succeed").is_some());
    }
}

#[test]
fn every_effect_state_is_reached() {
    // Without crashes and lease expiries: every state is reached without them, in a
    // fraction of the search.
    let checker = check(EffectModel {
        max_crashes: 0,
        max_expiries: 0,
        ..EffectModel::default()
    });
    for &state in EffectState::ALL {
        let name = reaches(state).name;
        assert!(checker.discovery(name).is_some(), "the model never {name}");
    }
}

/// The first counterexample the BFS of `model` finds (printed), with its property's name.
fn first_counterexample(model: EffectModel) -> Option<(&'static str, Vec<Action>)> {
    let checker = model
        .checker()
        .finish_when(stateright::HasDiscoveries::AnyFailures)
        .spawn_bfs()
        .join();
    let found = report(&checker);
    let name = found.first()?;
    Some((name, checker.discovery(name)?.into_actions()))
}

/// The runner as built: a claimed effect waits for a call slot, so its call may leave
/// after the claim that counts as its `sent_at` (even after the lease ran out); a keyless
/// provider then gets a second request while the first may still commit.
#[test]
fn a_call_that_leaves_after_its_claim_can_duplicate_a_keyless_effect() {
    let model = EffectModel {
        timing: Timing::Late,
        max_operator: 0,
        max_outages: 0,
        ..EffectModel::default()
    };
    let (name, _) = first_counterexample(model).expect("the late send is a known finding");
    assert_eq!(name, "no re-send before absence is proven");
    let model = EffectModel {
        timing: Timing::Late,
        ..EffectModel::default()
    };
    // A runner claims and waits for a call slot; its lease runs out; the other runner claims
    // it, checks once the settle window counted from the first claim has passed, finds
    // nothing and settles `absent`, claims again and sends; the first runner's call leaves
    // at last. Both commit. (Runner numbers are those of the canonical state: the runners
    // are kept in order, so the first claimer is runner 1 from its claim on.)
    let duplicate = [
        Action::Enqueue,
        Action::Claim(0),
        Action::ExpireLease,
        Action::WindowPasses,
        Action::Claim(0),
        Action::Check(1, CheckReply::Answered),
        Action::Settle(1),
        Action::Claim(0),
        Action::Send(1),
        Action::Send(0),
        Action::Process(0, Fate::Makes(Obj::Live)),
        Action::Process(1, Fate::Makes(Obj::Live)),
    ];
    let path = stateright::Path::from_actions(&model, model.init_states()[0].clone(), &duplicate)
        .expect("every action enabled");
    let last = path.last_state();
    assert_eq!(last.live_objects(), 2, "{last:?}");
    assert!(last.unproven_resend);
}

/// The runner as built: a status check decides on every object found for the reference, so
/// an object that ended under an earlier key (a declined charge an operator retried) fails
/// the effect while its latest attempt may still commit.
#[test]
fn an_ended_object_of_an_earlier_key_can_fail_a_live_effect() {
    let model = EffectModel {
        earlier_ended: EarlierEnded::Decides,
        max_crashes: 0,
        max_expiries: 0,
        max_outages: 0,
        ..EffectModel::default()
    };
    let (name, _) = first_counterexample(model.clone()).expect("a known finding");
    assert_eq!(name, "never failed while an object is live");
    // The charge is declined (its object ends) and settles `failed`; an operator retries it
    // under the key's next generation; that call's answer is lost; the status check finds
    // only the declined object and fails the effect; the second attempt commits.
    let failed_while_live = [
        Action::Enqueue,
        Action::Claim(0),
        Action::Send(1),
        Action::Process(0, Fate::Makes(Obj::Ended)),
        Action::Deliver(1, false),
        Action::Settle(1),
        Action::Retry,
        Action::Claim(0),
        Action::Send(1),
        Action::Timeout(1),
        Action::Settle(1),
        Action::Claim(0),
        Action::Check(1, CheckReply::Answered),
        Action::Settle(1),
        Action::Process(1, Fate::Makes(Obj::Live)),
    ];
    let path =
        stateright::Path::from_actions(&model, model.init_states()[0].clone(), &failed_while_live)
            .expect("every action enabled");
    let last = path.last_state();
    assert!(
        row_is(last, EffectState::Failed) && last.live_objects() == 1,
        "{last:?}"
    );
}

/// The late call of the first finding with a provider that honours keys: the key keeps it
/// to one object, but the status checks made meanwhile find nothing, and past the attempt
/// limit the effect is `failed` — then the late call commits.
#[test]
fn a_call_that_leaves_after_its_claim_can_fail_a_keyed_effect_that_happened() {
    let model = EffectModel {
        timing: Timing::Late,
        honours_keys: true,
        ..EffectModel::default()
    };
    let (name, _) = first_counterexample(model).expect("a known finding");
    assert_eq!(name, "never failed while an object is live");
}

/// The actions enabled after `trace` from the initial state (each step must be enabled).
fn enabled_after(model: &EffectModel, trace: &[Action]) -> (State, Vec<Action>) {
    let path = stateright::Path::from_actions(model, model.init_states()[0].clone(), trace)
        .expect("every action enabled");
    let last = path.last_state().clone();
    let mut actions = Vec::new();
    model.actions(&last, &mut actions);
    (last, actions)
}

/// The runner as built (`Timing::Bounded`): within the send bound of its claim a call's
/// lease cannot run out and its settle window cannot pass; past the bound the lease may run
/// out and another runner take the effect over — and then the first runner's call never
/// leaves (its stamp matches nothing). Untaken, the stamp renews the lease and opens the
/// window again.
#[test]
fn a_call_past_its_send_bound_leaves_only_under_its_own_claim() {
    let model = EffectModel::default();
    assert_eq!(model.timing, Timing::Bounded);
    let is_send = |a: &Action| matches!(a, Action::Send(_));
    // Claimed: the claimer is runner 1 of the canonical state (see the first finding).
    let (_, actions) = enabled_after(&model, &[Action::Enqueue, Action::Claim(0)]);
    assert!(actions.contains(&Action::Send(1)) && actions.contains(&Action::BoundPasses(1)));
    assert!(!actions.contains(&Action::ExpireLease), "{actions:?}");
    assert!(!actions.contains(&Action::WindowPasses), "{actions:?}");
    // Past the bound, its lease runs out and the other runner claims it (`unknown`).
    let taken_over = [
        Action::Enqueue,
        Action::Claim(0),
        Action::BoundPasses(1),
        Action::ExpireLease,
        Action::WindowPasses,
        Action::Claim(0),
    ];
    let (last, actions) = enabled_after(&model, &taken_over);
    assert!(row_is(&last, EffectState::Unknown), "{last:?}");
    assert!(!actions.iter().any(is_send), "{actions:?}");
    // Not taken over: the stamp renews the lease and the window opens again.
    let stamped = [
        Action::Enqueue,
        Action::Claim(0),
        Action::BoundPasses(1),
        Action::ExpireLease,
        Action::WindowPasses,
        Action::Send(1),
    ];
    let (last, _) = enabled_after(&model, &stamped);
    let row = last.row.expect("enqueued");
    assert!(
        matches!(row.lease, Lease::Held(_)) && !row.window_passed,
        "{row:?}"
    );
}
