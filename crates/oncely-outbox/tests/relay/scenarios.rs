//! The broker scenarios of the `<backend>::<broker>::…` matrix other than the outage ones
//! (those are in `outage.rs`): ordering across relays, republishing after a crash, a poison
//! event, late commits, LISTEN/NOTIFY wake-ups and one large batch.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use oncely_broker::{Message, Publisher};
use oncely_sql::{OutboxEvent, OutboxState, OutboxStore, RequeueTarget};
use oncely_testkit::TestBroker as Broker;

use crate::harness::{spawn_relay, stop, Harness, Jittery};

/// Three relays, 1,000 events over 50 aggregates written while they run: every event
/// arrives, and each aggregate's events arrive in the order they were committed.
pub(crate) async fn three_relays_keep_each_aggregates_order(mut h: Harness) {
    const AGGREGATES: usize = 50;
    const PER: usize = 20;
    let event = |a: usize, seq: usize| h.event(&format!("agg-{a}"), seq);
    // A backlog first (the first half of every aggregate's events), so the relays start by
    // competing for the same partitions; then four writers add the rest while they run.
    let backlog: Vec<OutboxEvent> = (0..PER / 2)
        .flat_map(|seq| (0..AGGREGATES).map(move |a| (a, seq)))
        .map(|(a, seq)| event(a, seq))
        .collect();
    h.enqueue(&backlog).await;
    // Each relay's broker round trips get a random extra 0–15 ms, so their batches
    // interleave every which way (the brokers are still the real ones).
    let relays: Vec<_> = (0..3)
        .map(|i| {
            let jittery: Arc<dyn Publisher> = Arc::new(Jittery(h.publisher.clone()));
            spawn_relay(h.relay(jittery, |c| {
                c.relay_id = format!("relay-{i}");
                c.batch_size = 16;
            }))
        })
        .collect();
    // Four writers, each owning a disjoint set of aggregates and writing each aggregate's
    // events in sequence (one transaction per event, as a service would).
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let db = h.db.db.clone();
            let events: Vec<OutboxEvent> = (PER / 2..PER)
                .flat_map(|seq| {
                    (0..AGGREGATES)
                        .filter(move |a| a % 4 == w)
                        .map(move |a| (a, seq))
                })
                .map(|(a, seq)| event(a, seq))
                .collect();
            tokio::spawn(async move {
                for e in events {
                    let mut tx = db.begin().await.expect("begin");
                    OutboxStore::enqueue(&mut tx, &e).await.expect("enqueue");
                    tx.commit().await.expect("commit");
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let got = h
        .consumer
        .collect(
            AGGREGATES * PER,
            Duration::from_secs(60),
            Duration::from_secs(1),
        )
        .await;
    for r in relays {
        stop(r).await;
    }
    assert_eq!(got.len(), AGGREGATES * PER, "every event once");
    let mut per: HashMap<String, Vec<usize>> = HashMap::new();
    for d in &got {
        let text = String::from_utf8(d.payload.clone()).unwrap();
        let (agg, seq) = text.split_once(':').unwrap();
        assert_eq!(agg, d.partition_key);
        per.entry(agg.to_owned())
            .or_default()
            .push(seq.parse().unwrap());
    }
    assert_eq!(per.len(), AGGREGATES);
    for (agg, seqs) in per {
        assert_eq!(seqs, (0..PER).collect::<Vec<_>>(), "{agg} out of order");
    }
    h.finish().await;
}

/// A relay that dies after the broker confirmed but before it marked the rows: another
/// relay republishes them, after the lease, with the same message ids. JetStream drops the
/// copies within its duplicate window; the SQL transport while the first copy is queued;
/// RabbitMQ delivers them again, with the same ids, for the consumer's inbox to skip.
pub(crate) async fn relay_killed_after_confirm_republishes_with_same_ids(mut h: Harness) {
    let events: Vec<OutboxEvent> = (0..5).map(|i| h.event(&format!("k-{i}"), 0)).collect();
    let ids = h.enqueue(&events).await;
    let store = h.store();
    // Relay A: claim and publish (confirmed), then "crash" before marking. The lease must
    // outlast that publish: a fresh Kafka producer first connects and obtains its producer
    // id (InitProducerId), which can take longer than the other brokers' round trip.
    let lease = match h.broker {
        Broker::Kafka => Duration::from_secs(3),
        _ => Duration::from_millis(500),
    };
    let claimed = store
        .claim("relay-a", 100, lease, oncely_core::now_ms())
        .await
        .unwrap();
    assert_eq!(claimed.len(), 5);
    let messages: Vec<_> = claimed
        .iter()
        .map(|r| oncely_outbox::to_message(r.event.clone()))
        .collect();
    let results = h.publisher.publish(&messages).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // While A's lease holds, nobody else takes the rows.
    let b = h.relay(h.publisher.clone(), |c| {
        "relay-b".clone_into(&mut c.relay_id);
    });
    assert_eq!(b.run_once().await.unwrap().claimed, 0);
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let report = b.run_once().await.unwrap();
    assert_eq!((report.claimed, report.published), (5, 5));
    for id in &ids {
        assert_eq!(
            store.get(*id).await.unwrap().unwrap().state,
            OutboxState::Published
        );
    }
    let got = h
        .consumer
        .collect(10, Duration::from_secs(5), Duration::from_millis(500))
        .await;
    let expected: HashSet<String> = events.iter().map(|e| e.message_id.to_string()).collect();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for d in &got {
        *counts.entry(d.id.clone()).or_default() += 1;
    }
    assert_eq!(
        counts.keys().cloned().collect::<HashSet<_>>(),
        expected,
        "same ids only"
    );
    // Kafka's idempotent producer de-duplicates its own retries within one producer
    // session only: the second relay's copy is a second record with the same id.
    let copies = match h.broker {
        Broker::RabbitMq | Broker::Kafka => 2,
        Broker::Nats | Broker::Sql => 1,
    };
    assert!(
        counts.values().all(|&c| c == copies),
        "copies per id: {counts:?}"
    );
    if let (Some(stream), Some(n)) = (&h.stream, &h.nats) {
        let mut s = n.jetstream().get_stream(stream).await.unwrap();
        assert_eq!(
            s.info().await.unwrap().state.messages,
            5,
            "JetStream dropped the copies"
        );
    }
    h.finish().await;
}

/// A poison event fails on every attempt, goes `dead` after the limit (attempts and the
/// error recorded, counted in stats), and meanwhile every other event flows — including
/// the one queued behind it in its own partition, once it is dead. Requeue puts it back.
pub(crate) async fn poison_event_goes_dead_while_the_rest_flow(mut h: Harness) {
    let poison = h.poison("shared");
    let follower = h.event("shared", 1);
    let mut events = vec![poison.clone(), follower.clone()];
    events.extend((0..20).map(|i| h.event(&format!("other-{i}"), 0)));
    let ids = h.enqueue(&events).await;
    let relay = spawn_relay(h.relay(h.publisher.clone(), |c| c.retry.max_attempts = 3));
    let got = h
        .consumer
        .collect(21, Duration::from_secs(30), Duration::from_millis(800))
        .await;
    stop(relay).await;
    let got_ids: HashSet<String> = got.iter().map(|d| d.id.clone()).collect();
    assert_eq!(got.len(), 21, "every healthy event once");
    assert!(!got_ids.contains(&poison.message_id.to_string()));
    assert!(got_ids.contains(&follower.message_id.to_string()));
    let store = h.store();
    let row = store.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(row.state, OutboxState::Dead);
    // Too large for the SQL transport's and Kafka's limits: dead at its first attempt (it
    // can never fit). Unroutable on RabbitMQ and NATS (a stream or binding may come): dead
    // at the limit.
    let (attempts, error) = match h.broker {
        Broker::Sql | Broker::Kafka => (1, "exceeds the limit"),
        Broker::RabbitMq | Broker::Nats => (3, "no destination"),
    };
    assert_eq!(row.attempts, attempts);
    let last_error = row.last_error.unwrap_or_default();
    assert!(last_error.contains(error), "last error {last_error:?}");
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead), (0, 1));
    let dead = store.dead(0, 10).await.unwrap();
    assert_eq!(dead.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids[0]]);
    assert_eq!(
        store
            .requeue_dead(RequeueTarget::All, oncely_core::now_ms())
            .await
            .unwrap(),
        1
    );
    let row = store.get(ids[0]).await.unwrap().unwrap();
    assert_eq!((row.state, row.attempts), (OutboxState::Pending, 0));
    h.finish().await;
}

/// Rows whose transaction commits after a higher-numbered row's are still published: the
/// relay claims by state, never by an "id > cursor" scan. PostgreSQL only: SQLite has one
/// writer, so its ids are assigned in commit order and the case cannot arise.
pub(crate) async fn late_committing_rows_are_not_skipped(mut h: Harness) {
    let store = h.store();
    let relay = h.relay(h.publisher.clone(), |_| {});
    let early = [h.event("late", 0), h.event("x", 0)];
    let later = [h.event("b", 0), h.event("x", 1)];
    let mut slow = h.db.db.begin().await.unwrap();
    let mut early_ids = Vec::new();
    for e in &early {
        early_ids.push(OutboxStore::enqueue(&mut slow, e).await.unwrap());
    }
    let later_ids = h.enqueue(&later).await;
    assert!(early_ids.iter().max() < later_ids.iter().min());
    let r = relay.run_once().await.unwrap();
    assert_eq!(r.published, 2, "the committed rows go out");
    let r = relay.run_once().await.unwrap();
    assert_eq!(r.claimed, 0);
    slow.commit().await.unwrap();
    let r = relay.run_once().await.unwrap();
    assert_eq!(r.published, 2, "the late rows are not skipped");
    let got = h
        .consumer
        .collect(4, Duration::from_secs(10), Duration::from_millis(300))
        .await;
    let order: Vec<String> = got.iter().map(|d| d.id.clone()).collect();
    let all: HashSet<String> = early
        .iter()
        .chain(&later)
        .map(|e| e.message_id.to_string())
        .collect();
    assert_eq!(order.iter().cloned().collect::<HashSet<_>>(), all);
    assert_eq!(order.len(), 4);
    // In partition x, commit order was x:1 then x:0; that is the publish order too.
    let pos = |e: &OutboxEvent| order.iter().position(|i| *i == e.message_id.to_string());
    assert!(pos(&later[1]) < pos(&early[1]));
    for id in early_ids.iter().chain(&later_ids) {
        assert_eq!(
            store.get(*id).await.unwrap().unwrap().state,
            OutboxState::Published
        );
    }
    h.finish().await;
}

/// On PostgreSQL a commit wakes the relay through LISTEN/NOTIFY: with polling every 30 s,
/// events still arrive at once.
pub(crate) async fn postgres_notify_wakes_an_idle_relay(mut h: Harness) {
    let relay = spawn_relay(h.relay(h.publisher.clone(), |c| {
        c.poll_interval = Duration::from_secs(30);
    }));
    // Let the relay finish its first (empty) round and go idle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for round in 0..3 {
        let e = h.event("woken", round);
        h.enqueue(std::slice::from_ref(&e)).await;
        let got = h
            .consumer
            .collect(1, Duration::from_secs(5), Duration::ZERO)
            .await;
        assert_eq!(got.len(), 1, "round {round}: the relay was not woken");
        assert_eq!(got[0].id, e.message_id.to_string());
    }
    stop(relay).await;
    h.finish().await;
}

/// One publish call of 300 messages — more than a confirmation window (256), and more than
/// the 30 futures above which `join_all` stops polling in order — reaches the consumer in
/// the call's order, one copy each: the publishers queue a window's messages in order.
pub(crate) async fn a_batch_reaches_the_broker_in_the_order_given(mut h: Harness) {
    let messages: Vec<Message> = (0..300)
        .map(|i| oncely_outbox::to_message(h.event("one-aggregate", i)))
        .collect();
    let results = h.publisher.publish(&messages).await;
    assert_eq!(results.len(), messages.len());
    for (i, r) in results.iter().enumerate() {
        assert!(r.is_ok(), "message {i}: {r:?}");
    }
    let got = h
        .consumer
        .collect(300, Duration::from_secs(30), Duration::from_millis(300))
        .await;
    let seqs: Vec<usize> = got
        .iter()
        .map(|d| {
            let text = String::from_utf8(d.payload.clone()).unwrap();
            text.split_once(':').unwrap().1.parse().unwrap()
        })
        .collect();
    assert_eq!(seqs, (0..300).collect::<Vec<_>>());
    h.finish().await;
}
