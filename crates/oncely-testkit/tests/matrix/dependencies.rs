//! Which way the workspace's dependencies point (issue 27; docs/ARCHITECTURE.md "The
//! crates"): no library depends on an app, not even in its tests, and the operator tool
//! `oncely` depends on no app at all.
//!
//! Read from the manifests as text: a dependency is a `name = …` (or `name.workspace = …`)
//! line under a `[*dependencies]` table, or a `[dependencies.name]` table header. A library
//! is a crate with a `src/lib.rs`; an app is a crate under `apps/`. Only what the manifests
//! say is read: a dependency pulled in through another crate is that crate's own line.

use std::fs;
use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The crates directly below `parent` (`crates`, `apps`, `examples`), as (dir, package name).
fn crates_under(parent: &str) -> Vec<(PathBuf, String)> {
    let Ok(entries) = fs::read_dir(workspace_root().join(parent)) else {
        return Vec::new();
    };
    let mut out: Vec<(PathBuf, String)> = entries
        .flatten()
        .map(|e| e.path())
        .filter_map(|dir| {
            let manifest = fs::read_to_string(dir.join("Cargo.toml")).ok()?;
            Some((dir, package_name(&manifest)?))
        })
        .collect();
    out.sort();
    out
}

fn package_name(manifest: &str) -> Option<String> {
    let mut in_package = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if in_package {
            if let Some(rest) = line.strip_prefix("name") {
                let value = rest.trim_start().strip_prefix('=')?.trim();
                return Some(value.trim_matches('"').to_owned());
            }
        }
    }
    None
}

/// Every dependency a manifest names, with the table it is under
/// (`dependencies`, `dev-dependencies`, `build-dependencies`, or a target's).
fn dependencies(manifest: &str) -> Vec<(String, String)> {
    let mut table = String::new();
    let mut out = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            header.trim().clone_into(&mut table);
            // `[dependencies.foo]`
            if let Some((kind, name)) = table.rsplit_once('.') {
                if kind.ends_with("dependencies") {
                    out.push((kind.to_owned(), name.trim_matches('"').to_owned()));
                }
            }
            continue;
        }
        if !table.ends_with("dependencies") || line.starts_with('#') || line.is_empty() {
            continue;
        }
        let key = line.split(['=', '.']).next().unwrap_or("").trim();
        if !key.is_empty() {
            out.push((table.clone(), key.trim_matches('"').to_owned()));
        }
    }
    out
}

#[test]
fn no_library_depends_on_an_app() {
    let apps: Vec<String> = crates_under("apps").into_iter().map(|(_, n)| n).collect();
    assert!(
        !apps.is_empty(),
        "no app found under apps/: the check reads nothing"
    );
    let mut wrong = Vec::new();
    let mut libraries = 0;
    for parent in ["crates", "apps"] {
        for (dir, name) in crates_under(parent) {
            if !dir.join("src/lib.rs").is_file() {
                continue;
            }
            libraries += 1;
            let manifest = fs::read_to_string(dir.join("Cargo.toml")).expect("manifest");
            for (table, dep) in dependencies(&manifest) {
                if apps.contains(&dep) && parent == "crates" {
                    wrong.push(format!("{name} [{table}] {dep}"));
                }
            }
        }
    }
    assert!(
        libraries >= 10,
        "found only {libraries} libraries: the check reads nothing"
    );
    assert!(
        wrong.is_empty(),
        "libraries that depend on an app:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_manifest_reader_finds_each_kind_of_dependency_line() {
    let manifest = "[package]\nname = \"x\"\n[dependencies]\na = \"1\"\nb.workspace = true\n\
                    # c = 1\n[dev-dependencies]\nd = { path = \"../d\" }\n\
                    [target.'cfg(unix)'.dependencies]\ne = \"1\"\n[dependencies.f]\nversion = \"1\"\n\
                    [features]\ng = []\n";
    assert_eq!(package_name(manifest).as_deref(), Some("x"));
    let names: Vec<String> = dependencies(manifest).into_iter().map(|(_, n)| n).collect();
    assert_eq!(names, ["a", "b", "d", "e", "f"]);
}
