//! House rules anyone can check with the project's own tools (issue 42):
//! the host's top-level modules import each other without circles, so each
//! can be read (and replaced) knowing only what it stands on; every Rust
//! file opens with a comment saying what it is for; and no file grows past
//! [`MAX_LINES`] unless its opening comment says why it is one concern.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use outroute_e2e::workspace;

/// The top-level modules `crate::X` names in `text` (`use crate::a::b`,
/// `crate::a::f()`, `use crate::{a, b::c}`), comments left out.
fn crate_refs(text: &str) -> BTreeSet<String> {
    // A line comment starts a line or follows a space (a `//` inside a
    // string, as in `postgres://`, does neither).
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .map(|l| l.split(" //").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The group's top-level names, up to its closing brace.
            let mut depth = 1;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    break;
                }
                if depth == 1 && c == ',' {
                    out.insert(ident(item.trim()));
                    item.clear();
                } else {
                    item.push(c);
                }
            }
            out.insert(ident(item.trim()));
        } else {
            out.insert(ident(rest));
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

/// Each top-level module of `host/src` and the top-level modules it uses.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap_or(&path);
            let first = rel
                .components()
                .next()
                .map(|c| {
                    c.as_os_str()
                        .to_string_lossy()
                        .trim_end_matches(".rs")
                        .to_string()
                })
                .unwrap_or_default();
            if first == "lib" || first == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let deps = graph.entry(first.clone()).or_default();
            deps.extend(crate_refs(&text).into_iter().filter(|m| *m != first));
        }
    }
    graph
}

/// Every circle in `graph`, each as the path that closes it.
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<Vec<String>>,
    ) {
        if let Some(i) = path.iter().position(|p| p == node) {
            let mut c = path[i..].to_vec();
            c.push(node.to_string());
            found.push(c);
            return;
        }
        if done.contains(node) {
            return;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if graph.contains_key(next) {
                visit(next, graph, path, done, found);
            }
        }
        path.pop();
        done.insert(node.to_string());
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        visit(node, graph, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

#[test]
fn the_host_modules_import_each_other_without_circles() {
    let graph = module_graph(&workspace().join("host/src"));
    assert!(
        graph.contains_key("relay") && graph["relay"].contains("store"),
        "the module graph was not read: {graph:?}"
    );
    let found = circles(&graph);
    assert!(
        found.is_empty(),
        "import circles between host modules (each: a → b → … → a):\n{}",
        found
            .iter()
            .map(|c| c.join(" → "))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The check itself finds what it is meant to find.
#[test]
fn a_circle_is_found() {
    let refs = crate_refs("use crate::{a::X, b};\nfn f() { crate::c::g(); } // crate::d\n");
    assert_eq!(
        refs,
        ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
    );
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.insert("a".into(), ["b".to_string()].into());
    g.insert("b".into(), ["c".to_string()].into());
    g.insert("c".into(), ["a".to_string()].into());
    g.insert("d".into(), ["a".to_string()].into());
    let found = circles(&g);
    assert_eq!(found, vec![vec!["a", "b", "c", "a"]]);
}

/// Longer than this, a file must say why it is one concern.
const MAX_LINES: usize = 700;

/// Every Rust file of the workspace's own crates (not build output).
fn rust_files() -> Vec<std::path::PathBuf> {
    let root = workspace();
    let mut out = Vec::new();
    let mut stack: Vec<_> = [
        "host/src",
        "guest-sdk/src",
        "tests/src",
        "tests/tests",
        "benches/src",
        "plugins",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if path.is_dir() {
                if !["target", "node_modules", "dist", "wit_world"].contains(&name.as_str()) {
                    stack.push(path);
                }
            } else if name.ends_with(".rs") {
                out.push(path);
            }
        }
    }
    out
}

/// The file's opening comment: its leading `//!` (or `//`) lines.
fn header(text: &str) -> String {
    text.lines()
        .take_while(|l| l.starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_file_says_what_it_is_for_and_long_ones_why_they_are_one_concern() {
    let root = workspace();
    let files = rust_files();
    assert!(files.len() > 50, "only {} files found", files.len());
    let mut problems = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let shown = path
            .strip_prefix(&root)
            .unwrap_or(path)
            .display()
            .to_string();
        let head = header(&text);
        if head.is_empty() {
            problems.push(format!("{shown}: no opening comment saying what it is for"));
        }
        let lines = text.lines().count();
        if lines > MAX_LINES && !head.contains("One concern") {
            problems.push(format!(
                "{shown}: {lines} lines; split it by concern, or say in its opening comment why it is one (\"One concern, one file: …\")"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn a_long_file_without_a_reason_is_found() {
    let long = "//! Something.\n".to_string() + &"fn f() {}\n".repeat(MAX_LINES);
    assert!(!header(&long).contains("One concern"));
    assert!(long.lines().count() > MAX_LINES);
    assert_eq!(
        header("//! A.\n//! B.\nuse x;\n//! not header"),
        "//! A.\n//! B."
    );
}
