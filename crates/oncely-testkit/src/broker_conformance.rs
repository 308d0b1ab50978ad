//! One publisher/subscriber conformance suite for every broker, written against the
//! [`Publisher`] and [`Subscriber`] traits alone. A broker's test binary implements
//! [`BrokerUnderTest`] for it and instantiates the cases that apply with
//! [`broker_conformance!`](crate::broker_conformance); each case is an
//! `async fn(&impl BrokerUnderTest)` whose name states the behaviour it proves and that
//! panics when the broker breaks it.
//!
//! The cases:
//! - [`published_message_is_received_with_its_fields_and_gone_after_ack`]
//! - [`retried_delivery_comes_again_to_its_group_only_after_the_delay_with_attempts_raised`]
//! - [`delivery_dead_lettered_at_the_attempt_limit_lands_in_the_dead_letters_and_comes_no_more`]
//! - [`a_republished_copy_with_the_same_message_id_is_delivered_once`] (brokers that
//!   de-duplicate by message id: the SQL transport, JetStream)
//! - [`messages_of_one_partition_key_arrive_in_publish_order`]
//! - [`a_message_the_broker_refuses_is_a_permanent_failure_and_the_rest_of_its_batch_goes`]
//! - [`dead_letters_are_listed_paged_and_requeued_to_their_group_only_with_attempts_reset`]
//! - [`a_group_started_after_one_hundred_events_were_published_receives_each_once`] and
//!   [`two_consumers_of_a_new_group_subscribing_while_events_are_published_receive_each_once`]
//!   (brokers whose group members share deliveries without a rebalance: not Kafka)
//! - [`publishing_to_an_unreachable_broker_is_a_transient_failure`] and
//!   [`subscribing_at_an_unreachable_broker_is_a_transient_failure`] (brokers with a network
//!   path to cut)

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use oncely_broker::{
    headers, DeadLetters, Incoming, Message, PublishError, Publisher, ReceivedMessage, Requeue,
    Subscriber,
};
use oncely_core::MessageId;

/// One dead letter as the broker's dead-letter destination holds it.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// The message id, when the dead letter carries one.
    pub id: Option<MessageId>,
    /// Failed attempts recorded with it.
    pub attempts: u32,
    /// The last error recorded with it.
    pub error: String,
}

/// A broker under test: a namespace of its own (topic, streams, exchanges) and the means
/// to reach it. Implemented once per broker in the broker's test binary.
pub trait BrokerUnderTest: Send + Sync {
    /// The broker's subscriber.
    type Sub: Subscriber;

    /// The publisher, on this test's namespace.
    fn publisher(&self) -> &dyn Publisher;

    /// The topic the cases publish to (subscribers of [`BrokerUnderTest::subscriber`]
    /// receive it).
    fn topic(&self) -> String;

    /// A new subscriber (own connection) of consumer group `group` on
    /// [`BrokerUnderTest::topic`]; `settle` is the time after which a delivery received and
    /// not settled comes again (SQL lease, JetStream `ack_wait`; RabbitMQ redelivers when
    /// the connection closes, Kafka on a rebalance).
    fn subscriber(&self, group: &str, settle: Duration) -> Self::Sub;

    /// What a deployment does for consumer group `group` before anything is published to
    /// [`BrokerUnderTest::topic`], if anything: RabbitMQ binds the group's queue (a message
    /// no queue takes is unroutable, and the relay keeps it in the outbox); on the other
    /// brokers a group need not exist before it first consumes.
    fn declare_group(&self, group: &str) -> impl Future<Output = ()> + Send {
        let _ = group;
        std::future::ready(())
    }

    /// A message this broker refuses for good, whatever is retried: one over its size
    /// limit, or one no destination takes.
    fn refused_message(&self) -> Message;

    /// A publisher whose broker cannot be reached (its path cut, or an address where none
    /// listens), and what must stay alive while it is used; `None` where the broker has no
    /// network path (the SQL transport on SQLite).
    fn unreachable_publisher(
        &self,
    ) -> impl Future<Output = Option<(Box<dyn std::any::Any + Send>, Box<dyn Publisher>)>> + Send;

    /// A subscriber of consumer group `group` whose broker cannot be reached, and what must
    /// stay alive while it is used; `None` where the broker has no network path.
    fn unreachable_subscriber(
        &self,
        group: &str,
    ) -> impl Future<Output = Option<(Box<dyn std::any::Any + Send>, Self::Sub)>> + Send;

    /// The dead letters of consumer group `group`.
    fn dead_letters(&self, group: &str) -> impl Future<Output = Vec<DeadLetter>> + Send;

    /// The broker's [`DeadLetters`] on this test's namespace (what `oncely inbox dead` and
    /// the console use).
    fn dead_letter_admin(&self) -> Box<dyn DeadLetters>;

    /// Removes what the test created on the broker.
    fn cleanup(&self) -> impl Future<Output = ()> + Send;
}

/// A message of `topic`, partition key `key`, with payload `payload` and header
/// `correlation-id: c-<payload>`.
pub fn message(topic: &str, key: &str, payload: &str) -> Message {
    let mut h = BTreeMap::new();
    h.insert(headers::CORRELATION_ID.to_owned(), format!("c-{payload}"));
    Message {
        id: MessageId::new_random(),
        topic: topic.to_owned(),
        partition_key: key.to_owned(),
        event_type: "test.event".to_owned(),
        payload: payload.as_bytes().to_vec(),
        headers: h,
    }
}

async fn publish(broker: &impl BrokerUnderTest, batch: &[Message]) {
    for (m, r) in batch.iter().zip(broker.publisher().publish(batch).await) {
        if let Err(e) = r {
            panic!("{} refused {}: {e}", broker.publisher().name(), m.id);
        }
    }
}

/// Receives from `s` until `n` deliveries came or `within` passed; returns them in arrival
/// order, unsettled.
///
/// # Panics
/// When the subscriber fails.
pub async fn receive_n<S: Subscriber>(
    sub: &S,
    n: usize,
    within: Duration,
) -> Vec<Incoming<S::Handle>> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        let max = u32::try_from(n - got.len()).unwrap_or(u32::MAX);
        got.extend(
            sub.receive(max, Duration::from_millis(200))
                .await
                .expect("receive"),
        );
    }
    got
}

/// Everything `s` delivers within `window`, each acknowledged.
async fn drain<S: Subscriber>(sub: &S, window: Duration) -> Vec<ReceivedMessage> {
    let deadline = Instant::now() + window;
    let mut got = Vec::new();
    while Instant::now() < deadline {
        for d in sub
            .receive(16, Duration::from_millis(200))
            .await
            .expect("receive")
        {
            sub.ack(&d).await.expect("ack");
            got.push(d.message.expect("decodable"));
        }
    }
    got
}

fn decoded<H>(d: &Incoming<H>) -> &ReceivedMessage {
    d.message.as_ref().expect("a decodable delivery")
}

/// How long an unsettled delivery takes to come again in these cases.
const SETTLE: Duration = Duration::from_millis(1_500);

/// Publish → receive → ack: the delivery carries the message's id, topic, partition key,
/// event type, payload and headers, on its first attempt; once acknowledged it does not
/// come again, not even to a new subscriber of the group after the settle time.
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn published_message_is_received_with_its_fields_and_gone_after_ack(
    broker: &impl BrokerUnderTest,
) {
    let sub = broker.subscriber("g", SETTLE);
    sub.subscribe().await.expect("subscribe");
    let m = message(&broker.topic(), "p-1", "one");
    publish(broker, std::slice::from_ref(&m)).await;
    let got = receive_n(&sub, 1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1, "the message is delivered");
    let d = &got[0];
    let r = decoded(d);
    assert_eq!(r.id, m.id);
    assert_eq!(r.topic, m.topic);
    assert_eq!(r.partition_key, m.partition_key);
    assert_eq!(r.event_type, m.event_type);
    assert_eq!(r.payload, m.payload);
    assert_eq!(
        r.headers.get(headers::CORRELATION_ID).map(String::as_str),
        Some("c-one")
    );
    assert_eq!(
        r.headers.get(headers::MESSAGE_ID),
        Some(&m.id.to_string()),
        "headers {:?}",
        r.headers
    );
    assert_eq!(d.attempts, 0, "first delivery");
    sub.ack(d).await.expect("ack");
    sub.close().await;
    let again = broker.subscriber("g", SETTLE);
    again.subscribe().await.expect("subscribe");
    let late = drain(&again, SETTLE + Duration::from_secs(2)).await;
    assert!(
        late.is_empty(),
        "acknowledged, yet delivered again: {late:?}"
    );
    again.close().await;
    broker.cleanup().await;
}

/// Nack → redelivered: a delivery retried with a delay comes again to its own group, not
/// before the delay, with its attempt count raised by one; another group subscribed to the
/// topic gets its own single copy (a retry is not a new publish).
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn retried_delivery_comes_again_to_its_group_only_after_the_delay_with_attempts_raised(
    broker: &impl BrokerUnderTest,
) {
    let delay = Duration::from_millis(1_500);
    let sub = broker.subscriber("g", Duration::from_secs(30));
    let other = broker.subscriber("other", Duration::from_secs(30));
    sub.subscribe().await.expect("subscribe");
    other.subscribe().await.expect("subscribe");
    let m = message(&broker.topic(), "p-1", "retried");
    publish(broker, std::slice::from_ref(&m)).await;
    let first = receive_n(&sub, 1, Duration::from_secs(20)).await;
    assert_eq!(first.len(), 1, "the message is delivered");
    let retried_at = Instant::now();
    sub.retry(&first[0], delay, "boom").await.expect("retry");
    let again = receive_n(&sub, 1, Duration::from_secs(20)).await;
    let came_after = retried_at.elapsed();
    assert_eq!(again.len(), 1, "the retried message comes again");
    assert_eq!(decoded(&again[0]).id, m.id);
    assert_eq!(again[0].attempts, 1, "one failed attempt counted");
    // 100 ms of slack for clocks that round (SQL transport: ms; RabbitMQ: TTL expiry).
    assert!(
        came_after + Duration::from_millis(100) >= delay,
        "came again after {came_after:?}, before its delay of {delay:?}"
    );
    sub.ack(&again[0]).await.expect("ack");
    let copies = drain(&other, Duration::from_secs(4)).await;
    assert_eq!(
        copies.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![m.id],
        "the other group gets its one copy"
    );
    sub.close().await;
    other.close().await;
    broker.cleanup().await;
}

/// Dead letter after the attempt limit: a consumer that retries a failing delivery until
/// its third failure and then dead-letters it sees attempts 0, 1, 2; the dead-letter
/// destination holds the message with three attempts and the last error; it is not
/// delivered again.
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn delivery_dead_lettered_at_the_attempt_limit_lands_in_the_dead_letters_and_comes_no_more(
    broker: &impl BrokerUnderTest,
) {
    const LIMIT: u32 = 3;
    let sub = broker.subscriber("g", Duration::from_secs(30));
    sub.subscribe().await.expect("subscribe");
    let m = message(&broker.topic(), "p-1", "poison");
    publish(broker, std::slice::from_ref(&m)).await;
    let mut seen = Vec::new();
    loop {
        // A broker that loses the count would have the consumer retry for ever.
        assert!(
            seen.len() < LIMIT as usize,
            "attempts never reached the limit: {seen:?}"
        );
        let got = receive_n(&sub, 1, Duration::from_secs(20)).await;
        assert_eq!(got.len(), 1, "delivered again after attempts {seen:?}");
        let d = &got[0];
        assert_eq!(decoded(d).id, m.id);
        seen.push(d.attempts);
        let failures = d.attempts + 1;
        if failures >= LIMIT {
            sub.dead(d, &format!("gave up after {failures}"))
                .await
                .expect("dead");
            break;
        }
        sub.retry(
            d,
            Duration::from_millis(100),
            &format!("failure {failures}"),
        )
        .await
        .expect("retry");
    }
    assert_eq!(seen, vec![0, 1, 2], "attempts of the deliveries");
    let deadline = Instant::now() + Duration::from_secs(20);
    let dead = loop {
        let dead = broker.dead_letters("g").await;
        if !dead.is_empty() || Instant::now() > deadline {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(dead.len(), 1, "one dead letter: {dead:?}");
    assert_eq!(dead[0].id, Some(m.id));
    assert_eq!(dead[0].attempts, LIMIT);
    assert!(
        dead[0].error.contains("gave up after 3"),
        "last error {:?}",
        dead[0].error
    );
    let late = drain(&sub, Duration::from_secs(2)).await;
    assert!(late.is_empty(), "dead, yet delivered again: {late:?}");
    sub.close().await;
    broker.cleanup().await;
}

/// De-duplication by message id: a message published twice with one id (a relay that
/// republishes after losing the confirmation) is delivered once.
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn a_republished_copy_with_the_same_message_id_is_delivered_once(
    broker: &impl BrokerUnderTest,
) {
    let sub = broker.subscriber("g", Duration::from_secs(30));
    sub.subscribe().await.expect("subscribe");
    let m = message(&broker.topic(), "p-1", "twice");
    publish(broker, std::slice::from_ref(&m)).await;
    publish(broker, std::slice::from_ref(&m)).await;
    let got = drain(&sub, Duration::from_secs(4)).await;
    assert_eq!(
        got.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![m.id],
        "delivered once"
    );
    sub.close().await;
    broker.cleanup().await;
}

/// Order within a partition key: 30 messages of one key, published in three batches
/// interleaved with another key's, reach one subscriber in publish order.
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn messages_of_one_partition_key_arrive_in_publish_order(broker: &impl BrokerUnderTest) {
    let sub = broker.subscriber("g", Duration::from_secs(30));
    sub.subscribe().await.expect("subscribe");
    let topic = broker.topic();
    for batch in 0..3 {
        let msgs: Vec<Message> = (0..10)
            .flat_map(|i| {
                let n = batch * 10 + i;
                [
                    message(&topic, "ordered", &n.to_string()),
                    message(&topic, "other", &format!("x{n}")),
                ]
            })
            .collect();
        publish(broker, &msgs).await;
    }
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < 60 && Instant::now() < deadline {
        got.extend(drain(&sub, Duration::from_millis(500)).await);
    }
    assert_eq!(got.len(), 60, "every message delivered");
    let ordered: Vec<String> = got
        .iter()
        .filter(|r| r.partition_key == "ordered")
        .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
        .collect();
    let expected: Vec<String> = (0..30).map(|n: i32| n.to_string()).collect();
    assert_eq!(ordered, expected, "publish order within the key");
    sub.close().await;
    broker.cleanup().await;
}

/// Permanent failures: a message the broker refuses for good (over its size limit, or
/// with no destination) fails as [`PublishError::Permanent`], not transient, so the relay
/// counts it; the other messages of its batch are confirmed and delivered.
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn a_message_the_broker_refuses_is_a_permanent_failure_and_the_rest_of_its_batch_goes(
    broker: &impl BrokerUnderTest,
) {
    let sub = broker.subscriber("g", Duration::from_secs(30));
    sub.subscribe().await.expect("subscribe");
    let topic = broker.topic();
    let batch = [
        message(&topic, "p-1", "before"),
        broker.refused_message(),
        message(&topic, "p-1", "after"),
    ];
    let results = broker.publisher().publish(&batch).await;
    assert_eq!(results.len(), 3, "one result per message");
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert!(results[2].is_ok(), "{:?}", results[2]);
    match &results[1] {
        Err(e @ PublishError::Permanent(_)) => {
            assert!(!e.is_transient(), "{e}");
        }
        other => panic!("refused message: {other:?}, expected a permanent failure"),
    }
    let got = drain(&sub, Duration::from_secs(4)).await;
    let mut ids: Vec<MessageId> = got.iter().map(|r| r.id).collect();
    ids.sort_by_key(ToString::to_string);
    let mut expected = vec![batch[0].id, batch[2].id];
    expected.sort_by_key(ToString::to_string);
    assert_eq!(ids, expected, "the batch's other messages are delivered");
    sub.close().await;
    broker.cleanup().await;
}

/// The dead-letter API ([`DeadLetters`]): three messages dead-lettered by group `g` are
/// listed with their id, topic, group, attempts, last error and payload, in two pages that
/// meet without overlap; group `other` has none. One requeued by message id comes again to
/// `g` with attempts reset and is listed no more; the other two requeued with
/// [`Requeue::All`] come again too; then the list is empty and a requeue finds nothing.
/// Group `other` got each message exactly once: no requeue reached it.
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn dead_letters_are_listed_paged_and_requeued_to_their_group_only_with_attempts_reset(
    broker: &impl BrokerUnderTest,
) {
    let admin = broker.dead_letter_admin();
    let sub = broker.subscriber("g", Duration::from_secs(30));
    let other = broker.subscriber("other", Duration::from_secs(30));
    sub.subscribe().await.expect("subscribe");
    other.subscribe().await.expect("subscribe");
    let topic = broker.topic();
    let sent: Vec<Message> = (1..=3)
        .map(|i| message(&topic, &format!("p-{i}"), &format!("dead-{i}")))
        .collect();
    publish(broker, &sent).await;
    let got = receive_n(&sub, 3, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 3, "the messages are delivered");
    for d in &got {
        let payload = String::from_utf8_lossy(&decoded(d).payload).into_owned();
        sub.dead(d, &format!("refused {payload}"))
            .await
            .expect("dead");
    }
    let letters = list_until(&*admin, "g", 3).await;
    assert_listed(&letters, &sent, &topic);
    let first = admin.list("g", 2, None).await.expect("first page");
    assert_eq!(first.len(), 2, "a page of two");
    let rest = admin
        .list("g", 10, Some(&first[1].position))
        .await
        .expect("second page");
    let mut paged: Vec<_> = first.iter().chain(&rest).map(|l| l.message_id).collect();
    paged.sort_by_key(|i| i.map(|i| i.to_string()));
    let mut all: Vec<_> = letters.iter().map(|l| l.message_id).collect();
    all.sort_by_key(|i| i.map(|i| i.to_string()));
    assert_eq!(paged, all, "the pages meet without overlap");
    assert!(admin
        .list("other", 10, None)
        .await
        .expect("list")
        .is_empty());

    let one = first[0].message_id.expect("an id");
    assert_eq!(
        admin
            .requeue("g", Requeue::Message(one))
            .await
            .expect("requeue"),
        1
    );
    let again = receive_n(&sub, 1, Duration::from_secs(20)).await;
    assert_eq!(again.len(), 1, "the requeued message comes again");
    let r = decoded(&again[0]);
    assert_eq!(r.id, one);
    assert_eq!(r.topic, topic);
    assert_eq!(again[0].attempts, 0, "attempts reset");
    sub.ack(&again[0]).await.expect("ack");
    let left = admin.list("g", 10, None).await.expect("list");
    assert_eq!(
        left.len(),
        2,
        "the requeued letter is listed no more: {left:?}"
    );
    assert!(left.iter().all(|l| l.message_id != Some(one)));

    assert_eq!(admin.requeue("g", Requeue::All).await.expect("requeue"), 2);
    let back = receive_n(&sub, 2, Duration::from_secs(20)).await;
    assert_eq!(back.len(), 2, "both come again");
    for d in &back {
        assert_eq!(d.attempts, 0, "attempts reset");
        sub.ack(d).await.expect("ack");
    }
    assert!(admin.list("g", 10, None).await.expect("list").is_empty());
    assert_eq!(
        admin
            .requeue("g", Requeue::Message(one))
            .await
            .expect("requeue"),
        0
    );
    assert!(drain(&sub, Duration::from_secs(2)).await.is_empty());
    let mut copies: Vec<String> = drain(&other, Duration::from_secs(4))
        .await
        .iter()
        .map(|r| r.id.to_string())
        .collect();
    copies.sort();
    let mut expected: Vec<String> = sent.iter().map(|m| m.id.to_string()).collect();
    expected.sort();
    assert_eq!(copies, expected, "the other group got each message once");
    admin.close().await;
    sub.close().await;
    other.close().await;
    broker.cleanup().await;
}

/// A late consumer group: 100 messages (seven partition keys) are published while group
/// `late` has never consumed (it was only declared where the broker needs that, see
/// [`BrokerUnderTest::declare_group`]); then a subscriber of `late` starts and receives
/// every one of them, each once: none lost, none twice (no duplicate within a further
/// window after all 100 were acknowledged).
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn a_group_started_after_one_hundred_events_were_published_receives_each_once(
    broker: &impl BrokerUnderTest,
) {
    broker.declare_group("late").await;
    let topic = broker.topic();
    let sent: Vec<Message> = (0..100)
        .map(|i| message(&topic, &format!("p-{}", i % 7), &format!("late-{i}")))
        .collect();
    publish(broker, &sent).await;
    let sub = broker.subscriber("late", Duration::from_secs(30));
    sub.subscribe().await.expect("subscribe");
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < sent.len() && Instant::now() < deadline {
        got.extend(drain(&sub, Duration::from_millis(500)).await);
    }
    got.extend(drain(&sub, Duration::from_secs(3)).await);
    assert_each_once(&got, &sent);
    sub.close().await;
    broker.cleanup().await;
}

/// A new group's first two consumers subscribe at once while events are being published:
/// 200 messages go out in batches of 10, the two subscribe together after the first 50;
/// between them they receive every message, each once — none published before, during or
/// after the subscription is lost or delivered twice.
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn two_consumers_of_a_new_group_subscribing_while_events_are_published_receive_each_once(
    broker: &impl BrokerUnderTest,
) {
    broker.declare_group("late").await;
    let topic = broker.topic();
    let sent: Vec<Message> = (0..200)
        .map(|i| message(&topic, &format!("p-{}", i % 7), &format!("racing-{i}")))
        .collect();
    let (a, b) = (
        broker.subscriber("late", Duration::from_secs(30)),
        broker.subscriber("late", Duration::from_secs(30)),
    );
    for batch in sent[..50].chunks(10) {
        publish(broker, batch).await;
    }
    let rest = async {
        for batch in sent[50..].chunks(10) {
            publish(broker, batch).await;
        }
    };
    let ((), (ra, rb)) = tokio::join!(rest, async { tokio::join!(a.subscribe(), b.subscribe()) });
    ra.expect("subscribe");
    rb.expect("subscribe");
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < sent.len() && Instant::now() < deadline {
        let window = Duration::from_millis(500);
        let (x, y) = tokio::join!(drain(&a, window), drain(&b, window));
        got.extend(x.into_iter().chain(y));
    }
    let (x, y) = tokio::join!(
        drain(&a, Duration::from_secs(3)),
        drain(&b, Duration::from_secs(3))
    );
    got.extend(x.into_iter().chain(y));
    assert_each_once(&got, &sent);
    a.close().await;
    b.close().await;
    broker.cleanup().await;
}

/// `got` holds each message of `sent` exactly once (in any order).
fn assert_each_once(got: &[ReceivedMessage], sent: &[Message]) {
    let mut counts: BTreeMap<String, usize> = sent.iter().map(|m| (m.id.to_string(), 0)).collect();
    let mut strangers = Vec::new();
    for r in got {
        match counts.get_mut(&r.id.to_string()) {
            Some(n) => *n += 1,
            None => strangers.push(r.id),
        }
    }
    let missing = counts.values().filter(|n| **n == 0).count();
    let twice = counts.values().filter(|n| **n > 1).count();
    assert!(
        missing == 0 && twice == 0 && strangers.is_empty(),
        "{} of {} delivered: {missing} never, {twice} more than once, {} not published here",
        got.len(),
        sent.len(),
        strangers.len()
    );
}

/// `letters` are the dead letters of `sent` (group `g`, `topic`), each with one attempt and
/// the error `refused <payload>`.
fn assert_listed(letters: &[oncely_broker::DeadLetter], sent: &[Message], topic: &str) {
    assert_eq!(letters.len(), sent.len(), "the dead letters: {letters:?}");
    for m in sent {
        let l = letters
            .iter()
            .find(|l| l.message_id == Some(m.id))
            .unwrap_or_else(|| panic!("{} not listed: {letters:?}", m.id));
        let payload = String::from_utf8_lossy(&m.payload).into_owned();
        assert_eq!(l.topic, topic);
        assert_eq!(l.group, "g");
        assert_eq!(l.event_type, m.event_type);
        assert_eq!(l.attempts, 1, "{l:?}");
        assert_eq!(
            l.last_error.as_deref(),
            Some(format!("refused {payload}").as_str())
        );
        assert_eq!(l.payload_size, m.payload.len());
        assert_eq!(l.payload_preview, payload);
    }
}

/// Lists `group`'s dead letters until `n` show (or 20 s passed).
async fn list_until(
    admin: &dyn DeadLetters,
    group: &str,
    n: usize,
) -> Vec<oncely_broker::DeadLetter> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let letters = admin.list(group, 100, None).await.expect("list");
        if letters.len() >= n || Instant::now() > deadline {
            return letters;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Transient failures: publishing to a broker that cannot be reached fails every message
/// as [`PublishError::Transient`] ([`PublishError::is_transient`]), which the relay does not
/// count as an attempt.
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn publishing_to_an_unreachable_broker_is_a_transient_failure(
    broker: &impl BrokerUnderTest,
) {
    let (_keep, publisher) = broker
        .unreachable_publisher()
        .await
        .expect("listed only for brokers with a network path");
    let topic = broker.topic();
    let batch = [message(&topic, "p-1", "a"), message(&topic, "p-2", "b")];
    let results = publisher.publish(&batch).await;
    assert_eq!(results.len(), 2, "one result per message");
    for r in &results {
        match r {
            Err(e @ PublishError::Transient(_)) => assert!(e.is_transient(), "{e}"),
            other => panic!("unreachable broker: {other:?}, expected a transient failure"),
        }
    }
    broker.cleanup().await;
}

/// Transient failures, receiving side: subscribing at a broker that cannot be reached
/// fails with a [`SubscribeError`](oncely_broker::SubscribeError) that
/// [`is_transient`](oncely_broker::SubscribeError::is_transient) (an outage to wait out, not
/// a configuration to fix).
///
/// # Panics
/// When the broker breaks the behaviour.
pub async fn subscribing_at_an_unreachable_broker_is_a_transient_failure(
    broker: &impl BrokerUnderTest,
) {
    let (_keep, sub) = broker
        .unreachable_subscriber("g")
        .await
        .expect("listed only for brokers with a network path");
    match sub.subscribe().await {
        Err(e) => assert!(
            e.is_transient(),
            "unreachable broker: {e:?}, expected transient"
        ),
        Ok(()) => panic!("subscribed at an unreachable broker"),
    }
    broker.cleanup().await;
}

/// Instantiates the listed cases of [`broker_conformance`](crate::broker_conformance) as
/// `#[tokio::test]`s (multi-threaded runtime, 4 workers) in module `$module`, each on a
/// broker made by `$make` (an `async` expression giving `Option<impl BrokerUnderTest>`;
/// `None` — broker unreachable — skips, or fails under `ONCELY_TEST_REQUIRE_SERVICES=1`
/// where `$make` checks [`service_reachable`](crate::service_reachable)).
///
/// ```text
/// oncely_testkit::broker_conformance!(nats, NatsBroker::new().await, [
///     published_message_is_received_with_its_fields_and_gone_after_ack,
/// ]);
/// ```
#[macro_export]
macro_rules! broker_conformance {
    ($module:ident, $make:expr, [$($case:ident),* $(,)?]) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    if let Some(broker) = $make {
                        $crate::broker_conformance::$case(&broker).await;
                    }
                }
            )*
        }
    };
}
