//! The workspace's shape, checked from its sources (issue 27, "One concept in one place"):
//! no non-test source file over 800 lines, and no import circle between the modules of one
//! crate.
//!
//! The circle check reads every `.rs` file under each crate's `src/`, one module per file
//! (`lib.rs`/`main.rs` is the crate root, `a/mod.rs` and `a.rs` are `a`, `a/b.rs` is
//! `a::b`). An edge runs from a file's module to every module one of its paths names:
//! `use` trees (braces expanded) and paths in code, starting with `crate::`, `super::`,
//! `self::` or the name of a child module, each resolved to the longest known module prefix.
//! Edges to the module's own ancestors (a child using its parent, `use super::*`) are left
//! out: a parent holding what its children share is the intended shape. Any strongly
//! connected set of two or more modules is a circle, printed with its edges.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Files longer than this many lines fail the size check.
const MAX_LINES: usize = 800;

/// The folders, under the workspace root, whose crates are checked.
const CRATE_PARENTS: [&str; 3] = ["crates", "apps", "examples"];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn relative(path: &Path) -> String {
    let root = workspace_root();
    path.strip_prefix(&root)
        .unwrap_or(path)
        .display()
        .to_string()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn crate_dirs() -> Vec<PathBuf> {
    let root = workspace_root();
    let mut dirs = Vec::new();
    for parent in CRATE_PARENTS {
        let Ok(entries) = fs::read_dir(root.join(parent)) else {
            continue;
        };
        dirs.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
    }
    dirs.sort();
    dirs
}

#[test]
fn no_non_test_source_file_is_over_800_lines() {
    let mut too_long = Vec::new();
    for dir in crate_dirs() {
        let mut files = Vec::new();
        for sub in ["src", "benches", "build.rs"] {
            let path = dir.join(sub);
            if path.is_file() {
                files.push(path);
            } else {
                rust_files(&path, &mut files);
            }
        }
        for file in files {
            let lines = fs::read_to_string(&file).expect("source").lines().count();
            if lines > MAX_LINES {
                too_long.push(format!("{lines:>6} {}", relative(&file)));
            }
        }
    }
    assert!(
        too_long.is_empty(),
        "non-test source files over {MAX_LINES} lines:\n{}",
        too_long.join("\n")
    );
}

#[test]
fn no_two_modules_of_one_crate_import_each_other() {
    let mut report = Vec::new();
    for dir in crate_dirs() {
        let graph = ModuleGraph::read(&dir.join("src"));
        for circle in graph.circles() {
            report.push(format!("{}:\n{}", relative(&dir), graph.describe(&circle)));
        }
    }
    assert!(report.is_empty(), "import circles:\n{}", report.join("\n"));
}

/// A module's path inside its crate, `[]` for the root.
type ModPath = Vec<String>;

/// One crate's modules (one per file) and the edges between them.
struct ModuleGraph {
    modules: BTreeSet<ModPath>,
    edges: BTreeMap<ModPath, BTreeSet<ModPath>>,
}

fn module_of(src: &Path, file: &Path) -> Option<ModPath> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    let last = parts.pop()?;
    match last.as_str() {
        "mod.rs" => {}
        "lib.rs" | "main.rs" if parts.is_empty() => {}
        _ => parts.push(last.trim_end_matches(".rs").to_owned()),
    }
    Some(parts)
}

fn show(path: &ModPath) -> String {
    if path.is_empty() {
        "crate".to_owned()
    } else {
        path.join("::")
    }
}

impl ModuleGraph {
    fn read(src: &Path) -> Self {
        let mut files = Vec::new();
        rust_files(src, &mut files);
        let sources: Vec<(ModPath, String)> = files
            .iter()
            .filter_map(|f| Some((module_of(src, f)?, fs::read_to_string(f).ok()?)))
            .collect();
        let modules: BTreeSet<ModPath> = sources.iter().map(|(m, _)| m.clone()).collect();
        let mut edges: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
        for (module, text) in &sources {
            let targets = edges.entry(module.clone()).or_default();
            for path in paths_in(&lex(text)) {
                if let Some(target) = resolve(&modules, module, &path) {
                    let ancestor = target.len() <= module.len() && module.starts_with(&target);
                    if !ancestor {
                        targets.insert(target);
                    }
                }
            }
        }
        Self { modules, edges }
    }

    /// Strongly connected sets of two or more modules (Tarjan).
    fn circles(&self) -> Vec<Vec<ModPath>> {
        let mut tarjan = Tarjan::default();
        for module in &self.modules {
            if !tarjan.index.contains_key(module) {
                tarjan.visit(self, module);
            }
        }
        tarjan.components.retain(|c| c.len() > 1);
        tarjan.components
    }

    fn describe(&self, circle: &[ModPath]) -> String {
        let members: BTreeSet<&ModPath> = circle.iter().collect();
        let mut lines = Vec::new();
        for from in &members {
            for to in self.edges.get(*from).into_iter().flatten() {
                if members.contains(to) {
                    lines.push(format!("  {} -> {}", show(from), show(to)));
                }
            }
        }
        lines.join("\n")
    }
}

#[derive(Default)]
struct Tarjan {
    index: BTreeMap<ModPath, usize>,
    low: BTreeMap<ModPath, usize>,
    stack: Vec<ModPath>,
    on_stack: BTreeSet<ModPath>,
    components: Vec<Vec<ModPath>>,
}

impl Tarjan {
    fn visit(&mut self, graph: &ModuleGraph, module: &ModPath) {
        let n = self.index.len();
        self.index.insert(module.clone(), n);
        self.low.insert(module.clone(), n);
        self.stack.push(module.clone());
        self.on_stack.insert(module.clone());
        for next in graph.edges.get(module).into_iter().flatten() {
            if !self.index.contains_key(next) {
                self.visit(graph, next);
                let low = self.low[module].min(self.low[next]);
                self.low.insert(module.clone(), low);
            } else if self.on_stack.contains(next) {
                let low = self.low[module].min(self.index[next]);
                self.low.insert(module.clone(), low);
            }
        }
        if self.low[module] == self.index[module] {
            let mut component = Vec::new();
            while let Some(top) = self.stack.pop() {
                self.on_stack.remove(&top);
                let done = &top == module;
                component.push(top);
                if done {
                    break;
                }
            }
            self.components.push(component);
        }
    }
}

/// Resolves a path as written in `module` to the longest known module it names.
fn resolve(modules: &BTreeSet<ModPath>, module: &ModPath, path: &[String]) -> Option<ModPath> {
    let mut base: ModPath;
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base = Vec::new();
            rest = &rest[1..];
        }
        Some("self") => {
            base = module.clone();
            rest = &rest[1..];
        }
        Some("super") => {
            base = module.clone();
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        Some(first) => {
            let mut child = module.clone();
            child.push(first.to_owned());
            if !modules.contains(&child) {
                return None;
            }
            base = module.clone();
        }
        None => return None,
    }
    let mut found = base.clone();
    for segment in rest {
        base.push(segment.clone());
        if modules.contains(&base) {
            found.clone_from(&base);
        } else {
            break;
        }
    }
    Some(found)
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    PathSep,
    Punct(char),
}

/// Rust tokens enough for paths: comments, strings and char literals are dropped.
fn lex(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i = skip_block_comment(&chars, i);
        } else if c == '"' {
            i = skip_string(&chars, i + 1);
        } else if c == 'r' && (next == Some('#') || next == Some('"')) && raw_string_at(&chars, i) {
            i = skip_raw_string(&chars, i + 1);
        } else if c == 'b' && next == Some('"') {
            i = skip_string(&chars, i + 2);
        } else if c == '\'' {
            i = skip_quote(&chars, i);
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            tokens.push(Token::Ident(chars[start..i].iter().collect()));
        } else if c == ':' && next == Some(':') {
            tokens.push(Token::PathSep);
            i += 2;
        } else {
            if !c.is_whitespace() {
                tokens.push(Token::Punct(c));
            }
            i += 1;
        }
    }
    tokens
}

fn raw_string_at(chars: &[char], i: usize) -> bool {
    let before_ok = i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
    let mut j = i + 1;
    while chars.get(j) == Some(&'#') {
        j += 1;
    }
    before_ok && chars.get(j) == Some(&'"')
}

fn skip_block_comment(chars: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i < chars.len() {
        if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
            depth += 1;
            i += 2;
        } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// From just after the opening quote to just after the closing one.
fn skip_string(chars: &[char], mut i: usize) -> usize {
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// From just after the `r` to just after the closing quote and hashes.
fn skip_raw_string(chars: &[char], mut i: usize) -> usize {
    let mut hashes = 0;
    while chars.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    i += 1;
    while i < chars.len() {
        if chars[i] == '"' && (1..=hashes).all(|h| chars.get(i + h) == Some(&'#')) {
            return i + 1 + hashes;
        }
        i += 1;
    }
    i
}

/// A char literal (`'a'`, `'\n'`, `'\u{..}'`) or a lifetime (`'a`).
fn skip_quote(chars: &[char], i: usize) -> usize {
    if chars.get(i + 1) == Some(&'\\') {
        let mut j = i + 2;
        while j < chars.len() && chars[j] != '\'' {
            j += 1;
        }
        return j + 1;
    }
    if chars.get(i + 2) == Some(&'\'') {
        return i + 3;
    }
    let mut j = i + 1;
    while j < chars.len() && (chars[j].is_alphanumeric() || chars[j] == '_') {
        j += 1;
    }
    j
}

/// Every path in the tokens: `use` trees expanded, and `a::b::c` paths in code.
fn paths_in(tokens: &[Token]) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] == Token::Ident("use".to_owned()) {
            i = use_tree(tokens, i + 1, &[], &mut paths);
            continue;
        }
        let starts_path = matches!(tokens[i], Token::Ident(_))
            && (i == 0 || tokens[i - 1] != Token::PathSep)
            && tokens.get(i + 1) == Some(&Token::PathSep);
        if starts_path {
            let mut path = Vec::new();
            while let Some(Token::Ident(name)) = tokens.get(i) {
                path.push(name.clone());
                if tokens.get(i + 1) == Some(&Token::PathSep) {
                    i += 2;
                } else {
                    break;
                }
            }
            paths.push(path);
        }
        i += 1;
    }
    paths
}

/// Reads one use tree from `i` under `prefix`, pushing each leaf path; returns the index
/// after the tree.
fn use_tree(
    tokens: &[Token],
    mut i: usize,
    prefix: &[String],
    out: &mut Vec<Vec<String>>,
) -> usize {
    let mut path = prefix.to_vec();
    loop {
        match tokens.get(i) {
            Some(Token::Ident(name)) if name == "as" => {
                i += 2;
                break;
            }
            Some(Token::Ident(name)) => {
                path.push(name.clone());
                i += 1;
            }
            Some(Token::PathSep) => i += 1,
            Some(Token::Punct('{')) => {
                i += 1;
                while tokens.get(i).is_some_and(|t| *t != Token::Punct('}')) {
                    i = use_tree(tokens, i, &path, out);
                    if tokens.get(i) == Some(&Token::Punct(',')) {
                        i += 1;
                    }
                }
                return after_tree(tokens, i + 1);
            }
            _ => break,
        }
    }
    out.push(path);
    after_tree(tokens, i)
}

/// Skips a glob and, at the top level, the closing `;`.
fn after_tree(tokens: &[Token], mut i: usize) -> usize {
    if tokens.get(i) == Some(&Token::Punct('*')) {
        i += 1;
    }
    if tokens.get(i) == Some(&Token::Punct(';')) {
        i += 1;
    }
    i
}
