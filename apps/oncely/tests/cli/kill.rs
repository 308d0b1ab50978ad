//! Relay processes SIGKILLed at random while events commit: no event lost, each
//! partition's events in order.

// Chaos: several `oncely relay` *processes* on one PostgreSQL outbox, publishing to NATS
// JetStream, SIGKILLed at random moments and restarted, while new events keep committing —
// some of them late, so rows commit out of id order, also within one partition key.
// Afterwards the stream must hold every event (at least once, a copy only under the same
// `Nats-Msg-Id`), each partition's events in order, and the outbox must be empty.
//
// Knobs (environment): `ONCELY_KILL_SEED` (the PRNG seed, printed), `ONCELY_KILL_EVENTS`
// (3000), `ONCELY_KILL_KEYS` (50), `ONCELY_KILL_LATE` (late-commit transactions, 300),
// `ONCELY_KILL_KILLS` (at least this many SIGKILLs, 60). Relay logs go to
// `$TMPDIR/oncely-kill-<suffix>/`.

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;

use oncely_testkit::process::ProcessGuard;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely_testkit::{TestBackend, TestDb};
use serde_json::Value;

use super::{env_u64, Rng};

/// What the test knows of each event it committed.
#[derive(Debug, Clone)]
struct Sent {
    key: String,
    id: i64,
    /// Global commit sequence (commits are serialised by [`Producer::commit_lock`], so this
    /// is the order in which they became visible).
    commit_seq: u64,
}

#[derive(Clone)]
struct Producer {
    db: oncely_sql::Database,
    topic: String,
    commit_lock: Arc<tokio::sync::Mutex<()>>,
    commit_seq: Arc<AtomicU64>,
    sent: Arc<Mutex<HashMap<String, Sent>>>,
}

impl Producer {
    /// Enqueues events for `keys` in one transaction, sleeps `hold` before committing.
    async fn commit(&self, keys: &[String], hold: Duration) {
        let mut tx = self.db.begin().await.unwrap();
        let mut pending = Vec::new();
        for key in keys {
            let mid = oncely_core::MessageId::new_random();
            let e = oncely_sql::OutboxEvent::new(
                mid,
                &self.topic,
                key,
                "order.created",
                format!("{{\"k\":\"{key}\"}}").into_bytes(),
            );
            let id = oncely_sql::OutboxStore::enqueue(&mut tx, &e).await.unwrap();
            pending.push((mid.to_string(), key.clone(), id));
        }
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        let _g = self.commit_lock.lock().await;
        tx.commit().await.unwrap();
        let seq = self.commit_seq.fetch_add(1, Ordering::SeqCst);
        let mut sent = self.sent.lock().unwrap();
        for (mid, key, id) in pending {
            sent.insert(
                mid,
                Sent {
                    key,
                    id,
                    commit_seq: seq,
                },
            );
        }
    }
}

/// A relay slot; its process, if one runs, is killed and reaped when the slot drops (a
/// test that fails mid-run leaves no relay behind).
struct Slot {
    child: Option<ProcessGuard>,
    started: u64,
}

impl Slot {
    /// SIGKILLs the slot's relay, if one runs; true when it did. A relay that exited by
    /// itself fails the test.
    fn kill(&mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return false;
        };
        if let Some(status) = c.child.try_wait().unwrap() {
            panic!("relay {} exited by itself: {status:?}", self.started);
        }
        c.child.kill().unwrap();
        c.child.wait().unwrap();
        true
    }
}

fn spawn_relay(
    url: &str,
    nats: &str,
    stream: &str,
    topic: &str,
    extra: &[String],
    log: std::fs::File,
) -> ProcessGuard {
    let mut cmd = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"));
    cmd.args(["relay", "--database-url", url, "--broker", "nats"])
        // Three relays run at once: a pool each of the LISTEN connection, the four
        // batches in flight and one for the loops, not the default 16 (PostgreSQL
        // allows 100 for the whole suite).
        .args(["--db-max-connections", "6"])
        .args([
            "--nats-url",
            nats,
            "--nats-stream",
            stream,
            "--nats-subjects",
            topic,
        ])
        .args(["--relay-batch", "16", "--relay-poll-ms", "50"])
        .args([
            "--relay-backoff-base-ms",
            "50",
            "--relay-backoff-cap-secs",
            "1",
        ])
        .args(extra)
        .env("ONCELY_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::from(log));
    ProcessGuard::spawn(cmd).expect("spawn oncely relay")
}

fn outbox_stats(url: &str) -> Value {
    let out = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
        .args(["outbox", "stats", "--database-url", url])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "outbox stats failed");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `dup_window`: `None` lets the relay create the stream (JetStream's default 2 min duplicate
/// window: the stream must end with exactly one message per event); `Some(w)` creates it
/// first with window `w`, so republished copies stay visible (same id, first arrival in order).
#[allow(
    clippy::too_many_lines,
    reason = "one kill-and-restart scenario shared by two brokers' tests"
)]
async fn killed_relays(extra: &[&str], dup_window: Option<Duration>) {
    let Some(t) = TestDb::new(TestBackend::Postgres).await else {
        return;
    };
    let nats_url = oncely_testkit::nats_url();
    if !oncely_testkit::service_reachable("NATS", &nats_url).await {
        return;
    }
    t.db.migrate().await.unwrap();
    let seed = env_u64("ONCELY_KILL_SEED", oncely_core::now_ms() as u64) | 1;
    let events = env_u64("ONCELY_KILL_EVENTS", 3000);
    let keys_n = env_u64("ONCELY_KILL_KEYS", 50);
    let late_n = env_u64("ONCELY_KILL_LATE", 300);
    let min_kills = env_u64("ONCELY_KILL_KILLS", 60);
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("kill.{suffix}");
    let stream = format!("KILL{suffix}");
    let logs = std::env::temp_dir().join(format!("oncely-kill-{suffix}"));
    std::fs::create_dir_all(&logs).unwrap();
    eprintln!(
        "kill test: seed {seed}, {events} events over {keys_n} keys, {late_n} late commits, \
         extra {extra:?}, url {}, stream {stream}, logs {}",
        t.url,
        logs.display()
    );
    if let Some(w) = dup_window {
        let client = async_nats::connect(&nats_url).await.unwrap();
        async_nats::jetstream::new(client)
            .create_stream(async_nats::jetstream::stream::Config {
                name: stream.clone(),
                subjects: vec![topic.clone()],
                duplicate_window: w,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let keys: Vec<String> = (0..keys_n).map(|k| format!("agg-{k:03}")).collect();
    let producer = Producer {
        db: t.db.clone(),
        topic: topic.clone(),
        commit_lock: Arc::default(),
        commit_seq: Arc::default(),
        sent: Arc::default(),
    };
    // The backlog: `events` events, each key several times, in transactions of 25.
    let mut rng = Rng(seed);
    let backlog: Vec<String> = (0..events)
        .map(|_| keys[rng.below(keys_n) as usize].clone())
        .collect();
    for chunk in backlog.chunks(25) {
        producer.commit(chunk, Duration::ZERO).await;
    }

    // Relays.
    let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
    let mut started = 0u64;
    let start = |started: &mut u64| {
        *started += 1;
        let log = std::fs::File::create(logs.join(format!("relay-{started:04}.log"))).unwrap();
        spawn_relay(&t.url, &nats_url, &stream, &topic, &extra, log)
    };
    let mut slots: Vec<Slot> = (0..3)
        .map(|_| {
            let child = start(&mut started);
            Slot {
                child: Some(child),
                started,
            }
        })
        .collect();

    // Live producers: a steady one and four that hold their transaction open (late commits).
    let live_done = Arc::new(AtomicBool::new(false));
    let mut producers = tokio::task::JoinSet::new();
    {
        let (p, keys, done) = (producer.clone(), keys.clone(), live_done.clone());
        let mut rng = Rng(seed ^ 0x9E37_79B9_7F4A_7C15);
        producers.spawn(async move {
            while !done.load(Ordering::SeqCst) {
                let n = 1 + rng.below(3) as usize;
                let ks: Vec<String> = (0..n)
                    .map(|_| keys[rng.below(keys.len() as u64) as usize].clone())
                    .collect();
                p.commit(&ks, Duration::ZERO).await;
                tokio::time::sleep(Duration::from_millis(5 + rng.below(20))).await;
            }
        });
    }
    let late_left = Arc::new(AtomicU64::new(late_n));
    for w in 0..4u64 {
        let (p, keys, left) = (producer.clone(), keys.clone(), late_left.clone());
        let mut rng = Rng(seed.rotate_left(7 + w as u32) | 1);
        producers.spawn(async move {
            while left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
                .is_ok()
            {
                let key = keys[rng.below(keys.len() as u64) as usize].clone();
                p.commit(&[key], Duration::from_millis(rng.below(800)))
                    .await;
            }
        });
    }

    // Kill loop: SIGKILL a random relay every 50–600 ms, restart it after 0–300 ms (one time in
    // six all three, restarted after 150–500 ms), until
    // the late commits are done, at least `min_kills` kills happened and the outbox drained
    // once; then stop the live producers and let the relays drain without kills.
    let mut kills = 0u64;
    let deadline = Instant::now() + Duration::from_secs(600);
    let store = oncely_sql::OutboxStore::new(t.db.clone());
    loop {
        assert!(Instant::now() < deadline, "no progress within 10 minutes");
        tokio::time::sleep(Duration::from_millis(50 + rng.below(550))).await;
        if rng.below(6) == 0 {
            // All at once, down for longer than a 100 ms duplicate window: whatever they had
            // confirmed and not recorded is republished by the next ones.
            for slot in &mut slots {
                kills += u64::from(slot.kill());
            }
            tokio::time::sleep(Duration::from_millis(150 + rng.below(350))).await;
            for slot in &mut slots {
                slot.child = Some(start(&mut started));
                slot.started = started;
            }
            continue;
        }
        let slot = &mut slots[rng.below(3) as usize];
        kills += u64::from(slot.kill());
        tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
        slot.child = Some(start(&mut started));
        slot.started = started;
        let late_done = late_left.load(Ordering::SeqCst) == 0;
        if late_done && kills >= min_kills {
            break;
        }
    }
    live_done.store(true, Ordering::SeqCst);
    while let Some(r) = producers.join_next().await {
        r.unwrap();
    }
    let drain_deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = store.stats().await.unwrap();
        if s.pending == 0 {
            break;
        }
        assert!(
            Instant::now() < drain_deadline,
            "the relays did not drain the outbox: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Settles in flight finish their commits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for slot in &mut slots {
        slot.kill();
    }
    let stats = outbox_stats(&t.url);
    let sent = producer.sent.lock().unwrap().clone();
    eprintln!(
        "kill test: {} events committed, {kills} kills, {started} relay processes, stats {stats}",
        sent.len()
    );

    // Read the stream.
    let client = async_nats::connect(&nats_url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut s = js.get_stream(&stream).await.unwrap();
    let info = s.info().await.unwrap().state.clone();
    // message id -> stream sequences (first arrival first).
    let mut arrivals: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut wrong_key = Vec::new();
    let mut unknown = Vec::new();
    for seq in info.first_sequence..=info.last_sequence {
        let m = s.get_raw_message(seq).await.unwrap();
        let id = m
            .headers
            .get("Nats-Msg-Id")
            .map(|v| v.as_str().to_owned())
            .expect("message id header");
        let pk = m
            .headers
            .get("partition-key")
            .map(|v| v.as_str().to_owned());
        match sent.get(&id) {
            Some(e) if pk.as_deref() != Some(e.key.as_str()) => {
                wrong_key.push((id.clone(), pk));
            }
            Some(_) => {}
            None => unknown.push(id.clone()),
        }
        arrivals.entry(id).or_default().push(seq);
    }
    let missing: Vec<&String> = sent
        .keys()
        .filter(|id| !arrivals.contains_key(*id))
        .collect();
    let duplicates: Vec<(&String, &Vec<u64>)> =
        arrivals.iter().filter(|(_, seqs)| seqs.len() > 1).collect();

    // Order: per key, for events A, B with A.id < B.id and A committed before B, A's first
    // arrival precedes B's (the relay's guarantee). Pairs whose id order and commit order
    // disagree are only counted (the relay publishes the lower id first when both are
    // visible).
    let mut by_key: HashMap<&str, Vec<(&String, &Sent, u64)>> = HashMap::new();
    for (mid, e) in &sent {
        if let Some(seqs) = arrivals.get(mid) {
            by_key
                .entry(e.key.as_str())
                .or_default()
                .push((mid, e, seqs[0]));
        }
    }
    let mut violations = Vec::new();
    let (mut crossed_pairs, mut crossed_in_commit_order) = (0u64, 0u64);
    for (key, evs) in &by_key {
        for a in evs {
            for b in evs {
                let (ea, eb) = (a.1, b.1);
                if ea.commit_seq < eb.commit_seq && ea.id < eb.id && a.2 > b.2 {
                    violations.push(format!(
                        "{key}: id {} (commit #{}, msg {}) arrived at stream seq {} after id {} \
                         (commit #{}, msg {}) at seq {}",
                        ea.id, ea.commit_seq, a.0, a.2, eb.id, eb.commit_seq, b.0, b.2
                    ));
                }
                if ea.commit_seq < eb.commit_seq && ea.id > eb.id {
                    crossed_pairs += 1;
                    if a.2 < b.2 {
                        crossed_in_commit_order += 1;
                    }
                }
            }
        }
    }
    eprintln!(
        "kill test: stream {} messages (seq {}..={}), {} distinct ids, {} duplicates (same id), \
         {} missing, {} unknown, {} wrong partition-key headers, {} order violations; \
         {crossed_pairs} same-key pairs committed against id order, {crossed_in_commit_order} of \
         them arrived in commit order",
        info.messages,
        info.first_sequence,
        info.last_sequence,
        arrivals.len(),
        duplicates.len(),
        missing.len(),
        unknown.len(),
        wrong_key.len(),
        violations.len()
    );
    for v in violations.iter().take(20) {
        eprintln!("ORDER VIOLATION {v}");
    }
    assert!(missing.is_empty(), "events never published: {missing:?}");
    assert!(unknown.is_empty(), "messages nobody sent: {unknown:?}");
    assert!(wrong_key.is_empty(), "wrong partition-key: {wrong_key:?}");
    assert!(
        violations.is_empty(),
        "{} order violations",
        violations.len()
    );
    if dup_window.is_none() {
        assert!(
            duplicates.is_empty(),
            "copies inside the duplicate window reached the stream: {duplicates:?}"
        );
    }
    assert_eq!(
        (stats["pending"].as_u64(), stats["dead"].as_u64()),
        (Some(0), Some(0)),
        "{stats}"
    );
    if extra.iter().any(|a| a == "--outbox-retention-secs") {
        // Each event recorded once in the published table, none missing.
        let pool = t.db.as_postgres().expect("postgres");
        let ids: Vec<String> = sqlx::query_scalar("SELECT message_id FROM oncely_outbox_published")
            .fetch_all(pool)
            .await
            .unwrap();
        let recorded: std::collections::HashSet<&String> = ids.iter().collect();
        assert_eq!(ids.len(), recorded.len());
        let not_recorded: Vec<&String> = sent.keys().filter(|id| !recorded.contains(id)).collect();
        assert!(
            not_recorded.is_empty() && ids.len() == sent.len(),
            "{} published rows for {} events; not recorded: {not_recorded:?}",
            ids.len(),
            sent.len()
        );
    }
    drop(js.delete_stream(&stream).await);
    drop(std::fs::remove_dir_all(&logs));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_relay_processes_sigkilled_at_random_lose_no_event_and_keep_each_partitions_order()
{
    killed_relays(&[], None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_relay_processes_sigkilled_at_random_while_vacuuming_and_keeping_published_rows() {
    // A 100 ms duplicate window (JetStream's minimum): copies republished after a kill reach the stream, and their
    // first arrivals still have to be in order.
    killed_relays(
        &[
            "--outbox-vacuum-after-rows",
            "100",
            "--outbox-retention-secs",
            "3600",
        ],
        Some(Duration::from_millis(100)),
    )
    .await;
}
