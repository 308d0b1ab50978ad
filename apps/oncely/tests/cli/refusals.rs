//! Bad configuration refused at start, in words (issue 29 §6): a relay pool too small for
//! the relay (a usage error, exit status 2) and a simulator's port in use.

use std::process::Stdio;
use std::time::Duration;

use oncely_testkit::process::SpawnTied as _;

use super::Proc;

/// Runs `oncely args…` to its exit (at most 30 s); its exit code and stderr.
async fn oncely(args: &[&str]) -> (Option<i32>, String) {
    let child = oncely_testkit::process::command(env!("CARGO_BIN_EXE_oncely"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn_tied()
        .unwrap();
    let mut p = Proc { child };
    let mut status = None;
    for _ in 0..300 {
        status = p.child.try_wait().unwrap();
        if status.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = status.expect("oncely did not exit within 30 s");
    let mut stderr = String::new();
    std::io::Read::read_to_string(p.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    (status.code(), stderr)
}

#[tokio::test]
async fn relay_refuses_a_pool_too_small_for_it_naming_the_flag_and_the_minimum() {
    // Nothing listens there: a relay that passed the check would fail to connect (status 1).
    let url = "postgres://postgres@127.0.0.1:1/none";
    let (code, err) = oncely(&["relay", "--database-url", url, "--db-max-connections", "2"]).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(
            "--db-max-connections 2 is too small: the relay holds up to 3 connections at \
             once; give it at least 3"
        ),
        "{err}"
    );
    let (code, err) = oncely(&["relay", "--database-url", url, "--db-max-connections", "3"]).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(!err.contains("too small"), "{err}");
}

#[tokio::test]
async fn sim_on_a_port_in_use_names_the_port_and_the_listen_flag() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    for api in ["payments", "shipping"] {
        let (code, err) = oncely(&["sim", api, "--listen", &addr.to_string()]).await;
        assert_eq!(code, Some(1), "{err}");
        assert!(
            err.contains(&format!("port {} is in use; pass --listen", addr.port())),
            "{err}"
        );
    }
}
