//! `orders dev`: the whole system from one command. Its banner's shell commands, run as a
//! user pastes them, reach a replayed retry, a fault resolved by a status check, a
//! compensated saga and the console's page of that order; a port in use stops it in words.

use std::io::{BufRead as _, BufReader};
use std::process::Stdio;
use std::time::Duration;

use oncely_testkit::process::SpawnTied as _;
use serde_json::Value;

use super::{run_to_exit, Proc, ORDERS};

/// The banner of a started `orders dev`: its export line, and each thing to try's commands
/// in order (the lines indented by four spaces under `N. …`).
#[derive(Debug)]
struct Banner {
    api: String,
    admin_token: String,
    export: String,
    tries: Vec<Vec<String>>,
}

impl Banner {
    /// Reads stdout up to the fifth thing to try's command.
    fn read(lines: &mut impl Iterator<Item = String>) -> Self {
        let mut banner = Self {
            api: String::new(),
            admin_token: String::new(),
            export: String::new(),
            tries: Vec::new(),
        };
        let mut text = String::new();
        for line in lines.by_ref() {
            text.push_str(&line);
            text.push('\n');
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["API", api, ..] => (*api).clone_into(&mut banner.api),
                ["Console", _, "admin", "token", token] => {
                    (*token).clone_into(&mut banner.admin_token);
                }
                ["export", ..] => line.trim().clone_into(&mut banner.export),
                [n, ..] if n.ends_with('.') && n[..n.len() - 1].parse::<u8>().is_ok() => {
                    banner.tries.push(Vec::new());
                }
                _ if line.starts_with("    ") && !banner.tries.is_empty() => {
                    let cmd = line.trim().to_owned();
                    banner.tries.last_mut().unwrap().push(cmd);
                    if banner.tries.len() == 5 {
                        break;
                    }
                }
                _ => {}
            }
        }
        assert!(
            !banner.api.is_empty() && !banner.admin_token.is_empty() && !banner.export.is_empty(),
            "banner incomplete:\n{text}"
        );
        assert_eq!(banner.tries.len(), 5, "five things to try:\n{text}");
        banner
    }

    /// Runs `command` in `bash` after the export line, with `ID` set to `id`; its stdout and
    /// stderr together.
    fn run(&self, command: &str, id: &str) -> String {
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!("{}\n{command}", self.export))
            .env("ID", id)
            .output()
            .expect("bash");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{command}\n{text}");
        text
    }

    /// Runs the `show` command until its JSON satisfies `done` (at most 30 s); that JSON.
    async fn until(&self, show: &str, id: &str, done: impl Fn(&Value) -> bool) -> Value {
        for _ in 0..300 {
            let v: Value = serde_json::from_str(self.run(show, id).trim()).unwrap_or_default();
            if done(&v) {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{show} never reached the state: {}", self.run(show, id));
    }
}

/// The order id in an answer: its first UUID.
fn first_uuid(text: &str) -> String {
    text.split(|c: char| !(c.is_ascii_hexdigit() || c == '-'))
        .find(|w| w.len() == 36 && uuid::Uuid::parse_str(w).is_ok())
        .unwrap_or_else(|| panic!("no id in {text}"))
        .to_owned()
}

/// `true` when `v`'s saga log has step `name` in `phase` succeeded.
fn step_succeeded(v: &Value, name: &str, phase: &str) -> bool {
    v["fulfilment"]["steps"].as_array().is_some_and(|steps| {
        steps
            .iter()
            .any(|s| s["name"] == name && s["phase"] == phase && s["state"] == "succeeded")
    })
}

/// Starts `orders dev` on a free port in a fresh directory, runs its five things to try as
/// printed, and checks what each says it shows.
#[tokio::test]
async fn dev_banner_commands_replay_a_retry_resolve_a_fault_by_status_check_and_compensate_a_saga()
{
    let dir = tempfile::tempdir().unwrap();
    let mut child = oncely_testkit::process::command(ORDERS)
        .args(["dev", "--listen", "127.0.0.1:0"])
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn_tied()
        .expect("spawn orders dev");
    let stdout = child.stdout.take().unwrap();
    let _proc = Proc {
        child,
        base: String::new(),
    };
    let b = tokio::task::spawn_blocking(move || {
        let mut lines = BufReader::new(stdout).lines().map_while(Result::ok);
        let banner = Banner::read(&mut lines);
        std::thread::spawn(move || for _ in lines {});
        banner
    })
    .await
    .unwrap();
    assert!(
        dir.path().join("oncely-dev.db").exists(),
        "the fresh SQLite file"
    );

    // 1, 2: an order, then the same request replayed.
    let first = b.run(&b.tries[0][0], "");
    assert!(first.starts_with("HTTP/1.1 201"), "{first}");
    assert!(!first.to_ascii_lowercase().contains("idempotent-replayed"));
    let again = b.run(&b.tries[1][0], "");
    assert!(again.starts_with("HTTP/1.1 201"), "{again}");
    assert!(
        again
            .to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{again}"
    );
    assert_eq!(first_uuid(&again), first_uuid(&first), "one order");

    // 3: a fault at the payments simulator, then an order whose charge a status check
    // resolves.
    let [fault, create, show, effects] = b.tries[2].as_slice() else {
        panic!("{:?}", b.tries[2]);
    };
    // The first order's charge first, so the one-shot fault cannot fall on it.
    b.until(show, &first_uuid(&first), |v| v["status"] == "fulfilled")
        .await;
    b.run(fault, "");
    let id = first_uuid(&b.run(create, ""));
    let got = b.until(show, &id, |v| v["status"] == "fulfilled").await;
    assert!(step_succeeded(&got, "charge", "forward"), "{got}");
    let oncely = super::oncely_bin().display().to_string();
    let effects = b.run(
        &effects.replace("cargo run --release -q -p oncely --", &oncely),
        "",
    );
    let charge = effects
        .lines()
        .find(|l| l.contains(&format!("{id}:charge")))
        .unwrap_or_else(|| panic!("no charge of {id}:\n{effects}"));
    let columns: Vec<&str> = charge.split('\t').collect();
    assert_eq!(
        (columns[4], columns[5], columns[6]),
        ("succeeded", "1", "1"),
        "one call, then one status check:\n{effects}"
    );
    let pay = b.export.split("PAY=").nth(1).unwrap().trim();
    let stats: Value = reqwest::get(format!("{pay}/_sim/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["faults_injected"]["drop_after"], 1, "{stats}");
    assert_eq!(stats["payment_intents"], 2, "one charge per order: {stats}");

    // 4: a saga compensated — the refused shipment refunds the charge.
    let [create, show] = b.tries[3].as_slice() else {
        panic!("{:?}", b.tries[3]);
    };
    let id = first_uuid(&b.run(create, ""));
    let got = b.until(show, &id, |v| v["status"] == "rejected").await;
    assert!(step_succeeded(&got, "charge", "compensate"), "{got}");
    assert!(step_succeeded(&got, "reserve", "compensate"), "{got}");

    // 5: the console's page of that order, signed in with the printed admin token.
    let url = b.run(&b.tries[4][0], &id).trim().to_owned();
    assert_eq!(url, format!("{}/console/orders/{id}", b.api));
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let signed_in = client
        .post(format!("{}/console/login", b.api))
        .form(&[("token", b.admin_token.as_str()), ("name", "dev-test")])
        .send()
        .await
        .unwrap();
    assert_eq!(signed_in.status(), 303, "signed in with the printed token");
    let cookie = signed_in.headers()["set-cookie"].to_str().unwrap();
    let cookie = cookie.split(';').next().unwrap().to_owned();
    let page = client
        .get(&url)
        .header("cookie", cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains(&id));
}

/// A port already taken stops `orders dev` at once, with the port and the flag that
/// changes it.
#[tokio::test]
async fn dev_on_a_port_in_use_names_the_port_and_the_listen_flag() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (status, stderr) = run_to_exit(
        oncely_testkit::process::command(ORDERS)
            .args(["dev", "--listen", &addr.to_string()])
            .current_dir(dir.path()),
    )
    .await;
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("port {} is in use; pass --listen", addr.port())),
        "{stderr}"
    );
}
