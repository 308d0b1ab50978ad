//! The documentation's relative links resolve: every `[text](target)` (and `[label]: target`
//! definition) in `README.md` and `docs/**/*.md` that is not a URL names a file or directory
//! of the repository, and a `#fragment` into a Markdown file names one of its headings (the
//! id GitHub and mdBook give it). Code blocks and code spans are not links. Every Markdown
//! file under `docs/` is a chapter of the book: `docs/SUMMARY.md` links it.
//!
//! It lives in oncely-core's test binary because that crate builds first and cheapest; it
//! reads the repository from `CARGO_MANIFEST_DIR/../..`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The repository's root: two levels above this crate.
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root exists")
}

/// `README.md` and every `.md` file under `docs/`, sorted.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut found = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).expect("docs/ is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The lines of `text` outside fenced code blocks, with their 1-based numbers and code spans
/// blanked out.
fn prose_lines(text: &str) -> Vec<(usize, String)> {
    let mut fence = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            continue;
        }
        if !fence {
            out.push((i + 1, without_code_spans(line)));
        }
    }
    out
}

/// `line` with everything between a pair of backticks removed.
fn without_code_spans(line: &str) -> String {
    line.split('`').step_by(2).collect::<Vec<_>>().join("")
}

/// The targets of inline links and images (`](target)`, an optional `"title"` dropped) and
/// of reference definitions (`[label]: target`) on one line.
fn link_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        let target = after[..end].split_whitespace().next().unwrap_or("");
        targets.push(target.trim_matches(['<', '>']).to_owned());
        rest = &after[end..];
    }
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') {
        if let Some((label, target)) = trimmed.split_once("]:") {
            if !label.contains("](") {
                if let Some(t) = target.split_whitespace().next() {
                    targets.push(t.to_owned());
                }
            }
        }
    }
    targets
}

/// The id GitHub and mdBook give a heading: lower case, letters, digits, `-` and `_` kept,
/// spaces turned into `-`, everything else dropped.
fn heading_id(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The ids of a Markdown text's headings; a repeated heading's later ids get `-1`, `-2`, ….
fn heading_ids(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut ids = BTreeSet::new();
    let mut fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            continue;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if fence || !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let id = heading_id(&line[hashes..]);
        let n = seen.entry(id.clone()).or_insert(0);
        ids.insert(if *n == 0 {
            id.clone()
        } else {
            format!("{id}-{n}")
        });
        *n += 1;
    }
    ids
}

/// Whether `target` leaves the repository: a URL (`https:`, `mailto:`, …).
fn is_external(target: &str) -> bool {
    target.split_once(':').is_some_and(|(scheme, _)| {
        !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphabetic())
    })
}

/// Every broken relative link of the given documents, as `file:line: target (why)`.
fn broken_links(root: &Path, docs: &[PathBuf]) -> Vec<String> {
    let mut broken = Vec::new();
    for doc in docs {
        let text = fs::read_to_string(doc).expect("a readable document");
        let shown = doc.strip_prefix(root).unwrap_or(doc).display().to_string();
        for (n, line) in prose_lines(&text) {
            for target in link_targets(&line) {
                if target.is_empty() || is_external(&target) {
                    continue;
                }
                let (path, fragment) = target.split_once('#').unwrap_or((&target, ""));
                let file = if path.is_empty() {
                    doc.clone()
                } else {
                    doc.parent().expect("a document's directory").join(path)
                };
                if !file.exists() {
                    broken.push(format!("{shown}:{n}: {target} (no such file)"));
                } else if !fragment.is_empty() && file.extension().is_some_and(|e| e == "md") {
                    let ids = heading_ids(&fs::read_to_string(&file).unwrap_or_default());
                    if !ids.contains(fragment) {
                        broken.push(format!("{shown}:{n}: {target} (no such heading)"));
                    }
                }
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_in_readme_and_docs_resolves() {
    let root = repo_root();
    let docs = documents(&root);
    assert!(
        docs.iter().any(|d| d.ends_with("docs/SUMMARY.md")),
        "docs/SUMMARY.md, the book's table of contents, is missing"
    );
    let broken = broken_links(&root, &docs);
    assert!(
        broken.is_empty(),
        "{} broken links:\n{}",
        broken.len(),
        broken.join("\n")
    );
}

#[test]
fn every_chapter_in_docs_is_in_the_books_table_of_contents() {
    let root = repo_root();
    let docs = root.join("docs");
    let summary = fs::read_to_string(docs.join("SUMMARY.md")).expect("docs/SUMMARY.md");
    let listed: BTreeSet<String> = prose_lines(&summary)
        .iter()
        .flat_map(|(_, line)| link_targets(line))
        .collect();
    let missing: Vec<String> = documents(&root)
        .iter()
        .filter_map(|d| d.strip_prefix(&docs).ok())
        .map(|d| d.display().to_string())
        .filter(|d| d != "SUMMARY.md" && !listed.contains(d))
        .collect();
    assert!(missing.is_empty(), "not in docs/SUMMARY.md: {missing:?}");
}

#[test]
fn a_link_to_a_missing_file_or_heading_is_reported() {
    let dir = tempdir();
    fs::write(dir.join("a.md"), "# Title\n\n## Second part: `x`\n").unwrap();
    fs::write(
        dir.join("b.md"),
        "[ok](a.md) [ok](a.md#second-part-x) [ok](https://example.org) [ok](#here)\n\
         # Here\n`[no](code-span.md)`\n```\n[no](fenced.md)\n```\n\
         [gone](missing.md) [gone](a.md#nowhere)\n[ref]: missing-too.md\n",
    )
    .unwrap();
    let broken = broken_links(&dir, &[dir.join("b.md")]);
    assert_eq!(
        broken,
        [
            "b.md:7: missing.md (no such file)",
            "b.md:7: a.md#nowhere (no such heading)",
            "b.md:8: missing-too.md (no such file)",
        ],
    );
    fs::remove_dir_all(&dir).unwrap();
}

/// A fresh directory under the system's temporary directory.
fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "oncely-docs-links-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    fs::create_dir_all(&dir).unwrap();
    dir
}
