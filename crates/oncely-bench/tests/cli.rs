//! `oncely-bench` keeps the subcommands and flags of the former `oncely bench …`.

fn help(args: &[&str]) -> String {
    let out = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely-bench"))
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn oncely_bench_offers_the_intake_relay_and_inbox_benchmarks_with_their_flags() {
    let top = help(&[]);
    for sub in ["intake", "relay", "inbox"] {
        assert!(top.contains(sub), "{top}");
    }
    let intake = help(&["intake"]);
    for flag in ["--database-url", "--seconds", "--concurrency", "--rounds"] {
        assert!(intake.contains(flag), "intake lacks {flag}: {intake}");
    }
    let relay = help(&["relay"]);
    for flag in [
        "--database-url",
        "--amqp-url",
        "--nats-url",
        "--kafka-brokers",
        "--events",
        "--window",
        "--rate",
        "--brokers",
        "--rounds",
        "--in-flight-batches",
        "--retention-secs",
    ] {
        assert!(relay.contains(flag), "relay lacks {flag}: {relay}");
    }
    let inbox = help(&["inbox"]);
    for flag in ["--database-url", "--messages", "--concurrency", "--batch"] {
        assert!(inbox.contains(flag), "inbox lacks {flag}: {inbox}");
    }
    let gateway = help(&["gateway"]);
    for flag in ["--database-url", "--seconds", "--concurrency", "--rounds"] {
        assert!(gateway.contains(flag), "gateway lacks {flag}: {gateway}");
    }
}

#[test]
fn oncely_bench_offers_the_year_benchmark_with_its_flags() {
    let top = help(&[]);
    assert!(top.contains("year"), "{top}");
    let year = help(&["year"]);
    for flag in [
        "--database-url",
        "--seconds",
        "--concurrency",
        "--rounds",
        "--records",
        "--expired",
        "--sweep-batch",
        "--chunk",
    ] {
        assert!(year.contains(flag), "year lacks {flag}: {year}");
    }
}

#[test]
fn oncely_bench_offers_the_whole_chain_with_its_broker_and_scale_flags() {
    assert!(help(&[]).contains("chain"));
    let chain = help(&["chain"]);
    for flag in [
        "--database-url",
        "--broker",
        "--seconds",
        "--rounds",
        "--concurrency",
        "--serves",
        "--relays",
        "--pool",
    ] {
        assert!(chain.contains(flag), "chain lacks {flag}: {chain}");
    }
}
