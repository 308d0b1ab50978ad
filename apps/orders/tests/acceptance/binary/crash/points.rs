//! The failpoints, read from the code: every `fail_point!("name")` in the workspace's
//! sources must have a crash test in [`super::SCENARIOS`], and every point a scenario
//! names must still exist. A new await point that gets a failpoint without a test (or a
//! test whose point was removed) fails here.

use std::collections::BTreeSet;
use std::path::Path;

/// The workspace root (two levels above this crate).
fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(Path::parent)
        .expect("apps/orders sits two levels below the workspace")
}

/// Every point named in non-comment lines of `src/` of every crate and app.
fn points_in_code() -> BTreeSet<String> {
    let mut points = BTreeSet::new();
    for group in ["crates", "apps"] {
        for krate in std::fs::read_dir(workspace().join(group)).unwrap() {
            scan(&krate.unwrap().path().join("src"), &mut points);
        }
    }
    points
}

fn scan(dir: &Path, points: &mut BTreeSet<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            scan(&path, points);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            // Comment lines dropped; the rest joined, so a call rustfmt broke after
            // `fail_point!(` is read as one.
            let code: String = text
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let mut rest = code.as_str();
            while let Some(at) = rest.find("fail_point!(") {
                rest = rest[at + "fail_point!(".len()..].trim_start();
                let name = rest
                    .strip_prefix('"')
                    .expect("a point named by a string literal");
                let end = name.find('"').expect("a closed point name");
                points.insert(name[..end].to_owned());
                rest = &name[end..];
            }
        }
    }
}

/// The generated list of points matches the crash tests one for one.
#[test]
fn every_failpoint_in_the_code_has_a_crash_test_and_every_crash_test_a_point() {
    let code = points_in_code();
    let tested: BTreeSet<String> = super::SCENARIOS
        .iter()
        .flat_map(|s| s.points.iter().map(|p| (*p).to_owned()))
        .collect();
    let untested: Vec<&String> = code.difference(&tested).collect();
    let stale: Vec<&String> = tested.difference(&code).collect();
    assert!(
        untested.is_empty() && stale.is_empty(),
        "failpoints without a crash test: {untested:?}; crash tests of points not in the code: {stale:?}"
    );
    // The scan itself works: the request path's points are there.
    assert!(code.contains("request.after_commit"), "{code:?}");
    eprintln!(
        "{} failpoints, each with a crash test on 3 backends: {code:?}",
        code.len()
    );
}
